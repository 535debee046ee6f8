import pytest

from suite.config import ConfigError, RunConfig, load_config
from tests.helpers import plan_for

BASE = """
name: t
sweep:
  methods: [reference, ring, ulysses]
  world_size: [1, 2]
  seq_len: [64]
  heads: [4]
  kv_heads: [4, 2]
  head_dim: [8]
  causal: [true, false]
  passes: [fwd, fwd_bwd]
  exclude:
    - {method: reference, world_size: 2}
"""


def test_loads_yaml_into_typed_config_with_defaults(write_config):
    cfg, text = load_config(write_config(BASE))
    assert cfg.name == "t" and cfg.sweep.kv_heads == [4, 2] and cfg.run.executor == "dist"
    assert cfg.run.repeats == 10 and cfg.tracking.mlflow is True  # schema defaults
    assert "kv_heads" in text and "repeats: 10" in text  # the resolved config that gets saved


def test_overrides_in_hydra_syntax(write_config):
    cfg, _ = load_config(
        write_config(BASE),
        [
            "run.repeats=3",
            "sweep.seq_len=[32,48]",
            "sweep.world_size=1,4",
            "sweep.causal=[false]",
            "tracking.uri=sqlite:///x.db",
        ],
    )
    assert cfg.run.repeats == 3 and cfg.sweep.seq_len == [32, 48] and cfg.sweep.world_size == [1, 4]
    assert cfg.sweep.causal == [False] and cfg.tracking.uri == "sqlite:///x.db"


@pytest.mark.parametrize(
    "yaml_or_override,expected",
    [
        ("run:\n  repeet: 3\n", "unknown config key 'run.repeet'; allowed keys under run: executor"),
        ("sweep:\n  methods: [ring, rnig]\n", "sweep.methods: unknown method 'rnig'; registered methods:"),
        ("run:\n  repeats: many\n", "run.repeats"),
        ("run:\n  executor: mpi\n", "run.executor: 'mpi' is not allowed; choose one of ['dist', 'threads', 'sim']"),
        ("sweep:\n  passes: [forward]\n", "sweep.passes: 'forward' is not allowed"),
        ("sweep:\n  dtype: [fp8]\n", "sweep.dtype: 'fp8' is not allowed"),
        ("sweep:\n  world_size: [0]\n", "sweep.world_size: values must be >= 1"),
        ("sweep:\n  exclude: [{metod: ring}]\n", "sweep.exclude[0]: unknown axis 'metod'"),
        ("sweep:\n  method_options: {ring: {ulysses_degree: 2}}\n", "unknown option 'ulysses_degree'"),
        ("bogus: 1\n", "unknown config key 'bogus'"),
        (
            "sweep:\n  methods: [usp]\n  method_options: {usp: {ulysses_degree: [2, 2]}}\n",
            "sweep.method_options.usp.ulysses_degree: a list of values is an axis and needs distinct values",
        ),
        (
            "sweep:\n  methods: [usp]\n  method_options: {usp: {ulysses_degree: ['4']}}\n",
            "sweep.method_options.usp: usp: ulysses_degree must be an integer >= 1",
        ),
        (
            "sweep:\n  methods: [burst]\n  method_options: {burst: {ranks_per_node: -2}}\n",
            "sweep.method_options.burst: burst: ranks_per_node must be an integer >= 0",
        ),
    ],
)
def test_bad_config_names_the_key_and_the_fix(write_config, yaml_or_override, expected):
    path = write_config("name: t\n" + yaml_or_override)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "override,expected",
    [
        ("run.repeet=3", "unknown config key 'run.repeet'; allowed keys under run:"),
        ("run.repeats=many", "run.repeats"),
        ("+run.extra=1", "unknown config key 'run.extra'; allowed keys under run:"),
        ("+run.repeats=3", "'run.repeats' is already set"),
        ("~sweep.method_options.nothing", "nothing to remove at 'sweep.method_options.nothing'"),
        ("sweep.method_options.usp.ulysses_degree=2", "write +sweep.method_options.usp.ulysses_degree=..."),
        ("run.repeats", "bad override"),
    ],
)
def test_bad_override_names_the_key(write_config, override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write_config(BASE), [override])
    assert expected in str(err.value)


def test_scalar_axis_add_and_remove_overrides(write_config):
    """Hydra's grammar on `suite run`: one value for a list axis, `+` to add a method's options,
    `~` to remove them again or to put a setting back to its default."""
    path = write_config(BASE)
    cfg, _ = load_config(
        path,
        [
            "sweep.seq_len=512",
            "sweep.methods=[ring,usp]",
            "run.repeats=7",
            "+sweep.method_options.usp.ulysses_degree=[1,2]",
            "++sweep.batch=2",
        ],
    )
    assert cfg.sweep.seq_len == [512] and cfg.sweep.batch == [2] and cfg.run.repeats == 7
    assert cfg.sweep.method_options == {"usp": {"ulysses_degree": [1, 2]}}
    again, _ = load_config(
        path,
        [
            "sweep.methods=[ring,usp]",
            "+sweep.method_options.usp.ulysses_degree=2",
            "~sweep.method_options.usp",
            "run.repeats=7",
            "~run.repeats",
        ],
    )
    assert again.sweep.method_options == {} and again.run.repeats == RunConfig().repeats


def test_missing_name_and_missing_file(write_config, tmp_path):
    with pytest.raises(ConfigError, match="name"):
        load_config(write_config("sweep:\n  seq_len: [8]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_plan_is_the_product_minus_excludes_with_stable_keys(write_config):
    cfg, _ = load_config(write_config(BASE))
    plan = plan_for(cfg, "cpu:test")
    # 3 methods x 2 ws x 2 kv x 2 causal x 2 passes = 48, minus reference at ws 2 (8)
    assert len(plan) == 40
    assert not any(s.method == "reference" and s.world_size == 2 for s in plan)
    keys = [s.key for s in plan]
    assert len(set(keys)) == len(keys)
    again = plan_for(load_config(write_config(BASE))[0], "cpu:test")
    assert [s.key for s in again] == keys  # stable across loads and processes (no hash randomisation)
    assert plan_for(cfg, "other")[0].key != keys[0]  # hardware is identity
    # ordered by world size, then problem: trials sharing inputs are adjacent
    assert [s.world_size for s in plan] == sorted(s.world_size for s in plan)
    ring = next(s for s in plan if s.method == "ring" and s.world_size == 2)
    assert (ring.ulysses_degree, ring.ring_degree) == (1, 2)
    uly = next(s for s in plan if s.method == "ulysses" and s.world_size == 2)
    assert (uly.ulysses_degree, uly.ring_degree) == (2, 1)


def test_every_shipped_config_validates():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    # topologies: test_sim; documents (length distributions): test_varlen; models: test_advise;
    # configs/validate/bands.yaml is the simulator's error record, no sweep (test_validate)
    paths = sorted(
        p
        for p in root.glob("**/*.yaml")
        if not {"topologies", "documents", "models"} & set(p.parts) and p.name != "bands.yaml"
    )
    assert len(paths) >= 12  # including configs/paper/ and the simulate_* sweeps
    for path in paths:
        cfg, _ = load_config(path)
        assert plan_for(cfg)  # on the places of its own executor (the simulator: every topology)


def test_list_valued_method_options_are_axes(write_config):
    cfg, _ = load_config(
        write_config("""
name: grid
sweep:
  methods: [usp, ring]
  world_size: [4]
  seq_len: [48]
  heads: [8]
  kv_heads: [8]
  causal: [true]
  passes: [fwd]
  method_options: {usp: {ulysses_degree: [1, 2, 4]}}
  exclude: [{method: usp, ring_degree: 4}]
""")
    )
    plan = plan_for(cfg, "x")
    usp = [(s.ulysses_degree, s.ring_degree) for s in plan if s.method == "usp"]
    assert usp == [(2, 2), (4, 1)]  # (1, 4) excluded by its ring degree
    assert len({s.key for s in plan}) == len(plan) == 3
    assert [s.method_options for s in plan if s.method == "usp"] == [{"ulysses_degree": 2}, {"ulysses_degree": 4}]


# -- method groups ----------------------------------------------------------------------------------------
def test_method_groups_expand_from_the_registry(write_config):
    import methods

    own = [
        n
        for n in methods.available()
        if methods.method_class(n).impl == "own"
        and not methods.method_class(n).single_device
        and not methods.method_class(n).test_double
    ]
    assert "token_ring" in own and "reference" not in own
    cfg, text = load_config(write_config(BASE), ["sweep.methods=[reference,own,ring]", "sweep.exclude=[]"])
    assert cfg.sweep.methods == ["reference"] + sorted(own)  # ring once, where `own` put it
    assert "token_ring" in text and "- own" not in text  # the saved config names what ran
    cfg, _ = load_config(write_config(BASE), ["sweep.methods=[all]", "sweep.exclude=[{method: own, world_size: 1}]"])
    peers = set(methods.group_members("peers"))
    assert peers and set(cfg.sweep.methods) == set(own) | peers and not peers & set(own)
    assert peers >= set(methods.unavailable())  # a peer not importable here is a recorded skip, not dropped
    assert cfg.sweep.exclude == [{"method": sorted(own), "world_size": 1}]
    planned = {(t.method, t.world_size) for t in plan_for(cfg)}
    assert not any(m in own and p == 1 for m, p in planned) and ("ring", 2) in planned


def test_an_unknown_method_names_the_groups(write_config):
    with pytest.raises(ConfigError, match=r"unknown method 'owns'.*groups: own, peers, all"):
        load_config(write_config(BASE), ["sweep.methods=[owns]"])


def test_a_method_registered_by_a_plugin_joins_its_group_but_a_test_double_does_not(write_config):
    import methods
    from methods.registry import _REGISTRY, register
    from methods.ring import Ring

    cfg, _ = load_config(
        write_config(BASE), ["sweep.methods=[own]", "run.plugins=[tests.plugins.faulty]", "sweep.exclude=[]"]
    )
    assert "faulty" in methods.available() and "faulty" not in cfg.sweep.methods and "wrong" not in cfg.sweep.methods

    class Future(Ring):
        name, description = "future_ring", "test: a method registered after the configs were written"

    register(Future)
    try:  # the plugin's methods stay registered (its module is imported once per process), this one not
        cfg, _ = load_config(write_config(BASE), ["sweep.methods=[own]", "sweep.exclude=[]"])
        assert "future_ring" in cfg.sweep.methods and "future_ring" in methods.group_members("all")
    finally:
        del _REGISTRY["future_ring"]


@pytest.mark.parametrize(
    "config",
    [
        "masks_cpu",
        "methods_cpu",
        "perplexity",
        "sim_check_cpu",
        "simulate_multinode",
        "simulate_varlen",
        "varlen_cpu",
        "h100_sweep",
        "h100_varlen",
    ],
)
def test_every_own_method_runs_in_the_evidence_sweeps(config):
    """The evidence configs ask for the `own` group: a method added to the registry is planned in
    them without anyone editing a list (token_ring was once missing from every one)."""
    import methods

    cfg, _ = load_config(config)
    planned = {t.method for t in plan_for(cfg)}
    assert set(methods.group_members("own")) <= planned


def test_results_root_expands_home_and_variables_or_names_the_unset_one(write_config, monkeypatch, tmp_path):
    """A shell would expand `$HOME/x` and `~/x`; the suite used to create a folder named `$HOME`."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SP_SUITE_TEST_DIR", str(tmp_path / "d"))
    monkeypatch.delenv("SP_SUITE_UNSET_DIR", raising=False)
    path = write_config("name: t\n")
    for given, want in [
        ("$HOME/x", tmp_path / "home" / "x"),
        ("'~/y'", tmp_path / "home" / "y"),  # quoted: Hydra's grammar has no bare ~
        ("$SP_SUITE_TEST_DIR/z", tmp_path / "d" / "z"),
    ]:
        cfg, _ = load_config(path, [f"results.root={given}"])
        assert cfg.results.root == str(want), given
    with pytest.raises(ConfigError) as err:
        load_config(path, ["results.root=$SP_SUITE_UNSET_DIR/x"])
    assert "results.root" in str(err.value) and "SP_SUITE_UNSET_DIR" in str(err.value)


def test_narrowing_methods_keeps_the_options_of_the_others_harmless(write_config):
    """`sweep.methods=[ring]` on a config that sets another method's options (h100_sweep sets
    yunchang_usp's ring_impl) runs ring: the user touched no option (issue 39). A name that is no
    method at all is still an error, and the options of an unselected method are still checked."""
    cfg, _ = load_config("configs/h100_sweep.yaml", ["sweep.methods=[ring]"])
    assert cfg.sweep.methods == ["ring"]
    path = write_config(BASE + "  method_options: {usp: {ulysses_degree: 2}}\n")
    assert load_config(path)[0].sweep.methods == ["reference", "ring", "ulysses"]
    with pytest.raises(ConfigError, match="options for 'rnig', which is no method"):
        load_config(write_config(BASE + "  method_options: {rnig: {x: 1}}\n"))
    with pytest.raises(ConfigError, match="unknown option 'degree'"):
        load_config(write_config(BASE + "  method_options: {usp: {degree: 2}}\n"))
