"""The examples of torchforge's observability document ("Observability in Forge"), as written
there but for the imports (forge.observability -> forge_obs) and for its service: torchforge's
``MyActor.options(procs=2, num_replicas=2).as_service()`` + ``fanout()`` is two meshes of 2 procs
spawned without a name, with the same actor name, each called. ``python forge_doc.py MODE``
runs section 2 with MODE as the console's logging_mode; ``python forge_doc.py basics`` runs
sections 1.1, 1.2, 3.1 and 4."""

import asyncio
import sys
from typing import Any

import provisioner_hooks
from forge_obs import get_or_create_metric_logger, record_metric, Reduce
from forge_obs import LoggerBackend, Metric, MetricAccumulator, register_backend, register_reduction
from forge_obs.perf_tracker import Tracer, trace
from monarch.actor import Actor, current_rank, endpoint, this_host


# Your distributed actor
class MyActor(Actor):
    @endpoint
    async def my_fn(self):
        rank = current_rank().rank # 0 or 1 per replica
        record_metric("my_sum_rank_metric", rank, Reduce.SUM) # <--- your metric


async def section_2(mode):
    provisioner_hooks.install()
    # Setup logger
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one(
        {"console": {"logging_mode": mode}} #  <--- Define logging_mode here
    )

    # Setup actor
    replicas = [this_host().spawn_procs(per_host={"procs": 2}).spawn("MyActor", MyActor) for _ in range(2)]

    # Accumulate metrics
    for _ in range(2):  # 2 steps
        await asyncio.gather(*(r.my_fn.call() for r in replicas))

    # Flush
    await mlogger.flush.call_one(global_step=0)  # Flush and reset
    await mlogger.shutdown.call_one()


# Example of a custom backend (section 3.1)
class ConsoleBackend(LoggerBackend):
    def __init__(self, logger_backend_config: dict[str, Any]) -> None:
        super().__init__(logger_backend_config)

    async def init(self, process_name: str | None = None, *args, **kwargs) -> None:
        self.process_name = process_name

    async def log_batch(self, metrics: list[Metric], global_step: int, *args, **kwargs) -> None:
        # Called on flush
        print(self.process_name, sorted((m.key, m.value) for m in metrics))

    def log_stream(self, metric: Metric, global_step: int, *args, **kwargs) -> None:
        # Called on `record_metric` if "logging_mode": "per_rank_no_reduce"
        print(metric)


# Example of a custom reduce type (section 4)
class MeanAccumulator(MetricAccumulator):
    def __init__(self, reduction: Reduce) -> None:
        super().__init__(reduction)
        self.sum = 0.0
        self.count = 0

    def append(self, value: Any) -> None:
        # Called after record_metric(key, value, reduce.TYPE)
        v = float(value.item() if hasattr(value, "item") else value)
        self.sum += v
        self.count += 1

    def get_value(self) -> float:
        return self.sum / self.count if self.count > 0 else 0.0

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.reduction_type.value, "sum": self.sum, "count": self.count}

    @classmethod
    def get_reduced_value_from_states(cls, states: list[dict[str, Any]]) -> float:
        # Useful for global reduce; called before flush
        total_sum = sum(s["sum"] for s in states)
        total_count = sum(s["count"] for s in states)
        return total_sum / total_count if total_count > 0 else 0.0

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0


register_backend("doc_console", ConsoleBackend)
MY_MEAN = register_reduction("my_mean", MeanAccumulator)


class Scorer(Actor):
    @endpoint
    @trace(prefix="my_reward_fn", track_memory=False, timer="cpu")
    async def reward_fn(self, x):  # Supports both sync/async functions
        record_metric("doc/custom_mean", x, MY_MEAN)
        return 1.0 if x > 0 else 0.0


async def basics():
    provisioner_hooks.install()
    # Setup logger
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"doc_console": {}})

    # Have this in any process
    def my_fn(number):
        record_metric("my_sum_metric", number, Reduce.SUM)   #  sum(1,2,3)
        record_metric("my_max_metric", number, Reduce.MAX)   # max(1,2,3)
        record_metric("my_mean_metric", number, Reduce.MEAN) # mean(1,2,3)

    # Accumulate metrics
    for number in range(1, 4): # 1, 2, 3
        my_fn(number)

    # Flush
    await mlogger.flush.call_one(global_step=0)  # Flushes and resets metric accumulators

    # 1.2, on the CPU when there is no GPU
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def my_fn():
        a, b = torch.randn(100, 100, device=device), torch.randn(100, 100, device=device)

        t = Tracer(prefix="my_cuda_loop", track_memory=True, timer="gpu")
        t.start()
        for _ in range(3):
            torch.mm(a, b)
            t.step("my_metric_mm_a_b")
        t.stop()

    # Accumulate metrics
    for _ in range(2):
        my_fn()

    scorer = this_host().spawn_procs(per_host={"procs": 2}).spawn("Scorer", Scorer)
    for x in (-1.0, 2.0, 5.0):
        await scorer.reward_fn.call(x)
    await mlogger.flush(global_step=1) # Flush and reset

    # Shutdown when done
    await mlogger.shutdown.call_one()


if __name__ == "__main__":
    asyncio.run(basics() if sys.argv[1] == "basics" else section_2(sys.argv[1]))
