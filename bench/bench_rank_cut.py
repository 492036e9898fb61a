"""What one cut costs a rank in CPU, with its caches warm and cold: the fetcher's own cut code.

    python bench/bench_rank_cut.py                  # 15 keys, 3 values each a step
    python bench/bench_rank_cut.py --keys 50

Runs :meth:`LocalFetcherActor._take_cut` (swap, export, acknowledge with the states) in this
process, without Monarch: the fetcher is built without its actor runtime and acknowledges on a
stand-in for the controller's port that frames and sends the ack on a socket pair, as the inbox
socket does. Each step records ``--keys`` keys, then cuts. *Warm*: step after step, as a busy
loop would. *Cold*: before each cut, the CPU caches are evicted (a sweep over about 50 MB of
Python objects), as a rank's process sleeping between two steps finds them. The figure is the
thread's CPU time per cut (``time.thread_time``), the mean over ``--steps``; the baseline, in the
same run and the same two states, is one ``pickle.dumps`` of a dict of ``--keys`` floats (a
floor for any Python code that hands the values over). Results go to
``bench/results/rank_cut.json``. This measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import pickle
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers

from forge_obs.controller import fetcher as _fetcher  # noqa: E402
from forge_obs.core.identity import set_identity  # noqa: E402
from forge_obs.recording.collector import record_metric  # noqa: E402
from forge_obs.recording.reduce import Reduce  # noqa: E402

REDUCTIONS = (Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.STD)


class _Port:
    """The controller's port as a same-host fetcher sees it: each message framed and sent
    (read back by :meth:`drain`, outside the timed cut)."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair()
        self.b.setblocking(False)

    def send(self, msg: object) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.a.sendall(len(data).to_bytes(4, "big") + data)

    def drain(self) -> None:
        try:
            while self.b.recv(1 << 16):
                pass
        except BlockingIOError:
            pass


def _fetcher_without_runtime() -> "_fetcher.LocalFetcherActor":
    f = _fetcher.LocalFetcherActor.__new__(_fetcher.LocalFetcherActor)
    f.identity = set_identity(mesh="generator", rank=0, coords={"procs": 0}, world_size=1)
    f.port, f.local, f.route, f.key, f._held = _Port(), None, None, ("mesh", 0), None
    f.last_seq, f.last_step, f._ident_dict = 0, None, (None, None)
    _fetcher._COLLECTOR.initialized = True
    return f


_JUNK = [{str(i * j): i for i in range(2000)} for j in range(300)]


def _evict() -> int:
    s = 0
    for d in _JUNK:
        for v in d.values():
            s += v
    return s


def _measure(cut, keys: list[str], steps: int, cold: bool, after=lambda: None) -> float:
    """Mean CPU µs of ``cut(step)`` after each step's values were recorded (``after()``, untimed,
    after each cut)."""
    total = 0.0
    for step in range(steps):
        for i, k in enumerate(keys):
            for v in (1.0, 2.0, 3.0):
                record_metric(k, v, REDUCTIONS[i % len(REDUCTIONS)])
        if cold:
            _evict()
        t0 = time.thread_time()
        cut(step)
        total += time.thread_time() - t0
        after()
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=15, help="keys a rank records per step (3 values each)")
    ap.add_argument("--steps", type=int, default=300, help="cuts measured per figure (warm: 10x)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    keys = [f"generator/key_{i}" for i in range(args.keys)]
    f = _fetcher_without_runtime()
    floor = {f"generator/key_{i}": float(i) for i in range(args.keys)}

    def fetcher_cut(step: int) -> None:
        f._take_cut(step + 1, step, "Generator")

    def pickle_floor(step: int) -> None:
        _fetcher._COLLECTOR.swap()
        pickle.dumps(floor, protocol=pickle.HIGHEST_PROTOCOL)

    rows = {}
    for name, fn in (("fetcher cut", fetcher_cut), ("baseline: swap + pickle of the floats", pickle_floor)):
        for cold in (False, True):
            n = args.steps if cold else args.steps * 10
            runs = [_measure(fn, keys, n, cold, f.port.drain) for _ in range(args.rounds)]
            rows[(name, "cold" if cold else "warm")] = statistics.median(runs)
    print(f"## a rank's cut, {args.keys} keys (median of {args.rounds} rounds, CPU µs per cut)")
    print("| code | caches warm | caches cold | cold / warm |")
    print("|---|---|---|---|")
    for name in ("fetcher cut", "baseline: swap + pickle of the floats"):
        w, c = rows[(name, "warm")], rows[(name, "cold")]
        print(f"| {name} | {w:.1f} µs | {c:.1f} µs | {c / w:.1f}x |")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rank_cut.json"
    path.write_text(json.dumps({"keys": args.keys, "us": {f"{k[0]} / {k[1]}": v for k, v in rows.items()}}, indent=1))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
