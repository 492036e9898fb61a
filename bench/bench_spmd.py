"""SPMD mode at TorchTitan's scale: what the logger does per step as the job grows, what a
training thread pays, what spans cost per rank, and TorchTitan's structured logger beside
``forge_obs.titan``.

    python bench/bench_spmd.py                      # every part; table on stdout, JSON to bench/results/spmd.json
    python bench/bench_spmd.py --sizes 16,128       # the logger at fewer sizes

1. **The logger at 16, 128 and 1,024 ranks** (8 ranks a node, helpers' fan-in 8, simulated on
   this machine): the real logger helper (backends: the local store, global values, and a
   backend that stamps each step's arrival) and, below it, a real node helper, fed by replayed
   messages: the cuts of the 8 ranks of each of those two nodes (``KEYS`` values each, MEAN /
   SUM / MAX), and one piece per step from every other child helper (its whole subtree's cuts
   merged exactly, made once). Steps every ``--step-ms``. Figures: the logger helper's CPU per
   step (its process: every thread), the node helper's, the step at the backends (from the
   step's flush to the stamping backend, median and p99), store operations per step (the
   helpers have no store client: none). Target: the logger's CPU per step at 1,024 ranks
   <= 2x its CPU at 16 (the baseline, same run).
2. **A training thread under torchrun** (3 ranks, one node: the logger helper runs beside the
   logger rank; the ranks' work takes less than the CPUs): each step the same ``--work-ms`` of
   CPU work on every rank, then ``KEYS`` values and ``flush``, then idle until the next step.
   Sessions follow one another with each rank as the logger rank in turn (``--rounds`` times):
   a rank's step work (wall time of the work and the flush, median) in the sessions where it is
   the logger rank against its own in the sessions where it is not, close in time, so that what
   differs between ranks (their place on the CPUs) cancels. Target: <= 1 % (the baseline: the
   same rank as another rank, same run; two halves of those sessions against each other give
   the noise). Also the thread's CPU time, the flush beside the collector's swap alone (target
   <= 50 us), the shipper's CPU per step, each rank's store operations (at init only).
3. **Spans at scale**: ``record_span`` (enter + exit) on a rank that writes spans and on one that
   does not (the default sample leaves most ranks of a large job out), and the bytes a span
   takes on disk: the cost per rank per step of ``--spans`` spans a step.
4. **TorchTitan's structured logger**: ``log_trace_span`` / ``log_trace_scalar`` of TorchTitan
   0.3.0 (a JSONL line written per call) beside ``forge_obs.titan``'s, same process.

This measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from _timing import percentile, proc_stat  # noqa: E402
from forge_obs.backends.base import LoggerBackend  # noqa: E402

KEYS = 20
RANKS_PER_NODE = 8
REDUCTIONS = ("mean", "sum", "max")


class StampBackend(LoggerBackend):
    """In the logger helper: when each step reached it, written to ``<run_dir>/arrivals.json`` at the end."""

    def init(self, run=None, **_kw) -> None:
        self.path = Path(run.run_dir) / "arrivals.json"
        self.arrivals: dict[int, float] = {}

    def log_step(self, record) -> None:
        self.arrivals[record.step] = time.time()

    def finish(self) -> None:
        self.path.write_text(json.dumps(self.arrivals))


# ---------------------------------------------------------------- 1. the logger at scale
class _Store:
    """The few store keys the helpers' start-up reads and writes, in memory (one process here)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes:
        return self.kv[key]


def _snapshot() -> bytes:
    """One rank's cut of KEYS values, as a rank ships it."""
    from forge_obs.recording.collector import record_metric
    from forge_obs.recording.reduce import Reduce
    from forge_obs.wire import rank_cut

    rank_cut.take(-1)
    for k in range(KEYS):
        record_metric(f"k{k}", float(k), (Reduce.MEAN, Reduce.SUM, Reduce.MAX)[k % 3])
    return rank_cut.export(rank_cut.take(0))


def _piece_bundle(snap: bytes, ranks: list[int]) -> bytes:
    from forge_obs.wire.bundle import dumps_bundle, make_bundle
    from forge_obs.wire.snapshot import loads

    return dumps_bundle(make_bundle({("spmd", r): loads(snap) for r in ranks}))


class _Replay:
    """The connections the replay plays: ranks of the two real helpers' nodes, and the helpers
    below them that are not real."""

    def __init__(self) -> None:
        self.ranks: list = []  # (conn, rank)
        self.children: list = []  # (conn, index, subtree ranks, bundle)

    def wait_ready(self, timeout_s: float) -> None:
        from forge_obs.wire.messages import Ready

        deadline = time.monotonic() + timeout_s
        for conn, rank in self.ranks:
            got = False
            while not got:
                assert time.monotonic() < deadline, f"rank {rank}: no Ready"
                conn.wait_readable(1.0)
                got = any(type(m) is Ready for m in conn.read() or [])

    def step(self, step: int, snap: bytes, final: bool = False) -> None:
        from forge_obs.wire.messages import Piece, RankCut, Status

        now = time.time()
        for conn, rank in self.ranks:
            report = {"shipped": step + 1, "shutdown_by": now + 60} if final else None
            conn.send([RankCut(step, now, snap, 0, final, report)])
        for conn, _i, ranks, bundle in self.children:
            conn.send([Piece(step, now, True, len(ranks), (), (), (), 0, tuple(ranks) if final else (), {}, bundle),
                       Status(time.time())])


def _start_helpers(size: int, tmp: Path) -> tuple:
    """The real logger helper (helper 0) and node helper 1 of a ``size``-rank job."""
    from forge_obs.controller.config import LoggerConfig
    from forge_obs.spmd import rendezvous
    from forge_obs.spmd.layout import FANIN, Layout
    from forge_obs.spmd.root import RootSetup

    lay = Layout(tuple(r // RANKS_PER_NODE for r in range(size)), 0, FANIN)
    run_dir = tmp / f"logger{size}"
    idents = {r: {"label": f"trainer/r{r}", "mesh": "trainer", "rank": r, "coords": {}} for r in range(size)}
    cfg = LoggerConfig.parse({"jsonl": {"logging_mode": "global_reduce"}, "bench_spmd:StampBackend": {},
                              "run": {"id": run_dir.name, "root": str(tmp)}})
    met = rendezvous.Meeting(run_dir.name, str(tmp), time.time(), lay, os.urandom(16), idents)
    root = RootSetup(config=cfg, run_id=run_dir.name, run_dir=run_dir, start_time=met.start, label="trainer/r0",
                     identities=idents, backend_classes={"bench_spmd:StampBackend": StampBackend})
    store = _Store()
    paths, procs = zip(*(rendezvous.start_helper(store, met, i, 60.0, root if i == 0 else None, False) for i in (0, 1)))
    return lay, run_dir, store, met.token, paths, procs


def _replay_for(lay, store: _Store, token: bytes, paths: tuple, snap: bytes) -> _Replay:
    """Connections as the ranks of the two real helpers' nodes and as every other child of theirs."""
    from forge_obs.spmd.transport import connect_tcp, connect_unix
    from forge_obs.wire.messages import HelperHello, RankHello

    rp = _Replay()
    for index, path in enumerate(paths):
        for r in lay.ranks_of(index):
            c = connect_unix(path, 30.0)
            c.send([RankHello(r)])
            rp.ranks.append((c, r))
        for child in lay.children_of(index):
            if (index, child) == (0, 1):
                continue  # the real node helper
            c = connect_tcp(tuple(json.loads(store.get(f"helper/{index}/tcp"))), token, 30.0)
            c.send([HelperHello(child)])
            sub = lay.subtree(child)
            rp.children.append((c, child, sub, _piece_bundle(snap, sub)))
    return rp


def logger_at(size: int, steps: int, step_ms: float, tmp: Path) -> dict:
    """Part 1 at ``size`` ranks."""
    lay, run_dir, store, token, paths, (p0, p1) = _start_helpers(size, tmp)
    snap = _snapshot()
    rp = _replay_for(lay, store, token, paths, snap)
    rp.wait_ready(60.0)
    warm = max(20, steps // 10)
    t0 = time.time()
    for step in range(steps + 1):
        if step == warm:
            cpu0 = (proc_stat(p0.pid)[1], proc_stat(p1.pid)[1])
        time.sleep(max(0.0, t0 + step * step_ms / 1e3 - time.time()))
        rp.step(step, snap, final=step == steps)
    cpu1 = (proc_stat(p0.pid)[1], proc_stat(p1.pid)[1])
    n = steps - warm
    for conn, _r in rp.ranks:
        conn.sock.shutdown(socket.SHUT_WR)
    for conn, *_ in rp.children:
        conn.close()
    p0.wait(120)
    p1.wait(120)
    arrivals = {int(k): v for k, v in json.loads((run_dir / "arrivals.json").read_text()).items()}
    lat = [(arrivals[s] - (t0 + s * step_ms / 1e3)) * 1e3 for s in range(warm, steps) if s in arrivals]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    exact = all(r["metrics"].get("obs/ranks_reported") == size and not r.get("missing") for r in rows
                if r.get("mode") == "global_reduce" and r["step"] < steps)
    return {"ranks": size, "nodes": lay.n_helpers, "steps": n, "logger_cpu_us_per_step": (cpu1[0] - cpu0[0]) / n * 1e6,
            "helper_cpu_us_per_step": (cpu1[1] - cpu0[1]) / n * 1e6, "backend_ms": statistics.median(lat),
            "backend_p99_ms": percentile(lat, 0.99), "steps_at_backend": len(lat), "every_rank_in_every_step": exact,
            "store_ops_per_step": 0}


# ---------------------------------------------------------------- 2. a training thread under torchrun
def _work(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def _calibrated_work(work_ms: float) -> int:
    """Iterations of :func:`_work` that take about ``work_ms`` of CPU, the same on every rank (rank 0's)."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([0])
    if dist.get_rank() == 0:
        t = time.perf_counter()
        _work(20000)
        n[0] = max(1000, int(20000 * work_ms / 1e3 / (time.perf_counter() - t)))
    dist.broadcast(n, 0)
    return int(n[0])


def _session(out: Path, logger_rank: int, steps: int, n: int, step_ms: float) -> dict:
    """One session with ``logger_rank`` as the logger rank: per step, the work, its values, and
    the flush (every other step the collector's swap alone, the floor of any cut)."""
    from forge_obs import Reduce, record_metric, spmd
    from forge_obs.recording.collector import MetricCollector

    obs = spmd.init({"jsonl": {"logging_mode": "global_reduce"}, "run": {"root": str(out / "runs")}},
                    logger_rank=logger_rank, coords={"dp_shard": 0}, timeout_s=30.0)
    rank = obs.rank
    work, cpu, flush, swap = [], [], [], []
    c = MetricCollector()
    start = time.time()
    for step in range(2 * steps):
        time.sleep(max(0.0, start + step * step_ms / 1e3 - time.time()))
        t0, c0 = time.perf_counter(), time.thread_time()
        _work(n)
        for k in range(KEYS):
            record_metric(f"k{k}", float(rank + step + k), (Reduce.MEAN, Reduce.SUM, Reduce.MAX)[k % 3])
        t1 = time.perf_counter()
        if step % 2:
            c.swap()
            swap.append((time.perf_counter() - t1) * 1e6)
        else:
            obs.flush(step // 2)
            flush.append((time.perf_counter() - t1) * 1e6)
        work.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    shipped = max(1, obs.shipped)
    summary = obs.shutdown()
    return {"logger": rank == logger_rank, "work_ms": statistics.median(work), "cpu_ms": statistics.median(cpu),
            "flush": flush, "swap": swap, "ship_cpu_us_per_step": obs.ship_cpu_s / shipped * 1e6,
            "store_ops": obs.store_ops, "steps_logged": summary.get("steps_logged")}


def worker(out: Path, steps: int, work_ms: float, step_ms: float, rounds: int) -> None:
    """Sessions in turn with each rank as the logger rank (``rounds`` times): each rank's step work
    when it is the logger rank against its own when it is not, close in time."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = _calibrated_work(work_ms)
    sessions = [_session(out, k % world, steps, n, step_ms) for k in range(rounds * world)]
    flush = [x for s in sessions for x in s["flush"]]
    res = {"rank": rank, "sessions": [{k: v for k, v in s.items() if k not in ("flush", "swap")} for s in sessions],
           "flush_us": statistics.median(flush), "flush_p99_us": percentile(flush, 0.99),
           "swap_us": statistics.median(x for s in sessions for x in s["swap"]),
           "ship_cpu_us_per_step": statistics.median(s["ship_cpu_us_per_step"] for s in sessions),
           "store_ops": sessions[0]["store_ops"], "steps_logged": max(s["steps_logged"] or 0 for s in sessions)}
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def training_thread(nproc: int, steps: int, work_ms: float, step_ms: float, rounds: int, tmp: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent / "src"), str(HERE.parent)]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           str(Path(__file__).resolve()), "--worker", str(tmp), str(steps), str(work_ms), str(step_ms), str(rounds)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-3000:] + res.stderr[-3000:])
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


# ---------------------------------------------------------------- 3. spans at scale
def span_costs(tmp: Path, spans_per_step: int) -> dict:
    """``record_span`` enter + exit with this rank's spans written, and with them off (a rank
    left out of the sample); bytes per span on disk."""
    import timeit

    from forge_obs.core.identity import set_identity
    from forge_obs.recording.timeline import record_span, writer

    set_identity(mesh="trainer", actor="", rank=0, world_size=1024, coords={})  # an SPMD rank, not a controller

    def cycle() -> None:
        with record_span("fwd"):
            pass

    out = {}
    for name, ranks in (("on", [0]), ("off", [])):
        d = tmp / f"spans_{name}"
        writer.configure(d, writer.controller_options("spans", time.time(), {"ranks": ranks}))
        n = 2000
        out[f"span_{name}_us"] = min(timeit.repeat(cycle, number=n, repeat=7)) / n * 1e6
        writer.close()
        for f in (d / "events").glob("*.jsonl") if (d / "events").is_dir() else ():
            f.unlink()
        writer.configure(d, writer.controller_options("spans", time.time(), {"ranks": ranks}))
        empty = _written(d)
        for _ in range(1000):
            cycle()
        c0 = time.thread_time()
        writer.flush()  # the writer's pass over them (encode, write), here on this thread
        out[f"writer_cpu_us_per_span_{name}"] = (time.thread_time() - c0) / 1000 * 1e6
        out[f"bytes_per_span_{name}"] = (_written(d) - empty) / 1000
        writer.close()
    out["per_step_on_us"] = (out["span_on_us"] + out["writer_cpu_us_per_span_on"]) * spans_per_step
    out["per_step_off_us"] = (out["span_off_us"] + out["writer_cpu_us_per_span_off"]) * spans_per_step
    return out


def _written(run_dir: Path) -> int:
    """Bytes of the timeline files under ``run_dir`` (their headers' bytes included)."""
    from forge_obs.recording.timeline import writer

    writer.flush()
    ev = run_dir / "events"
    return sum(f.stat().st_size for f in ev.glob("*.jsonl")) if ev.is_dir() else 0


# ---------------------------------------------------------------- 4. TorchTitan's structured logger
def titan_costs(tmp: Path) -> dict:
    """TorchTitan's structured logger's span / scalar cost beside forge_obs.titan's (same process)."""
    import timeit

    from torchtitan.observability import structured_logger as tt

    from forge_obs import titan as ours
    from forge_obs.recording import timeline

    tt.init_structured_logger(source="bench", output_dir=str(tmp / "tt"), rank=0)
    ours.init_structured_logger(source="bench", output_dir=str(tmp / "ours"), rank=0)
    tt.set_step(1)
    ours.set_step(1)

    def span(mod):
        def f():
            with mod.log_trace_span("fwd"):
                pass
        return f

    def scalar(mod):
        return lambda: mod.log_trace_scalar({"loss": 1.5})

    res = {}
    for name, fn in (("span", span), ("scalar", scalar)):
        for who, mod in (("torchtitan", tt), ("forge_obs", ours)):
            number = 2000
            res[f"{name}_{who}_us"] = min(timeit.repeat(fn(mod), number=number, repeat=7)) / number * 1e6
            timeline.flush()
    timeline.close()
    return res


# ---------------------------------------------------------------- the table
def _logger_rank_slowdown(ranks: list[dict]) -> tuple:
    """(wall %, CPU %, their noise %): each rank's step work in the sessions where it was the logger
    rank against the sessions where it was not (medians), averaged over ranks; the noise is the
    same figure between two halves of the sessions where it was not."""
    def ratio(a: list, b: list, key: str) -> float:
        return statistics.median(s[key] for s in a) / statistics.median(s[key] for s in b) - 1

    wall, cpu, noise, cpu_noise = [], [], [], []
    for r in ranks:
        mine = [s for s in r["sessions"] if s["logger"]]
        other = [s for s in r["sessions"] if not s["logger"]]
        wall.append(ratio(mine, other, "work_ms"))
        cpu.append(ratio(mine, other, "cpu_ms"))
        noise.append(ratio(other[0::2], other[1::2], "work_ms"))
        cpu_noise.append(ratio(other[0::2], other[1::2], "cpu_ms"))
    return tuple(statistics.fmean(x) * 100 for x in (wall, cpu, noise, cpu_noise))


def _table(scale: list[dict], ranks: list[dict], spans: dict, titan: dict, args: argparse.Namespace) -> list[tuple]:
    base = scale[0]
    rows = []
    for s in scale:
        ratio = s["logger_cpu_us_per_step"] / base["logger_cpu_us_per_step"]
        rows.append((f"logger CPU per step, {s['ranks']} ranks ({s['nodes']} nodes)", f"{s['logger_cpu_us_per_step']:.0f} us",
                     "<= 2x at 16 ranks" if s is not base else "(baseline)", f"{ratio:.2f}x the {base['ranks']}-rank figure"))
        rows.append((f"  node helper CPU per step, {s['ranks']} ranks", f"{s['helper_cpu_us_per_step']:.0f} us", "", ""))
        rows.append((f"  step at the backends, {s['ranks']} ranks (median / p99)",
                     f"{s['backend_ms']:.1f} / {s['backend_p99_ms']:.1f} ms", "",
                     f"{s['steps_at_backend']} of {s['steps']} steps; every rank in every step: {s['every_rank_in_every_step']}"))
        rows.append((f"  store operations per step, {s['ranks']} ranks", "0", "",
                     f"the TCPStore queue design: {2 * s['ranks']} (a push and a pop per rank)"))
    r0, others = ranks[0], ranks[1:]
    slow, cpu_slow, noise, cpu_noise = _logger_rank_slowdown(ranks)
    rows += [
        (f"logger rank's step work vs its own as another rank, {len(ranks)} ranks", f"{slow:+.2f} %", "< 1 %",
         f"mean over ranks of median(as logger) / median(not); the same between halves of the sessions not "
         f"logger (noise): {noise:+.2f} %"),
        ("  the same, the training thread's CPU time", f"{cpu_slow:+.2f} %", "",
         f"noise {cpu_noise:+.2f} %; {statistics.median(s['cpu_ms'] for s in r0['sessions']):.2f} ms CPU a step"),
        ("flush on the training thread (median, rank 0 / others)",
         f"{r0['flush_us']:.1f} / {statistics.median(r['flush_us'] for r in others):.1f} us", "<= 50 us",
         f"the collector's swap alone {r0['swap_us']:.1f} us"),
        ("shipper CPU per step (rank 0 / others)",
         f"{r0['ship_cpu_us_per_step']:.0f} / {statistics.median(r['ship_cpu_us_per_step'] for r in others):.0f} us",
         "off the training thread", ""),
        ("store operations per rank (all at init)", f"{r0['store_ops']} / {max(r['store_ops'] for r in others)}", "none per step",
         f"{r0['steps_logged']} steps logged"),
        ("spans: record_span, rank writing / left out", f"{spans['span_on_us']:.2f} / {spans['span_off_us']:.2f} us", "",
         f"the writer thread's CPU per span written {spans['writer_cpu_us_per_span_on']:.2f} us; "
         f"{spans['bytes_per_span_on']:.0f} B on disk"),
        (f"spans: CPU per rank per step ({args.spans} spans), writing / left out",
         f"{spans['per_step_on_us']:.1f} / {spans['per_step_off_us']:.1f} us", "",
         f"{spans['bytes_per_span_on'] * args.spans:.0f} / 0 B on disk per step"),
        ("TorchTitan span (enter + exit): forge_obs.titan", f"{titan['span_forge_obs_us']:.2f} us", "",
         f"TorchTitan 0.3.0 {titan['span_torchtitan_us']:.2f} us"),
        ("TorchTitan scalar (one): forge_obs.titan", f"{titan['scalar_forge_obs_us']:.2f} us", "",
         f"TorchTitan 0.3.0 {titan['scalar_torchtitan_us']:.2f} us"),
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,128,1024", help="ranks simulated for the logger (part 1)")
    ap.add_argument("--steps", type=int, default=800, help="steps per size (part 1)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="time between steps (parts 1 and 2)")
    ap.add_argument("--nproc", type=int, default=3, help="ranks under torchrun (part 2; the ranks' work should not oversubscribe the CPUs)")
    ap.add_argument("--train-steps", type=int, default=100, help="steps per session (part 2)")
    ap.add_argument("--rounds", type=int, default=3, help="sessions with each rank as the logger rank (part 2)")
    ap.add_argument("--work-ms", type=float, default=5.0, help="CPU work per step (part 2)")
    ap.add_argument("--spans", type=int, default=10, help="spans a training step records (part 3)")
    ap.add_argument("--only-training-thread", action="store_true", help="part 2 alone, one line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ranks = training_thread(args.nproc, args.train_steps, args.work_ms, 4 * args.step_ms, args.rounds, tmp)
        if args.only_training_thread:
            print("logger rank's step work vs its own as another rank: wall %+.2f %%, CPU %+.2f %% (noise %+.2f / %+.2f %%)"
                  % _logger_rank_slowdown(ranks))
            return
        scale = [logger_at(int(n), args.steps, args.step_ms, tmp) for n in args.sizes.split(",")]
        spans = span_costs(tmp, args.spans)
        titan = titan_costs(tmp)
    rows = _table(scale, ranks, spans, titan, args)
    w = max(len(r[0]) for r in rows)
    print(f"SPMD mode at scale ({platform.node()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}); "
          f"{KEYS} keys a rank a step, {RANKS_PER_NODE} ranks a node")
    print(f"{'':{w}}  {'forge_obs':>16}  {'target':>24}  baseline (same run)")
    for name, fig, target, base in rows:
        print(f"{name:{w}}  {fig:>16}  {target:>24}  {base}")
    result = {"args": vars(args), "scale": scale, "ranks": ranks, "spans": spans, "titan": titan,
              "load": os.getloadavg()}
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "spmd.json").write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {out / 'spmd.json'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
