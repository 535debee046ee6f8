"""Memory and hours before the start: each trial's predicted per-rank peak and the sweep's duration.

A dry run and the start of every run print, per world size, the trials, the predicted hours with
their band and the largest predicted per-rank peak, and how many trials are predicted over the
device's memory (docs/running.md, "Memory and hours"). A trial predicted over it is a recorded skip
before it starts, naming both figures, unless `run.memory_check: false`.

**Memory, per rank, in bytes** (`predict_memory`; every term a whole tensor):

- the float64 check (`check_memory_bytes`: every row's statistics and the rank's reference rows,
  suite/reference.py; its own assumptions are stated there);
- the rank's shards (q, k, v, dout) and, for forward+backward, the copies that take gradients;
- the method's working set during one call, from its declared formula (suite/sim/memory.py
  `estimate(...).working`: outputs, accumulators, blocks in flight, head-scattered copies);
- the block kernel's workspace that never becomes a tensor: flash-attention's backward keeps an
  fp32 dq accumulator of the call's queries and an fp32 row vector (softmax_d), so forward+backward
  adds one fp32 copy of the local q and one fp32 [B, H, L]; the forward none.

The peak is the larger of the check's computation (its statistics and rows being computed, beside
the shards) and the run (the check's rows held + shards + working set + workspace). The device's
memory: on CUDA the device's total less `CUDA_RESERVE_BYTES` (CUDA context, NCCL buffers, allocator
fragmentation); on CPU the machine's RAM divided among the ranks (each rank of a local CPU group is a
process with its own check of the problem); `run.device_memory_gb` replaces either (and is how a
dry run on a machine without the device asks about it). The `sim` executor runs nothing, so it has no memory check.

**Duration** (`predict_seconds`), on the figures of `TimeModel` (H100 SXM, bf16, head dim 128:
recorded in reports/recorded/gpu_h100.md, or the h100_sxm topology's sourced link figures):
iterations x one iteration's time, plus the trial's fixed costs. One iteration is the larger of its
kernel time (FLOPs / (P x the kernel's measured throughput) + a fixed cost per block call) and its
communication (the method's byte formula at one NCCL flow's bandwidth, plus a latency per ring
step): overlap is assumed perfect, and exposed communication lies in the band. Iterations: the
check's call, the counting call, warm-up - 1, the timed repeats and, with `run.breakdown` for the
suite's own methods, 3 x repeats more (the time split, compute-only and comm-only runs). Fixed
costs: a trial's harness and input build, the check's rows of the trial's layout
(`shard_reference_s`), the check's row statistics once per problem and world size (consecutive
trials share them: suite/check.py `ProblemCache`), and one worker group start per world size.
The band (`BAND`) is stated where it is defined.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Optional

import methods
from methods.base import element_bytes
from suite import metrics as M
from suite.plan import TrialSpec
from suite.sim.memory import estimate

GB = 1e9  # figures are printed in GB (10^9 bytes), as the device's memory is sold

# CUDA context (~0.5 GB), NCCL's buffers and channels (~1-2 GB on 8 GPUs) and the caching
# allocator's fragmentation: what the trial's own tensors cannot use of the device's total [assumed].
CUDA_RESERVE_BYTES = 4 * 10**9


@dataclass(frozen=True)
class CheckMemory:
    """Bytes per rank of the float64 check (suite/reference.py), beyond the rank's shards."""

    held: int  # kept for the whole trial: every row's statistics and this rank's reference rows
    building: int  # the most held at once while they are computed (one batch element's K/V, a tile)


def check_memory_bytes(spec: TrialSpec, checked: bool, world_size: Optional[int] = None) -> CheckMemory:
    """The float64 check's memory on one rank, in ONE place. A rank draws only its shard of the
    inputs (counted with the shards); checked, it holds (suite/reference.py):

    - every row's statistics: float64 lse and rowsum(dO * O), and the naive computation's in its
      accumulator dtype: 8 + 8 + 2 x 4 bytes (8 + 8 for float64 inputs) x B x H x S;
    - its rows' float64 reference: out [B, L, H, Dv], lse [B, H, L], dq [B, L, H, D], dk, dv
      [B, L, Hkv, D(v)] (forward-only trials hold out and lse only; L = S / P, the padded shard);
      `reference.KEEP_BYTES` of earlier layouts' rows may stay beside them (not counted: the newest
      is what a trial of one layout needs);
    - while computing them: one batch element's K and V in the trial dtype, one KV head's K/V in
      float64, the naive dk, dv of its rows in the accumulator dtype, and one tile's scores and
      their intermediates (`reference.TILE_BYTES`) with its bool mask."""
    if not checked:
        return CheckMemory(held=0, building=0)
    import torch

    from methods import kernels
    from suite import reference  # the check's own figures

    e, a = element_bytes(spec.case())
    p = world_size or spec.world_size
    b, h, hkv, s = spec.batch, spec.heads, spec.kv_heads, spec.seq_len
    d, dv = spec.head_dim, spec.head_dim_v or spec.head_dim
    local = -(-s // p)
    stats = b * h * s * (8 + 8 + 2 * a)
    rows = b * local * h * dv * 8 + b * h * local * 8  # out, lse
    if spec.pass_ == "fwd_bwd":
        rows += b * local * (h * d + hkv * (d + dv)) * 8  # dq, dk, dv
    kv = s * hkv * (d + dv) * e + s * (d + dv) * 8  # one batch element's K/V, one head's in float64
    naive = b * local * hkv * (d + dv) * a if spec.pass_ == "fwd_bwd" else 0
    group = max(1, h // hkv)

    # the reference's tiles carry a bool mask unless every query sees every key: a causal mask is
    # [1, rows, keys], packed documents or a mask family [B, rows, keys] (one element's a view);
    # the kernel's inverted copy is one more [1, rows, keys]
    masked = spec.causal or spec.documents() is not None
    per_mask = 0 if not masked else (1 if spec.documents() is None else b) + 1

    def tile(rows: int, keys: int, op: str) -> int:  # one math call on a tile (reference.ProblemReference._tile)
        rows = min(rows, max(1, reference.TILE_BYTES // (48 * group * keys)))
        call = kernels.cpu_block_working_set(
            1, rows, keys, group, 1, d, dv, dtype=torch.float64, op=op, softcap=bool(spec.softcap)
        )
        # the tile's q and dO rows of every head in the trial dtype, its heads' q (and dO) in float64
        copies = rows * h * (d + dv) * e + rows * group * (d + (dv if op == "bwd" else 0)) * 8
        return call + per_mask * rows * keys + copies

    work = [tile(s, s, "fwd"), tile(local, s, "fwd")]  # every row's statistics; its rows' out
    if spec.pass_ == "fwd_bwd":
        work += [tile(local, s, "bwd"), tile(s, local, "bwd")]  # its rows' dq; its keys' dk, dv
    return CheckMemory(held=stats + rows, building=stats + rows + kv + naive + max(work))


@dataclass(frozen=True)
class MemoryPrediction:
    """Bytes per rank of one trial."""

    problem: CheckMemory
    shards: int  # the rank's q, k, v, dout (and the copies that take gradients)
    working: int  # the method's working set in one call (suite/sim/memory.py estimate)
    workspace: int  # the block kernel's own buffers (flash-attention's backward)

    @property
    def run_peak(self) -> int:
        """What the rank holds at the peak of an iteration: the problem, the shards and the call."""
        return self.problem.held + self.shards + self.working + self.workspace

    @property
    def peak(self) -> int:
        return max(self.problem.building + self.shards, self.run_peak)


class _LinearBytes:
    """`method` with its byte formula read at a short length and scaled to the case's tokens.

    A plain (unpacked) workload moves bytes in proportion to batch x length at a fixed world size,
    mask and head shape (the dispatch method's formula measured so: 9856 bytes per token at P = 8,
    causal, from 8064 to 1032192 tokens), while some formulas build their whole plan to answer
    (dispatch: 13 s at a million tokens); the budget asks thousands of them before a sweep starts."""

    REF_TOKENS = 4096

    def __init__(self, method: methods.Method):
        self._method = method
        self._cache: dict[tuple, Optional[tuple[int, int]]] = {}

    def __getattr__(self, name: str):
        return getattr(self._method, name)

    def expected_bytes(self, case, pass_: str):
        if case.documents is not None or case.batch * case.seq_len <= self.REF_TOKENS:
            return self._method.expected_bytes(case, pass_)
        granule = max(1, self._method.granule(case))
        ref_len = granule * max(1, -(-self.REF_TOKENS // granule))
        if ref_len >= case.seq_len:
            return self._method.expected_bytes(case, pass_)
        ref = replace(case, batch=1, seq_len=ref_len)
        key = (ref, pass_)
        if key not in self._cache:
            self._cache[key] = self._method.expected_bytes(ref, pass_)
        got = self._cache[key]
        if got is None:
            return None
        scale = case.batch * case.seq_len / ref_len
        sent, recv = got
        return int(sent * scale), int(recv * scale)


def predict_memory(spec: TrialSpec, method: methods.Method, checked: bool) -> MemoryPrediction:
    """The per-rank peak of trial `spec` with its built `method` (module docstring: the terms)."""
    case = spec.run_case(method)
    est = estimate(method, case, spec.pass_)
    e, _ = element_bytes(case)
    local = case.seq_len // case.world_size
    q32 = case.batch * local * case.heads * case.head_dim * 4
    grads = est.inputs - (case.batch * local * case.heads * case.dv * e)  # q, k, v take gradients
    shards = est.inputs + (grads if spec.pass_ == "fwd_bwd" else 0)
    workspace = q32 + case.batch * case.heads * local * 4 if spec.pass_ == "fwd_bwd" else 0
    return MemoryPrediction(check_memory_bytes(spec, checked), shards, est.working, workspace)


def device_memory_bytes(device: str, world_size: int, configured_gb: float = 0.0) -> Optional[int]:
    """What one rank may use: `configured_gb` when set; on CUDA the device's total less
    CUDA_RESERVE_BYTES; on CPU the machine's RAM divided among the `world_size` ranks (each a
    process with its own problem). None where it cannot be known (CUDA asked for, none here)."""
    if configured_gb > 0:
        return int(configured_gb * GB)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(0).total_memory - CUDA_RESERVE_BYTES
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return ram // max(1, world_size)


@dataclass(frozen=True)
class TimeModel:
    """The figures of the duration model (seconds, bytes, FLOP/s)."""

    # FLOPs / time of one flash-attention call on an H100, bf16, D 128, 16K-131K tokens: the median
    # of the recorded single-GPU rows (reports/recorded/gpu_h100.md: fwd 315-349, fwd+bwd 318-330)
    fwd_tflops: float = 335.0
    fwd_bwd_tflops: float = 322.0
    call_s: float = 0.15e-3  # one block call's fixed cost: 0.1-0.3 ms measured on small blocks (gpu_h100.md)
    flow_Bps: float = 180e9  # one NCCL send/recv flow on H100 NVLink (configs/topologies/h100_sxm.yaml)
    latency_s: float = 10e-6  # per NCCL op intra-node (h100_sxm.yaml)
    # the float64 reference (suite/check.py) on the device: FP64 tensor-core GEMMs at about 3/4 of
    # the H100's 67 TFLOP/s, and ~40 bytes read and written per score element and pass at HBM's
    # ~2.8 TB/s (scale, mask, max, exp, sum, the backward's dP and dS) [assumed: not measured]
    f64_flops: float = 50e12
    score_bytes: float = 40.0
    mem_Bps: float = 2.8e12
    trial_s: float = 1.0  # harness, row, MLflow child, barriers, input build of a trial [assumed]
    group_start_s: float = 60.0  # one worker group: spawn, CUDA and NCCL start-up [assumed]


# The band: predicted x (low, high). Low: the kernel figures are the recorded rows' medians, which
# scatter within about -8 %..+8 % at 16K tokens and more (one 8K row is 25 % slower: gpu_h100.md),
# so -15 % covers them. High: +60 % is an assumption: exposed communication, imbalance across ranks
# and per-call costs of small blocks only ever add time, and no multi-GPU H100 run is recorded to
# measure them against.
BAND = (0.85, 1.6)


def _iteration_s(spec: TrialSpec, method: methods.Method, model: TimeModel) -> tuple[float, float]:
    """(kernel seconds, communication seconds) of one iteration on one rank."""
    case = spec.run_case(method)
    flops = M.attention_flops(
        spec.batch, spec.seq_len, spec.heads, spec.head_dim, spec.causal, spec.pass_, spec.head_dim_v
    )
    rate = (model.fwd_tflops if spec.pass_ == "fwd" else model.fwd_bwd_tflops) * 1e12
    p = spec.world_size
    _, ring = method.degrees(case) if p > 1 else (1, 1)
    calls = max(1, ring) * (1 if spec.pass_ == "fwd" else 3)  # a backward call costs about two forward ones
    kernel = flops / (p * rate) + calls * model.call_s
    if p == 1:
        return kernel, 0.0
    try:
        moved = method.expected_bytes(case, spec.pass_)
    except (NotImplementedError, ValueError):
        moved = None
    if moved is None:  # a peer library: a K/V ring's bytes (its backward: K/V and dK/dV, twice over)
        e, _ = element_bytes(case)
        kv = 2 * spec.batch * case.seq_len // p * spec.kv_heads * spec.head_dim * e
        sent = kv * (p - 1) * (1 if spec.pass_ == "fwd" else 3)
    else:
        sent = max(moved)
    comm = sent / model.flow_Bps + max(1, ring) * model.latency_s * (1 if spec.pass_ == "fwd" else 2)
    return kernel, comm


def iterations(spec: TrialSpec, method: methods.Method, warmup: int, repeats: int, breakdown: bool, checked: bool):
    """How many calls a trial makes (suite/workloads/attention.py): the check's, the counting one,
    warm-up - 1, the timed repeats and, with the breakdown, its three runs of `repeats`."""
    n = int(checked) + 1 + max(0, warmup - 1) + repeats
    if breakdown and not method.needs_processes:
        n += 3 * repeats
    return n


def reference_s(spec: TrialSpec, model: TimeModel) -> float:
    """The check's row statistics of one problem on a rank (suite/reference.py): a forward over
    every score of the whole [S, S] in float64 and once more in the trial dtype (counted at the
    float64 rate: an upper bound); the masks are applied, not skipped."""
    dv = spec.head_dim_v or spec.head_dim
    scores = spec.batch * spec.heads * spec.seq_len**2
    gemm = scores * 2 * (spec.head_dim + dv)  # QK^T, PV
    return 2 * (gemm / model.f64_flops + scores * model.score_bytes / model.mem_Bps)


def shard_reference_s(spec: TrialSpec, model: TimeModel) -> float:
    """One rank's rows of the reference for one trial's layout: 1/P of a forward and backward of the
    whole problem (its rows against every key, every query against its keys), float64 and naive."""
    dv = spec.head_dim_v or spec.head_dim
    scores = spec.batch * spec.heads * spec.seq_len**2 / max(1, spec.world_size)
    gemm = scores * 2 * (spec.head_dim + dv)  # the forward of its rows
    passes = 1
    if spec.pass_ == "fwd_bwd":
        gemm += scores * 2 * (2 * spec.head_dim + 2 * dv) * 2  # dq of its rows, dk/dv of its keys
        passes = 3
    return 2 * (gemm / model.f64_flops + scores * model.score_bytes * passes / model.mem_Bps)


@dataclass
class TrialBudget:
    spec: TrialSpec
    memory: Optional[MemoryPrediction]  # None: the method could not be built or sized
    seconds: float  # this trial alone (its reference is counted once per problem, in SweepBudget)
    runs: bool  # runs on its target (not refused by the method, workload or executor)
    over: bool = False  # predicted over the device's memory (and memory_check on)


@dataclass
class WorldBudget:
    trials: int = 0
    runs: int = 0
    over: int = 0
    seconds: float = 0.0
    largest: int = 0  # bytes: the largest predicted per-rank peak of a trial that runs


@dataclass
class SweepBudget:
    per_world: dict[int, WorldBudget] = field(default_factory=dict)
    device_bytes: Optional[dict[int, Optional[int]]] = None

    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.per_world.values())

    def lines(self) -> list[str]:
        """The console summary: one line per world size and the total."""
        out = []
        lo, hi = BAND
        for p, w in sorted(self.per_world.items()):
            dev = (self.device_bytes or {}).get(p)
            dev_txt = f"{dev / GB:.0f} GB/rank" if dev else "device memory unknown (run.device_memory_gb)"
            out.append(
                f"  P={p}: {w.trials} trials ({w.runs} run), {_hours(w.seconds)} h "
                f"[{_hours(w.seconds * lo)}-{_hours(w.seconds * hi)}], largest peak {w.largest / GB:.1f} GB/rank "
                f"of {dev_txt}; {w.over} over memory"
            )
        total = self.seconds
        trials = sum(w.trials for w in self.per_world.values())
        over = sum(w.over for w in self.per_world.values())
        out.append(
            f"  total: {trials} trials, {_hours(total)} h [{_hours(total * lo)}-{_hours(total * hi)}], "
            f"{over} predicted over the device's memory"
        )
        return out


def _hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.1f}" if h < 100 else f"{h:.0f}"


def over_memory_reason(peak: int, device: int) -> str:
    return (
        f"predicted per-rank peak {peak / GB:.1f} GB exceeds the device's {device / GB:.1f} GB "
        f"(suite/budget.py; run.memory_check=false runs it anyway)"
    )


class Budget:
    """Predictions for the trials of one sweep, on the device its executor runs them on."""

    def __init__(
        self,
        *,
        device: str,
        warmup: int,
        repeats: int,
        breakdown: bool,
        check: bool,
        check_max_seq_len: int,
        memory_check: bool,
        device_memory_gb: float = 0.0,
        executor: str = "dist",
        model: TimeModel = TimeModel(),
    ):
        self.device, self.executor, self.model = device, executor, model
        self.warmup, self.repeats, self.breakdown = warmup, repeats, breakdown
        self.check, self.check_max_seq_len = check, check_max_seq_len
        self.memory_check = memory_check and executor != "sim"
        self.device_memory_gb = device_memory_gb
        self._device_bytes: dict[int, Optional[int]] = {}
        self._linear: dict[tuple, _LinearBytes] = {}
        self._memory: dict[str, Optional[MemoryPrediction]] = {}  # by trial key

    @classmethod
    def of(cls, cfg, device: str) -> "Budget":
        r = cfg.run
        return cls(
            device=device,
            warmup=r.warmup,
            repeats=r.repeats,
            breakdown=r.breakdown,
            check=r.check,
            check_max_seq_len=r.check_max_seq_len,
            memory_check=r.memory_check,
            device_memory_gb=r.device_memory_gb,
            executor=r.executor,
        )

    def device_bytes(self, world_size: int) -> Optional[int]:
        if world_size not in self._device_bytes:
            self._device_bytes[world_size] = device_memory_bytes(self.device, world_size, self.device_memory_gb)
        return self._device_bytes[world_size]

    def checked(self, spec: TrialSpec) -> bool:
        return self.check and spec.seq_len <= self.check_max_seq_len

    def memory(self, spec: TrialSpec, method: methods.Method) -> Optional[MemoryPrediction]:
        """The trial's predicted peak, computed once (the summary at the start and the trial's own
        memory check ask for the same trial)."""
        if spec.key not in self._memory:
            try:
                self._memory[spec.key] = predict_memory(spec, method, self.checked(spec))
            except (NotImplementedError, ValueError, ZeroDivisionError):
                self._memory[spec.key] = None
        return self._memory[spec.key]

    def fits(self, spec: TrialSpec, method: methods.Method) -> tuple[bool, str]:
        """False with the reason (both figures) when the trial is predicted over the device's memory."""
        if not self.memory_check or spec.kind != "attention":
            return True, ""
        dev = self.device_bytes(spec.world_size)
        key = (spec.method, spec.kernel, repr(sorted(spec.method_options.items())))
        if key not in self._linear:  # one per method and options: its scaled byte formula is cached
            self._linear[key] = _LinearBytes(method)
        mem = self.memory(spec, self._linear[key])  # type: ignore[arg-type]
        if dev is None or mem is None or mem.peak <= dev:
            return True, ""
        return False, over_memory_reason(mem.peak, dev)

    def trial(self, spec: TrialSpec, method: Optional[methods.Method], runs: bool) -> TrialBudget:
        if method is None or spec.kind != "attention":
            return TrialBudget(spec, None, 0.0, runs)
        mem = self.memory(spec, method)
        dev = self.device_bytes(spec.world_size)
        over = bool(self.memory_check and mem is not None and dev is not None and mem.peak > dev)
        seconds = 0.0
        if runs and not over:
            kernel, comm = _iteration_s(spec, method, self.model)
            n = iterations(spec, method, self.warmup, self.repeats, self.breakdown, self.checked(spec))
            seconds = n * max(kernel, comm) + self.model.trial_s
            if self.checked(spec):
                seconds += shard_reference_s(spec, self.model)
        return TrialBudget(spec, mem, seconds, runs, over)

    def sweep(self, trials: list[TrialBudget]) -> SweepBudget:
        """Per world size: trials, predicted seconds (each problem's reference once, each group's start
        once), the largest per-rank peak and the trials over memory."""
        out = SweepBudget(device_bytes={})
        references: set[tuple] = set()  # (world size, problem key)
        for t in trials:
            p = t.spec.world_size
            w = out.per_world.setdefault(p, WorldBudget(seconds=self.model.group_start_s))
            assert out.device_bytes is not None
            out.device_bytes[p] = self.device_bytes(p)
            w.trials += 1
            w.over += int(t.over)
            if not t.runs or t.over:
                continue
            w.runs += 1
            w.seconds += t.seconds
            if t.memory is not None:
                w.largest = max(w.largest, t.memory.peak)
            key = (p, t.spec.problem_key())
            if self.checked(t.spec) and key not in references:
                references.add(key)
                w.seconds += reference_s(t.spec, self.model)
        return out


def target_method(spec: TrialSpec):
    """The trial's method as it would run on its target device: a peer library's adapter made the
    simulator's where it can be (so a missing flash-attn here does not decide it), else as built;
    its byte formula read at a short length and scaled (`_LinearBytes`). None: cannot be built."""
    try:
        from suite.sim.trace import traced_method

        method = traced_method(spec.method, {"kernel": spec.kernel, **spec.method_options})
    except (ValueError, TypeError, ImportError):
        try:
            method = spec.build_method()
        except (ValueError, TypeError):
            return None
    return _LinearBytes(method)


def runs_on_target(spec: TrialSpec, method: Optional[methods.Method], workload) -> bool:
    """Whether the method and the workload take the trial, judged as on its target device (the
    device itself, and what this machine lacks, aside): the trials the duration counts."""
    if method is None:
        return False
    try:
        case = replace(spec.run_case(method), device="cpu")
        ok, _ = method.supports(case)
        if ok and spec.pass_ != "fwd":
            ok = not method.forward_only_reason(case)
        return ok and workload.supports(spec, method)[0]
    except (ValueError, TypeError, NotImplementedError):
        return False
