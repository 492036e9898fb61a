"""GRPO-shaped run directories with planted faults and a known critical path, written in the
documented ``events/*.jsonl`` format (schema v1) with exact timings.

    grpo_run(run_dir, steps=12, slow_replica=(1, 0.8))   # replica 1's generate takes 0.8 s

Each step: the controller's ``controller_step`` (flow ``policy-v{n+1}``) waits for a batch
(``wait_for_batch``: a failed ``buffer_sample``, one rollout ``rollout-{n}`` = ``generate`` on
replica ``n % 2`` -> ``reward`` -> ``reference_logprobs`` -> ``buffer_add``, then a successful
``buffer_sample``), then awaits ``train_step`` on every trainer rank (``forward_backward``, then
``grad_allreduce`` until the slowest rank arrives) and ``weights_push`` on rank 0. Meanwhile the
other replica runs a rollout of its own (concurrent with training: never on the path).
"""

from __future__ import annotations

import json
from pathlib import Path

T0_US = 1_763_860_000_000_000
START = 1_763_860_000.0
US = 1_000_000


class Proc:
    """One process's file: spans on tracks (lanes), steps, flows, open spans."""

    def __init__(self, mesh: str, rank: int, pid: int, host: str = "node0", ctl: bool = False,
                 actor: str = "", skew_s: float = 0.0, ws: int = 1) -> None:
        self.h = {"h": 1, "v": 1, "run": "t", "start": START, "session": f"s{pid}", "host": host, "pid": pid,
                  "mesh": mesh, "actor": actor or mesh.capitalize(), "rank": rank, "coords": {"procs": rank},
                  "ws": ws, "ctl": ctl, "ranks": "all", "t0": T0_US, "file": 0}
        self.lines: list = []
        self.names: dict[str, int] = {}
        self.lanes: set = set()
        self.skew = int(skew_s * US)  # this host's clock runs ahead by skew_s (no clock sample corrects it)
        self.sid = 0
        self.end = 0

    def _nid(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.names) + 1
            self.lines.append(["N", self.names[name], name])
        return self.names[name]

    def _lane(self, lane: int) -> int:
        if lane not in self.lanes:
            self.lanes.add(lane)
            self.lines.append(["L", lane, "main" if lane == 0 else f"Task-{lane}", 1])
        return lane

    def span(self, name: str, start_s: float, dur_s: float, step: int | None = None, lane: int = 0,
             flow: str | None = None, link: str | None = None) -> float:
        """A finished span (``link``: opened while a linked endpoint call was handled, see
        :meth:`call`); returns its end (s)."""
        ts = int(round(start_s * US)) + self.skew
        rec = [ts, int(round(dur_s * US)), self._lane(lane), self._nid(name), step]
        ex = {**({"f": flow} if flow is not None else {}), **({"p": link} if link is not None else {})}
        if ex:
            rec.append(ex)
        self.lines.append(rec)
        self.end = max(self.end, ts + rec[1])
        return start_s + dur_s

    def open(self, name: str, start_s: float, step: int | None = None, lane: int = 0, flow: str | None = None,
             link: str | None = None) -> None:
        """A span that never ends (a hang, or its process died): written as a "begun" record."""
        self.sid += 1
        ts = int(round(start_s * US)) + self.skew
        rec = ["B", self.sid, ts, self._lane(lane), self._nid(name), step]
        ex = {**({"f": flow} if flow is not None else {}), **({"p": link} if link is not None else {})}
        if ex:
            rec.append(ex)
        self.lines.append(rec)
        self.end = max(self.end, ts)

    def call(self, at_s: float, link: str, step: int | None = None, lane: int = 0) -> None:
        """An endpoint call sent under the span open on ``lane`` at ``at_s``: the callee's
        top-level spans of that call carry ``link``."""
        ts = int(round(at_s * US)) + self.skew
        self.lines.append(["I", ts, self._lane(lane), self._nid("call"), step, {"p": link}])

    def step(self, at_s: float, step: int) -> None:
        self.lines.append(["S", int(round(at_s * US)) + self.skew, self._lane(0), step])

    def write(self, ev: Path, close: bool = True) -> None:
        lines = [self.h, *self.lines] + ([["Z", self.end]] if close else [])
        path = ev / f"{self.h['host']}_{self.h['pid']}_{self.h['mesh']}_{self.h['rank']}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def grpo_run(run_dir: "str | Path", steps: int = 12, *, slow_replica: tuple | None = None,
             slow_rank: tuple | None = None, slow_sync_s: float = 0.0, slow_sample: tuple | None = None,
             starved: tuple | None = None, hang: tuple | None = None, trainer_host: str = "node0",
             trainer_skew_s: float = 0.0, slow_from: int = 0, carried_sync_s: float = 0.0,
             unspanned_s: float = 0.0, span_after_gap: bool = False, busy_sample_s: float = 0.0) -> Path:
    """Writes the run; every fault applies from step ``slow_from`` on.

    ``slow_replica=(i, s)``: replica i's ``generate`` takes s; ``slow_rank=(r, s)``: trainer rank r's
    ``forward_backward`` takes s; ``slow_sync_s``: each replica's ``weights_load`` (just before the
    step's rollout, on the replica that serves it) takes that long; ``slow_sample=(s,)``: the
    successful ``buffer_sample`` takes s; ``starved=(s,)``: the rollout waits s in the controller's
    ``route`` (no replica free) before its ``generate``; ``hang=(step,)``: trainer rank 1's
    ``forward_backward`` never ends at that step (nothing after it is written);
    ``trainer_host``/``trainer_skew_s``: the trainer runs on another host whose clock is ahead;
    ``carried_sync_s``: the replica's ``weights_load`` of the policy just published starts 1.5 ms
    before the step (right after the previous step's publish) and the rollout's ``generate``
    waits for it; ``unspanned_s``: the replica that serves the step's rollout works that long
    after its ``generate`` without a span before it replies (``span_after_gap``: then records a
    ``detokenize`` span of 2 ms before it replies); ``busy_sample_s``: the buffer's first (failed)
    ``buffer_sample`` blocks the buffer that long, and the rollout's ``buffer_add`` waits behind it.
    """
    run_dir = Path(run_dir)
    ev = run_dir / "events"
    ev.mkdir(parents=True, exist_ok=True)
    ctl = Proc("controller", 0, 1, ctl=True, actor="")
    gens = [Proc(f"generator_{i}", 0, 10 + i, actor="Generator") for i in range(2)]
    trainer = [Proc("trainer", r, 20 + r, host=trainer_host, skew_s=trainer_skew_s, actor="Trainer", ws=2)
               for r in range(2)]
    reward, ref, buf = Proc("reward", 0, 30), Proc("reference", 0, 31), Proc("buffer", 0, 32)
    procs = [ctl, *gens, *trainer, reward, ref, buf]
    t = 0.0
    hung = False
    for n in range(steps):
        on = n >= slow_from
        ctl.step(t, n)
        for p in (*gens, *trainer, reward, ref, buf):
            p.step(t, n)
        i = n % 2
        flow = f"rollout-{n}"
        c = buf.span("buffer_sample", t + 0.001, busy_sample_s if busy_sample_s and on else 0.002, n)  # nothing new yet
        g0 = t + 0.002
        if slow_sync_s and on:
            g0 = gens[i].span("weights_load", t + 0.002, slow_sync_s, n, lane=1, flow=f"policy-v{n}") + 0.001
        if carried_sync_s and on:
            g0 = gens[i].span("weights_load", t - 0.0015, carried_sync_s, n, lane=1, flow=f"policy-v{n}") + 0.001
        if starved and on:
            g0 = ctl.span("route", t + 0.002, starved[0], n, lane=1, flow=flow) + 0.001
        gen_s = slow_replica[1] if slow_replica and slow_replica[0] == i and on else 0.1
        e = gens[i].span("generate", g0, gen_s, n, lane=2, flow=flow)
        gens[i].span("tokenize", g0 + 0.001, 0.002, n, lane=2)
        if unspanned_s and on:
            e += unspanned_s
            if span_after_gap:
                e = gens[i].span("detokenize", e, 0.002, n, lane=2, flow=flow)
        e = reward.span("reward", e + 0.001, 0.01, n, flow=flow)
        e = ref.span("reference_logprobs", e + 0.001, 0.02, n, flow=flow)
        e = buf.span("buffer_add", max(e + 0.001, c + 0.0002), 0.005, n, flow=flow)
        sample_s = slow_sample[0] if slow_sample and on else 0.003
        e = buf.span("buffer_sample", max(e, c) + 0.001, sample_s, n) + 0.0005
        ctl.span("wait_for_batch", t, e - t, n)
        ts = e + 0.001
        fb = [slow_rank[1] if slow_rank and slow_rank[0] == r and on else 0.2 for r in range(2)]
        other = 1 - i  # the other replica's rollout runs during training
        o = gens[other].span("generate", ts + 0.002, 0.15, n, lane=2, flow=f"rollout-{n}-bg")
        o = reward.span("reward", o + 0.001, 0.01, n, flow=f"rollout-{n}-bg")
        if hang and hang[0] == n:
            for r, p in enumerate(trainer):
                p.span("batch_creation", ts, 0.005, n, lane=1)
            trainer[0].open("grad_allreduce", ts + 0.005 + fb[0], n, lane=1)
            trainer[1].open("forward_backward", ts + 0.005, n, lane=1)
            trainer[0].open("train_step", ts, n, lane=1, flow=f"policy-v{n + 1}")
            trainer[1].open("train_step", ts, n, lane=1, flow=f"policy-v{n + 1}")
            ctl.open("controller_step", t, n, flow=f"policy-v{n + 1}")
            hung = True
            break
        ar_end = ts + 0.005 + max(fb) + 0.01
        for r, p in enumerate(trainer):
            p.span("batch_creation", ts, 0.005, n, lane=1)
            p.span("forward_backward", ts + 0.005, fb[r], n, lane=1)
            p.span("grad_allreduce", ts + 0.005 + fb[r], ar_end - (ts + 0.005 + fb[r]), n, lane=1)
            p.span("optimizer_step", ar_end, 0.01, n, lane=1)
            p.span("train_step", ts, ar_end + 0.01 - ts, n, lane=1, flow=f"policy-v{n + 1}")
        e = trainer[0].span("weights_push", ar_end + 0.012, 0.02, n, lane=2, flow=f"policy-v{n + 1}") + 0.001
        ctl.span("controller_step", t, e - t, n, flow=f"policy-v{n + 1}")
        t = e + 0.002
    for p in procs:
        p.lines.sort(key=lambda r: 0 if r[0] in ("N", "L") else 1)  # definitions first (stable)
        p.write(ev, close=not hung)
    return run_dir
