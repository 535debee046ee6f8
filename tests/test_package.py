"""The suite as an installed package: a wheel built from this tree, installed into a fresh virtual
environment outside the checkout, runs a bundled sweep by name and the advisor.

The environment gets the wheel only; its dependencies (torch, MLflow, ...) are the test
interpreter's, reached through a .pth line (a path entry: the test interpreter's own .pth files,
among them the editable install of this checkout, are not run there). So every import of `suite`
or `methods` in the new environment, in the parent and in the spawned workers, is the wheel's.
"""

import json
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "suite", "methods", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:  # a copy, so the build leaves nothing in the checkout
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dist),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (whl,) = dist.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    Path(purelib, "_sp_suite_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    return env


def test_the_wheel_holds_every_module_and_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for pkg in ("suite", "methods") for p in (ROOT / pkg).rglob("*.py")}
    assert modules - names == set(), "a package folder is missing from pyproject.toml's [tool.setuptools] packages"
    cfg_dir = ROOT / "configs"
    configs = {f"suite/configs/{p.relative_to(cfg_dir).as_posix()}" for p in cfg_dir.rglob("*.yaml")}
    assert configs and configs - names == set()


def test_installed_outside_the_checkout_runs_a_bundled_sweep_by_name(venv, tmp_path):
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import suite, methods, suite.bundled as b; print(suite.__file__, methods.__file__, b.CONFIGS)",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where  # the wheel's code and configs, not the checkout's
    results = tmp_path / "results"
    run = subprocess.run(
        [
            str(venv / "bin" / "sp-suite"),
            "run",
            "quickstart",
            "sweep.world_size=[1,2]",
            "sweep.kv_heads=[4]",
            "sweep.passes=[fwd_bwd]",
            "sweep.causal=[true]",
            "run.repeats=1",
            "run.warmup=0",
            "run.breakdown=false",
            "tracking.mlflow=false",
            f"results.root={results}",
            "--no-progress",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (rows_file,) = results.glob("quickstart/*/trials.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"reference", "ring", "ulysses"}
    assert rows and all(r["status"] == "ok" and r["checked"] for r in rows)


def test_installed_outside_the_checkout_advises(venv, tmp_path):
    run = subprocess.run(
        [
            str(venv / "bin" / "sp-suite"),
            "advise",
            "--model",
            "llama3_8b",
            "--topology",
            "h100_sxm",
            "--gpus",
            "2",  # the smallest question: the installed package's bundled files are what is tested
            "--seq-len",
            "16384",
            "--top",
            "3",
            "--no-mlflow",
            "--results-root",
            str(tmp_path / "r"),
            "--out",
            str(tmp_path / "advice"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "llama3_8b" in run.stdout and "2 x H100" in run.stdout and (tmp_path / "advice" / "advice.md").is_file()
