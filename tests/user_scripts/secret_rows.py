"""Rollouts that carry credentials, as a user's script records them: two generator ranks on an
unnamed mesh and a trainer on another, every actor defined here; each SAMPLE row holds an API key
field, a JSON string with an Authorization header, a key in free text, a database URL with a
password and a token as a dict key; the config holds a token as a dict key. Console, local store,
W&B (offline) and TensorBoard. ``python secret_rows.py RUNS_ROOT``; prints the run directory.

The secrets are joined from parts so that the script's own text holds none of them whole."""

import asyncio
import json
import sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, get_or_create_metric_logger, record_metric

OPENAI_KEY = "sk-proj-" + "Q7xVb2LmN9pRt4Ws" + "K8yZ0601"
HF_TOKEN = "hf_" + "Jw3Kq8Lp2Mn7Rt5Vx9Zb" + "0602"
GITHUB_TOKEN = "ghp_" + "Ab3Cd5Ef7Gh9Ij2Kl4Mn6Op" + "0603"
DB_PASSWORD = "Pw" + "Sq9Tz4Uy" + "0604"
STEPS = 3


class Generator(Actor):
    @endpoint
    async def generate(self, step: int) -> None:
        rank = current_rank().rank
        record_metric("generator/rollouts", {
            "prompt": f"What is {step}+{rank}?",
            "completion": f"It is {step + rank}.",
            "reward": float(step + rank),
            "api_key": OPENAI_KEY,
            "request": json.dumps({"headers": {"Authorization": f"Bearer {HF_TOKEN}"}, "model": "qwen"}),
            "log": f"called the API with {OPENAI_KEY}",
            "by_user": {GITHUB_TOKEN: rank},
        }, Reduce.SAMPLE)
        record_metric("generator/tokens", 10 * (rank + 1), Reduce.SUM)


class Trainer(Actor):
    @endpoint
    async def train(self, step: int) -> None:
        record_metric("trainer/loss", 1.0 / (step + 1), Reduce.MEAN)
        record_metric("trainer/batches", {"step": step, "db": f"postgres://rl:{DB_PASSWORD}@db.example.com/rl"},
                      Reduce.SAMPLE)


async def main(root: str) -> None:
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one({
        "run": {"root": root, "id": "secrets"},
        "console": {"logging_mode": ["global_reduce", "per_rank_no_reduce"]},
        "jsonl": {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]},
        "wandb": {"mode": "offline", "project": "secrets", "logging_mode": ["global_reduce", "per_rank_reduce"],
                  "config": {"owners": {GITHUB_TOKEN: "alice"}, "lr": 3e-4}},
        "tensorboard": {"logging_mode": "global_reduce"},
    })
    generators = this_host().spawn_procs(per_host={"procs": 2}).spawn("generator", Generator)
    trainer = this_host().spawn_procs(per_host={"procs": 1}).spawn("trainer", Trainer)
    for step in range(STEPS):
        await generators.generate.call(step)
        await trainer.train.call(step)
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(json.dumps({"run_dir": info["run_dir"]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
