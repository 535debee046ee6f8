"""Shared test helpers: a float64 oracle for sharded methods, and a small multi-process runner."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from datetime import timedelta

import torch

from suite.check import build_problem, max_abs_err

TENSORS = ("out", "lse", "dq", "dk", "dv")


def run_method_rank(method, case, prob, comm) -> dict:
    """Run `method` on this rank's shards of `prob`; return its local out, lse and grads."""
    layout = method.layout(case)
    r = comm.rank
    q, k, v = (layout.shard(x, r).requires_grad_() for x in (prob.q, prob.k, prob.v))
    out, lse = method.attention(q, k, v, causal=case.causal, comm=comm, return_lse=True, softcap=case.softcap)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), layout.shard(prob.dout, r))
    return {"out": out.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def local_errors(method, case, prob, rank: int, res: dict) -> dict[str, float]:
    """This rank's max |method - float64 reference| per tensor."""
    layout = method.layout(case)
    return {t: max_abs_err(res[t], layout.shard(prob.ref[t], rank, dim=2 if t == "lse" else 1)) for t in TENSORS}


def errors_vs_reference(method, case, prob, per_rank: list[dict]) -> dict[str, tuple[float, float]]:
    """(max error over ranks, tolerance) per tensor, against the float64 reference."""
    errs = [local_errors(method, case, prob, r, res) for r, res in enumerate(per_rank)]
    return {t: (max(e[t] for e in errs), prob.tolerance(t, case.world_size)) for t in TENSORS}


def problem_for(case, seed=0):
    return build_problem(
        case.batch,
        case.seq_len,
        case.heads,
        case.kv_heads,
        case.head_dim,
        case.dtype,
        case.causal,
        seed=seed,
        device=torch.device("cpu"),
        with_reference=True,
        head_dim_v=case.head_dim_v,
        softcap=case.softcap,
    )


# -- real processes over gloo ----------------------------------------------------------------------
def _entry(rank, world_size, port, fn, args, results):
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        from methods.comm import DistComm

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        results.put((rank, True, fn(DistComm(), *args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))


def run_dist(world_size: int, fn, *args, timeout_s: float = 240.0) -> list:
    """Run fn(comm, *args) on `world_size` gloo processes; return per-rank results (rank order).
    `fn` must be importable (module level)."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, store.port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = [None] * world_size
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    except queue.Empty:
        raise AssertionError(f"distributed test timed out after {timeout_s}s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


# -- planning --------------------------------------------------------------------------------------
def plan_for(cfg, hardware: str | None = None, device: str = "cpu"):
    """The trials of `cfg` as the runner plans them: on the executor's places, or on one machine
    labelled `hardware`."""
    from suite.executors import make_executor
    from suite.plan import Place, expand
    from suite.workloads import make_workload

    if hardware is None:
        places = make_executor(cfg, dry_run=True).places()
    else:
        places = [Place(hardware, "single-node", lambda world_size: 1)]
    return expand(cfg, make_workload(cfg.kind, cfg), places, device)


# -- the methods under test, from the registry -------------------------------------------------------
def own_variants() -> list[tuple[str, dict]]:
    """Every sequence-parallel method implemented in methods/ (not peers, test plugins or the
    single-device reference), once per option set it declares in `test_variants`."""
    import methods

    out = []
    for name in methods.available():
        cls = methods.method_class(name)
        if cls.impl != "own" or cls.single_device or not cls.__module__.startswith("methods."):
            continue
        out += [(name, dict(options)) for options in cls.test_variants]
    return out


def own_methods() -> list[str]:
    return sorted({name for name, _ in own_variants()})


def variant_id(name: str, options: dict) -> str:
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def seq_len_for(
    name: str, world_size: int, options: dict | None = None, heads: int = 8, kv_heads: int = 8, factor: int = 3
) -> int:
    """A length the method's layout takes at `world_size`: `factor` granules (factor 3: never a
    power of two)."""
    import methods
    from methods import Case

    m = methods.get_method(name, **(options or {}))
    return factor * m.granule(Case(1, 0, heads, kv_heads, 8, "float32", True, world_size))


def counted(name: str, case, **options) -> list:
    """Per rank of `name` on virtual ranks under a counting comm: (forward (sent, recv), backward
    (sent, recv), forward p2p records), with the case's documents (and mask) if any."""
    import methods
    from methods.comm import CommLedger, CountingComm, run_threads

    m = methods.get_method(name, **options)
    prob = problem_for(case)
    lay = m.layout(case)

    def fn(comm):
        led = CommLedger()
        c = CountingComm(comm, led)
        q, k, v = (lay.shard(x, comm.rank).requires_grad_() for x in (prob.q, prob.k, prob.v))
        out = m.attention(q, k, v, causal=case.causal, comm=c, docs=case.documents, softcap=case.softcap)
        fwd = (led.bytes_sent, led.bytes_recv)
        fwd_records = list(led.records)
        torch.autograd.grad(out, (q, k, v), lay.shard(prob.dout, comm.rank))
        return fwd, (led.bytes_sent - fwd[0], led.bytes_recv - fwd[1]), fwd_records

    return run_threads(case.world_size, fn)


def peak_bytes(method, case, wrap=None) -> list[tuple[int, int]]:
    """Per rank: peak bytes of the rank's own tensors (suite.memtrack) in one causal forward and in
    one forward+backward, on virtual ranks; `wrap(comm)` may hide what a comm allocates."""
    from methods.comm import run_threads
    from suite.memtrack import TensorMemoryTracker

    prob = problem_for(case)
    lay = method.layout(case)

    def rank(comm):
        comm = wrap(comm) if wrap else comm
        q, k, v, do = (lay.shard(x, comm.rank) for x in (prob.q, prob.k, prob.v, prob.dout))
        with torch.no_grad(), TensorMemoryTracker() as fwd:
            method.attention(q, k, v, causal=True, comm=comm)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        with TensorMemoryTracker() as both:
            torch.autograd.grad(method.attention(qg, kg, vg, causal=True, comm=comm), (qg, kg, vg), do)
        return fwd.peak_bytes, both.peak_bytes

    return run_threads(case.world_size, rank)


def assert_block_matches(out, lse, grads, ref_out, ref_lse, ref_grads, tol: float = 1e-5) -> None:
    """One block's out, lse and (dq, dk, dv) against float64: rows that see no key have lse -inf on
    both sides, every other value within `tol`."""
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if seen.any():
        assert float((lse.double() - ref_lse)[seen].abs().max()) < tol
    assert float((out.double() - ref_out).abs().max()) < tol
    for got, want in zip(grads, ref_grads):
        assert float((got.double() - want).abs().max()) < tol


class FakeMlflowServer:
    """A stand-in for an MLflow tracking server on loopback: it answers every REST call MLflow's
    client makes with the smallest valid reply (one experiment, runs that exist once created) and
    records each request's path and Authorization header, so a test can run a sweep against a
    reachable server without starting one (MLflow's takes a minute)."""

    def __init__(self):
        import http.server
        import itertools
        import json
        import threading

        self.requests: list[tuple[str, str]] = []  # (path, Authorization header)
        runs: dict[str, dict] = {}
        ids = itertools.count(1)
        server = self

        def run_of(run_id: str, name: str = "run") -> dict:
            return runs.setdefault(
                run_id,
                {
                    "info": {
                        "run_id": run_id,
                        "run_uuid": run_id,
                        "run_name": name,
                        "experiment_id": "1",
                        "status": "RUNNING",
                        "start_time": 0,
                        "lifecycle_stage": "active",
                        "artifact_uri": f"mlflow-artifacts:/1/{run_id}/artifacts",
                    },
                    "data": {"params": [], "tags": [], "metrics": []},
                },
            )

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                server.requests.append((self.path, self.headers.get("Authorization") or ""))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                path = self.path.split("?")[0]
                query = self.path.split("?")[1] if "?" in self.path else ""
                exp = {"experiment_id": "1", "name": "exp", "artifact_location": "x", "lifecycle_stage": "active"}
                if path.endswith("experiments/get-by-name") or path.endswith("experiments/get"):
                    return self._reply({"experiment": exp})
                if path.endswith("experiments/create"):
                    return self._reply({"experiment_id": "1"})
                if path.endswith("experiments/search"):
                    return self._reply({"experiments": [exp]})
                if path.endswith("runs/create"):
                    run = run_of(f"r{next(ids)}", body.get("run_name") or "run")
                    run["data"]["tags"] = body.get("tags") or []
                    return self._reply({"run": run})
                if path.endswith("runs/get"):
                    run_id = dict(kv.split("=", 1) for kv in query.split("&") if "=" in kv).get("run_id", "r0")
                    return self._reply({"run": run_of(run_id)})
                if path.endswith("runs/update"):
                    run = run_of(body.get("run_id") or "r0")
                    run["info"]["status"] = body.get("status") or run["info"]["status"]
                    return self._reply({"run_info": run["info"]})
                if path.endswith("runs/search"):
                    return self._reply({"runs": []})
                return self._reply({})

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
