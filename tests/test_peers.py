"""Peer library adapters: registration with and without the library, yunchang's layouts against
its own sharding functions on real process groups, and the suite catching yunchang's wrong
torch_math ring (zero LSE) as `incorrect`."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import methods
from methods.base import Case
from suite import metrics as M
from tests.helpers import run_dist

ROOT = Path(__file__).resolve().parents[1]
HAS_YUNCHANG = "yunchang_usp" in methods.available()
needs_yunchang = pytest.mark.skipif(not HAS_YUNCHANG, reason="yunchang is not installed (pip install -e .[peers])")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def test_a_missing_library_gives_a_reason_not_an_import_error():
    # sys.modules[name] = None makes `import name` raise ImportError, as on a machine without it
    out = _python(
        "import sys; sys.modules['yunchang'] = None\n"
        "import methods\n"
        "u = methods.unavailable()\n"
        "assert 'yunchang_usp' in u and 'yunchang_ulysses' in u and 'pip install' in u['yunchang_usp'], u\n"
        "assert 'yunchang_usp' not in methods.available()\n"
        "try:\n    methods.get_method('yunchang_usp')\nexcept KeyError as e:\n    print('KEY', e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "not available here" in out.stdout
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['yunchang'] = None\nfrom suite.cli import main; main(['list'])",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "yunchang is not importable" in listed.stdout


def test_ring_flash_attn_without_flash_attn_is_listed_with_the_reason():
    """Installed but not importable (no flash-attn): registered, so that the simulator can trace
    it, but it cannot run here, and says why (`suite list`, and a skip under executor dist)."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        assert "not installed" in methods.unavailable()["rfa_ring"]
        return
    if methods.method_class("rfa_ring").available_here()[0]:
        pytest.skip("ring-flash-attn imports here (a GPU machine)")
    case = Case(batch=1, seq_len=64, heads=4, kv_heads=4, head_dim=16, dtype="bfloat16", causal=True, world_size=2)
    for name in ("rfa_ring", "rfa_zigzag", "rfa_stripe", "rfa_llama3"):
        ok, why = methods.method_class(name).available_here()
        assert not ok and "ring-flash-attn is not importable" in why
        ok, why = methods.get_method(name).supports(case)
        assert not ok and "ring-flash-attn is not importable" in why


def test_torch_cp_is_skipped_on_cpu_with_the_reason():
    if "torch_cp_allgather" not in methods.available():
        pytest.skip(methods.unavailable()["torch_cp_allgather"])
    case = Case(batch=1, seq_len=64, heads=2, kv_heads=2, head_dim=16, dtype="float32", causal=True, world_size=2)
    ok, why = methods.get_method("torch_cp_allgather").supports(case)
    assert not ok and "_scaled_dot_product_flash_attention_for_cpu" in why


@needs_yunchang
def test_yunchang_registration_options_and_errors():
    m = methods.get_method("yunchang_usp", ring_impl="zigzag", ulysses_degree=2)
    assert m.impl.startswith("yunchang 0.") and m.needs_processes
    assert methods.get_method("yunchang_usp", kernel_shim=True).impl.endswith("+cpu-kernel")
    with pytest.raises(ValueError, match="'strip'"):
        methods.get_method("yunchang_usp", ring_impl="stripe")
    case = Case(batch=1, seq_len=64, heads=4, kv_heads=4, head_dim=16, dtype="float32", causal=False, world_size=4)
    ok, why = methods.get_method("yunchang_usp", ring_impl="zigzag").supports(case)
    assert not ok and "asserts causal=True" in why
    # torch_math has no backward: forward+backward is a recorded skip with yunchang's own words
    assert "Not implemented backward" in methods.get_method("yunchang_usp").forward_only_reason(case)
    gqa = Case(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="float32", causal=True, world_size=2)
    ok, why = methods.get_method("yunchang_usp", ulysses_degree=1).supports(gqa)
    assert not ok and "no GQA" in why
    assert methods.get_method("yunchang_usp", ulysses_degree=1, kernel_shim=True).supports(gqa)[0]


def _layouts_vs_extract(comm, cases):
    """On real gloo groups: yunchang's EXTRACT_FUNC_DICT shard of a global tensor equals the
    adapter's layout shard, for every ring kind and Ulysses x ring split."""
    from yunchang import EXTRACT_FUNC_DICT

    from methods.peers.yunchang_peer import _set_groups

    out = []
    for kind, ud in cases:
        rd = comm.world_size // ud
        _set_groups(ud, rd)
        case = Case(
            batch=2,
            seq_len=48,
            heads=4,
            kv_heads=4,
            head_dim=8,
            dtype="float32",
            causal=True,
            world_size=comm.world_size,
        )
        method = methods.get_method("yunchang_usp", ring_impl=kind, ulysses_degree=ud)
        g = torch.arange(2 * 48 * 3, dtype=torch.float32).view(2, 48, 3)
        theirs = EXTRACT_FUNC_DICT[kind](g, comm.rank, world_size=comm.world_size, rd=rd, ud=ud)
        ours = method.layout(case).shard(g, comm.rank)
        out.append((kind, ud, torch.equal(theirs, ours)))
    return out


@needs_yunchang
@pytest.mark.slow
def test_yunchang_layouts_match_its_own_sharding_functions():
    cases = [(kind, ud) for kind in ("basic", "zigzag", "strip") for ud in (1, 2, 4)]
    per_rank = run_dist(4, _layouts_vs_extract, cases)
    for rank, results in enumerate(per_rank):
        for kind, ud, same in results:
            assert same, f"rank {rank}: {kind} layout with ulysses_degree {ud} differs from yunchang's"


@needs_yunchang
@pytest.mark.slow
def test_suite_records_yunchang_torch_math_rings_incorrect(write_config):
    """yunchang's CPU kernel returns a zero LSE: every ring degree > 1 is wrong attention. The
    suite must say so (incorrect, with the error), while ring degree 1 and the kernel shim pass."""
    from suite.config import load_config
    from suite.runner import run_sweep

    path = write_config("""
    name: peers
    sweep:
      methods: [yunchang_usp]
      world_size: [2]
      batch: [1]
      seq_len: [64]
      heads: [2]
      kv_heads: [2]
      head_dim: [16]
      causal: [true]
      passes: [fwd, fwd_bwd]
      method_options: {yunchang_usp: {ring_impl: [basic, zigzag], ulysses_degree: [1, 2], kernel_shim: [false, true]}}
    run: {warmup: 1, repeats: 2, timeout_s: 60}
    tracking: {mlflow: false}
    """)
    cfg, text = load_config(path)
    recs = run_sweep(cfg, text, progress=False, out=open(os.devnull, "w")).records
    assert len(recs) == 16
    for r in recs:
        opts = json.loads(r["options"])
        if r["pass"] == "fwd_bwd":
            assert r[M.STATUS] == M.SKIPPED and "backward" in r[M.REASON]
        elif opts["kernel_shim"]:
            assert r[M.STATUS] == M.OK and r["impl"].endswith("+cpu-kernel"), r[M.REASON]
            assert r[M.KERNEL_USED].startswith("suite ")
        elif opts["ulysses_degree"] == 2:  # ring degree 1: the single block is returned as is
            assert r[M.STATUS] == M.OK and r[M.KERNEL_USED] == "yunchang torch_math"
        else:  # ring degree 2 with a zero LSE
            assert r[M.STATUS] == M.INCORRECT and r[M.ERR["out"]] > 100 * r[M.TOL["out"]]
            assert "out: error" in r[M.REASON]
        if r[M.STATUS] != M.SKIPPED:
            assert r[M.BYTES_SENT] is None and r[M.ERR["lse"]] is None  # not counted / not returned by yunchang


def _torch_cp_on_cpu(comm):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (comm.world_size,))
    q = torch.randn(1, 2, 32, 16)
    try:
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except NotImplementedError as exc:
        return str(exc)
    return "ran"


@pytest.mark.slow
def test_torch_cp_really_cannot_run_on_cpu():
    """Keeps the skip reason honest: when a torch release adds a CPU rule, this fails and the
    adapter's CPU skip must go."""
    if "torch_cp_allgather" not in methods.available() and "torch_cp_allgather" not in methods.unavailable():
        pytest.skip("no torch_cp adapter")
    pytest.importorskip("torch.distributed.tensor.experimental")
    for msg in run_dist(2, _torch_cp_on_cpu):
        assert "_scaled_dot_product_flash_attention_for_cpu" in msg


RFA_SWEEP = """
name: rfa
sweep:
  methods: [rfa_ring, rfa_zigzag, rfa_stripe, rfa_llama3]
  world_size: [2]
  batch: [1]
  seq_len: [64]
  heads: [4]
  kv_heads: [2]
  head_dim: [16]
  dtype: [{dtype}]
  causal: [true]
  passes: [fwd_bwd]
  workload: [{workload}]
documents:
  short: {{distribution: lognormal, median: 12, sigma: 0.7}}
run: {{warmup: 1, repeats: 2, timeout_s: 60, plugins: [{plugin}]}}
tracking: {{mlflow: false}}
"""
needs_rfa = pytest.mark.skipif(
    importlib.util.find_spec("ring_flash_attn") is None,
    reason="ring-flash-attn is not installed (pip install -e .[peers])",
)


@pytest.fixture
def restore_modules():
    """The test-double plugin also loads in this (the parent) process: put sys.modules and the
    method registry back afterwards, so later tests see the machine as it is."""
    from methods import registry
    from methods.peers import ring_flash_attn_peer

    modules = {k: v for k, v in sys.modules.items() if k.startswith(("flash_attn", "ring_flash_attn"))}
    reg, unavail = dict(registry._REGISTRY), dict(registry._UNAVAILABLE)
    shim = {cls: (cls.shim, cls.impl, cls.import_error) for cls in ring_flash_attn_peer.CLASSES}
    supports = ring_flash_attn_peer._RFA.supports
    yield
    for k in [k for k in sys.modules if k.startswith(("flash_attn", "ring_flash_attn", "tests.plugins.rfa"))]:
        del sys.modules[k]
    sys.modules.update(modules)
    registry._REGISTRY.clear(), registry._REGISTRY.update(reg)
    registry._UNAVAILABLE.clear(), registry._UNAVAILABLE.update(unavail)
    for cls, (flag, impl, error) in shim.items():
        cls.shim, cls.impl, cls.import_error = flag, impl, error
    ring_flash_attn_peer._RFA.supports = supports


def _rfa_sweep(write_config, dtype, plugin, workload="uniform"):
    from suite.config import load_config
    from suite.runner import run_sweep

    cfg, text = load_config(write_config(RFA_SWEEP.format(dtype=dtype, plugin=plugin, workload=workload)))
    return {r["method"]: r for r in run_sweep(cfg, text, progress=False, out=open(os.devnull, "w")).records}


@needs_rfa
@pytest.mark.slow
def test_ring_flash_attn_adapters_run_its_ring_logic_on_cpu_through_a_test_double(write_config, restore_modules):
    """With a CPU test double of flash-attn's kernel interface, ring-flash-attn's own ring, zigzag,
    stripe and llama3 code runs over gloo: the adapters' layouts and calls pass the float64 check
    (forward, LSE and gradients, GQA), labelled +cpu-kernel."""
    rows = _rfa_sweep(write_config, "bfloat16", "tests.plugins.rfa_cpu_shim")
    assert set(rows) == {"rfa_ring", "rfa_zigzag", "rfa_stripe", "rfa_llama3"}
    for name, r in rows.items():
        assert r[M.STATUS] == M.OK, (name, r[M.REASON])
        assert r["impl"].endswith("+cpu-kernel") and r[M.ERR["lse"]] is not None and r[M.ERR["dk"]] is not None


@needs_rfa
@pytest.mark.slow
def test_ring_flash_attn_llama3_varlen_takes_packed_documents(write_config, restore_modules):
    """Packed documents of any lengths: rfa_llama3 passes their boundaries to the library's varlen
    path and matches float64; stripe has no varlen function and is skipped with that reason."""
    rows = _rfa_sweep(write_config, "bfloat16", "tests.plugins.rfa_cpu_shim", workload="short")
    assert rows["rfa_llama3"][M.STATUS] == M.OK, rows["rfa_llama3"][M.REASON]
    assert rows["rfa_llama3"]["docs_per_sequence"] > 2
    assert rows["rfa_stripe"][M.STATUS] == M.SKIPPED and "no varlen version" in rows["rfa_stripe"][M.REASON]
    for name in ("rfa_ring", "rfa_zigzag"):  # run or skipped by their documents' lengths (the next test)
        r = rows[name]
        assert r[M.STATUS] == M.OK or (r[M.STATUS] == M.SKIPPED and "divisible by" in r[M.REASON]), r[M.REASON]


RFA_DOCUMENTS_SWEEP = """
name: rfa_documents
sweep:
  methods: [rfa_ring, rfa_zigzag]
  world_size: [2, 4]
  batch: [1, 2]
  seq_len: [64]
  heads: [4]
  kv_heads: [2]
  head_dim: [16]
  dtype: [bfloat16]
  causal: [true]
  passes: [fwd_bwd]
  workload: [even, by_p, odd]
documents:
  even: {distribution: fixed, lengths: [16, 32, 16]}   # divisible by 8: 2P at P = 2 and 4
  by_p: {distribution: fixed, lengths: [12, 40, 12]}   # divisible by 4: P at P = 2 and 4, 2P at P = 2 only
  odd: {distribution: fixed, lengths: [13, 38, 13]}
run: {warmup: 1, repeats: 2, timeout_s: 60, plugins: [tests.plugins.rfa_cpu_shim]}
tracking: {mlflow: false}
"""


@needs_rfa
@pytest.mark.slow
def test_ring_flash_attn_ring_and_zigzag_varlen_take_divisible_documents(write_config, restore_modules):
    """Packed documents through ring-flash-attn's varlen ring and zigzag (each rank holding its
    pieces of every document) pass the float64 check (out, LSE, dq, dk, dv; GQA; a batch packed
    alike) where every length divides into the pieces: the world size for the ring, 2 x world size
    for zigzag. Other lengths are recorded skips naming the library's limitation."""
    from suite.config import load_config
    from suite.runner import run_sweep

    cfg, text = load_config(write_config(RFA_DOCUMENTS_SWEEP))
    records = run_sweep(cfg, text, progress=False, out=open(os.devnull, "w")).records
    assert len(records) == 24
    for r in records:
        workload = json.loads(r["workload"])["documents"]["name"]
        p, zigzag = r["world_size"], r["method"] == "rfa_zigzag"
        runs = workload == "even" or (workload == "by_p" and not (zigzag and p == 4))
        label = (r["method"], p, r["batch"], workload)
        if runs:
            assert r[M.STATUS] == M.OK, (label, r[M.REASON])
            assert r["impl"].endswith("+cpu-kernel") and r["docs_per_sequence"] == 3, label
            assert all(r[M.ERR[t]] is not None for t in ("out", "lse", "dq", "dk", "dv")), label
        else:
            want = "2 x the world size" if zigzag else "divisible by the world size"
            assert r[M.STATUS] == M.SKIPPED and want in r[M.REASON] and "rfa_llama3" in r[M.REASON], label


@needs_rfa
@pytest.mark.slow
def test_ring_flash_attn_fp32_gradients_are_caught_wrong(write_config, restore_modules):
    """Upstream quirk: with fp32 inputs `block_dq_buffer.to(float32)` returns the reused buffer
    itself, so later ring steps overwrite the accumulated dq/dk. The adapters skip fp32 for that
    reason; lifted, the check must flag the gradients while the forward stays right."""
    rows = _rfa_sweep(write_config, "float32", "tests.plugins.rfa_fp32")
    r = rows["rfa_ring"]
    assert r[M.STATUS] == M.INCORRECT and "dq: error" in r[M.REASON]
    assert r[M.ERR["out"]] <= r[M.TOL["out"]] and r[M.ERR["dq"]] > 1000 * r[M.TOL["dq"]]


@needs_rfa
def test_ring_flash_attn_imports_beside_transformers_5_where_flash_attn_does():
    """As on a GPU node: with flash_attn importable (the simulator's stand-in, flash-attn 2's
    private names) ring-flash-attn imports beside the transformers the extras install, although
    transformers 5 lacks the name its Hugging Face adapter imports, and `suite list` says every
    rfa_* runs here. The name the adapter provides answers from the installed flash-attn."""
    pytest.importorskip("transformers", reason="the extras test and hf install transformers")
    out = _python(
        "import sys\n"
        "from suite.sim import flash_attn_stub\n"
        "sys.modules.update(flash_attn_stub.modules())\n"
        "from methods.peers import ring_flash_attn_peer\n"
        "ring_flash_attn_peer.register_methods()  # first registered on import, before the stand-in\n"
        "from suite.cli import main\n"
        "main(['list'])\n"
        "import transformers.modeling_flash_attention_utils as fa_utils\n"
        "provided = getattr(fa_utils, 'is_flash_attn_greater_or_equal_2_10', None)\n"
        "print('answer', provided and provided())\n"
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("rfa_")}
    assert sorted(rows) == ["rfa_llama3", "rfa_ring", "rfa_stripe", "rfa_zigzag"], out.stdout
    for line in rows.values():
        assert " yes " in line and "not importable" not in line, line
    if importlib.util.find_spec("flash_attn") is None:  # no flash-attn distribution: below 2.1.0
        assert "answer False" in out.stdout


def test_ring_flash_attn_keeps_a_transformers_name_that_exists(monkeypatch):
    """A transformers (4.x) that still has the name keeps its own function."""
    fa_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    from methods.peers import ring_flash_attn_peer

    def own() -> bool:
        return True

    monkeypatch.setattr(fa_utils, "is_flash_attn_greater_or_equal_2_10", own, raising=False)
    assert not ring_flash_attn_peer._provide_removed_transformers_name()
    assert fa_utils.is_flash_attn_greater_or_equal_2_10 is own


@pytest.mark.parametrize(
    "installed, answer",
    [("2.7.4.post1", True), ("2.1.0", True), ("2.0.9", False), ("2.1.0.dev0", False), (None, False)],
)
def test_ring_flash_attn_provided_name_reads_the_installed_flash_attn(monkeypatch, installed, answer):
    """The provided `is_flash_attn_greater_or_equal_2_10` ("2_10" is 2.1.0) compares the installed
    flash-attn distribution's version, as transformers 4's did."""
    pytest.importorskip("packaging")
    from methods.peers import ring_flash_attn_peer

    monkeypatch.setattr(ring_flash_attn_peer, "version_of", lambda name: installed if name == "flash-attn" else None)
    assert ring_flash_attn_peer._flash_attn_at_least_2_1() is answer


def test_the_test_double_does_not_leak_into_later_tests():
    """Runs after the rfa sweeps (file order): flash_attn is what this machine really has."""
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn" not in sys.modules or sys.modules["flash_attn"] is None
        if "rfa_ring" in methods.available():
            assert not methods.method_class("rfa_ring").available_here()[0]
            assert not methods.method_class("rfa_ring").shim
