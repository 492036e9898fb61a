"""GRPO on Monarch with vLLM, instrumented with forge_obs: a real RL run on a tiny local model.

    python -m apps.grpo.main                          # default: 300 steps, 2 vLLM replicas, 2 trainer ranks
    python -m apps.grpo.main --generator torch        # no vLLM: Hugging Face generate
    python -m apps.grpo.main --steps 6 --fault-kill-replica 3

Algorithm (``main`` below, top to bottom):
    build the tiny Qwen2 model + tokenizer locally, with a short supervised warm start   (model.py)
    spawn proc meshes: generator replicas, trainer (N ranks), reference, reward, buffer  (meshes.py)
    rollout workers beside training, up to --rollout-lead batches ahead:           (Rollouts)
        prompts ~ task;  G completions per prompt from the least-loaded replica   (service.py, generator.py)
        rewards by code, group-normalised advantages                               (reward.py)
        reference log-probs                                                        (reference.py)
        add the episodes to the replay buffer                                      (buffer.py)
    for step in 1..S:                                                              (train)
        batch <- buffer.sample (episodes of policy >= version - max_age)
        GRPO update on every trainer rank (policy-gradient + KL to reference)      (trainer.py, loss.py)
        publish policy version+1; replicas pull it in the background
        flush(step)                                    # forge_obs: one experiment view per step
    stop rollouts, flush and stop the logger, stop the meshes; summary and report  (teardown, summary.py)

Beside it: the flags (cli.py; the faults to inject, faults.py), the process environment (env.py),
the logger (logger.py), the progress bar (progress.py).

Observability is attached only by ``provisioner_hooks.install()`` and
``get_or_create_metric_logger`` (logger.py); every actor calls ``record_metric`` /
``record_span`` where the thing happens. See docs/grpo.md.
"""

from __future__ import annotations

from apps.grpo import env  # noqa: F401 - imported first: sets what Monarch, torch and Hugging Face read on import

import argparse
import asyncio
import random
import statistics
import time

import monarch.actor

from apps.grpo import task
from apps.grpo.cli import parse_args
from apps.grpo.faults import SupervisionHook
from apps.grpo.logger import start_logging
from apps.grpo.meshes import Actors, pick_generator, spawn_actors, stop_actors
from apps.grpo.model import ensure_model
from apps.grpo.progress import Progress
from apps.grpo.service import GeneratorService, ReplicaDown
from apps.grpo.summary import StepLog, write_summary
from apps.grpo.workers import Workers
from forge_obs import Reduce, record_metric
from forge_obs.timeline import record_event, record_span, set_step


async def main(args: argparse.Namespace) -> dict:
    """One GRPO run, top to bottom (the algorithm in the module docstring); returns its summary."""
    t_start = time.time()
    supervision = SupervisionHook(asyncio.get_running_loop(), args.replicas)
    monarch.actor.unhandled_fault_hook = supervision  # a replica's death goes to the service
    gen_kind, generator_cls = pick_generator(args.generator)
    model_dir = str(ensure_model(warm_steps=args.warm_start_steps))
    mlogger, run_dir = await start_logging(args, gen_kind, model_dir)
    actors = await spawn_actors(args, generator_cls, model_dir)
    service = supervision.service = GeneratorService(actors.replicas)
    print(f"[grpo] {len(actors.meshes)} proc meshes up in {time.time() - t_start:.1f}s; "
          f"training {args.steps} steps", flush=True)
    rollouts = Rollouts(args, service, actors)
    rollouts.workers.start()
    steps = StepLog(run_start=t_start)
    try:
        await train(args, actors, service, rollouts, mlogger, steps)
    finally:
        await teardown(rollouts, service, mlogger, actors)
    return write_summary(args, run_dir, steps, time.time(), gen_kind)


class Rollouts:
    """Rollout requests, one worker per replica, concurrently with training: prompts -> G
    completions each -> rewards and advantages -> reference log-probs -> replay buffer.
    ``version`` is the newest published policy (set by the training loop)."""

    def __init__(self, args: argparse.Namespace, service: GeneratorService, actors: Actors) -> None:
        self.args, self.service, self.actors = args, service, actors
        self.rng = random.Random(args.seed)
        self.version = 0
        self.requests = 0  # rollout requests started; request k's flow id is rollout-<k>
        self.workers = Workers(args.replicas, self.rollout, ends_on=ReplicaDown)  # ReplicaDown: none left
        # --rollout-lead: requests may start for the awaited batch and `lead` more, no further
        self.per_batch = -(-args.batch_groups // args.prompts_per_request)
        lead = args.rollout_lead
        self.credits = None if lead is None else asyncio.Semaphore(self.per_batch * (1 + lead))
        self.in_flight = 0

    async def rollout(self) -> None:
        """One rollout request: ``prompts_per_request`` groups of ``group_size`` episodes, into the buffer."""
        if self.credits is not None:
            await self.credits.acquire()
            if self.workers.stopping:
                return
        self.in_flight += 1
        try:
            await self._rollout()
        finally:
            self.in_flight -= 1

    async def _rollout(self) -> None:
        a, k = self.args, self.requests
        self.requests += 1
        flow = f"rollout-{k}"
        problems = task.make_prompts(a.prompts_per_request, rng=self.rng)
        groups = await self.service.generate(flow, [p.prompt for p in problems], a.group_size, a.max_tokens,
                                             a.temperature, self.version)
        scored = await self.actors.reward.score.call_one(flow, [
            {"answer": p.answer, "texts": [c["text"] for c in g["completions"]]} for p, g in zip(problems, groups)])
        pids = [g["prompt_ids"] for g in groups for _c in g["completions"]]
        cids = [c["ids"] for g in groups for c in g["completions"]]
        ref = iter(await self.actors.reference.logprobs.call_one(flow, pids, cids))
        episodes = [{"group": f"{k}.{gi}", "prompt_ids": g["prompt_ids"], "completion_ids": c["ids"], "reward": r,
                     "advantage": adv, "ref_logprobs": next(ref), "version": g["version"]}
                    for gi, (g, s) in enumerate(zip(groups, scored))
                    for c, r, adv in zip(g["completions"], s["rewards"], s["advantages"])]
        await self.actors.buffer.add.call_one(flow, episodes)

    async def next_batch(self, batch_size: int, min_version: int) -> list[dict]:
        """``batch_size`` episodes of policy >= ``min_version`` from the buffer, waiting for new
        episodes as long as a worker runs."""
        while True:
            batch = await self.actors.buffer.sample.call_one(batch_size, min_version, self.version)
            if batch is not None:
                self.grant(self.per_batch)
                return batch
            if not self.workers.running():
                raise RuntimeError("every rollout worker stopped (no healthy generator replica)")
            if self.in_flight == 0 and self.credits is not None and self.credits.locked():
                self.grant(1)  # too few fresh episodes and none coming: one more request
                record_metric("rollout/extra_requests", 1, Reduce.SUM)
            await self.workers.wait_for_progress()

    async def stop(self, timeout_s: float) -> None:
        """No new rollout requests (one waiting for its turn ends); those in flight finish within ``timeout_s``."""
        self.workers.stopping = True
        self.grant(self.args.replicas)
        await self.workers.stop(timeout_s)

    def grant(self, n: int) -> None:
        """Let ``n`` more rollout requests start (with ``--rollout-lead``; else they never wait)."""
        if self.credits is None:
            return
        for _ in range(n):
            self.credits.release()


async def train(args: argparse.Namespace, actors: Actors, service: GeneratorService, rollouts: Rollouts,
                mlogger, steps: StepLog) -> None:
    """``args.steps`` policy updates, each published to the replicas and flushed."""
    progress = Progress(args.steps, args.console_every, run_start=steps.run_start)
    steps.train_start = progress.t0
    batch_size = args.batch_groups * args.group_size
    for step in range(args.steps):
        set_step(step)
        version = rollouts.version
        t0 = time.perf_counter()
        with record_span("controller_step", flow=f"policy-v{version + 1}"):
            with record_span("wait_for_batch"):
                batch = await rollouts.next_batch(batch_size, version - args.max_policy_age)
            t_wait = time.perf_counter() - t0
            await actors.trainer.train_step.call(step, version, batch)
            paths = await actors.trainer.push_weights.call(version + 1)
            path = next(p for _rank, p in paths if p)
            rollouts.version = version + 1
            record_event("policy_published", flow=f"policy-v{version + 1}", version=version + 1)
            service.publish(path, version + 1)
        dt = time.perf_counter() - t0
        steps.durations_s.append(dt)
        steps.end_wall.append(time.time())
        record_metric("controller/step_s", dt, Reduce.MEAN)
        record_metric("controller/wait_for_batch_s", t_wait, Reduce.MEAN)
        record_metric("controller/policy_version", version + 1, Reduce.MAX)
        progress.update(step + 1, statistics.fmean(e["reward"] for e in batch))
        await mlogger.flush.call_one(step)


async def teardown(rollouts: Rollouts, service: GeneratorService, mlogger, actors: Actors) -> None:
    """Rollouts in flight finish (or their replica is found down) within one request timeout;
    the logger flushes every recorded step and stops; every mesh stops; the weight files go."""
    await rollouts.stop(timeout_s=service.request_timeout() + 2.0)
    service.close()
    await rollouts.workers.cancel()
    await mlogger.shutdown.call_one()
    await stop_actors(actors)


def cli(argv: list[str] | None = None) -> dict:
    return asyncio.run(main(parse_args(argv)))


if __name__ == "__main__":
    cli()
