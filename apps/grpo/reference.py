"""Reference model actor: the frozen warm-started policy; per-token log-probabilities of each
completion, used by the trainer's KL penalty."""

from __future__ import annotations

import time

import torch
from monarch.actor import Actor, endpoint

from apps.grpo.common import Idle, device, setup_process, token_logprobs
from forge_obs import Reduce, record_metric
from forge_obs.timeline import record_span


class ReferenceModel(Actor):
    def __init__(self, model_dir: str) -> None:
        setup_process()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device()).eval()
        record_metric("reference/model_load_s", time.perf_counter() - t0, Reduce.MAX)
        self.idle = Idle()

    @endpoint
    async def logprobs(self, flow: str, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        record_metric("reference/idle_s", self.idle.start(), Reduce.SUM)
        t0 = time.perf_counter()
        with record_span("reference_logprobs", flow=flow, sequences=len(prompt_ids)):
            with torch.no_grad():
                lp, mask = token_logprobs(self.model, prompt_ids, completion_ids, self.tok.pad_token_id)
            out = [lp[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]
        dt = time.perf_counter() - t0
        ntok = sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        record_metric("reference/forward_ms", dt * 1e3, Reduce.MEAN)
        record_metric("reference/tokens_per_s", ntok / max(dt, 1e-9), Reduce.MEAN)
        record_metric("reference/sequences", len(prompt_ids), Reduce.SUM)
        self.idle.end()
        return out
