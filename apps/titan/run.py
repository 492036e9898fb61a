"""Run TorchTitan's trainer (llama3 debug model, CPU, gloo) under torchrun, observed with forge_obs.

    python -m apps.titan.run                          # DP=2 (FSDP over 2 ranks), 6 steps
    python -m apps.titan.run --pp 2                   # PP=2 (1F1B), the loss on the last stage
    python -m apps.titan.run --fault-slow-rank 1      # rank 1 slow in every step: forge-obs doctor names it

Builds the tokenizer and the data set under ``<run-root>/titan-assets`` (once), then starts
``torchrun --standalone --nproc_per_node N -m apps.titan.train --module apps.titan --config
titan_debugmodel ...``; arguments after ``--`` go to TorchTitan's config parser unchanged
(``-- --training.steps 10``). The forge_obs run directory is ``<run-dir>`` (printed at the end);
TorchTitan's own outputs (TensorBoard, checkpoints) are under ``<run-dir>/titan``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from forge_obs.core.shell import printed_command, python_command

__all__ = ["TITAN_MODULES", "main", "missing_extra", "parse_args", "torchrun_command"]

ASSETS_ENV = "TITAN_ASSETS"  # the assets folder, read by apps.titan.config_registry


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="TorchTitan's trainer on CPU, instrumented with forge_obs.")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (the rest is data parallel)")
    ap.add_argument("--steps", type=int, default=6, help="training steps")
    ap.add_argument("--fault-slow-rank", type=int, default=-1, help="a rank whose data loading is slowed each step")
    ap.add_argument("--fault-slow-s", type=float, default=1.5, help="seconds the slowed rank loses per step")
    ap.add_argument("--run-root", default="runs", help="the run directory is <run-root>/<run-id>/")
    ap.add_argument("--run-id", default=None, help="default: titan-<date-time>")
    ap.add_argument("titan_args", nargs=argparse.REMAINDER, help="after --: TorchTitan config overrides")
    args = ap.parse_args(argv)
    if args.titan_args and args.titan_args[0] == "--":
        args.titan_args = args.titan_args[1:]
    if args.nproc < 1 or args.pp < 1 or args.nproc % args.pp:
        ap.error(f"--nproc ({args.nproc}) must be a positive multiple of --pp ({args.pp})")
    return args


def torchrun_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "apps.titan.train",
           "--module", "apps.titan", "--config", "titan_debugmodel",
           "--dump_folder", str(run_dir / "titan"), "--training.steps", str(args.steps),
           "--obs.run_dir", str(run_dir), "--obs.fault_slow_rank", str(args.fault_slow_rank),
           "--obs.fault_slow_s", str(args.fault_slow_s)]
    # data parallel over the ranks the pipeline leaves: DDP (FSDP's reduce-scatter needs
    # PREMUL_SUM, which gloo lacks)
    cmd += ["--parallelism.pipeline_parallel_degree", str(args.pp),
            "--parallelism.data_parallel_replicate_degree", str(args.nproc // args.pp),
            "--parallelism.data_parallel_shard_degree", "1"]
    if args.pp > 1:  # a schedule needs at least one microbatch (of 1 sequence) per stage
        cmd += ["--training.local_batch_size", str(args.pp)]
    return cmd + list(args.titan_args)


#: what the app imports from the ``titan`` extra (pyproject.toml)
TITAN_MODULES = ("torchtitan", "datasets", "tokenizers", "tyro", "torchdata")


def missing_extra() -> str | None:
    """None when the ``titan`` extra is installed; else what is missing and the command that
    installs it, as the shell that started this process runs it."""
    missing = [m for m in TITAN_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    py = python_command()
    torch = importlib.metadata.version("torch").split("+")[0]
    return (f"apps.titan.run: the 'titan' extra is not installed (missing: {', '.join(missing)}). Install it from "
            f"the repository's root with:\n  {py} -m pip install \"torch=={torch}\" && {py} -m pip install -e \".[titan]\"")


def main(argv: "list[str] | None" = None) -> int:
    args = parse_args(argv)
    problem = missing_extra()
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2
    from apps.titan.assets import build

    root = Path(args.run_root)
    run_dir = root / (args.run_id or time.strftime("titan-%Y%m%d-%H%M%S"))
    assets = build(root / "titan-assets")
    env = dict(os.environ, **{ASSETS_ENV: str(assets.root.resolve())})
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_CACHE", str((root / "titan-assets" / "hf-cache").resolve()))
    env.setdefault("OMP_NUM_THREADS", "1")
    rc = subprocess.call(torchrun_command(args, run_dir), env=env)
    if rc != 0 or not (run_dir / "meta.json").is_file():  # no run to look at: no commands for one
        print(f"apps.titan.run: torchrun exited with {rc}" + ("" if (run_dir / "meta.json").is_file() else
              f"; no run was written to {run_dir}") + " (its output is above)", file=sys.stderr, flush=True)
        return rc or 1
    print(f"titan run directory: {run_dir}\n  {printed_command('doctor', run_dir)}\n  "
          f"{printed_command('trace', run_dir, '--open')}\n  "
          f"{printed_command('sql', run_dir, 'SELECT rank, name, avg(dur_us) FROM spans GROUP BY rank, name')}",
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
