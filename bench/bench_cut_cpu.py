"""What one step's cut costs in CPU, against the floor Monarch sets: one no-op endpoint round trip.

    python bench/bench_cut_cpu.py                       # 6 meshes x 1 proc, 50 keys a rank, 4 rounds
    python bench/bench_cut_cpu.py --meshes 6 --keys 0 --rounds 6

A controller drives ``--meshes`` meshes of ``--procs`` procs, as an RL loop does its generator,
trainer, buffer, ...: each step one endpoint call to every rank (the rank records ``--keys``
values), ``--controller-keys`` values recorded on the controller, then ``--gap-s`` idle (the
ranks wait, as in an app). Five configurations, each in its own process, run one after the
other in every round (the order rotates between rounds):

- ``off``: ``FORGE_DISABLE_METRICS=true`` (no fetcher, ``record_metric`` does nothing);
- ``off + raw``: ``off`` plus one more no-op endpoint call to every rank each step: what a
  per-step round trip to every rank costs through Monarch;
- ``off + socket``: ``off`` plus one 8-byte round trip to every rank each step over a same-host
  Unix socket, answered by a thread of the rank's (no Monarch message): what the same round trip
  costs outside Monarch;
- ``on, port``: forge_obs with ``FORGE_OBS_LOCAL_SOCKET=0``: the ranks answer on the inbox's
  Monarch port, not on its socket;
- ``on``: forge_obs at its defaults, ``flush(step)`` each step.

The table gives CPU per step (user + system, /proc) of the controller process and of all ranks,
for each configuration (median over rounds), and per round the differences ``on - off``
(forge_obs), ``on, port - off``, ``raw - off`` and ``socket - off`` (the two round trips), with their 95 % intervals
(Student's t), and forge_obs's ratio to the raw round trip; the ``on`` row also gives what
forge_obs accounted for itself (``obs/cpu_s``). Results go to ``bench/results/cut_cpu.json``.
This measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import pair_interval, proc_stat  # noqa: E402  (bench/, beside this script)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("off", "off + raw", "off + socket", "on, port", "on")
ENVS = {"off": {"FORGE_DISABLE_METRICS": "true"}, "off + raw": {"FORGE_DISABLE_METRICS": "true"},
        "off + socket": {"FORGE_DISABLE_METRICS": "true"}, "on, port": {"FORGE_OBS_LOCAL_SOCKET": "0"}, "on": {}}
FLAGS = {"off + raw": ["--raw"], "off + socket": ["--socket"]}


def echo_until_closed(path: str) -> None:
    """A rank's side of the socket round trip: connect to ``path`` and send back every message,
    on a thread of its own, until the controller closes the connection."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)

    def echo() -> None:
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    threading.Thread(target=echo, name="bench-echo", daemon=True).start()


class SocketRoundTrip:
    """The controller's side: one connection per rank; :meth:`round_trip` sends 8 bytes on each
    and returns once every rank's 8 bytes were read back (counted in bytes: a stream may split or
    join them) by a reader thread, which wakes the caller's event loop as an inbox thread would."""

    def __init__(self) -> None:
        self.path = f"\0bench-cut-cpu-{os.getpid()}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(64)
        self.conns: list[socket.socket] = []

    def accept(self, n: int) -> None:
        self.conns += [self.server.accept()[0] for _ in range(n)]

    def start(self, loop) -> None:
        self.loop, self.left, self.done = loop, 0, None
        self.sel = selectors.DefaultSelector()
        for c in self.conns:
            self.sel.register(c, selectors.EVENT_READ)
        threading.Thread(target=self._read, name="bench-socket-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                for key, _ in self.sel.select():
                    data = key.fileobj.recv(64)
                    if not data:
                        return  # a rank closed: the run is over
                    self.left -= len(data)
                    if self.left == 0 and not self.loop.is_closed():
                        self.loop.call_soon_threadsafe(self.done.set_result, None)
        except (OSError, ValueError):
            return  # closed by close(): the run is over

    async def round_trip(self, step: int) -> None:
        self.done, self.left = self.loop.create_future(), 8 * len(self.conns)
        for c in self.conns:
            c.sendall(step.to_bytes(8, "little"))
        await self.done

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.server.close()


# ---------------------------------------------------------------- one run (a process of its own)
async def run_one(args: argparse.Namespace) -> dict:
    import asyncio

    from monarch.actor import Actor, endpoint, this_host

    import provisioner_hooks
    from forge_obs import Reduce, get_or_create_metric_logger, record_metric

    class Rank(Actor):
        @endpoint
        async def work(self, keys: int) -> int:
            for i in range(keys):
                record_metric(f"rank/key_{i}", float(i), Reduce.MEAN)
            return os.getpid()

        @endpoint
        async def echo_on(self, path: str) -> None:
            echo_until_closed(path)

    provisioner_hooks.install()
    tmp = tempfile.mkdtemp(prefix="cut_cpu_")
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"run": {"root": tmp, "id": "cpu"}})
    meshes = [this_host().spawn_procs(per_host={"procs": args.procs}) for _ in range(args.meshes)]
    ranks = [m.spawn("Rank", Rank) for m in meshes]
    pids = sorted({p for r in ranks for _, p in (await r.work.call(0)).items()})
    sock = SocketRoundTrip() if args.socket else None
    if sock is not None:
        for m, r in zip(meshes, ranks):
            connected = r.echo_on.call(sock.path)
            await asyncio.get_running_loop().run_in_executor(None, sock.accept, len(m))
            await connected
        sock.start(asyncio.get_running_loop())

    async def step(s: int) -> None:
        await asyncio.gather(*(r.work.call(args.keys) for r in ranks))
        if args.raw:
            await asyncio.gather(*(r.work.call(0) for r in ranks))
        if sock is not None:
            await sock.round_trip(s)
        for i in range(args.controller_keys):
            record_metric(f"ctl/key_{i}", 1.0, Reduce.SUM)
        await mlogger.flush.call_one(s)
        await asyncio.sleep(args.gap_s)

    for s in range(args.warmup):
        await step(s)
    me = os.getpid()
    ctl0, ranks0 = proc_stat(me)[1], sum(proc_stat(p)[1] for p in pids)
    for s in range(args.warmup, args.warmup + args.steps):
        await step(s)
    ctl1, ranks1 = proc_stat(me)[1], sum(proc_stat(p)[1] for p in pids)
    await mlogger.shutdown.call_one()
    if sock is not None:
        sock.close()
    out = {"controller_ms": (ctl1 - ctl0) / args.steps * 1e3, "ranks_ms": (ranks1 - ranks0) / args.steps * 1e3,
           "accounted_ms": None}
    if not os.environ.get("FORGE_DISABLE_METRICS"):
        from forge_obs.analysis.store import read_metrics

        rows = [r for r in read_metrics(Path(tmp) / "cpu") if args.warmup <= r["step"] < args.warmup + args.steps]
        out["accounted_ms"] = statistics.fmean(r["metrics"].get("obs/cpu_s", 0.0) for r in rows) * 1e3
    for m in meshes:
        await m.stop()
    return out


def child_main(args: argparse.Namespace) -> None:
    import asyncio

    print("RESULT " + json.dumps(asyncio.run(run_one(args))), flush=True)


# ---------------------------------------------------------------- the rounds
def spawn(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--meshes", str(args.meshes), "--procs", str(args.procs),
           "--keys", str(args.keys), "--controller-keys", str(args.controller_keys), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--gap-s", str(args.gap_s)]
    cmd += FLAGS.get(config, [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(ENVS[config], PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), MONARCH_FILE_LOG="error")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.steps * 2 + 300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{config} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def differences(rounds: list[dict], a: str, b: str) -> dict:
    """``a - b`` per round, of all processes and of the controller, with means and intervals."""
    out = {}
    for part, keys in (("all", ("controller_ms", "ranks_ms")), ("controller", ("controller_ms",)), ("ranks", ("ranks_ms",))):
        diffs = [sum(r[a][k] for k in keys) - sum(r[b][k] for k in keys) for r in rounds]
        mean, lo, hi = pair_interval(diffs)
        out[part] = {"diff_ms": diffs, "mean_ms": mean, "ci95_ms": [lo, hi]}
    return out


def print_table(rounds: list[dict], args: argparse.Namespace) -> dict:
    print(f"\n{args.meshes} meshes x {args.procs} procs, {args.keys} keys a rank, {args.controller_keys} on the "
          f"controller, {args.steps} steps a run, {len(rounds)} rounds; CPU ms per step (median over rounds)\n")
    print("| configuration | controller | all ranks | total | forge_obs accounted (`obs/cpu_s`) |")
    print("|---|---|---|---|---|")
    for c in CONFIGS:
        ctl = statistics.median(r[c]["controller_ms"] for r in rounds)
        rk = statistics.median(r[c]["ranks_ms"] for r in rounds)
        acc = [r[c]["accounted_ms"] for r in rounds if r[c]["accounted_ms"] is not None]
        print(f"| {c} | {ctl:.2f} | {rk:.2f} | {ctl + rk:.2f} | {statistics.median(acc):.2f} |" if acc else
              f"| {c} | {ctl:.2f} | {rk:.2f} | {ctl + rk:.2f} | |")
    cut, raw = differences(rounds, "on", "off"), differences(rounds, "off + raw", "off")
    sock, port = differences(rounds, "off + socket", "off"), differences(rounds, "on, port", "off")
    print("\n| per round | all processes | controller | ranks |")
    print("|---|---|---|---|")
    for name, d in (("forge_obs: on - off", cut), ("forge_obs answering on the port: on, port - off", port),
                    ("one raw round trip: off + raw - off", raw), ("one socket round trip: off + socket - off", sock)):
        cells = [f"{', '.join(f'{x:+.2f}' for x in d[p]['diff_ms'])}; mean {d[p]['mean_ms']:+.2f} "
                 f"[{d[p]['ci95_ms'][0]:+.2f}, {d[p]['ci95_ms'][1]:+.2f}]" for p in ("all", "controller", "ranks")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ratio = [c_ / r_ if r_ > 0 else float("nan") for c_, r_ in zip(cut["all"]["diff_ms"], raw["all"]["diff_ms"])]
    print(f"\nforge_obs / one raw round trip, all processes: per round {', '.join(f'{x:.2f}' for x in ratio)}; "
          f"median {statistics.median(ratio):.2f}")
    return {"rounds": rounds, "forge_obs": cut, "forge_obs_port": port, "raw_round_trip": raw, "socket_round_trip": sock,
            "ratio_per_round": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", type=int, default=6)
    ap.add_argument("--procs", type=int, default=1, help="procs per mesh")
    ap.add_argument("--keys", type=int, default=50, help="values each rank records per step")
    ap.add_argument("--controller-keys", type=int, default=30)
    ap.add_argument("--steps", type=int, default=300, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gap-s", type=float, default=0.05, help="idle time per step after the flush")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args)
    rounds = []
    for i in range(args.rounds):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]
        r = {c: spawn(c, args) for c in order}
        rounds.append(r)
        print(f"round {i + 1}: " + ", ".join(f"{c} {r[c]['controller_ms'] + r[c]['ranks_ms']:.2f} ms" for c in CONFIGS), flush=True)
    result = print_table(rounds, args)
    out = ROOT / "bench" / "results" / "cut_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "time": time.time(), **result}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
