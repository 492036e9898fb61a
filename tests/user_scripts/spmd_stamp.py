"""A user's backend (``"spmd_stamp:Stamp"``): writes when each step reached it, one line
``step wall_time`` to ``<run_dir>/arrivals.txt``, so that a test measures how late steps
reach the backends from the ranks' own flush times."""

import time

from forge_obs import LoggerBackend


class Stamp(LoggerBackend):
    def init(self, run=None, **_kw):
        self.f = open(f"{run.run_dir}/arrivals.txt", "a", buffering=1)

    def log_step(self, record):
        self.f.write(f"{record.step} {time.time()!r}\n")

    def finish(self):
        self.f.close()
