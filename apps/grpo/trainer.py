"""Trainer actor mesh: data-parallel GRPO on N ranks (gloo all-reduce of gradients), rank 0
publishes the weights after each update (policy version v -> a file the generators pull).

One update (``Trainer.train_step``): this rank's shard of the batch -> per-token log-probs ->
``grpo_loss`` (loss.py: policy gradient + KL to the reference) -> backward -> gradients averaged
over the ranks -> clipped AdamW step, skipped when the loss or a gradient is not finite.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint

from apps.grpo.common import Idle, device, rank_of, setup_process, token_logprobs
from apps.grpo.faults import TrainerFaults
from apps.grpo.loss import grpo_loss, k3_kl, masked_mean
from forge_obs import Reduce, record_metric
from forge_obs.timeline import add_step_tag, record_event, record_span, set_step

# peak dense FLOP/s used for the MFU estimate (fp32): a 2-core AVX2 CPU, or the GPU's spec
CPU_PEAK_FLOPS = 2 * 32 * 3.0e9
GPU_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}


@dataclass
class Shard:
    """One rank's part of a training batch: token ids, and its advantages, reference log-probs
    (zero-padded to the longest completion) and rewards on this rank's device."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor  # [B, T]
    rewards: list[float]

    @classmethod
    def of(cls, episodes: list[dict]) -> Shard:
        completion_ids = [e["completion_ids"] for e in episodes]
        ref_lp = torch.zeros(len(episodes), max(len(c) for c in completion_ids), device=device())
        for i, e in enumerate(episodes):
            ref_lp[i, : len(e["ref_logprobs"])] = torch.tensor(e["ref_logprobs"])
        return cls([e["prompt_ids"] for e in episodes], completion_ids,
                   torch.tensor([e["advantage"] for e in episodes], device=device()), ref_lp,
                   [e["reward"] for e in episodes])

    def tokens(self) -> int:
        """Prompt and completion tokens of the shard."""
        return sum(len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids))


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
        """One GRPO update on this rank's shard of ``batch``; returns the loss averaged over the ranks."""
        set_step(step)
        record_metric("trainer/idle_s", self.idle.start(), Reduce.SUM)
        with record_span("train_step", flow=f"policy-v{version + 1}", version=version + 1):
            t0 = time.perf_counter()  # the step's time: its throughput and MFU
            with record_span("batch_creation", log_to_metrics=True):
                shard = Shard.of(batch[self.rank::self.world])
            with record_span("forward_backward", log_to_metrics=True, rank=self.rank):
                self.faults.sleep_if_slow(self.rank, step)
                lp, mask, ent = token_logprobs(self.model, shard.prompt_ids, shard.completion_ids,
                                               self.tok.pad_token_id, with_entropy=True)
                loss = grpo_loss(lp, shard.ref_logprobs, shard.advantages, mask, self.kl_beta)
                loss = self.faults.nan_loss_if_due(loss, step)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
            with record_span("grad_allreduce"):
                with torch.no_grad():
                    stats = torch.stack([loss.detach().float(), masked_mean(k3_kl(lp, shard.ref_logprobs), mask),
                                         masked_mean(ent, mask)])
                grads = self._average_over_ranks(stats)
            g_loss, g_kl, g_ent = (float(x) for x in stats)
            with record_span("optimizer_step"):
                update_rel = self._optimizer_step(step, g_loss, grads)
        now = time.perf_counter()
        self._record_update(loss, grads, shard, mask, g_kl, g_ent, update_rel)
        self._record_speed(now - t0, shard.tokens(), now)
        self.idle.end()
        return g_loss

    def _average_over_ranks(self, stats: torch.Tensor) -> torch.Tensor:
        """Every gradient, and ``stats`` in place, become their mean over the ranks (gloo
        all-reduce of one flat buffer). Returns the averaged gradients, flat."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
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
        return flat

    def _optimizer_step(self, step: int, loss: float, grads: torch.Tensor) -> float:
        """Clip to norm 1.0 and step, unless the loss or a gradient is not finite (the step is then
        skipped and marked). Returns the relative change of the parameters, ||dtheta|| / ||theta||."""
        before = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).clone()
        if math.isfinite(loss) and bool(torch.isfinite(grads).all()):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        else:
            record_metric("trainer/skipped_nonfinite_steps", 1, Reduce.SUM)
            record_event("nonfinite_loss_skipped", step=step)
            add_step_tag("nonfinite_loss")
        after = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        return float((after - before).norm() / before.norm().clamp(min=1e-12))

    def _record_update(self, loss: torch.Tensor, grads: torch.Tensor, shard: Shard, mask: torch.Tensor, kl: float,
                       entropy: float, update_rel: float) -> None:
        """The update's metrics: this rank's loss, gradients, advantages, rewards and lengths; the
        KL and entropy averaged over the ranks."""
        record_metric("trainer/loss", float(loss.detach()), Reduce.MEAN)
        record_metric("trainer/grad_abs_max", float(grads.abs().max()), Reduce.MAX)
        record_metric("trainer/grad_mean_sq", float((grads.float() ** 2).mean()), Reduce.MEAN)
        record_metric("trainer/lr", self.opt.param_groups[0]["lr"], Reduce.LAST)
        record_metric("trainer/advantage_min", float(shard.advantages.min()), Reduce.MIN)
        record_metric("trainer/advantage_max", float(shard.advantages.max()), Reduce.MAX)
        record_metric("trainer/advantage_mean", float(shard.advantages.mean()), Reduce.MEAN)
        record_metric("trainer/kl_to_ref", kl, Reduce.MEAN)
        record_metric("trainer/entropy_nats", entropy, Reduce.MEAN)
        record_metric("trainer/reward_mean", sum(shard.rewards) / len(shard.rewards), Reduce.MEAN)
        record_metric("trainer/episode_len_tokens", float(mask.sum(1).float().mean()), Reduce.MEAN)
        record_metric("trainer/param_update_rel", update_rel, Reduce.MEAN)

    def _record_speed(self, dt: float, tokens: int, now: float) -> None:
        """The step's time, throughput and MFU (6 FLOPs per parameter and token), and the update rate."""
        record_metric("trainer/step_s", dt, Reduce.MAX)
        record_metric("trainer/tokens_per_s", tokens / max(dt, 1e-9), Reduce.SUM)
        record_metric("trainer/mfu_pct", 100.0 * 6 * self.n_params * tokens / max(dt, 1e-9) / self.peak, Reduce.MEAN)
        if self.t_last_update is not None:
            record_metric("trainer/policy_updates_per_min", 60.0 / max(now - self.t_last_update, 1e-9), Reduce.MEAN)
        self.t_last_update = now

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
