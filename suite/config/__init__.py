"""Sweep configuration: Hydra YAML -> validated dataclasses (docs/DESIGN.md section 3).

- schema.py: every section as a documented dataclass (the perplexity section lives with the check,
  suite/perplexity/config.py);
- load.py: a file composed with Hydra, merged into the schema, overrides applied in Hydra's grammar;
- validate.py: the rules values must meet, and the method groups (`own`, `peers`, `all`).

Every problem (unknown key, wrong type, bad value, unknown method) raises `ConfigError` naming the
key and what is allowed, before anything starts. `methods/` never sees any of this.
"""

from suite.config.load import bundled_configs, config_from_node, load_config
from suite.config.schema import (
    AXES,
    KINDS,
    PASSES,
    ConfigError,
    DocumentsConfig,
    RunConfig,
    SimConfig,
    SuiteConfig,
    SweepConfig,
    mask_points,
    option_points,
    to_dict,
)
from suite.config.validate import validate

__all__ = [
    "AXES",
    "KINDS",
    "mask_points",
    "PASSES",
    "ConfigError",
    "DocumentsConfig",
    "RunConfig",
    "SimConfig",
    "SuiteConfig",
    "SweepConfig",
    "bundled_configs",
    "config_from_node",
    "load_config",
    "option_points",
    "to_dict",
    "validate",
]
