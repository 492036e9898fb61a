"""TorchTitan's Trainer, MetricsProcessor and CheckpointManager, observed through their own
extension points: each subclass declares a ``Config`` (TorchTitan's ``Configurable`` wires
``Config.build()`` to the subclass), and the app's config registry names those configs.
TorchTitan's source is not patched; every forge_obs call is in :mod:`apps.titan.obs`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.trainer import Trainer

from apps.titan import obs
from apps.titan.compat import presplit_schedule

__all__ = ["ObsConfig", "ObservedTrainer", "ObservedMetricsProcessor", "ObservedCheckpointManager"]


@dataclass(kw_only=True, slots=True)
class ObsConfig:
    run_dir: str = ""
    """forge_obs run directory (metrics.jsonl, events/); empty: <dump_folder>/obs"""

    fault_slow_rank: int = -1
    """a global rank whose data loading sleeps ``fault_slow_s`` per batch (-1: none)"""

    fault_slow_s: float = 1.5
    """seconds the slowed rank sleeps per batch"""

    flush_timeout_s: float = 30.0
    """forge_obs's bound on waiting for a rank's rows at a flush"""


class ObservedMetricsProcessor(MetricsProcessor):
    """TorchTitan's metrics processor; each ``log`` also records the same values with forge_obs,
    before TorchTitan resets its counters."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    has_loss: bool = True  # False on a pipeline stage that holds no loss (set by the trainer)

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        elapsed_s = time.perf_counter() - self.time_last_log
        obs.record_train_step(
            loss=global_avg_loss if self.has_loss else None,
            max_loss=global_max_loss if self.has_loss else None,
            grad_norm=grad_norm,
            ntokens=self.ntokens_since_last_log,
            elapsed_s=elapsed_s,
            non_data_parallel_size=self.parallel_dims.non_data_parallel_size,
            data_loading_s=list(self.data_loading_times),
            memory=self.device_memory_monitor.get_peak_stats(),
            extra=extra_metrics,
        )
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


class ObservedCheckpointManager(CheckpointManager):
    """TorchTitan's DCP checkpointer; a save or load that does work is a forge_obs span."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        with obs.span("checkpoint/save", step=curr_step):
            return super().save(curr_step, last_step)

    def load(self, step: int = -1) -> bool:
        with obs.span("checkpoint/load"):
            return super().load(step)


class ObservedTrainer(Trainer):
    """TorchTitan's Trainer with forge_obs set up on every rank (coordinates from its DeviceMesh),
    a span per step and per forward-backward, a flush per step, and an optional slowed rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        obs: ObsConfig = field(default_factory=ObsConfig)

    def __init__(self, config: Config):
        super().__init__(config)
        if self.parallel_dims.pp_enabled:
            self.pp_schedule = presplit_schedule(self.pp_schedule)
        self.metrics_processor.has_loss = (not self.parallel_dims.pp_enabled) or self.pp_has_last_stage
        run_dir = config.obs.run_dir or os.path.join(config.dump_folder, "obs")
        self.obs = obs.start(run_dir=run_dir, parallel_dims=self.parallel_dims, timeout_s=config.obs.flush_timeout_s)
        self._flushed_step: "int | None" = None  # set at this process's first step (after a checkpoint load)
        self._slow_s = config.obs.fault_slow_s if torch.distributed.get_rank() == config.obs.fault_slow_rank else 0.0

    def train_step(self, data_iterator):
        # every rank starts each step here: the previous step (its checkpoint save included) is
        # complete, so it is flushed here; the last step is flushed in close(). A step restored
        # from a checkpoint was flushed by the run that saved it.
        if self._flushed_step is None:
            self._flushed_step = self.step - 1
        self._flush_through(self.step - 1)
        obs.set_step(self.step)
        with obs.span("train_step"):
            super().train_step(data_iterator)

    def _flush_through(self, step: int) -> None:
        if self.obs is not None and self._flushed_step is not None and step > self._flushed_step:
            self.obs.flush(step)
            self._flushed_step = step

    def batch_generator(self, data_iterable):
        return super().batch_generator(self._observed_batches(data_iterable))

    def _observed_batches(self, data_iterable):
        """TorchTitan's batches, each fetch a ``data_loading`` span (inside TorchTitan's own
        data-loading timer); the slowed rank loses ``fault_slow_s`` in each fetch."""
        it = iter(data_iterable)
        while True:
            with obs.span("data_loading"):
                if self._slow_s:
                    time.sleep(self._slow_s)  # the injected fault: this rank's data loading is slow
                try:
                    batch = next(it)
                except StopIteration:
                    return
            yield batch

    def forward_backward_step(self, *args, **kwargs):
        with obs.span("forward_backward"):
            return super().forward_backward_step(*args, **kwargs)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if getattr(self, "obs", None) is not None:
                self._flush_through(self.step)
                self.obs.shutdown()
                self.obs = None
