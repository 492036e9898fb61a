"""The run's metric logger: the only two calls of the app that attach forge_obs."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import provisioner_hooks
from forge_obs import get_or_create_metric_logger
from forge_obs.core.run import write_meta


async def start_logging(args: argparse.Namespace, gen_kind: str, model_dir: str) -> tuple:
    """Every proc mesh spawned from now on is observed (the provisioner hook), and the logger's
    backends are up. Returns (logger, run directory)."""
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
    if args.wandb:  # the dashboard: each step's critical path and the findings in W&B (docs/backends.md)
        config["wandb"] = {"mode": "offline", "project": "forge_obs_grpo", "config": vars(args)}
        config["critical_path"] = {}
    return config
