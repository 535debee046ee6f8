"""Replay a traced schedule on a topology: a flow-level discrete-event simulation.

Each rank runs its traced events in order (`suite/sim/trace.py`):

- `Compute`: the rank is busy for the compute model's time of that block (a "flow" of work on the
  rank's compute resource, so ranks that share cores, as CPU processes do, share them fairly);
  `Memory` (the method's own tensor work between blocks: merges, copies) likewise;
- a point-to-point exchange is posted and does not block; each send is matched with the peer's
  receive from this rank (first posted with first posted, per ordered pair) and becomes a flow
  once both are posted, after the path's per-message latency;
- `Wait`: the rank blocks until every flow of that exchange (its sends and its receives) is done;
- `HostSync`: the code made the host wait for the device (device data indexed with a host tensor);
  the device then idles `compute.host_sync_us` while the host turns round and issues
  the next kernel;
- collectives (all_to_all, all_gather, reduce_scatter, all_reduce): once every member has
  called it, each member sends its share to every other member directly, after (P-1) x the
  group's latency (2(P-1) for all_reduce) - the textbook alpha-beta cost of the ring/pairwise
  algorithms, with the bandwidth term set by how the flows share the fabric. A collective blocks
  the rank where it is called, unless a later `Wait` names its event (a collective posted with
  async_op=True, whose handle the code waits on later): then it runs beside the rank's work until
  that `Wait`, as an exchange does.

Concurrent flows share every link, port and NIC they cross max-min fairly (progressive filling),
each also capped by its own single-flow limit (`Topology.path`). So on an NVSwitch node 7 flows
out of one GPU each get 1/7 of its port, while on a full mesh each gets its own link (up to the
GPU's aggregate cap where the topology gives one).

Overlap has a cost (the topology's `overlap` section): while a rank has a flow of its own in
flight (it sends or receives it), its kernels run at 1 / (1 + compute_slowdown) of their speed -
NCCL's kernels hold SMs and move their bytes through HBM beside the attention kernel. Rates are
recomputed whenever a flow starts or ends, so a kernel that overlaps communication for part of
its run is slowed for that part only. And every exchange pays two cross-stream event dependencies
of `sync_us`: its flows start that long after the exchange is posted and its latency has passed
(the communication stream waits for the compute stream that produced the buffers), and a `Wait`
returns that long after the last flow ends, or after the wait is reached if they already ended (the
compute stream waits for the communication stream). The per-message `latency_us` stays the
library's own per-operation latency; the launch of the communication kernels is part of it.

The host issues (the topology's `host` section; none: free, as on a host topology). Each rank's host
(the Python process driving its GPU) issues the rank's events in order, each costing it a host time:
`kernel_us` per block-kernel call (the attention library's Python wrapper, the dispatcher and the
launch), `op_us` per aten op of the method's own tensor work, `comm_us` per send or receive of an
exchange and per collective call, `wait_us` per `Wait` (the host-side call that makes the stream wait).
An event cannot start on the device before its host has issued it: the host runs ahead of the
device as far as its issuing allows, so its cost shows only where the device's ops are shorter than
the host's work for them (small blocks, many small ops). An iteration is one of a loop (`replay`): a
host that never waits for its device issues the next iteration while the device runs this one, so a
rank's iteration takes the longer of its device's and its host's time. Waits and collectives do
not block the host (NCCL's stream semantics); a `HostSync` does: the host resumes when the device
has drained to it and turned round (`host_sync_us`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from typing import Callable, Optional, Sequence

from methods.comm.counting import CommRecord
from suite.sim.ledger import Compute, HostSync, Memory, Trace, Wait

COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


class SimError(RuntimeError):
    """The schedule cannot be replayed (unmatched messages, a deadlock)."""


@dataclass(eq=False)
class Flow:
    resources: tuple
    cap: float  # its own limit (bytes/s, or work/s for compute)
    size: float
    on_done: Callable[[], None]
    ranks: tuple = ()  # a message's sender and receiver: the ranks whose kernels it slows
    computing: Optional[int] = None  # a kernel's rank: slowed while that rank's messages flow
    remaining: float = field(init=False)
    rate: float = 0.0
    base_cap: float = field(init=False)

    def __post_init__(self):
        self.remaining = self.size
        self.base_cap = self.cap


def max_min_rates(flows: list[Flow], capacity: dict) -> None:
    """Max-min fair rates by progressive filling: raise every unfrozen flow's rate together; a flow
    freezes when it reaches its own cap or a resource it uses is full."""
    left = {}
    users: dict = defaultdict(list)
    for f in flows:
        f.rate = 0.0
        for r in f.resources:
            users[r].append(f)
            left[r] = capacity[r]
    unfrozen = set(flows)
    count = {r: len(us) for r, us in users.items()}
    level = 0.0
    while unfrozen:
        inc = min(
            min((f.cap - level for f in unfrozen), default=math.inf),
            min((left[r] / n for r, n in count.items() if n > 0), default=math.inf),
        )
        inc = max(inc, 0.0)
        level += inc
        for r, n in count.items():
            if n:
                left[r] -= inc * n
        full = {r for r, n in count.items() if n and left[r] <= 1e-9 * capacity[r]}
        frozen = [f for f in unfrozen if f.cap - level <= 1e-9 * f.cap or any(r in full for r in f.resources)]
        if not frozen:  # numerical safety: nothing can grow any more
            frozen = list(unfrozen)
        for f in frozen:
            f.rate = level
            unfrozen.discard(f)
            for r in f.resources:
                count[r] -= 1


@dataclass
class Replay:
    """The simulated iteration: per rank when it finished, how long it spent in block kernels and
    how long it sat blocked on communication (waits and collectives)."""

    end_s: list[float]
    kernel_s: list[float]
    blocked_s: list[float]

    @property
    def time_s(self) -> float:
        return max(self.end_s)


class _Handle:
    def __init__(self, rank: int):
        self.rank, self.pending, self.waiting = rank, 0, False
        self.synced = False  # it carried messages, so waiting for it is a cross-stream dependency


def replay(
    trace: Trace, topology, compute_time: Callable[[Compute], float], *, comm: bool = True, compute: bool = True
) -> Replay:
    """Simulate one iteration of `trace` on `topology`, in a loop of them (as benchmarks and training
    run it: no synchronisation between iterations). `comm=False` makes every message free (the
    compute-only time), `compute=False` every block (the comm-only time).

    With a host section the device is replayed alone first, its hosts clocked beside it. A host that
    never waits for its device keeps its own pace in the loop: a rank's iteration takes the longer of
    its device's time and its host's issue time (a host ahead of its device costs nothing; one behind
    it sets the pace, the device's work after the last issue overlapping the next iteration's issue).
    A host that waits (a `HostSync`) cannot run ahead past the wait: the iteration is replayed again
    with each host starting as far ahead of the device as it finished the first time, holding the
    device up where it falls behind (an approximation: a host-bound rank is charged the device's work
    after its last issue)."""
    device = _Sim(trace, topology, compute_time, comm, compute, host_start=None)
    alone = device.run()
    if not device.host_priced:
        return alone
    # the device alone also clocked its hosts (issuing as they go, never holding the device up). A host
    # that never waits for its device issues the next iteration while the device still runs this one:
    # in the loop each host and each device keeps its own pace, and the slower of the two sets the
    # rank's period (a host ahead of its device costs nothing; a host behind it hides the device's
    # work after its last issue)
    if not device.host_waited:
        return replace_fields(alone, end_s=[max(e, h) for e, h in zip(alone.end_s, device.host_t)])
    # a host that waits for its device (a HostSync) cannot run ahead past that wait: replay again with
    # each host starting as far ahead of the device as it finished the first time
    lead = [min(0.0, h - alone.time_s) for h in device.host_t]
    return _Sim(trace, topology, compute_time, comm, compute, host_start=lead).run()


class _Sim:
    def __init__(
        self,
        trace: Trace,
        topology,
        compute_time,
        comm: bool,
        compute: bool,
        host_start: Optional[Sequence[float]] = (),
    ):
        """`host_start`: each rank's host clock when the iteration starts on the device (negative: that
        far ahead; empty: all 0, a synchronised start); None replays the device alone, without the host."""
        self.tr, self.topo, self.compute_time = trace, topology, compute_time
        self.with_comm, self.with_compute = comm, compute
        p = len(trace.ranks)
        self.p = p
        self.t = 0.0
        self.pc = [0] * p
        self.blocked: list[Optional[str]] = [None] * p
        self.blocked_since = [0.0] * p
        self.end = [0.0] * p
        self.kernel_s = [0.0] * p
        self.blocked_s = [0.0] * p
        self.handles: dict[tuple[int, int], _Handle] = {}
        self.sends: dict[tuple[int, int], deque] = defaultdict(deque)
        self.recvs: dict[tuple[int, int], deque] = defaultdict(deque)
        self.coll_seq: dict[tuple, int] = defaultdict(int)
        self.coll_posted: dict[tuple, dict[int, tuple[CommRecord, Optional[_Handle]]]] = {}
        # per rank, the collectives some later Wait names: posted asynchronously
        self.async_colls = [
            {e.handle for e in events if isinstance(e, Wait)}
            & {i for i, e in enumerate(events) if isinstance(e, CommRecord) and e.kind in COLLECTIVES}
            for events in trace.ranks
        ]
        self.flows: list[Flow] = []
        self.timers: list = []
        self.tick = 0
        self.ready = deque(range(p))
        self.capacity = dict(topology.capacities(p))
        self.dirty = True
        overlap = getattr(topology, "overlap", None) or {}
        self.slowdown = float(overlap.get("compute_slowdown", 0.0))
        self.sync_s = float(overlap.get("sync_us", 0.0)) * 1e-6
        self.host_sync_s = float((getattr(topology, "compute", None) or {}).get("host_sync_us", 0.0)) * 1e-6
        host = (getattr(topology, "host", None) or {}) if compute else {}
        self.host_cost = {k: float(host.get(f"{k}_us", 0.0)) * 1e-6 for k in ("kernel", "op", "comm", "wait")}
        self.host_priced = any(self.host_cost.values())
        self.hosted = self.host_priced and host_start is not None
        self.host_waited = False  # a HostSync made a host wait for the device
        # when each rank's host has issued its events so far
        self.host_t = list(host_start) if host_start else [0.0] * p
        self.issued = [-1] * p  # the last event each rank's host has issued

    # -- scheduling primitives ------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self.tick += 1
        heapq.heappush(self.timers, (when, self.tick, fn))

    def start_flow(
        self,
        resources: tuple,
        cap: float,
        size: float,
        on_done: Callable[[], None],
        *,
        ranks: tuple = (),
        computing: Optional[int] = None,
    ) -> None:
        if size <= 0:
            on_done()
            return
        for r in resources:
            if r not in self.capacity:
                raise SimError(f"topology {self.topo.name} has no resource {r}")
        self.flows.append(Flow(resources, cap, size, on_done, ranks, computing))
        self.dirty = True

    def slow_overlapped_kernels(self) -> None:
        """Cap every kernel whose rank has a message in flight at 1 / (1 + slowdown) of its speed."""
        talking = {r for f in self.flows for r in f.ranks}
        for f in self.flows:
            if f.computing is not None:
                f.cap = f.base_cap / (1.0 + self.slowdown) if f.computing in talking else f.base_cap

    def wake(self, rank: int, delay: float) -> None:
        """Unblock `rank` now, or after `delay` (the compute stream's wait on a communication event)."""
        if delay > 0:
            self.at(self.t + delay, lambda: self.unblock(rank))
        else:
            self.unblock(rank)

    def settle(self, h: _Handle, delay: float) -> None:
        """One part of handle `h`'s communication is done; the last one wakes a rank waiting on it."""
        h.pending -= 1
        if not h.pending and h.waiting:
            h.waiting = False
            self.wake(h.rank, delay)

    def unblock(self, rank: int) -> None:
        if self.blocked[rank] not in ("compute", "host"):  # computing is not waiting on communication
            self.blocked_s[rank] += self.t - self.blocked_since[rank]
        self.blocked[rank] = None
        self.ready.append(rank)

    # -- the ranks' programs ----------------------------------------------------------------------
    def advance(self, r: int) -> None:
        events = self.tr.ranks[r]
        while self.blocked[r] is None and self.pc[r] < len(events):
            i = self.pc[r]
            e = events[i]
            if self.host_priced and self.issued[r] < i:
                self.issued[r] = i
                self.host_t[r] += self.issue_cost(e)
                if self.hosted and self.host_t[r] > self.t:  # the device waits for its host to issue the event
                    self.block(r, "host")
                    self.at(self.host_t[r], functools.partial(self.unblock, r))
                    break
            self.pc[r] += 1
            if isinstance(e, (Compute, Memory)):
                secs = self.compute_time(e) if self.with_compute else 0.0
                if secs > 0:
                    self.blocked[r] = "compute"
                    res, cap = self.topo.compute_resource(r)
                    done = self.kernel_done(r, self.t) if isinstance(e, Compute) else functools.partial(self.unblock, r)
                    self.start_flow(res, cap, secs, done, computing=r)
            elif isinstance(e, HostSync):
                # the host waits for the device to drain, then turns round while the device idles
                self.host_t[r] = max(self.host_t[r], self.t + self.host_sync_s)
                self.host_waited = True
                if self.with_compute and self.host_sync_s > 0:
                    self.block(r, "host")
                    self.at(self.t + self.host_sync_s, functools.partial(self.unblock, r))
            elif isinstance(e, Wait):
                h = self.handles[(r, e.handle)]
                if h.pending:
                    h.waiting = True
                    self.block(r, "wait")
                elif h.synced and self.sync_s > 0:
                    # the exchange is done; the compute stream still waits on its event
                    self.block(r, "wait")
                    self.at(self.t + self.sync_s, functools.partial(self.unblock, r))
            elif e.kind == "p2p":
                self.post_exchange(r, i, e)
            elif e.kind in COLLECTIVES:
                self.post_collective(r, e, i if i in self.async_colls[r] else None)
            else:
                raise SimError(f"unknown communication kind {e.kind!r}")
        if self.pc[r] == len(events) and self.blocked[r] is None:
            self.end[r] = self.t

    def issue_cost(self, e) -> float:
        """What issuing event `e` costs its rank's host (the topology's `host` section)."""
        c = self.host_cost
        if isinstance(e, Compute):
            if e.pairs == 0:
                return 0.0
            calls = sum(n for _, n in e.pieces) if e.pieces is not None and not e.varlen else 1
            return calls * c["kernel"]
        if isinstance(e, Memory):
            return e.ops * c["op"]
        if isinstance(e, Wait):
            return c["wait"]
        if isinstance(e, HostSync):
            return 0.0
        if e.kind == "p2p":  # one send or receive op per peer and direction of the exchange
            return c["comm"] * sum(bool(sent) + bool(recv) for sent, recv in e.per_peer.values())
        return c["comm"]

    def kernel_done(self, r: int, started: float) -> Callable[[], None]:
        """A block kernel's completion: its time in `kernel_s` is what it took, slowed or not."""

        def done() -> None:
            self.kernel_s[r] += self.t - started
            self.unblock(r)

        return done

    def block(self, r: int, why: str) -> None:
        self.blocked[r] = why
        self.blocked_since[r] = self.t

    def post_exchange(self, r: int, i: int, e: CommRecord) -> None:
        h = self.handles[(r, i)] = _Handle(r)
        if not self.with_comm:
            return
        h.synced = any(sent or recv for sent, recv in e.per_peer.values())
        for q, (sent, recv) in sorted(e.per_peer.items()):
            if sent:
                h.pending += 1
                self.sends[(r, q)].append((h, sent, self.t))
                self.match(r, q)
            if recv:
                h.pending += 1
                self.recvs[(q, r)].append((h, recv, self.t))
                self.match(q, r)

    def match(self, src: int, dst: int) -> None:
        sq, rq = self.sends[(src, dst)], self.recvs[(src, dst)]
        while sq and rq:
            (hs, n, ts), (hr, m, tr) = sq.popleft(), rq.popleft()
            if n != m:
                raise SimError(f"rank {src} sends {n} bytes to rank {dst}, which receives {m}")
            res, cap, lat = self.topo.path(src, dst)

            def done(hs=hs, hr=hr) -> None:
                for h in (hs, hr):
                    self.settle(h, self.sync_s)  # the compute stream's wait on the exchange's event

            def start(res=res, cap=cap, n=n, done=done, ranks=(src, dst)) -> None:
                self.start_flow(res, cap, n, done, ranks=ranks)

            # the communication stream first waits for the compute stream's event (sync_s)
            self.at(max(ts, tr) + lat + self.sync_s, start)

    def post_collective(self, r: int, e: CommRecord, handle: Optional[int] = None) -> None:
        """Post rank r's part of a collective: blocking, or (`handle`: the event's index, which a
        later Wait names) running beside the rank's work until that Wait."""
        group = tuple(e.peers)
        seq_key = (r, e.kind, group)
        key = (e.kind, group, self.coll_seq[seq_key])
        self.coll_seq[seq_key] += 1
        posted = self.coll_posted.setdefault(key, {})
        if handle is None:
            posted[r] = (e, None)
            self.block(r, "collective")
        else:
            h = self.handles[(r, handle)] = _Handle(r)
            h.pending, h.synced = 1, self.with_comm and len(group) > 1
            posted[r] = (e, h)
        if len(posted) < len(group):
            return
        del self.coll_posted[key]
        p = len(group)

        def finish(q: int, delay: float) -> None:
            h = posted[q][1]
            if h is None:  # a blocked member goes on
                self.wake(q, delay)
            else:  # posted asynchronously: done, and its Wait may already be waiting
                self.settle(h, delay)

        if not self.with_comm or p == 1:
            for q in group:
                finish(q, 0.0)
            return
        steps = (p - 1) * (2 if e.kind == "all_reduce" else 1)
        lat = steps * max(self.topo.path(a, b)[2] for a in group for b in group if a != b)
        state = {"left": p * (p - 1)}

        def one_done() -> None:
            state["left"] -= 1
            if not state["left"]:
                for q in group:  # each member's compute stream waits on the collective's event
                    finish(q, self.sync_s)

        def start() -> None:
            for a in group:
                share = posted[a][0].bytes_sent / (p - 1)
                for b in group:
                    if a != b:
                        res, cap, _ = self.topo.path(a, b)
                        self.start_flow(res, cap, share, one_done, ranks=(a, b))

        self.at(self.t + lat + self.sync_s, start)  # and the collective's stream on the compute stream

    # -- the event loop ---------------------------------------------------------------------------
    def run(self) -> Replay:
        while True:
            while self.ready:
                self.advance(self.ready.popleft())
            if not self.flows and not self.timers:
                break
            if self.dirty:
                if self.slowdown:
                    self.slow_overlapped_kernels()
                max_min_rates(self.flows, self.capacity)
                self.dirty = False
            t_timer = self.timers[0][0] if self.timers else math.inf
            finish = [self.t + f.remaining / f.rate if f.rate > 0 else math.inf for f in self.flows]
            t_next = min(t_timer, min(finish, default=math.inf))
            if t_next == math.inf:
                raise SimError("flows with no bandwidth: a resource of capacity 0 in the topology")
            dt = t_next - self.t
            finished = []
            for f, end in zip(self.flows, finish):
                if end <= t_next + 1e-12 * max(t_next, 1e-9):
                    finished.append(f)
                else:
                    f.remaining -= f.rate * dt
            self.t = t_next
            if finished:
                gone = set(finished)  # flows compare by identity
                self.flows = [f for f in self.flows if f not in gone]
                self.dirty = True
                for f in finished:
                    f.on_done()
            while self.timers and self.timers[0][0] <= self.t:
                _, _, fn = heapq.heappop(self.timers)
                fn()
        stuck = [r for r in range(self.p) if self.pc[r] < len(self.tr.ranks[r]) or self.blocked[r]]
        if stuck:
            raise SimError(
                f"{self.tr.method}: ranks {stuck} never finished (blocked on "
                f"{[self.blocked[r] for r in stuck]}): unmatched messages or a collective not all "
                f"ranks called"
            )
        return Replay(self.end, self.kernel_s, self.blocked_s)
