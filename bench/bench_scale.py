"""Scaling: the controller's CPU and the step's latency as ranks grow, on the library's two answer
routes (``"aggregate": "off"``: every rank answers the controller; ``"on"``: one leader per
(mesh, host) answers for its group, :mod:`forge_obs.controller.aggregate`); and a simulation to thousands of
ranks that runs the library's real pipeline code.

    python bench/bench_scale.py                      # 4..64 procs, both routes, + simulation (~8 min, 2 cores)
    python bench/bench_scale.py --procs 4 32 --steps 8 --designs off on
    python bench/bench_scale.py --sim-only --sim-ranks 1024 8192

Real runs: each (design, procs, layout) runs in a fresh controller process, with the procs on
localhost Monarch hosts (worker processes attached with ``attach_to_workers``): every proc on
one host (``--per-host 64``: "here", one machine), and at most 8 procs per host (``--per-host
8``: 4 hosts at 32 procs, 8 at 64). Two proc meshes are spread over all hosts (several meshes);
each rank records 100 MEAN keys per step. Per step it measures the controller process's CPU
(``time.process_time``: every thread, Monarch's included) from ``flush(step)`` until the step
reached the backends, and that latency ("step at backends"). Designs (``"aggregate"`` of
``init_backends``): ``off`` (the direct route: what the library did before aggregation) and
``on`` (the aggregated route). ``--library-config '{...}'`` adds ``init_backends`` keys.

Target: controller CPU per step at 32 procs <= 2x that at 4 procs (same design, same run, one
host). The simulation (``--sim-ranks``) runs the library's controller code for states
(FlushPipeline, fed as the inbox feeds it: real snapshots exported by the collector, pickled as
sent, decoded and merged; real bundles made by forge_obs.wire.bundle) with many logical ranks in one
process, and adds the controller's CPU to receive each message, measured on a real proc
(``--calibrate``). Latency is projected from the residual measured at the largest real size
(latency minus controller CPU) plus the projected controller CPU and the leaders' merge. Prints
tables, writes bench/results/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("MONARCH_FILE_LOG", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)

PROCS_PER_HOST = 8
MESHES = 2
KEYS = 100
TARGET_RATIO = 2.0
RESULTS = ROOT / "bench" / "results"


# ============================================================================ real runs
def layout(procs: int, per_host: int = PROCS_PER_HOST) -> tuple[int, int]:
    """(hosts, procs per host per mesh) for ``procs`` ranks in MESHES meshes, ``per_host`` procs
    per Monarch host at most."""
    hosts = max(1, math.ceil(procs / per_host))
    per = procs // (hosts * MESHES)
    if per * hosts * MESHES != procs:
        raise SystemExit(f"{procs} procs do not split into {MESHES} meshes over {hosts} hosts")
    return hosts, per


INBOX = [0]  # messages taken by the controller's inbox


def worker_main(design: str, procs: int, per_host: int, steps: int, warmup: int, keys: int, library_config: dict) -> None:
    """One (design, procs) run in this process; prints one JSON line."""
    import forge_obs.controller.inbox as inbox

    take = inbox.take

    def counted(msg: tuple) -> None:
        INBOX[0] += 1
        take(msg)

    inbox.take = counted  # counts the inbox's messages; the protocol is the library's
    asyncio.run(_worker(design, procs, per_host, steps, warmup, keys, library_config))


async def _worker(design: str, procs: int, per_host_max: int, steps: int, warmup: int, keys: int, library_config: dict) -> None:
    import tempfile

    import provisioner_hooks
    from monarch.actor import Actor, endpoint

    from forge_obs import LoggerBackend, Reduce, get_or_create_metric_logger, record_metric, register_backend

    arrivals: dict[int, tuple] = {}

    class Arrival(LoggerBackend):
        def log_step(self, record):
            now = time.perf_counter()
            g = record.global_dict()
            w = waiters.pop(record.step, None)
            arrivals[record.step] = (now, g.get("obs/missing_ranks", 0.0), g.get(f"bench/k{keys - 1}"),
                                     {p: g.get(f"obs/cpu_{p}_s", 0.0) for p in ("flush", "inbox", "pipeline")},
                                     g.get("obs/bundles", 0.0))
            if w is not None:
                w[0].call_soon_threadsafe(w[1].set)

    waiters: dict[int, tuple] = {}
    register_backend("bench_arrival", Arrival)

    class Recorder(Actor):
        @endpoint
        async def record(self, n: int, step: int) -> None:
            for i in range(n):
                record_metric(f"bench/k{i}", float(i + step), Reduce.MEAN)

    from tests.support.localhosts import LocalHosts

    hosts_n, per = layout(procs, per_host_max)
    provisioner_hooks.install()
    tmp = tempfile.mkdtemp(prefix="bench_scale_")
    with LocalHosts(hosts_n) as hosts:
        hm = hosts.host_mesh()
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        cfg = {"bench_arrival": {}, "jsonl": None, "run": {"root": tmp, "id": "scale"}, "aggregate": design,
               **library_config}
        await mlogger.init_backends.call_one(cfg)
        meshes = [hm.spawn_procs(per_host={"procs": per}, name=f"mesh{i}") for i in range(MESHES)]
        recs = [pm.spawn("Recorder", Recorder) for pm in meshes]
        await asyncio.gather(*[r.record.call(1, 0) for r in recs])
        idle0_cpu, idle0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(1.0)
        idle_cpu_per_s = (time.process_time() - idle0_cpu) / (time.perf_counter() - idle0)
        rows = []
        loop = asyncio.get_running_loop()
        for step in range(warmup + steps):
            await asyncio.gather(*[r.record.call(keys, step) for r in recs])
            ev = asyncio.Event()
            waiters[step] = (loop, ev)
            INBOX[0] = 0
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            await mlogger.flush.call_one(step)
            t1 = time.perf_counter()
            await asyncio.wait_for(ev.wait(), 60)
            cpu1 = time.process_time()
            t_arr, missing, last_value, _parts, bundles = arrivals[step]
            if step >= warmup:
                rows.append({"cpu_ms": (cpu1 - cpu0) * 1e3, "latency_ms": (t_arr - t0) * 1e3,
                             "idle_corrected_cpu_ms": (cpu1 - cpu0 - idle_cpu_per_s * (t_arr - t0)) * 1e3,
                             "blocked_ms": (t1 - t0) * 1e3, "messages": INBOX[0],
                             "missing": missing, "bundles": bundles,
                             "exact": last_value == float(keys - 1 + step)})
        # forge_obs's own controller threads (flush, inbox, pipeline) per step: each step reports
        # the CPU counted since the previous one, so step k+1 carries step k's
        for i, r in enumerate(rows):
            nxt = arrivals.get(warmup + i + 1)
            r["obs_threads_cpu_ms"] = sum(nxt[3].values()) * 1e3 if nxt else None
        await mlogger.shutdown.call_one()
        for pm in meshes:
            await pm.stop()
    out = {
        "design": design, "procs": procs, "hosts": hosts_n, "per_host": per_host_max, "meshes": MESHES, "keys": keys,
        "cpu_ms": statistics.median(r["cpu_ms"] for r in rows),
        "latency_ms": statistics.median(r["latency_ms"] for r in rows),
        "blocked_ms": statistics.median(r["blocked_ms"] for r in rows),
        "messages": statistics.median(r["messages"] for r in rows),
        "idle_corrected_cpu_ms": statistics.median(r["idle_corrected_cpu_ms"] for r in rows),
        "obs_threads_cpu_ms": statistics.median([r["obs_threads_cpu_ms"] for r in rows if r["obs_threads_cpu_ms"] is not None] or [float("nan")]),
        "idle_cpu_ms_per_s": idle_cpu_per_s * 1e3,
        "all_exact": all(r["exact"] and not r["missing"] for r in rows),
        "bundles": statistics.median(r["bundles"] for r in rows),
        "steps": rows,
    }
    print("RESULT " + json.dumps(out), flush=True)


def run_one(design: str, procs: int, per_host: int, steps: int, warmup: int, keys: int, library_config: dict,
            timeout_s: float) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", design, str(procs), "--per-host-worker", str(per_host),
           "--steps", str(steps), "--warmup", str(warmup),
           "--keys", str(keys), "--library-config", json.dumps(library_config)]
    t0 = time.monotonic()
    # its own session: on a timeout the whole group goes (the run's localhost hosts and procs too)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        print(f"  {design} @ {procs} procs ({layout(procs, per_host)[0]} hosts): timed out after {timeout_s:.0f} s",
              flush=True)
        return None
    p = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["wall_s"] = time.monotonic() - t0
            print(f"  {design:8s} {procs:3d} procs ({r['hosts']} hosts): controller CPU {r['cpu_ms']:.2f} ms/step "
                  f"(forge_obs threads {r['obs_threads_cpu_ms']:.2f}), "
                  f"at backends {r['latency_ms']:.1f} ms, flush blocked {r['blocked_ms']:.1f} ms, "
                  f"{r['messages']:.0f} msgs/step, exact {r['all_exact']} ({r['wall_s']:.0f} s)", flush=True)
            return r
    print(f"  {design} @ {procs} procs failed (rc {p.returncode}):\n{p.stderr[-3000:]}", flush=True)
    return None


# ============================================================================ transport calibration
def calibrate_main(n_msgs: int, keys: int) -> None:
    """The controller's CPU to receive one message on its inbox port (Monarch's transport and a
    blocking receive on a thread, as the inbox does; the decode is left out: the simulation does
    it), per kind of message, sent by a real proc. Prints one JSON line."""
    asyncio.run(_calibrate(n_msgs, keys))


async def _calibrate(n_msgs: int, keys: int) -> None:
    import threading

    from monarch.actor import Actor, Channel, endpoint, this_host

    from forge_obs.wire.bundle import dumps_bundle, make_bundle
    from forge_obs.wire.messages import ACK, ACKB, BUNDLE, STATES, Ack, AckBatch, Bundle, States, wire
    from forge_obs.wire.snapshot import loads

    class Sender(Actor):
        @endpoint
        async def send(self, port, payload: bytes, n: int) -> None:
            msg = pickle.loads(payload)
            for _ in range(n):
                port.send(msg)

    templates = _templates(keys)
    ack = Ack(ACK, 1, ("m", 0), [], None)
    states = States(STATES, 1, ("m", 0), {"label": "m/r0", "mesh": "m", "rank": 0, "host": "h", "pid": 1}, templates[0])
    bundle8 = make_bundle({("m", r): loads(templates[r % len(templates)]) for r in range(PROCS_PER_HOST)})
    payloads = {
        "ack": wire(ack),
        "states": wire(states),
        "ack_batch": wire(AckBatch(ACKB, 1, [(("m", r), ()) for r in range(PROCS_PER_HOST)], [])),
        "bundle": wire(Bundle(BUNDLE, 1, ("m", 0), 1, [("m", r) for r in range(PROCS_PER_HOST)], {},
                              dumps_bundle(bundle8))),
    }
    pm = this_host().spawn_procs(per_host={"procs": 1}, name="calibrate")
    sender = pm.spawn("Sender", Sender)
    out = {}
    for kind, msg in payloads.items():
        port, receiver = Channel.open()
        base = receiver._receiver
        got = threading.Event()

        def drain(n=n_msgs) -> None:
            for _ in range(n):
                base.recv_task().block_on()  # receive only: the simulation decodes
            got.set()

        await sender.send.call(port, pickle.dumps(msg), 20)  # warm the path
        for _ in range(20):
            base.recv_task().block_on()
        th = threading.Thread(target=drain, daemon=True)
        cpu0 = time.process_time()
        th.start()
        await sender.send.call(port, pickle.dumps(msg), n_msgs)
        await asyncio.get_running_loop().run_in_executor(None, got.wait)
        out[kind] = (time.process_time() - cpu0) / n_msgs * 1e3
    await pm.stop()
    print("RESULT " + json.dumps(out), flush=True)


def calibrate(keys: int, timeout_s: float) -> dict[str, float]:
    p = subprocess.run([sys.executable, __file__, "--calibrate", "--keys", str(keys)], capture_output=True,
                       text=True, timeout=timeout_s)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"calibration failed (rc {p.returncode}):\n{p.stderr[-2000:]}")
    return {}


# ============================================================================ simulation
def _templates(keys: int, n: int = 16) -> list[bytes]:
    """Real rank snapshots (the collector's packed export, pickled as a fetcher sends it)."""
    from forge_obs.recording.collector import MetricCollector, record_metric
    from forge_obs.wire.snapshot import dumps
    from forge_obs.recording.reduce import Reduce

    c = MetricCollector()
    c.reset()
    out = []
    for t in range(n):
        for i in range(keys):
            record_metric(f"bench/k{i}", float(i * 0.37 + t), Reduce.MEAN)
        out.append(dumps(c.export(c.swap(), packed=True)))
    return out


def simulate(ranks: int, design: str, keys: int, group: int, fanin: int, steps: int) -> dict:
    """Controller CPU per step for ``ranks`` logical ranks, through the real pipeline code.

    ``off``: one ack and one states message per rank (each message pickled and unpickled as the
    port does). ``on``: one ack batch and one bundle per group of ``group`` ranks (bundles made by
    forge_obs.wire.bundle from real snapshots); with ``fanin`` > 1, groups' bundles are merged again by
    ``fanin`` (a second level of aggregators, not in the library), so the controller gets
    ranks/(group*fanin)."""
    import threading

    from forge_obs.backends.base import LoggerBackend
    from forge_obs.controller.pipeline import FlushPipeline
    from forge_obs.wire.bundle import dumps_bundle, make_bundle, merge_bundles
    from forge_obs.wire.messages import ACK, ACKB, BUNDLE, STATES, Ack, AckBatch, Bundle, States, view, wire
    from forge_obs.wire.snapshot import loads

    done = threading.Event()
    seen = {}

    class Arrival(LoggerBackend):
        def log_step(self, record):
            seen[record.step] = record.global_dict()
            done.set()

    templates = _templates(keys)
    mesh = "m"
    keys_r = [(mesh, r) for r in range(ranks)]
    ident = {"label": "m/r0", "mesh": mesh, "rank": 0, "host": "h", "pid": 1}
    leader_cpu_s = 0.0
    if design == "off":
        pipe = FlushPipeline({"arrival": Arrival({})}, "sim", flush_timeout_s=600)
        msgs = []
        for k in keys_r:
            msgs.append(pickle.dumps(wire(Ack(ACK, 0, k, [], None))))
            msgs.append(pickle.dumps(wire(States(STATES, 0, k, dict(ident, label=f"m/r{k[1]}", rank=k[1]),
                                                 templates[k[1] % len(templates)]))))
    else:
        pipe = FlushPipeline({"arrival": Arrival({})}, "sim", flush_timeout_s=600)
        per = group * fanin
        msgs = []
        level1, level2 = [], []
        for g0 in range(0, ranks, per):
            bundles = []
            for h0 in range(g0, min(ranks, g0 + per), group):
                members = keys_r[h0:h0 + group]
                c0 = time.process_time()
                b1 = make_bundle({k: loads(templates[k[1] % len(templates)]) for k in members})
                dumps_bundle(b1)
                level1.append(time.process_time() - c0)
                bundles.append(b1)
            c0 = time.process_time()
            b = bundles[0] if len(bundles) == 1 else merge_bundles(bundles)
            payload = dumps_bundle(b)
            if len(bundles) > 1:
                level2.append(time.process_time() - c0)
            members = keys_r[g0:g0 + per]
            msgs.append(pickle.dumps(wire(AckBatch(ACKB, 0, [(k, ()) for k in members], []))))
            msgs.append(pickle.dumps(wire(Bundle(BUNDLE, 0, members[-1], 1, members, {}, payload))))
        leader_cpu_s = statistics.median(level1) + (statistics.median(level2) if level2 else 0.0)
    pipe.start()
    labels = {k: f"m/r{k[1]}" for k in keys_r}
    cpus = []
    for step in range(steps):
        done.clear()
        cpu0 = time.process_time()
        cut = pipe.begin_cut(step, None, labels)
        for raw in msgs:
            m = view(pickle.loads(raw))
            if m.kind == ACK:
                pipe.ack(cut.seq, m.rank, m.children)
            elif m.kind == STATES:
                pipe.states(cut.seq, m.rank, m.identity, m.states)
            elif m.kind == ACKB:
                pipe.ack_batch(cut.seq, m.items, m.given_up)
            else:
                pipe.bundle(cut.seq, m.ranks, m.bundle, m.identities)
        done.wait(600)
        cpus.append(time.process_time() - cpu0)
    asyncio.run(pipe.close())
    value = seen[steps - 1].get(f"bench/k{keys - 1}")
    return {"ranks": ranks, "design": design if fanin == 1 else f"{design}x{fanin}", "messages": len(msgs),
            "cpu_ms": statistics.median(cpus) * 1e3, "leader_cpu_ms": leader_cpu_s * 1e3, "value": value}


# ============================================================================ report
def plot(real: list[dict], sim: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"off": "tab:blue", "on": "tab:green"}
    names = {"off": 'aggregate "off" (direct)', "on": 'aggregate "on" (per host)'}
    for design, marker in (("off", "o"), ("on", "s")):
        for name, multi, ls in (("one host", False, "-"), (f"{PROCS_PER_HOST}/host", True, "--")):
            rows: dict[int, list] = {}
            for r in real:
                want = layout(r["procs"])[0] if multi else 1
                if r["design"] == design and r["hosts"] == want:
                    rows.setdefault(r["procs"], []).append(r)
            if len(rows) < 2 or (multi and all(p <= PROCS_PER_HOST for p in rows)):
                continue
            x = sorted(rows)
            kw = dict(marker=marker, ls=ls, color=colors[design], label=f"{names[design]}, {name}")
            axes[0].plot(x, [statistics.median(r["cpu_ms"] for r in rows[p]) for p in x], **kw)
            axes[1].plot(x, [statistics.median(r["latency_ms"] for r in rows[p]) for p in x], **kw)
    for ax, title in ((axes[0], "controller CPU per step (ms)"), (axes[1], "step at backends (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"procs ({MESHES} meshes, {KEYS} keys/rank)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for design, style, label in (("off", "o-", "direct"), ("on", "s-", "per host"),
                                 ("onx16", "d-", "per host + 1 leader per 16 hosts (not in the library)")):
        ss = sorted((s for s in sim if s["design"] == design), key=lambda s: s["ranks"])
        if ss:
            axes[2].plot([s["ranks"] for s in ss], [s["proj_cpu_ms"] for s in ss], style, label=label)
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("ranks (simulated, real code path)")
    axes[2].set_title("projected controller CPU per step (ms)")
    axes[2].grid(True, alpha=0.3)
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, metavar=("DESIGN", "PROCS"))
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--procs", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--per-host", type=int, nargs="+", default=[64, PROCS_PER_HOST],
                    help="layouts: at most this many procs per Monarch host (64: every proc on one host)")
    ap.add_argument("--per-host-worker", type=int, default=PROCS_PER_HOST, help=argparse.SUPPRESS)
    ap.add_argument("--designs", nargs="+", default=["off", "on"], choices=["off", "on", "auto"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--keys", type=int, default=KEYS)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--library-config", default="{}")
    ap.add_argument("--sim-ranks", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--sim-steps", type=int, default=3)
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default="scale", help="bench/results/<out>.json and <out>.png")
    args = ap.parse_args()
    lib_cfg = json.loads(args.library_config)
    if args.calibrate:
        calibrate_main(2000, args.keys)
        return
    if args.worker:
        worker_main(args.worker[0], int(args.worker[1]), args.per_host_worker, args.steps, args.warmup, args.keys, lib_cfg)
        return

    RESULTS.mkdir(parents=True, exist_ok=True)
    real: list[dict] = []
    if not args.sim_only:
        print(f"## real runs: {MESHES} meshes over ceil(procs/{PROCS_PER_HOST}) localhost hosts, {args.keys} keys/rank, "
              f"median of {args.steps} steps", flush=True)
        for rep in range(args.repeat):
            done_layouts = set()
            for per_host in args.per_host:
                for procs in args.procs:
                    hosts_n = layout(procs, per_host)[0]
                    if (procs, hosts_n) in done_layouts:
                        continue  # e.g. 8 procs at <= 8 per host is the single-host run again
                    done_layouts.add((procs, hosts_n))
                    for design in args.designs:
                        r = run_one(design, procs, per_host, args.steps, args.warmup, args.keys, lib_cfg, args.timeout)
                        if r is not None:
                            r["repeat"] = rep
                            real.append(r)
    sim: list[dict] = []
    if not args.no_sim:
        print("\n## simulation (real pipeline code, many logical ranks in one process)", flush=True)
        receive = calibrate(args.keys, args.timeout)
        print("  controller CPU to receive one message (real proc -> inbox-like port): "
              + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in receive.items()), flush=True)
        per_kind = {"off": receive.get("ack", 0.0) + receive.get("states", 0.0),
                    "on": receive.get("ack_batch", 0.0) + receive.get("bundle", 0.0)}
        # what the real runs spent beyond the simulated pipeline and the receives: Monarch's cast,
        # the asyncio loop, background threads (reported, not projected)
        for r in real:
            if r["design"] in ("off", "on"):
                d = r["design"]
                sim_r = simulate(r["procs"], d, args.keys, layout(r["procs"], r["per_host"])[1], 1, args.sim_steps)
                r["sim_cpu_ms"] = sim_r["cpu_ms"]
                r["other_cpu_ms"] = r["cpu_ms"] - sim_r["cpu_ms"] - per_kind[d] / 2 * r["messages"]
        for ranks in args.sim_ranks:
            for design, fanin in (("off", 1), ("on", 1), ("on", 16)):
                if fanin > 1 and ranks < PROCS_PER_HOST * fanin * 2:
                    continue
                s = simulate(ranks, design, args.keys, PROCS_PER_HOST, fanin, args.sim_steps)
                t = per_kind[design] / 2  # per message, average of the pair
                s["transport_ms_per_msg"] = t
                s["proj_cpu_ms"] = s["cpu_ms"] + t * s["messages"]
                sim.append(s)
                print(f"  {s['design']:10s} {ranks:5d} ranks: {s['messages']:6d} msgs/step, pipeline CPU {s['cpu_ms']:.1f} ms, "
                      f"+ receive {t * s['messages']:.1f} ms -> {s['proj_cpu_ms']:.1f} ms/step; leader merge {s['leader_cpu_ms']:.2f} ms",
                      flush=True)
        # latency: the residual measured at the largest real size (latency - controller CPU: the
        # cast, the ranks' export, the hops, the backend), plus the projected controller CPU, plus
        # the leaders' merge; a second level of aggregators adds one more measured leader hop
        def resid(design: str) -> float:
            rs = sorted((r for r in real if r["design"] == design and r["hosts"] == layout(r["procs"])[0]),
                        key=lambda r: r["procs"])
            return (rs[-1]["latency_ms"] - rs[-1]["cpu_ms"]) if rs else float("nan")

        hop = max(0.0, resid("on") - resid("off"))
        for s in sim:
            if s["design"] == "off":
                s["proj_latency_ms"] = resid("off") + s["proj_cpu_ms"]
            else:
                levels = 2 if s["design"] != "on" else 1
                s["proj_latency_ms"] = resid("on") + (levels - 1) * hop + s["proj_cpu_ms"] + s["leader_cpu_ms"]

    # ------------------------------------------------------------------ tables
    if real:
        print("\n## controller CPU per step and step at backends (real procs; median over steps, then over repeats)")
        print("| procs | hosts | design | msgs/step at controller | controller CPU/step | vs 4 procs (target <= 2x at 32, one host) "
              "| forge_obs threads | net of Monarch's idle background | step at backends | flush blocked | exact |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        agg: dict[tuple, list] = {}
        for r in real:
            agg.setdefault((r["design"], r["procs"], r["hosts"]), []).append(r)
        summary = []
        for (design, procs, hosts_n), rs in sorted(agg.items(), key=lambda kv: (kv[0][2] > 1, kv[0][1], kv[0][0])):
            summary.append({
                "design": design, "procs": procs, "hosts": hosts_n,
                "cpu_ms": statistics.median(r["cpu_ms"] for r in rs),
                "idle_corrected_cpu_ms": statistics.median(r["idle_corrected_cpu_ms"] for r in rs),
                "idle_cpu_ms_per_s": statistics.median(r["idle_cpu_ms_per_s"] for r in rs),
                "obs_threads_cpu_ms": statistics.median(r["obs_threads_cpu_ms"] for r in rs),
                "latency_ms": statistics.median(r["latency_ms"] for r in rs),
                "blocked_ms": statistics.median(r["blocked_ms"] for r in rs),
                "messages": statistics.median(r["messages"] for r in rs),
                "exact": all(r["all_exact"] for r in rs), "runs": len(rs)})
        smallest = min(args.procs)
        base = {s["design"]: s["cpu_ms"] for s in summary if s["procs"] == smallest and s["hosts"] == 1}
        for s in summary:
            ratio = s["cpu_ms"] / base[s["design"]] if s["design"] in base else float("nan")
            s["ratio_vs_smallest"] = ratio
            mark = ""
            if s["procs"] == 32 and smallest == 4:
                verdict = "meets" if ratio <= TARGET_RATIO else "misses"
                mark = f" ({verdict})" if s["hosts"] == 1 else f" ({verdict}; {s['hosts']} hosts)"
            print(f"| {s['procs']} | {s['hosts']} | {s['design']} | {s['messages']:.0f} | {s['cpu_ms']:.2f} ms | "
                  f"{ratio:.2f}x{mark} | {s['obs_threads_cpu_ms']:.2f} ms | {s['idle_corrected_cpu_ms']:.2f} ms "
                  f"({s['idle_cpu_ms_per_s']:.0f} ms/s idle) | {s['latency_ms']:.1f} ms | {s['blocked_ms']:.1f} ms | "
                  f"{s['exact']} |")
    else:
        summary = []
    if sim:
        print("\n## simulation: projected controller CPU and latency per step (100 keys/rank, global_reduce)")
        print("| ranks | design | msgs/step at controller | pipeline CPU (real code) | + receive (calibrated) | "
              "projected controller CPU/step | per-leader merge | projected step at backends |")
        print("|---|---|---|---|---|---|---|---|")
        for s in sorted(sim, key=lambda s: (s["ranks"], s["design"])):
            print(f"| {s['ranks']} | {s['design']} | {s['messages']} | {s['cpu_ms']:.1f} ms | "
                  f"{s['transport_ms_per_msg'] * s['messages']:.1f} ms | {s['proj_cpu_ms']:.1f} ms | "
                  f"{s['leader_cpu_ms']:.2f} ms | {s['proj_latency_ms']:.0f} ms |")
    out = {"real": real, "summary": summary, "sim": sim,
           "config": {"procs_per_host": PROCS_PER_HOST, "meshes": MESHES, "keys": args.keys, "steps": args.steps,
                      "library_config": lib_cfg, "cores": os.cpu_count()}}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2))
    print(f"\nJSON: {RESULTS / (args.out + '.json')}")
    if real or sim:
        try:
            plot(real, sim, RESULTS / f"{args.out}.png")
            print(f"plot: {RESULTS / (args.out + '.png')}")
        except ImportError:
            print("plot skipped: pip install matplotlib (in the dev extra)")


if __name__ == "__main__":
    main()
