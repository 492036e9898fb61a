"""Trainer actor mesh: data-parallel GRPO on N ranks (gloo all-reduce of gradients), rank 0
publishes the weights after each update (policy version v -> a file the generators pull).

Loss (per completion token, averaged per sequence then over the batch), as in torchforge's GRPO:
    ratio = exp(logp - logp.detach())             # 1 in value, the policy gradient in grad
    kl    = exp(ref - logp) - (ref - logp) - 1    # k3 estimator of KL(policy || reference)
    loss  = -(ratio * advantage - beta * kl)
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint

from apps.grpo.common import Idle, device, rank_of, setup_process, token_logprobs
from apps.grpo.faults import TrainerFaults
from forge_obs import Reduce, record_metric
from forge_obs.timeline import add_step_tag, record_event, record_span, set_step

# peak dense FLOP/s used for the MFU estimate (fp32): a 2-core AVX2 CPU, or the GPU's spec
CPU_PEAK_FLOPS = 2 * 32 * 3.0e9
GPU_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}


class Trainer(Actor):
    def __init__(self, model_dir: str, world: int, port: int, lr: float, kl_beta: float, weights_dir: str,
                 faults: TrainerFaults) -> None:
        setup_process()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank = rank_of()
        self.world = world
        self.port = port
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device())
        self.model.train()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.kl_beta = kl_beta
        self.weights_dir = weights_dir
        self.faults = faults
        self.idle = Idle()
        self.t_last_update: float | None = None
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            self.peak = next((v for k, v in GPU_PEAK_FLOPS.items() if k in name), 50e12)
        else:
            self.peak = CPU_PEAK_FLOPS

    @endpoint
    async def setup(self) -> int:
        """Join the gloo group (every rank at once)."""
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank,
                                    world_size=self.world)
        return self.rank

    @endpoint
    async def train_step(self, step: int, version: int, batch: list[dict]) -> float:
        """One GRPO update on this rank's shard of ``batch``; returns the (all-reduced) loss."""
        set_step(step)
        idle = self.idle.start()
        record_metric("trainer/idle_s", idle, Reduce.SUM)
        flow = f"policy-v{version + 1}"
        with record_span("train_step", flow=flow, version=version + 1):
            t0 = time.perf_counter()  # the step's time: its throughput and MFU
            with record_span("batch_creation", log_to_metrics=True):
                shard = batch[self.rank::self.world]
                prompt_ids = [e["prompt_ids"] for e in shard]
                completion_ids = [e["completion_ids"] for e in shard]
                adv = torch.tensor([e["advantage"] for e in shard], device=device())
                ref_lp = torch.zeros(len(shard), max(len(c) for c in completion_ids), device=device())
                for i, e in enumerate(shard):
                    ref_lp[i, : len(e["ref_logprobs"])] = torch.tensor(e["ref_logprobs"])

            with record_span("forward_backward", log_to_metrics=True, rank=self.rank):
                slow_s = self.faults.slow_s_for(self.rank, step)
                if slow_s:
                    time.sleep(slow_s)  # blocks the rank, as slow compute would
                lp, mask, ent = token_logprobs(self.model, prompt_ids, completion_ids, self.tok.pad_token_id,
                                               with_entropy=True)
                d = ref_lp - lp
                kl = torch.exp(d) - d - 1
                per_tok = -(torch.exp(lp - lp.detach()) * adv.unsqueeze(1) - self.kl_beta * kl)
                lens = mask.sum(1).clamp(min=1)
                loss = ((per_tok * mask).sum(1) / lens).mean()
                if self.faults.nan_at(step):
                    loss = loss * float("nan")
                self.opt.zero_grad(set_to_none=True)
                loss.backward()

            with record_span("grad_allreduce"):
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                with torch.no_grad():
                    stats = torch.stack([loss.detach().float(), (kl * mask).sum() / mask.sum(), (ent * mask).sum() / mask.sum()])
                if self.world > 1:
                    dist.all_reduce(flat)
                    flat /= self.world
                    dist.all_reduce(stats)
                    stats /= self.world
                off = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[off: off + n].view_as(g))
                    off += n
            g_loss, g_kl, g_ent = (float(x) for x in stats)

            with record_span("optimizer_step"):
                before = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).clone()
                finite = math.isfinite(g_loss) and bool(torch.isfinite(flat).all())
                if finite:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.opt.step()
                else:
                    record_metric("trainer/skipped_nonfinite_steps", 1, Reduce.SUM)
                    record_event("nonfinite_loss_skipped", step=step)
                    add_step_tag("nonfinite_loss")
                after = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
                upd = float((after - before).norm() / before.norm().clamp(min=1e-12))
        now = time.perf_counter()
        dt = now - t0
        ntok = sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        rewards = [e["reward"] for e in shard]
        record_metric("trainer/loss", float(loss.detach()), Reduce.MEAN)
        record_metric("trainer/grad_abs_max", float(flat.abs().max()), Reduce.MAX)
        record_metric("trainer/grad_mean_sq", float((flat.float() ** 2).mean()), Reduce.MEAN)
        record_metric("trainer/lr", self.opt.param_groups[0]["lr"], Reduce.LAST)
        record_metric("trainer/advantage_min", float(adv.min()), Reduce.MIN)
        record_metric("trainer/advantage_max", float(adv.max()), Reduce.MAX)
        record_metric("trainer/advantage_mean", float(adv.mean()), Reduce.MEAN)
        record_metric("trainer/kl_to_ref", g_kl, Reduce.MEAN)
        record_metric("trainer/entropy_nats", g_ent, Reduce.MEAN)
        record_metric("trainer/reward_mean", sum(rewards) / len(rewards), Reduce.MEAN)
        record_metric("trainer/episode_len_tokens", float(mask.sum(1).float().mean()), Reduce.MEAN)
        record_metric("trainer/step_s", dt, Reduce.MAX)
        record_metric("trainer/tokens_per_s", ntok / max(dt, 1e-9), Reduce.SUM)
        record_metric("trainer/mfu_pct", 100.0 * 6 * self.n_params * ntok / max(dt, 1e-9) / self.peak, Reduce.MEAN)
        record_metric("trainer/param_update_rel", upd, Reduce.MEAN)
        if self.t_last_update is not None:
            record_metric("trainer/policy_updates_per_min", 60.0 / max(now - self.t_last_update, 1e-9), Reduce.MEAN)
        self.t_last_update = now
        self.idle.end()
        return g_loss

    @endpoint
    async def push_weights(self, version: int) -> str | None:
        """Rank 0 writes the weights of policy ``version`` (atomically) and returns the path."""
        if self.rank != 0:
            return None
        with record_span("weights_push", flow=f"policy-v{version}", log_to_metrics=True, version=version):
            path = os.path.join(self.weights_dir, f"policy_v{version}.pt")
            sd = {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}
            torch.save(sd, path + ".tmp")
            os.replace(path + ".tmp", path)
            old = os.path.join(self.weights_dir, f"policy_v{version - 5}.pt")
            if os.path.exists(old):
                os.remove(old)  # bounded disk use: a replica is only ever told to load the newest version
        record_metric("trainer/policy_version", version, Reduce.MAX)
        return path
