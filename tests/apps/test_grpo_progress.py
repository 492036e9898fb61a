"""The GRPO run's progress bar and its closing summary read one clock and say what they count: a
run that took 74 s to start and 47 s to train showed "47s elapsed" on the bar and "121s" in the
summary (start-up excluded in one only). Both now say elapsed since the run started, split into
start-up and training, and agree to the second."""

from __future__ import annotations

import argparse
import io
import re
from contextlib import redirect_stdout

import pytest

from apps.grpo.progress import Progress
from apps.grpo.summary import StepLog, write_summary


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t


def test_the_bar_and_the_summary_split_the_same_elapsed_time(tmp_path, capsys):
    clock = Clock(1000.0 + 74)  # the run started at 1000; start-up took 74 s
    steps = StepLog(run_start=1000.0)
    bar = Progress(10, keep_every=5, run_start=steps.run_start, clock=clock.time)
    steps.train_start = bar.t0
    for done in range(1, 11):  # 10 steps of 4.7 s
        clock.t = 1074 + 4.7 * done
        steps.durations_s.append(4.7)
        steps.end_wall.append(clock.t)
        bar.update(done, 0.5)
    last = capsys.readouterr().err.splitlines()[-1]
    assert "step 10/10" in last and "121s elapsed (start-up 74s, training 47s), ~0s left" in last, last
    args = argparse.Namespace(no_report=True, no_alerts=True)
    out = io.StringIO()
    with redirect_stdout(out):
        summary = write_summary(args, str(tmp_path), steps, now=1124.0, gen_kind="torch")  # 3 s of shutdown
    m = re.search(r"\((\d+) steps, (\d+)s elapsed: start-up (\d+)s, training (\d+)s, shutdown (\d+)s\)", out.getvalue())
    assert m, out.getvalue()
    assert [int(g) for g in m.groups()] == [10, 124, 74, 47, 3]
    bar_elapsed = int(re.search(r"(\d+)s elapsed", last).group(1))
    assert bar_elapsed == 74 + 47  # the bar's last elapsed is the summary's start-up + training
    assert summary["startup_s"] == pytest.approx(74) and summary["training_s"] == pytest.approx(47)


def test_the_bar_estimates_what_is_left_from_training_time_only():
    clock = Clock(200.0)
    bar = Progress(4, run_start=100.0, clock=clock.time)  # 100 s of start-up
    clock.t = 210.0
    line = bar.line(1, 0.25)
    assert "110s elapsed (start-up 100s, training 10s), ~30s left" in line, line
