"""Communication layer: the `Comm` protocol and its executors (docs/DESIGN.md section 5)."""

from methods.comm.base import P2P, Comm, CommAborted, CommError, DoneWork, Work
from methods.comm.counting import CommLedger, CommRecord, CountingComm
from methods.comm.measure import NullComm, TimingComm
from methods.comm.threads import ThreadComm, ThreadWorld, run_threads

__all__ = [
    "P2P",
    "Comm",
    "CommAborted",
    "CommError",
    "DoneWork",
    "Work",
    "CommLedger",
    "CommRecord",
    "CountingComm",
    "NullComm",
    "TimingComm",
    "ThreadComm",
    "ThreadWorld",
    "run_threads",
    "DistComm",
]


def __getattr__(name: str):
    # DistComm imports torch.distributed lazily so that `import methods` stays light.
    if name == "DistComm":
        from methods.comm.dist import DistComm

        return DistComm
    raise AttributeError(name)
