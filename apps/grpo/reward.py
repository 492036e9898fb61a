"""Reward actor: scores completions by code (the sum is checked exactly) and turns each group's
rewards into GRPO advantages (reward minus the group mean, over the group std)."""

from __future__ import annotations

import statistics

from monarch.actor import Actor, endpoint

from apps.grpo import task
from forge_obs import Reduce, record_metric
from forge_obs.timeline import record_span


class RewardActor(Actor):
    @endpoint
    async def score(self, flow: str, groups: list[dict]) -> list[dict]:
        """``groups``: [{"answer", "texts": [...]}] -> [{"rewards": [...], "advantages": [...]}]"""
        out = []
        with record_span("reward", flow=flow, log_to_metrics=True, groups=len(groups)):
            for g in groups:
                rewards = [task.score(t, g["answer"]) for t in g["texts"]]
                mu = statistics.fmean(rewards)
                sd = statistics.pstdev(rewards)
                adv = [(r - mu) / (sd + 1e-4) for r in rewards]
                out.append({"rewards": rewards, "advantages": adv})
                for r in rewards:
                    record_metric("reward/reward_mean", r, Reduce.MEAN)
                    record_metric("reward/correct_frac", 1.0 if r >= 1.0 else 0.0, Reduce.MEAN)
                record_metric("reward/group_reward_std", sd, Reduce.MEAN)
                record_metric("reward/zero_std_groups", 1 if sd == 0 else 0, Reduce.SUM)
        record_metric("reward/completions", sum(len(g["texts"]) for g in groups), Reduce.SUM)
        return out
