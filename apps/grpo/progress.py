"""The run's progress on stderr: a bar redrawn in place on a terminal, a line every N steps otherwise.
Its clock is the summary's (:class:`apps.grpo.summary.StepLog`): elapsed since the run started,
split into start-up and training, so the two never disagree."""

from __future__ import annotations

import sys
import time


class Progress:
    """One-line progress bar on a terminal, a line every ``keep_every`` steps otherwise.
    ``run_start``: the run's start (``clock()``); training starts when the bar is made."""

    def __init__(self, total: int, keep_every: int = 10, run_start: float | None = None, clock=time.time) -> None:
        self.total, self.tty, self.keep_every, self.clock = total, sys.stderr.isatty(), max(1, keep_every), clock
        self.t0 = clock()  # training starts
        self.run_start = self.t0 if run_start is None else run_start

    def line(self, done: int, reward: float) -> str:
        now = self.clock()
        training = now - self.t0
        eta = training / max(done, 1) * (self.total - done)
        w = 30
        bar = "#" * int(w * done / self.total) + "-" * (w - int(w * done / self.total))
        return (f"[{bar}] step {done}/{self.total}  batch reward {reward:.3f}  {now - self.run_start:.0f}s elapsed "
                f"(start-up {self.t0 - self.run_start:.0f}s, training {training:.0f}s), ~{eta:.0f}s left")

    def update(self, done: int, reward: float) -> None:
        line = self.line(done, reward)
        if self.tty:  # redrawn in place; kept (newline) on the steps the console prints
            keep = done % self.keep_every == 0 or done == self.total
            print("\r" + line + "\x1b[K", end="\n" if keep else "", file=sys.stderr, flush=True)
        elif done % self.keep_every == 0 or done == self.total:
            print(line, file=sys.stderr, flush=True)
