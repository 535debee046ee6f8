"""The workload seam: what a kind of trial is, keyed by the config's `kind`.

A workload plans (its passes and the identity of what it runs), runs one trial on each rank
(`run_rank`, returning a typed `RankReport`), and builds the trial's row in the parent from every
rank's report. The runner and the executors call these and nothing else, so a new kind of trial
(packed documents, a model's training) is one class here, with no branch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch

from methods.comm.base import Comm
from suite.check import ProblemCache
from suite.lengths import UNIFORM, Distribution, identity
from suite.plan import RunSettings, TrialSpec
from suite.records import Outcome, RankReport, RowContext


def documents_identity(cfg: "SuiteConfig", workload: str, batch: int, seq_len: int) -> str:
    """The `workload` column of a trial of length mix `workload` ("" for uniform)."""
    if workload == UNIFORM:
        return ""
    import dataclasses

    dist = Distribution.from_config(workload, dataclasses.asdict(cfg.documents[workload]))
    return identity(dist, seq_len, batch, cfg.run.seed)


if TYPE_CHECKING:
    from methods.base import Method
    from suite.config import SuiteConfig


@dataclass
class RankContext:
    """What one rank has to run a trial with."""

    settings: RunSettings
    comm: Comm
    device: torch.device
    cache: ProblemCache
    autograd: bool = True
    """False: gradients by the method's own backward called directly (virtual ranks on one GPU,
    where autograd would run every rank's backward on one thread and deadlock)."""
    on_prepared: Optional[Callable[[], None]] = None
    """Called once the inputs (and the float64 reference) exist: the trial's own time limit starts."""

    def prepared(self) -> None:
        if self.on_prepared is not None:
            self.on_prepared()


class Workload:
    """One kind of trial. Subclasses set `kind` and implement `run_rank` and `row`.

    The parent builds it with the sweep's config (`cfg`); ranks build it without one (a trial's
    spec carries everything a rank needs).
    """

    kind: ClassVar[str]
    needs_autograd: ClassVar[bool] = False
    """Gradients flow through the method across ranks inside autograd (training a model)."""

    def __init__(self, cfg: Optional["SuiteConfig"] = None):
        self.cfg = cfg

    # -- planning (parent) ------------------------------------------------------------------------
    def passes(self, cfg: "SuiteConfig") -> list[str]:
        return list(cfg.sweep.passes)

    def identity(self, cfg: "SuiteConfig", *, workload: str, batch: int, seq_len: int) -> str:
        """The trials' `workload` column: what is run beyond the attention shape: "" for one
        document per sequence, else the packed documents (`sweep.workload`, suite/lengths.py)."""
        return documents_identity(cfg, workload, batch, seq_len)

    def supports(self, spec: TrialSpec, method: "Method") -> tuple[bool, str]:
        """This workload's own limits for a trial (the method's and the executor's are asked apart)."""
        return True, ""

    # -- around the sweep (parent) ----------------------------------------------------------------
    def start(self, store, tracker, ctx: RowContext, say: Callable[[str], None] = print) -> None:
        """Called once before the first trial (e.g. to read rows this workload made earlier). `say`
        prints a line for the user without breaking the progress bar."""

    def before(self, spec: TrialSpec) -> None:
        """Called before a trial runs (e.g. to train the single-device baseline it is judged by)."""

    def added_rows(self) -> list[dict[str, Any]]:
        """Rows this workload wrote besides the trials' own (e.g. baselines), for the summary."""
        return []

    # -- each rank and the verdict ------------------------------------------------------------------
    def run_rank(self, spec: TrialSpec, ctx: RankContext) -> RankReport:
        raise NotImplementedError

    def row(self, spec: TrialSpec, outcome: Outcome, ctx: RowContext, started_at: str, wall_s: float) -> dict[str, Any]:
        raise NotImplementedError
