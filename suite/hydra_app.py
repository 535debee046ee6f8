"""`python -m suite.hydra_app`: the suite as a Hydra application (docs/DESIGN.md section 3).

Every sweep file of configs/ is an option of the config group `config` (`config=quickstart`,
`config=paper/usp_grid`), placed at the top level, so overrides read as on `suite run`
(`sweep.seq_len=512`, `+sweep.method_options.usp.ulysses_degree=2`, `~run.warmup`). What Hydra
adds over `suite run`: `--cfg job` (print the composed config), `-m` multirun (one sweep per
combination: `-m config=quickstart,perplexity` or `-m sweep.seq_len=256,512`), its launchers
(`hydra/launcher=submitit_slurm` submits each sweep as a SLURM job through
hydra-submitit-launcher, `pip install -e '.[slurm]'`) and its output folders (outputs/ or
multirun/, with the composed config and the job's log). Results go to the results store exactly
as with `suite run`, and the run ends the same way (signals, one-line errors, exit codes);
`cli.dry_run=true`, `cli.resume=latest`, `cli.force=true` and `cli.progress=false` stand for its
options.

The composed config is validated by the same schema as `suite run` (suite/config.py), so errors
name the key. Hydra runs in this parent process only; the workers get the validated dataclasses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from suite.bundled import CONFIGS, sweep_files
from suite.config import ConfigError, SuiteConfig, config_from_node

GROUP = "config"


def register(root: Path = CONFIGS) -> None:
    """Put every sweep file in Hydra's ConfigStore as an option of the group `config` (package
    _global_: its keys at the top level), and the primary config `suite` that picks one."""
    cs = ConfigStore.instance()
    for name, path in sweep_files(root).items():
        group, _, option = f"{GROUP}/{name}".rpartition("/")
        cs.store(group=group, name=option, node=OmegaConf.load(path), package="_global_")
    # The primary config holds every key of the schema at its default (plain values, not typed, so
    # that one value for a list axis is accepted and checked later by the schema), then the chosen
    # sweep file on top: any setting can be overridden, also one the file does not mention.
    defaults = OmegaConf.to_container(OmegaConf.structured(SuiteConfig))
    defaults.pop("name")  # required: it comes from the sweep file
    cs.store(
        name="suite",
        node={
            "defaults": ["_self_", {GROUP: "quickstart"}],
            **defaults,
            "cli": {"dry_run": False, "resume": None, "progress": True, "force": False},
        },
    )


register()


@hydra.main(version_base="1.3", config_path=None, config_name="suite")
def main(cfg: DictConfig) -> None:
    from suite.cli import sweep_exit_code

    choice = HydraConfig.get().runtime.choices.get(GROUP, "?")
    cli = cfg.get("cli") or {}
    node = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("cli", "hydra")])
    try:
        suite_cfg, text = config_from_node(node, source=f"config={choice}")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    code = sweep_exit_code(
        suite_cfg,
        text,
        resume=cli.get("resume"),
        dry_run=bool(cli.get("dry_run")),
        progress=bool(cli.get("progress", True)),
        force=bool(cli.get("force")),
    )
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
