"""Every command the README and docs/ show names things that exist.

The fenced command blocks of README.md and docs/*.md (```bash, ```sh, ```console, and unlabelled
ones that hold commands) are read line by line (backslash continuations joined, comments and
blank lines skipped) and each command is checked without running it:
- `make X`: X is a target of the Makefile;
- `python -m suite SUB ...` (also `.venv/bin/python`, `sp-suite`, `torchrun ... -m suite`): SUB is a
  subcommand of suite/cli.py's parser, which accepts the line's flags; a config argument (a path or a
  bundled name) loads and, with the line's `key=value` overrides, validates (suite.config.load_config);
- `python -m MODULE` (suite.hydra_app, pytest, ...): the module exists; `config=NAME` of the Hydra
  application names a config;
- a repository path in a command (configs/..., reports/..., tests/..., benchmarks/...) exists;
  results/ paths and the values of output flags (--out, --emit-config) are outputs, not checked.
It also holds the README to being a front door: under 250 lines, the two set-up commands in its
first 40, and a link to every page of docs/.
"""

import argparse
import importlib.util
import re
import shlex
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))

COMMAND_LANGS = ("bash", "sh", "shell", "console")
# the first word of a line that is a command, for unlabelled fences
COMMANDS = (
    "make",
    "python",
    "python3",
    ".venv/bin/python",
    "sp-suite",
    "torchrun",
    "srun",
    "pip",
    "bash",
    ".venv/bin/pre-commit",
    "pre-commit",
    "git",
)
REPO_DIRS = ("configs/", "reports/", "tests/", "benchmarks/", "docs/", "methods/", "suite/")
OUTPUT_FLAGS = ("--out", "--emit-config", "--results-root")
PLACEHOLDER = re.compile(r"[<>$*]|\.\.\.")


# -- reading the pages -----------------------------------------------------------------------------------
def code_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first line, lines) of every fenced block."""
    blocks, lang, start, lines = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if lang is None:
                lang, start, lines = stripped[3:].strip().lower(), n + 1, []
            else:
                blocks.append((lang, start, lines))
                lang = None
        elif lang is not None:
            lines.append(stripped)
    return blocks


def command_lines(lang: str, first: int, lines: list[str]) -> list[tuple[int, str]]:
    """(line number, command) of a block's commands: continuations joined, comments skipped."""
    if lang == "console":
        lines = [line[2:] if line.startswith("$ ") else "# output" for line in lines]
    elif lang == "":
        words = [line.split()[0] for line in lines if line and not line.startswith("#")]
        if not words or words[0] not in COMMANDS:
            return []
    elif lang not in COMMAND_LANGS:
        return []
    out, pending, at = [], "", first
    for n, line in enumerate(lines, first):
        if not pending:
            at = n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text, pending = (pending + line).strip(), ""
        if text and not text.startswith("#"):
            out.append((at, text))
    return out


def documented_commands(page: Path) -> list[tuple[int, str]]:
    return [c for lang, first, lines in code_blocks(page.read_text()) for c in command_lines(lang, first, lines)]


# -- checking one command --------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_targets() -> frozenset:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, flags=re.M))
    for phony in re.findall(r"^\.PHONY\s*:(.*)$", text, flags=re.M):
        targets.update(phony.split())
    return frozenset(targets)


class _ParseError(Exception):
    pass


@contextmanager
def _raising_parsers():
    """argparse reports a bad line by printing and exiting; raise instead, so the test can say which."""

    def error(self, message):
        raise _ParseError(f"{self.prog}: {message}")

    old = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = old


def suite_parser() -> argparse.ArgumentParser:
    from suite import cli

    build = getattr(cli, "build_parser", None) or cli._parser
    return build()


def subcommands(parser: argparse.ArgumentParser) -> dict:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@lru_cache(maxsize=None)
def config_problem(config: str, overrides: tuple) -> str:
    """'' when `config` (a path or a bundled name) loads and validates with `overrides`."""
    from suite.config import ConfigError, load_config

    path = ROOT / config
    try:
        load_config(str(path) if path.exists() else config, list(overrides))
    except ConfigError as exc:
        return f"config {config} {' '.join(overrides)}: {exc}"
    except Exception as exc:  # a missing file, an unreadable YAML: the documented line cannot work
        return f"config {config}: {type(exc).__name__}: {exc}"
    return ""


def check_suite(args: list[str]) -> list[str]:
    """Problems of `python -m suite ARGS`."""
    parser = suite_parser()
    subs = subcommands(parser)
    if not args or args[0] not in subs:
        return [f"suite has no subcommand {args[0] if args else '(none)'!r}; it has {', '.join(sorted(subs))}"]
    try:
        with _raising_parsers():
            ns, extra = parser.parse_known_args(args)
    except _ParseError as exc:
        return [str(exc)]
    sub = args[0]
    overrides = list(getattr(ns, "overrides", []) or [])
    bad = [w for w in extra if w.startswith("-") or "=" not in w or sub not in ("run", "calibrate")]
    if bad:
        return [f"suite {sub} does not accept {' '.join(bad)}"]
    overrides += extra
    if sub == "run" and ns.resume and "=" in ns.resume:  # `--resume key=value`, as suite/cli.py reads it
        overrides.append(ns.resume)
    problems = []
    if sub in ("run", "calibrate") and not PLACEHOLDER.search(ns.config):
        problem = config_problem(ns.config, tuple(overrides))
        if problem:
            problems.append(problem)
    if sub == "advise":
        for value, folder in ((ns.model, "models"), (ns.topology, "topologies")):
            named = "/" not in value and not value.endswith((".yaml", ".yml"))
            if named and not (ROOT / "configs" / folder / f"{value}.yaml").exists():
                problems.append(f"configs/{folder}/{value}.yaml does not exist")
    return problems


def check_module(module: str, args: list[str]) -> list[str]:
    if importlib.util.find_spec(module) is None:
        return [f"no module {module}"]
    if module == "suite.hydra_app":
        names = [n for a in args if a.startswith("config=") for n in a.split("=", 1)[1].split(",")]
        return [f"configs/{n}.yaml does not exist" for n in names if not (ROOT / "configs" / f"{n}.yaml").exists()]
    return []


def problems(command: str) -> list[str]:
    """What a documented command names that does not exist (nothing is run)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as exc:
        return [f"cannot split: {exc}"]
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return []
    found = []
    for i, word in enumerate(words):
        if i and words[i - 1] in OUTPUT_FLAGS or PLACEHOLDER.search(word):
            continue
        path = word.split("=", 1)[-1] if word.startswith("--") else word
        if path.startswith(REPO_DIRS) and not (ROOT / path.split("::")[0]).exists():
            found.append(f"{path} does not exist")
    if words[0] == "make":
        found += [
            f"the Makefile has no target {t!r}"
            for t in words[1:]
            if "=" not in t and not t.startswith("-") and t not in make_targets()
        ]
    elif words[0] == "sp-suite":
        found += check_suite(words[1:])
    elif "-m" in words[:-1]:
        i = words.index("-m")
        module, rest = words[i + 1], words[i + 2 :]
        found += check_suite(rest) if module == "suite" else check_module(module, rest)
    elif words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1 and words[1].endswith(".py"):
        if not (ROOT / words[1]).exists():
            found.append(f"{words[1]} does not exist")
    return found


# -- the tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_documented_command_names_what_exists(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = [
        f"{page.relative_to(ROOT)}:{n}: {cmd}\n    {p}" for n, cmd in documented_commands(page) for p in problems(cmd)
    ]
    assert not bad, "documented commands that cannot work:\n" + "\n".join(bad)


def test_the_check_reports_what_does_not_exist(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert problems("python -m suite run configs/nope.yaml")
    assert problems("make nope")
    assert problems("python -m suite nope")
    assert problems(".venv/bin/python -m suite run configs/quickstart.yaml --no-such-flag")
    assert problems("python -m suite run configs/quickstart.yaml run.repeet=3")
    assert problems("python -m suite advise --model nope_7b --topology h100_sxm")
    assert problems("python -m suite.hydra_app config=nope")
    assert problems("python -m pytest tests/test_nope.py")
    assert problems("python benchmarks/nope.py")
    # and passes what is there
    assert problems("make quickstart") == []
    assert problems("python -m suite run configs/quickstart.yaml run.repeats=3 --dry-run  # a comment") == []
    assert problems("python -m suite report results/quickstart --out reports/new_name") == []


def test_blocks_are_read_as_a_shell_reads_them():
    text = "\n".join(
        [
            "```bash",
            "# a comment",
            "make test \\",
            "    quickstart",
            "",
            "```",
            "```text",
            "make nope",
            "```",
            "```",
            "make lint",
            "```",
            "```",
            "config error: x",
            "```",
            "```console",
            "$ make list",
            "output line",
            "```",
        ]
    )
    got = [cmd for lang, first, lines in code_blocks(text) for _, cmd in command_lines(lang, first, lines)]
    assert got == ["make test quickstart", "make lint", "make list"]


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; topics belong in docs/"
    head = "\n".join(lines[:40])
    assert "make quickstart" in head and "make test" in head, "the set-up commands must come in the first 40 lines"


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in text]
    assert not missing, f"README.md links no page {missing}"


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


# -- the habits' tooling ------------------------------------------------------------------------------------
def test_the_commit_subject_hook_refuses_long_subjects_and_a_missing_blank_line():
    spec = importlib.util.spec_from_file_location("commit_subject", ROOT / ".ci" / "commit_subject.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    assert hook.problems("Short subject\n\nThe reason.\n") == []
    assert hook.problems("# git's comment\nShort subject\n") == []
    assert "72" in hook.problems("x" * 73 + "\n\nbody")[0]
    assert hook.problems("Subject\nbody at once") and hook.problems("\n\nbody")


def test_pre_commit_runs_what_make_lint_runs():
    import yaml

    lint = ROOT.joinpath("Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    hooks = [
        h for repo in yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"] for h in repo["hooks"]
    ]
    entries = " | ".join(h["entry"] for h in hooks)
    for tool in ("ruff check", "ruff format --check", "mypy methods suite"):
        assert tool in lint and tool in entries, tool
