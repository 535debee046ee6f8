"""The probe workload (kind: probe): one attention problem run as it is, for the option-flip and
repeat checks (suite/flips.py, suite/repeats.py; docs/conformance.md), never a sweep's row.

A probe differs from an attention trial (suite/workloads/attention.py) in three ways:
- its inputs come from the problem's *shape* alone (batch, length, heads, head dims, dtype, seed),
  not from its whole key: a flipped option (causal, a mask parameter, sinks, the soft cap, the
  scale) runs on the very q, k, v, dO of the unflipped run, so their outputs differ by the option
  alone (an attention trial's key, and so its inputs, change with every option);
- it takes what a sweep does not vary: a softmax scale other than 1/sqrt(D), sink logits shifted
  by a constant, packed documents of given lengths (`ProbeSettings`, carried in the spec's
  `workload` column as JSON);
- it calls the method `repeats` times on the same inputs and reports, per tensor, whether every
  repeat equals the first bit for bit, the largest difference from the first, and every repeat's
  float64-check errors; with `keep`, the first repeat's tensors and the reference's out and lse
  of the rank's rows come back to the parent, which compares probes with each other.
Nothing is timed or counted. The check is the attention trial's: this rank's rows of the float64
reference (`suite/reference.py`) and its part of the pass rule (`check.pass_floor`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from methods import kernels, merge
from methods.base import Case
from methods.documents import Documents
from suite.check import INPUT_NAMES, InputSource, make_sinks, max_abs_err, pass_floor, problem_seed
from suite.plan import TrialSpec
from suite.records import RankReport
from suite.reference import ProblemReference
from suite.workloads.attention import _outputs
from suite.workloads.base import RankContext, Workload

KIND = "probe"


@dataclass(frozen=True)
class ProbeSettings:
    """What a probe runs beyond its `TrialSpec` (which holds the shape, causal flag, mask, sinks on
    or off, soft cap and value head dim)."""

    lengths: Optional[tuple[tuple[int, ...], ...]] = None
    """Packed documents: their lengths per sequence (each adding up to seq_len); None: one document."""
    scale: Optional[float] = None
    """The softmax scale; None: 1/sqrt(head_dim), which every trial of a sweep uses."""
    sink_shift: float = 0.0
    """Added to every sink logit (`check.make_sinks`'), with sinks on."""
    repeats: int = 1
    """Calls of the method on the same inputs."""
    keep: bool = True
    """Send the first repeat's tensors (and the reference's out and lse) back to the parent."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["lengths"] = None if self.lengths is None else [list(ls) for ls in self.lengths]
        return json.dumps({"probe": d}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def of(cls, spec: TrialSpec) -> "ProbeSettings":
        d = dict(json.loads(spec.workload)["probe"])
        if d.get("lengths") is not None:
            d["lengths"] = tuple(tuple(ls) for ls in d["lengths"])
        return cls(**d)


def probe_documents(spec: TrialSpec, probe: ProbeSettings, padded_len: Optional[int] = None) -> Optional[Documents]:
    """The probe's documents and mask on the true length (None: one document, a plain mask),
    padded to `padded_len`."""
    mask = spec.mask_spec
    if probe.lengths is None and mask is None and (padded_len or spec.seq_len) == spec.seq_len:
        return None
    lengths = probe.lengths or tuple((spec.seq_len,) for _ in range(spec.batch))
    return Documents(lengths, padded_len or spec.seq_len, mask)


def probe_case(spec: TrialSpec, probe: ProbeSettings, method) -> Case:
    """The case `method` runs (as `TrialSpec.run_case`, with the probe's documents): padded to the
    method's granule, with the documents, the mask and the padding as `documents` when there are any."""
    case = spec.case()
    docs = probe_documents(spec, probe)
    if docs is not None:
        case = dataclasses.replace(case, documents=docs)
    padded = method.padded_len(case)
    if docs is None and padded == spec.seq_len:
        return case
    return dataclasses.replace(case, seq_len=padded, documents=probe_documents(spec, probe, padded))


def input_seed(seed: int, spec: TrialSpec) -> int:
    """The inputs' seed: the shape's, whatever the options (module docstring)."""
    shape = ("probe", spec.batch, spec.seq_len, spec.heads, spec.kv_heads, spec.head_dim, spec.head_dim_v, spec.dtype)
    return problem_seed(seed, shape)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included), not merely by value."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@dataclass
class ProbeReport(RankReport):
    """A rank's view of a probe: `errors` etc. are the first repeat's check, as in a trial."""

    repeat_errors: list[dict[str, float]] = field(default_factory=list)  # per repeat: tensor -> max |x - ref|
    identical: dict[str, bool] = field(default_factory=dict)  # tensor -> every repeat bitwise equal to the first
    spread: dict[str, float] = field(default_factory=dict)  # tensor -> max over repeats of max |x_i - x_0|
    differing: list[int] = field(default_factory=list)  # repeats (0-based) not bitwise equal to the first
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the first repeat's real rows, on the CPU
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # float64 out and lse of the same rows
    positions: Optional[torch.Tensor] = None  # global positions of those rows (and of the dk, dv rows)


class ProbeWorkload(Workload):
    kind = KIND

    def run_rank(self, spec: TrialSpec, ctx: RankContext) -> RankReport:
        comm, device, settings = ctx.comm, ctx.device, ctx.settings
        probe = ProbeSettings.of(spec)
        method = spec.build_method()
        case = probe_case(spec, probe, method)
        layout = method.layout(case)
        checked = settings.check and spec.seq_len <= settings.check_max_seq_len
        scale = kernels.default_scale(spec.head_dim) if probe.scale is None else float(probe.scale)

        def build() -> tuple[InputSource, Optional[torch.Tensor], Optional[ProblemReference]]:
            seed = input_seed(settings.seed, spec)
            source = InputSource(
                spec.batch,
                spec.seq_len,
                spec.heads,
                spec.kv_heads,
                spec.head_dim,
                spec.dtype,
                seed,
                device,
                spec.head_dim_v,
            )
            sinks = make_sinks(spec.heads, spec.seq_len, seed, device) + probe.sink_shift if spec.sinks else None
            ref = None
            if checked:
                ref = ProblemReference(
                    source,
                    causal=spec.causal,
                    scale=scale,
                    documents=probe_documents(spec, probe),
                    sinks=sinks,
                    softcap=spec.softcap,
                )
                ref.stats()
            return source, sinks, ref

        key = (KIND, spec.problem_key(), spec.workload, checked, settings.seed, str(device))
        source, sink_logits, reference = ctx.cache.get(key, build)
        rank = comm.rank
        positions = layout.positions(rank)  # padding (>= seq_len) comes as zeros
        q, k, v, dout = (source.rows(name, positions) for name in INPUT_NAMES)
        grads = spec.pass_ == "fwd_bwd"
        expected = reference.shard(positions, grads=grads) if reference is not None else None
        ctx.prepared()
        real = positions < spec.seq_len
        where = real.nonzero().flatten().to(device)
        used = method.kernel_used(device, q.dtype, spec.head_dim, head_dim_v=spec.head_dim_v, softcap=spec.softcap)
        report = ProbeReport(rank=rank, checked=expected is not None, kernel_used=used)
        report.positions = positions[real].cpu()
        if expected is not None:
            report.tol_floor = pass_floor(q.dtype, spec.seq_len, spec.world_size)
            report.naive_err, report.ref_max = expected.naive_err, expected.ref_max
        sinks = None if sink_logits is None else sink_logits.to(merge.acc_dtype(q.dtype))
        first: dict[str, torch.Tensor] = {}
        for i in range(probe.repeats):
            got = _outputs(method, spec, q, k, v, dout, comm, ctx.autograd, case.documents, sinks, scale)
            # a peer library that does not return the LSE gives None: nothing to compare
            rows = {n: _real_rows(n, t, where) for n, t in got.items() if t is not None}
            report.repeat_errors.append(
                {n: max_abs_err(t, expected.ref[n]) for n, t in rows.items()} if expected is not None else {}
            )
            if i == 0:
                first = rows
                report.identical = {n: True for n in rows}
                report.spread = {n: 0.0 for n in rows}
                continue
            same = True
            for n, t in rows.items():
                if not bitwise_equal(t, first[n]):
                    same = report.identical[n] = False
                    report.spread[n] = max(report.spread[n], max_abs_err(t, first[n]))
            if not same:
                report.differing.append(i)
        report.errors = dict(report.repeat_errors[0]) if report.repeat_errors else {}
        if probe.keep:
            report.tensors = {n: t.detach().cpu() for n, t in first.items()}
            if expected is not None:
                report.reference = {n: expected.ref[n].cpu() for n in ("out", "lse")}
        return report

    def row(self, spec, outcome, ctx, started_at, wall_s) -> dict[str, Any]:
        raise RuntimeError("a probe makes no sweep row: suite/flips.py and suite/repeats.py compare its reports")


def _real_rows(name: str, t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Tensor `name` without the padding rows (dsink, [H] and already summed over ranks, as it is)."""
    t = t.detach()  # a peer's lse may carry its library's graph
    if name == "dsink":
        return t
    return t.index_select(2 if name == "lse" else 1, where)


def assemble(reports: list[ProbeReport], seq_len: int) -> dict[str, torch.Tensor]:
    """The global tensors of a probe's first repeat from every rank's rows (dk, dv: each rank's
    keys are its query positions, as every layout shards q and k alike), and the float64
    reference's out and lse as `ref_out`, `ref_lse`."""
    out: dict[str, torch.Tensor] = {}
    for prefix, pick in (("", lambda r: r.tensors), ("ref_", lambda r: r.reference)):
        for name in pick(reports[0]):
            if name == "dsink":  # [H], already summed over the ranks
                out[prefix + name] = pick(reports[0])[name]
                continue
            dim = 2 if name == "lse" else 1
            shape = list(pick(reports[0])[name].shape)
            shape[dim] = seq_len
            full = torch.zeros(shape, dtype=pick(reports[0])[name].dtype)
            for r in reports:
                assert r.positions is not None  # a probe rank that reports tensors reports their positions
                full.index_copy_(dim, r.positions, pick(r)[name])
            out[prefix + name] = full
    return out
