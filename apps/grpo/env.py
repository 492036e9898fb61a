"""The environment of the GRPO controller and of the actor processes it spawns (they inherit it).

Monarch reads its log level and supervision settings, torch its thread count and Hugging Face its
offline mode when they are imported, so importing this module sets them: ``main.py`` imports it
before anything that imports them. Values already set by the caller win, except ``PYTHONPATH``,
which gains the repository root.
"""

from __future__ import annotations

import os
import sys

from apps.grpo import faults

#: the repository root: actor processes unpickle the actors by module name (``apps.grpo.*``)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def setup_environment(argv: list[str]) -> None:
    """Sets the variables for a run started with the flags ``argv``."""
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
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


setup_environment(sys.argv[1:])
