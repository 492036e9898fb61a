"""A real run of the library on several localhost Monarch hosts, read back as JSON.

    python -m tests.support.agg_programs --hosts 2 --procs 3 --steps 4 --kill 4 --kill-at 2
    python -m tests.support.agg_programs --hosts 2 --procs 3 --steps 5 --hang 5 --hang-at 2 --hang-s 8 --aggregate off
    python -m tests.support.agg_programs --hosts 2 --procs 3 --steps 6 --kill 5 --kill-at 2 --signal STOP --resume-after 3

Every rank records, per step, ``check/sum`` (SUM of rank+1), ``check/mean`` (MEAN of the rank),
``check/max`` (MAX of the rank) and ``check/count`` (one SUM per rank), with ``init_backends(..., "aggregate": --aggregate)`` (``on``:
one leader per (mesh, host), :mod:`forge_obs.controller.aggregate`) and every logging mode on. ``--kill R --kill-at S``: rank R's process exits while
recording step S; ``--hang R --hang-at S --hang-s T``: rank R's process holds its GIL for T
seconds from step S (a C loop that never releases it; step S + 1 begins once it answers again).
``--signal KILL`` kills rank R with
SIGKILL instead of exiting; ``--signal STOP`` stops it (SIGSTOP) and, with ``--resume-after K``,
the controller continues it (SIGCONT) once step K is logged (it records nothing after it
stopped). Each host's leader is its highest rank
(rank 5 of 2 x 3). Prints one JSON line: per step the global values, the per-rank values, the raw
values per rank, missing/late labels, the flush's blocking time and the inbox messages.
Runs in its own process (it counts the inbox's messages by wrapping ``forge_obs.controller.inbox.take``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("MONARCH_FILE_LOG", "error")
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")


INBOX = [0]  # messages taken by the controller's inbox


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aggregate", default="on", choices=["auto", "on", "off"])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--procs", type=int, default=3, help="procs per host")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kill", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--signal", default="exit", choices=["exit", "KILL", "STOP"])
    ap.add_argument("--resume-after", type=int, default=-1)
    ap.add_argument("--hang", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--hang-s", type=float, default=8.0)
    ap.add_argument("--flush-timeout", type=float, default=4.0)
    ap.add_argument("--root", default="/tmp/forge_obs_scenario")
    args = ap.parse_args()
    import monarch.actor

    monarch.actor.unhandled_fault_hook = lambda failure: None  # a killed rank must not end this run
    import forge_obs.controller.inbox as inbox

    take = inbox.take

    def counted(msg: tuple) -> None:
        INBOX[0] += 1
        take(msg)

    inbox.take = counted  # before the inbox starts: its drains take every message through this
    print("RESULT " + json.dumps(asyncio.run(run(args))), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the killed rank's mesh cannot be stopped cleanly; the hosts are ended by LocalHosts


async def run(args: argparse.Namespace) -> dict:
    import provisioner_hooks
    from monarch.actor import Actor, context, endpoint

    from tests.support.localhosts import LocalHosts
    from forge_obs import LoggerBackend, Reduce, get_or_create_metric_logger, record_metric, register_backend

    records: dict[int, dict] = {}

    class Keep(LoggerBackend):
        def log_step(self, record):
            records[record.step] = {
                "global": {k: v for k, v in record.global_dict().items() if k.startswith(("check/", "obs/"))},
                # each rank's recorded values (its telemetry, obs/sys/..., is forge_obs's own)
                "per_rank": {lb: kept for lb, vals in record.per_rank_values().items()
                             if (kept := {k: v for k, v in vals.items() if not k.startswith("obs/")})},
                "raw": {label: [[k, v] for k, v, _ts in vals] for label, vals in record.raw.items()},
                "missing": list(record.missing),
                "late": list(record.late),
            }

    register_backend("keep", Keep)

    class Rec(Actor):
        @endpoint
        async def record(self, step: int, kill: int, hang_s: float, sig: str = "exit") -> int:
            r = context().actor_instance.rank.rank
            record_metric("check/sum", float(r + 1), Reduce.SUM)
            record_metric("check/mean", float(r), Reduce.MEAN)
            record_metric("check/max", float(r), Reduce.MAX)
            record_metric("check/count", 1, Reduce.SUM)
            if r == kill:
                if sig == "exit":
                    os._exit(1)
                import signal

                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
            if hang_s > 0:
                import threading

                per_s = 0.0
                for _ in range(3):  # the fastest of three: a warm-up or a busy moment makes a hang short
                    t0 = time.perf_counter()
                    sum(range(10**6))
                    per_s = max(per_s, 10**6 / (time.perf_counter() - t0))
                # sum() over a range runs in C and never releases the GIL: the process is hung
                threading.Thread(target=lambda: sum(range(int(per_s * hang_s))), daemon=True).start()
            return os.getpid()

        @endpoint
        async def ping(self) -> None:
            return None

    provisioner_hooks.install()
    out: dict = {"steps": {}, "blocked_s": {}, "messages": {}}
    with LocalHosts(args.hosts) as hosts:
        hm = hosts.host_mesh()
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        await mlogger.init_backends.call_one({
            "keep": {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]},
            "jsonl": None, "flush_timeout_s": args.flush_timeout,
            "run": {"root": args.root, "id": f"{args.aggregate}-{os.getpid()}"}, "aggregate": args.aggregate,
        })
        pm = hm.spawn_procs(per_host={"procs": args.procs}, name="m")
        rec = pm.spawn("Rec", Rec)
        n = args.hosts * args.procs
        dead: set[int] = set()
        pids: dict[int, int] = {}
        for step in range(args.steps):
            kill = args.kill if step == args.kill_at else -1
            # each live rank by itself: a mesh-wide call fails once one of its ranks is dead; a
            # hung rank answers when it resumes (its values then land in a later step)
            def call(r: int):
                hang = r == args.hang and step == args.hang_at
                stop = r == kill and args.signal == "STOP"
                c = rec.slice(hosts=r // args.procs, procs=r % args.procs).record.call_one(
                    step, kill, args.hang_s if hang else 0.0, args.signal)
                return asyncio.wait_for(c, timeout=0.5 if hang or stop else 60.0)  # the flush runs while it hangs

            async def pid_of(r: int):
                pids[r] = await call(r)

            calls = [pid_of(r) for r in range(n) if r not in dead]
            done = await asyncio.gather(*calls, return_exceptions=True)
            if kill >= 0:
                dead.add(kill)
            out.setdefault("call_errors", []).extend(type(e).__name__ for e in done if isinstance(e, BaseException))
            INBOX[0] = 0
            t0 = time.perf_counter()
            await mlogger.flush.call_one(step)
            out["blocked_s"][step] = time.perf_counter() - t0
            await mlogger.wait_idle.call_one()
            out["messages"][step] = INBOX[0]
            if step == args.hang_at:  # the next step begins once the hung rank answers again
                await rec.slice(hosts=args.hang // args.procs, procs=args.hang % args.procs).ping.call_one()
            if step == args.resume_after and args.kill in pids:
                import signal

                os.kill(pids[args.kill], signal.SIGCONT)
        await mlogger.shutdown.call_one()
    out["steps"] = records
    return out


if __name__ == "__main__":
    main()
