"""The run's progress on stderr: a bar redrawn in place on a terminal, a line every N steps otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    """One-line progress bar on a terminal, a line every ``keep_every`` steps otherwise."""

    def __init__(self, total: int, keep_every: int = 10) -> None:
        self.total, self.t0, self.tty, self.keep_every = total, time.time(), sys.stderr.isatty(), max(1, keep_every)

    def update(self, done: int, reward: float) -> None:
        el = time.time() - self.t0
        eta = el / max(done, 1) * (self.total - done)
        w = 30
        bar = "#" * int(w * done / self.total) + "-" * (w - int(w * done / self.total))
        line = f"[{bar}] step {done}/{self.total}  batch reward {reward:.3f}  {el:.0f}s elapsed, ~{eta:.0f}s left"
        if self.tty:  # redrawn in place; kept (newline) on the steps the console prints
            keep = done % self.keep_every == 0 or done == self.total
            print("\r" + line + "\x1b[K", end="\n" if keep else "", file=sys.stderr, flush=True)
        elif done % self.keep_every == 0 or done == self.total:
            print(line, file=sys.stderr, flush=True)
