"""Every threshold of the doctor's rules, in one dataclass shared by ``forge-obs doctor`` and the
live ``"alerts"`` backend (same names, same meaning).

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> cfg = DoctorConfig.from_dict({"straggler_ratio": 3.0})
    >>> cfg.straggler_ratio, cfg.min_excess_s
    (3.0, 0.002)
    >>> DoctorConfig.from_dict({"straggler_ratoi": 2.0})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown doctor setting 'straggler_ratoi'; valid: straggler_ratio, ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DoctorConfig"]


@dataclass
class DoctorConfig:
    # ---- stragglers and slowdowns (per span and step; live: per duration metric and step)
    #: a rank is out of line when its duration is >= this x its reference: the larger of the median
    #: of the other ranks of its mesh at that step and the median of their usual durations (once
    #: out of line: the smaller of the two)
    straggler_ratio: float = 2.0
    #: ... or (``slowdown``) >= this x its own rolling baseline
    history_ratio: float = 2.0
    #: ... and at least this many seconds longer than the reference (keeps tiny spans quiet)
    min_excess_s: float = 0.002
    #: ... and the excess is at least this share of the step's wall time
    min_step_share: float = 0.1
    #: peers spending less than this on a span (or not having it) do not do that work: the rank
    #: that does it from the start has a role (rank 0 writes the weights), judged by its history
    role_peer_max_s: float = 0.001
    #: an out-of-line condition starts when it holds in ``fire_steps`` of the last ``window_steps``
    #: judged steps, and ends when it holds in at most ``clear_steps`` of them
    fire_steps: int = 4
    window_steps: int = 5
    clear_steps: int = 1
    #: ``since step N`` is the first of those steps whose excess is at least this share of the
    #: median excess of the steps that started it (an out-of-line step just before the slowdown,
    #: much smaller than it, is noise on a loaded machine, not its start)
    onset_share: float = 0.5
    #: the doctor (seeing whole episodes) reports one only when it held in at least this many steps
    #: and in at least ``persist`` of the steps from its onset to its end: blips and the streaks
    #: of a loaded machine (out of line in 60-65 % of their steps) are not findings
    min_episode_steps: int = 4
    persist: float = 0.8
    #: a rank's own baseline (and its usual duration, its peers' reference): the median of its last
    #: ``history_steps`` normal durations, used once it has ``history_min_steps`` of them
    history_steps: int = 16
    history_min_steps: int = 5
    #: span / metric names that wait on other ranks (collectives, queues): time there is a
    #: consequence of someone else's slowness, never a root
    wait_spans: str = r"wait|idle|allreduce|all_reduce|allgather|all_gather|reduce_scatter|barrier|collective|recv|sleep|queue"
    #: one-off phases that do not count toward a process's active time (shares)
    lifecycle_spans: str = r"^(startup|start_up|setup|set_up|init|initialize|warmup|warm_up|teardown|shutdown|close)$"
    # ---- hangs and stalls
    #: shortest silence / open span reported
    stall_min_s: float = 0.5
    #: a span still open after this x the longest finished one of its name in the mesh is a hang
    hang_factor: float = 10.0
    #: a process silent for this x its mean gap between records has stalled
    silence_factor: float = 20.0
    #: while a run is still being written, a silent process (or a rank without a timeline) is
    #: judged only once the run began this many steps since (the start-up is not a stall)
    stall_steps: int = 3
    # ---- sync bottlenecks
    #: span names (or duration metric names, live) that move state rather than compute
    sync_spans: str = r"weight|sync|ckpt|checkpoint|reload|barrier"
    #: reported when such a span covers >= this share of its process's active time ...
    sync_share: float = 0.5
    #: ... over at least this many calls
    min_calls: int = 3
    # ---- metrics
    #: a ``*staleness*`` metric grows: last third's mean > first third's + this (Theil-Sen slope > 0)
    staleness_growth: float = 1.0
    #: live: rolling window of the staleness test (steps)
    staleness_window: int = 30
    #: throughput metrics (global values) whose drop is reported
    throughput_keys: str = r"(^|/)(tokens|samples|sequences)_per_s$"
    #: a throughput (or the step rate) at or below this share of its rolling median
    #: (``history_steps``), in ``fire_steps`` of the last ``window_steps`` steps, has dropped
    throughput_drop: float = 0.33
    #: consecutive steps a rank that used to report values may stay silent (answers, no values)
    quiet_steps: int = 3
    # ---- host contention (the processes' and hosts' telemetry, obs/sys/...: docs/telemetry.md)
    #: a host sample is oversubscribed when its runnable tasks per core exceed this, ...
    contention_runnable: float = 1.0
    #: ... or some task waited for a CPU this share of the interval (PSI cpu "some"), ...
    contention_pressure: float = 0.2
    #: ... or the hypervisor took this share of its CPU time (steal)
    contention_steal: float = 0.05
    #: a slowdown or straggler is its host's, not its actor's, when the host was oversubscribed in
    #: at least this share of the samples of its steps, ...
    contention_host_share: float = 0.5
    #: ... the slow work took at most this x its usual CPU time (it waited; it did not compute more), ...
    contention_cpu_ratio: float = 1.5
    #: ... and the extra time its threads waited for a CPU (against its peers', or its own before)
    #: covers at least this share of its extra wall time (without run-queue figures: the slowdown
    #: is shared by another process of the host). A throughput drop is the host's when a process
    #: waited for a CPU at least ``contention_pressure`` of the time and twice its own share before
    contention_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("wait_spans", "lifecycle_spans", "sync_spans", "throughput_keys"):
            try:
                re.compile(getattr(self, name))
            except re.error as e:
                raise ValueError(f"doctor setting {name}: bad regular expression {getattr(self, name)!r} ({e})") from None
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", "int") and not isinstance(v, (int, float)):
                raise ValueError(f"doctor setting {f.name} must be a number, got {v!r}")
            if f.type in ("float", "int") and v < 0:
                raise ValueError(f"doctor setting {f.name} must be >= 0, got {v!r}")
        if not 1 <= self.fire_steps <= self.window_steps:
            raise ValueError(f"fire_steps must be in 1..window_steps ({self.window_steps}), got {self.fire_steps}")
        if self.clear_steps >= self.fire_steps:
            raise ValueError(f"clear_steps must be < fire_steps ({self.fire_steps}), got {self.clear_steps}")
        if self.history_min_steps < 1 or self.history_steps < self.history_min_steps:
            raise ValueError("history_steps must be >= history_min_steps >= 1")
        self.wait_re = re.compile(self.wait_spans)
        self.lifecycle_re = re.compile(self.lifecycle_spans)
        self.sync_re = re.compile(self.sync_spans)
        self.throughput_re = re.compile(self.throughput_keys)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "DoctorConfig":
        """Settings by name; ValueError naming the valid ones for an unknown name."""
        values = dict(values or {})
        valid = cls.names()
        for k in values:
            if k not in valid:
                raise ValueError(f"unknown doctor setting {k!r}; valid: {', '.join(valid)}")
        types = {f.name: f.type for f in fields(cls)}
        for k, v in list(values.items()):
            try:
                if types[k] == "int":
                    values[k] = int(v)
                elif types[k] == "float":
                    values[k] = float(v)
                else:
                    values[k] = str(v)
            except (TypeError, ValueError):
                raise ValueError(f"doctor setting {k} must be a {types[k]}, got {v!r}") from None
        return cls(**values)
