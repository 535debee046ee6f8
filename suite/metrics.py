"""The bottom layer of the suite: trial identity, result columns, statuses, the FLOP convention.

Every column name of a trial row is a constant here, so that metric names live in one module.
Identity goes to MLflow params, numbers to metrics, environment to tags. This module imports
nothing from the suite (nor torch), so that readers of stored results (reports) can use it alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional


def suite_command() -> str:
    """How the user started the suite, for the commands its messages suggest: `sp-suite` when the
    installed script runs (`pip install .`), `python -m suite` otherwise (also under torchrun and
    pytest). A message that says `python -m suite` to a user of `sp-suite` names a command their
    environment may not have."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "sp-suite" if os.path.splitext(name)[0] == "sp-suite" else "python -m suite"


# The identity of a trial, one table: every column that says what was run, where and how (everything
# else in a row is a measurement). The plan (suite/plan.py), the config's axes and their checks
# (suite/config/), the rows (suite/records.py), MLflow (suite/tracking.py), the console summary
# (suite/summary.py) and the reports (suite/reports/) derive what they list from it, so that a new
# axis of the problem is one entry here (docs/extending.md, "An axis of the problem").
@dataclass(frozen=True)
class Axis:
    """One identity column of a trial: how it is keyed, stored, configured, checked and shown."""

    name: str
    """The column, the `TrialSpec` attribute, and the `methods.base.Case` field of the same name
    when methods see it (a trial's case is built by matching names)."""
    type: type = int
    """int, float, bool or str: how a value is read (config values, MLflow's text params)."""
    plain: tuple = ()
    """Values at which a trial's key leaves the axis out: the value every trial had before the axis
    existed, so those trials keep their keys. (): always in the key."""
    always: bool = True
    """Every row has the column. False (head_dim_v, softcap, and every axis added from now on): only
    the rows of trials whose value is not plain have it, so older rows keep exactly their columns;
    readers take a missing value as `plain[0]`."""
    sweep: str = ""
    """The config list under `sweep:` that plans the axis ("": the plan sets it, e.g. the
    hardware from the executor, the degrees from the method)."""
    values: tuple = ()
    """That list's default, for an axis `suite/config/schema.py` does not spell out (it adds the
    field from here); (): the plain value alone."""
    rule: bool = True
    """An exclude rule (`sweep.exclude`) may name it."""
    nullable: bool = False
    """null is a value of its list (head_dim_v: equal to head_dim)."""
    minimum: Optional[float] = None
    """Values must be finite and at least this."""
    means: str = ""
    """What the plain value means, for messages and docs ("0: no capping")."""
    example: str = ""
    """The fix a message suggests for a bad value."""
    doc: str = ""
    """What the axis is, for an axis schema.py does not spell out (its documentation)."""
    label: Optional[str] = ""
    """How a set value reads in a trial's label and the tables: a format ("cap={:g}"); "": the name
    (a bool) or name=value; None: shown by code of its own (head_dim_v in D=192/128)."""

    @property
    def default(self) -> Any:
        """A trial's value when nothing sets it (the plain one)."""
        return self.plain[0] if self.plain else None

    @property
    def planned(self) -> tuple:
        """The values a sweep plans when its config does not name the axis."""
        return self.values or self.plain[:1]


PLAIN_MASKS = ("", "causal", "full")  # a trial whose mask is one of these keeps the key it had before masks
TRIAL_AXES = (
    Axis("method", str, sweep="methods"),
    Axis("impl", str, rule=False),
    Axis("executor", str, rule=False),
    Axis("hardware", str, rule=False),
    Axis("topology", str),
    Axis("world_size", sweep="world_size", minimum=1),
    Axis("nodes", rule=False),
    Axis("ulysses_degree"),
    Axis("ring_degree"),
    Axis("batch", sweep="batch", minimum=1),
    Axis("seq_len", sweep="seq_len", minimum=1),
    Axis("heads", sweep="heads", minimum=1),
    Axis("kv_heads", sweep="kv_heads", minimum=1),
    Axis("head_dim", sweep="head_dim", minimum=1),
    Axis("dtype", str, sweep="dtype"),
    Axis("causal", bool, sweep="causal"),
    Axis("pass", str, sweep="passes"),
    Axis("kernel", str, rule=False),
    Axis("options", str, rule=False),
    # attention trials keep the keys they had before workloads existed, plain masks those they had
    # before masks, trials without sinks those they had before sinks
    Axis("workload", str, plain=("",), sweep="workload"),
    Axis("mask", str, plain=PLAIN_MASKS, sweep="mask"),
    Axis("sinks", bool, plain=(False,), sweep="sinks"),
    # a value head dim other than head_dim (MLA) and a logit soft cap: in rows and keys only when set
    Axis(
        "head_dim_v",
        plain=(None,),
        always=False,
        sweep="head_dim_v",
        nullable=True,
        minimum=1,
        means="null: equal to head_dim",
        example="use the values' head dim, e.g. 128",
        label=None,
    ),
    Axis(
        "softcap",
        float,
        plain=(0.0,),
        always=False,
        sweep="softcap",
        minimum=0,
        means="0: no capping",
        example="Gemma 2 caps attention logits at 50",
        label="cap={:g}",
    ),
)
AXIS = {a.name: a for a in TRIAL_AXES}
IDENTITY = tuple(a.name for a in TRIAL_AXES if a.always)  # the identity columns of every row
# Identity a trial carries only when set (a row then has the column, its key the value); a trial
# without any keeps the key and the columns it had before these existed.
VARIANT_IDENTITY = tuple(a.name for a in TRIAL_AXES if not a.always)
VARIANTS = tuple(AXIS[name] for name in VARIANT_IDENTITY)


def keyed_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """A trial's identity as its key hashes it: the axes at a plain value left out (TRIAL_AXES)."""
    return {k: v for k, v in identity.items() if not (k in AXIS and AXIS[k].plain and v in AXIS[k].plain)}


def variant_value(row: dict, axis: Axis) -> Any:
    """A row's value of a variant axis: the plain one where the row has none (rows from before)."""
    v = row.get(axis.name)
    return axis.default if v is None or v != v else v  # None or NaN (pandas' missing value)


def variant_sort_key(row: dict) -> tuple:
    """A row's variants, comparable across rows (a null value, head_dim_v's plain one, first)."""
    return tuple((0, "") if v is None else (1, v) for v in (variant_value(row, a) for a in VARIANTS))


def variant_labels(row: dict) -> str:
    """The set variants of a row or identity as a label reads them: " cap=5 qk_norm" ("" for none)."""
    out = ""
    for a in VARIANTS:
        v = variant_value(row, a)
        if a.label is None or v in a.plain:
            continue
        if a.label:
            out += " " + a.label.format(v)
        else:
            out += " " + (a.name if v is True else f"{a.name}={v}")
    return out


# -- statuses ------------------------------------------------------------------------------------
OK, INCORRECT, SKIPPED, FAILED, TIMEOUT = "ok", "incorrect", "skipped", "failed", "timeout"
STATUSES = (OK, INCORRECT, SKIPPED, FAILED, TIMEOUT)

# -- correctness ---------------------------------------------------------------------------------
CHECKED_TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink")  # dsink: with attention sinks only
ERR = {t: f"err_{t}" for t in CHECKED_TENSORS}  # max |method - float64 reference|
TOL = {t: f"tol_{t}" for t in CHECKED_TENSORS}  # allowed: 2 x naive same-dtype error + floor

# -- row columns ---------------------------------------------------------------------------------
KEY = "key"
STATUS = "status"
REASON = "reason"
CHECKED = "checked"
TIME_MS_MEDIAN, TIME_MS_MIN, TIME_MS_MAX = "time_ms_median", "time_ms_min", "time_ms_max"
TIME_MS_SAMPLES = "time_ms_samples"
# A trial whose slowest timed repeat takes more than this many times its median is noisy: something
# else used the machine (or its clocks changed) while it ran, and its numbers are not to be trusted
# (`time_spread`).
NOISY_SPREAD = 1.5
TFLOPS_PER_GPU = "tflops_per_gpu"
TOKENS_PER_S = "tokens_per_s"
BYTES_SENT = "bytes_sent_per_rank"
BYTES_RECV = "bytes_recv_per_rank"
COMM_OPS = "comm_ops"
PEAK_MEM = "peak_mem_bytes"  # allocated by one iteration beyond what was alive before, max over ranks
KERNEL_USED = "kernel_used"
# time split (docs/DESIGN.md section 7), measured after the timed repeats
KERNEL_MS = "kernel_ms"  # time in block kernels, median-total iteration, mean over ranks
COMM_WAIT_MS = "comm_wait_ms"  # time blocked in communication calls/waits, mean over ranks
OVERHEAD_RATIO = "overhead_ratio"  # iteration / (kernel + comm wait): the method's own bookkeeping
COMPUTE_ONLY_MS = "compute_only_ms"  # median iteration with communication replaced by no-ops
COMM_ONLY_MS = "comm_only_ms"  # median iteration with block kernels replaced by no-ops
CCR = "ccr"  # compute_only / comm_only
OVERLAP_EFF = "overlap_efficiency"  # (compute_only + comm_only - time) / min(compute_only, comm_only)
DURATION_S = "trial_wall_s"
STARTED_AT = "started_at"
RUN_ID = "run_id"
SEED, WARMUP, REPEATS = "seed", "warmup", "repeats"
ERROR_TRACE = "error_trace"
# model-level check (kind: perplexity); time_ms_* are then per training step, bytes per step
LOSS_CURVE = "loss_curve"  # global mean training loss of every step (list)
VAL_LOSS = "val_loss"  # mean validation loss after training (nats per token)
PPL = "perplexity"  # exp(val_loss)
PPL_BASELINE = "perplexity_baseline"  # the single-device baseline's perplexity
PPL_REL_DIFF = "perplexity_rel_diff"  # perplexity / baseline - 1
LOSS_MAX_REL_DIFF = "loss_max_rel_diff"  # max over steps of |loss - baseline loss| / baseline loss

# load balance and packed documents (sweep.workload)
PADDED_TOKENS = "padded_tokens"  # tokens added at the tail so the layout divides the length (per sequence)
PADDING_FRACTION = "padding_fraction"  # padded_tokens / the padded length
DOC_LENGTHS = "doc_lengths"  # packed documents' lengths, per sequence (list of lists); None: one each
DOCS_PER_SEQ = "docs_per_sequence"  # mean number of documents in a sequence
PAIRS_MAX = "pairs_max_rank"  # visible (query, key) pairs x heads a rank's forward kernels compute, max
PAIRS_MEAN = "pairs_mean_rank"  # ... and the mean over ranks
IMBALANCE = "imbalance"  # pairs_max_rank / pairs_mean_rank: the compute imbalance
KERNEL_SPREAD = "kernel_ms_spread"  # max / mean over ranks of the measured time in block kernels
AREA_GINI = "area_gini"  # Gini coefficient of the ranks' visible pairs (0: equal; LongCA-bench's measure)
REDUNDANT_BYTES = "redundant_bytes_per_rank"  # K/V bytes a rank received that none of its queries attends, max
# simulated rows (executor sim): the simulator's validated error for the row's family (kernel- or
# comm-bound x topology kind x method family, suite/sim/bands.py), the mean |error| `suite validate`
# recorded over published tables, in percent of the predicted value (configs/validate/bands.yaml);
# None for measured rows, and for simulated rows of a family no validated row covers: those are
# UNVALIDATED, which every place that shows a band says instead of a number (`sim_band_label`)
SIM_ERROR_PCT = "sim_error_pct"
UNVALIDATED = "unvalidated"
# simulated rows: how the band reads, "±4.3 %" or UNVALIDATED (`sim_band_label`); None for measured rows
SIM_BAND = "sim_band"


def sim_band_label(row: dict) -> Optional[str]:
    """How a row's error band reads: "±4.3 %" for a simulated row of a validated family, UNVALIDATED
    for a simulated row of a family no published row covers, None for a measured row."""
    if row.get("executor") != "sim":
        return None
    band = row.get(SIM_ERROR_PCT)
    try:
        band = None if band is None else float(band)
    except (TypeError, ValueError):
        band = None
    if band is None or band != band:  # None or NaN
        return UNVALIDATED
    return f"±{band:.1f} %"


BREAKDOWN = (KERNEL_MS, COMM_WAIT_MS, OVERHEAD_RATIO, COMPUTE_ONLY_MS, COMM_ONLY_MS, CCR, OVERLAP_EFF)
BALANCE = (
    PADDED_TOKENS,
    PADDING_FRACTION,
    DOCS_PER_SEQ,
    PAIRS_MAX,
    PAIRS_MEAN,
    IMBALANCE,
    KERNEL_SPREAD,
    AREA_GINI,
    REDUNDANT_BYTES,
)
MODEL_CHECK = (VAL_LOSS, PPL, PPL_BASELINE, PPL_REL_DIFF, LOSS_MAX_REL_DIFF)
NUMERIC_METRICS = (
    (
        TIME_MS_MEDIAN,
        TIME_MS_MIN,
        TIME_MS_MAX,
        TFLOPS_PER_GPU,
        TOKENS_PER_S,
        BYTES_SENT,
        BYTES_RECV,
        PEAK_MEM,
        DURATION_S,
    )
    + BREAKDOWN
    + BALANCE
    + tuple(ERR.values())
    + tuple(TOL.values())
    + MODEL_CHECK
    + (SIM_ERROR_PCT,)
)


def gini(values) -> float:
    """Gini coefficient of nonnegative values: mean absolute difference over twice the mean (0 when
    all are equal, (n - 1) / n when one holds everything)."""
    xs = [float(v) for v in values]
    n, total = len(xs), sum(xs)
    if n == 0 or total == 0:
        return 0.0
    return sum(abs(a - b) for a in xs for b in xs) / (2 * n * total)


COLUMNS = (
    (KEY,)
    + IDENTITY
    + (STATUS, REASON, CHECKED)
    + tuple(ERR.values())
    + tuple(TOL.values())
    + (TIME_MS_MEDIAN, TIME_MS_MIN, TIME_MS_MAX, TFLOPS_PER_GPU, TOKENS_PER_S, BYTES_SENT, BYTES_RECV, PEAK_MEM)
    + BREAKDOWN
    + BALANCE
    + MODEL_CHECK
    + (SIM_ERROR_PCT, SIM_BAND)
    + (
        LOSS_CURVE,
        DOC_LENGTHS,
        KERNEL_USED,
        COMM_OPS,
        TIME_MS_SAMPLES,
        SEED,
        WARMUP,
        REPEATS,
        DURATION_S,
        STARTED_AT,
        RUN_ID,
        ERROR_TRACE,
    )
)


def attention_flops(
    batch: int, seq_len: int, heads: int, head_dim: int, causal: bool, pass_: str, head_dim_v: int | None = None
) -> float:
    """FLOPs of one attention call, flash-attention's convention.

    forward = 2 * B * S^2 * H * (D + Dv) (QK^T at the query/key head dim D, PV at the values' Dv:
    4 * B * S^2 * H * D when they are equal), halved for causal; backward = 2.5 x forward; fwd_bwd
    = 3.5 x forward. Counts the work of the whole (global) problem; per-GPU rates divide by world
    size. `head_dim_v` None: equal to head_dim.
    """
    fwd = 2.0 * batch * seq_len * seq_len * heads * (head_dim + (head_dim_v or head_dim))
    if causal:
        fwd /= 2
    return fwd * (3.5 if pass_ == "fwd_bwd" else 1.0)


def pairs_flops(pairs: int, heads: int, head_dim: int, pass_: str, head_dim_v: int | None = None) -> float:
    """FLOPs of `pairs` visible (query, key) pairs per head (summed over the batch): packed
    documents count their exact document-causal pairs; QK^T at head_dim, PV at head_dim_v (None:
    equal); backward = 2.5 x forward as above."""
    return 2.0 * pairs * heads * (head_dim + (head_dim_v or head_dim)) * (3.5 if pass_ == "fwd_bwd" else 1.0)


def tflops_per_gpu(flops: float, seconds: float, world_size: int) -> float:
    return flops / (seconds * world_size) / 1e12


def tokens_per_s(batch: int, seq_len: int, seconds: float) -> float:
    return batch * seq_len / seconds


def time_spread(row: dict) -> float | None:
    """A row's slowest timed repeat over its median (1.0: every repeat alike); None without timings."""
    median, slowest = row.get(TIME_MS_MEDIAN), row.get(TIME_MS_MAX)
    if not median or slowest is None or median <= 0:
        return None
    return slowest / median


def method_label(method: str, options: dict[str, Any]) -> str:
    """A method with its options, as tables print it: usp(ulysses_degree=2)."""
    return method + ("(" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) + ")" if options else "")


def mask_label(mask, causal) -> str:
    """A row's mask for tables and figures: "causal" or "full" for the plain masks (and rows from
    before the mask column, by their `causal` flag), else the family and its values, e.g.
    "sliding_window(64)" or "shared_question(answers=4, question=128)" (the row's `mask` column holds the full,
    parseable name: methods/masks.py)."""
    if not mask or not isinstance(mask, str) or mask in PLAIN_MASKS:
        return "causal" if _truthy(causal) else "full"
    family, _, rest = mask.partition(":")
    parts = [p.partition("=") for p in rest.split(",")] if rest else []
    pairs = [(k, v) for k, _, v in parts if not (k == "symmetric" and v == "false")]
    if len(pairs) == 1:  # one value says what it is: sliding_window(64)
        return f"{family}({'sym' if pairs[0][0] == 'symmetric' else pairs[0][1]})"
    values = ["sym" if k == "symmetric" else f"{k}={v}" for k, v in pairs]
    return f"{family}({', '.join(values)})" if values else family


def _truthy(v) -> bool:
    return str(v).lower() == "true" if isinstance(v, str) else bool(v)


def workload_label(workload) -> str:
    """ "uniform" for one document per sequence, else "docs:<distribution name>" (from a row's
    `workload` column; perplexity rows carry their model settings there too)."""
    if not workload or not isinstance(workload, str):
        return "uniform"
    import json

    try:
        docs = json.loads(workload).get("documents")
    except (ValueError, AttributeError):
        return "uniform"
    return f"docs:{docs['name']}" if docs else "uniform"


# Display-only MLflow tags (suite/tracking.py writes them; reading MLflow back, suite/reports skips
# them): the run folder of a row, and headline numbers written for the runs table, where a metric
# shows 14 digits and loses its exponent.
MLFLOW_RUN_FOLDER = "run folder"  # <sweep>/<timestamp> of the row's run folder
MLFLOW_SHOWN_BEFORE = ("TFLOP/s per GPU",)  # display tags of older suites (read back, skipped like the others)
MLFLOW_SHOWN = {  # tag -> (metric, how it is written)
    "time ms": (TIME_MS_MEDIAN, "sig3"),
    # "per rank", not "per GPU": the same tag is written on CPU rows, whose ranks are processes
    "TFLOP/s per rank": (TFLOPS_PER_GPU, "sig3"),
    "sent per rank": (BYTES_SENT, "bytes"),
    "peak memory": (PEAK_MEM, "bytes"),
    "err out": (ERR["out"], "err"),
    "ppl rel diff": (PPL_REL_DIFF, "signed"),
}


# A machine whose 1-minute load average at a sweep's start reaches this share of its cores was
# busy before the sweep began: other processes then take CPU time from the ranks and the launches.
BUSY_LOAD_PER_CORE = 0.5


def busy_note(samples: list[dict], *, measured: bool = True) -> str:
    """One line on the machine's load over a sweep from environment.json's `load` samples ("" when
    there are none): the 1-minute load average at the start and end against the cores, flagged
    when the start's (before any rank of the sweep ran) reaches half the cores, unless the sweep
    measured nothing (`measured` False: simulated)."""
    starts = [s for s in samples if s.get("at") == "start" and s.get("loadavg")]
    ends = [s for s in samples if s.get("at") == "end" and s.get("loadavg")]
    if not starts:
        return ""
    start, cores = starts[-1], starts[-1].get("cpu_count") or 1
    text = f"machine load (1-minute average) {start['loadavg'][0]:g} at the start"
    if ends:
        text += f", {ends[-1]['loadavg'][0]:g} at the end (the sweep's own ranks count there)"
    text += f", on {cores} cores"
    if start.get("cpu_mhz"):
        mhz = start["cpu_mhz"]
        text += f"; CPU clock {mhz['min']}-{mhz['max']} MHz"
    if not measured:
        text += " (a simulated sweep: its predictions do not depend on the load)"
    elif start["loadavg"][0] >= BUSY_LOAD_PER_CORE * cores:
        text += " - BUSY: other work shared the machine, timings are noisy (rerun on an idle machine)"
    return text
