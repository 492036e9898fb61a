"""A class defined in this script with `@trace(timer="gpu", track_memory=True)` methods and a GPU
Tracer made in `__init__`, sent by value to a fresh process (as Monarch sends a script's actor)
and run there on CUDA under `torch.cuda.set_sync_debug_mode("error")`: no host sync, and every
timing and memory value recorded. Needs torch and cloudpickle, not Monarch. Prints one JSON line
({"skipped": ...} without CUDA)."""

import json
import subprocess
import sys

import cloudpickle
import torch

from forge_obs import Reduce, Tracer, record_metric, trace

CALLS = 5


class Model:
    def __init__(self):
        self.w = torch.randn(256, 256, device="cuda")
        self.tracer = Tracer("model/init_tracer", timer="gpu")

    @trace("model/forward", timer="gpu", track_memory=True)
    def forward(self, x):
        self.tracer.start()
        y = x @ self.w
        self.tracer.step("mm")
        self.tracer.stop()
        record_metric("model/out", y.sum(), Reduce.MEAN)   # a CUDA tensor: accumulated on the device
        return y

    @trace("model/step_async", timer="gpu")
    async def step_async(self, x):
        return self.forward(x)


CHILD = r"""
import asyncio, json, sys, cloudpickle, torch
from forge_obs.recording.collector import MetricCollector
from forge_obs.wire.merge import reduce_metrics_states
cls, calls = cloudpickle.loads(sys.stdin.buffer.read())
m = cls()
x = torch.ones(8, 256, device="cuda")
m.forward(x); torch.cuda.synchronize(); MetricCollector().snapshot()   # warm-up, not counted
torch.cuda.set_sync_debug_mode("error")
for _ in range(calls):
    m.forward(x)
    asyncio.run(m.step_async(x))
torch.cuda.set_sync_debug_mode(0)
vals = {k.key: k.value for k in reduce_metrics_states([MetricCollector().snapshot()["states"]])}
print(json.dumps({"module": cls.__module__, "values": vals}))
"""


def main():
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return
    payload = cloudpickle.dumps((Model, CALLS))
    res = subprocess.run([sys.executable, "-c", CHILD], input=payload, capture_output=True, check=True)
    print(res.stdout.decode().strip().splitlines()[-1])


if __name__ == "__main__":
    main()
