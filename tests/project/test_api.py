"""The public API is a small facade: every name in ``forge_obs.__all__`` is importable and
listed by ``dir()``, torchforge's public names are all there, and the recording API loads
neither Monarch nor torch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import forge_obs
from tests.support.helpers import CHILD_PATH

ROOT = Path(__file__).resolve().parents[2]
#: this checkout\'s forge_obs (src/) and its tests/apps helpers (the root), as a child process sees them

TORCHFORGE_ALL = [  # forge.observability.__all__
    "record_metric", "reduce_metrics_states", "get_logger_backend_class", "get_or_create_metric_logger", "Tracer",
    "trace", "Metric", "BackendRole", "Reduce", "LoggingMode", "get_proc_name_with_rank", "GlobalLoggingActor",
    "LocalFetcherActor", "MetricCollector", "LoggerBackend", "ConsoleBackend", "WandbBackend", "MetricAccumulator",
    "MeanAccumulator", "SumAccumulator", "MaxAccumulator", "MinAccumulator", "StdAccumulator",
]


def test_every_public_name_is_importable_and_listed_by_dir():
    assert len(forge_obs.__all__) == len(set(forge_obs.__all__)) <= 40
    for name in forge_obs.__all__:
        assert getattr(forge_obs, name) is not None, name
    assert set(forge_obs.__all__) <= set(dir(forge_obs))
    assert {"Tracer", "record_span", "get_or_create_metric_logger"} <= set(dir(forge_obs))
    assert set(TORCHFORGE_ALL) <= set(forge_obs.__all__)


def test_internal_modules_are_not_part_of_the_facade():
    """The facade is the user's API; a module's ``__all__`` is its contract with other modules."""
    internal = {"core", "recording", "wire", "controller", "collector", "pipeline", "device", "sketch", "record",
                "fetcher", "reduce_snapshots", "ROW_FIELDS", "merge_snapshots"}
    assert not internal & set(forge_obs.__all__)


def test_recording_api_loads_neither_monarch_nor_torch():
    code = (
        "import sys\n"
        "from forge_obs import record_metric, Reduce, record_span, Tracer\n"
        "record_metric('x', 1.0, Reduce.SUM)\n"
        "with record_span('s'):\n"
        "    pass\n"
        "t = Tracer('p'); t.start(); t.stop()\n"
        "print(sorted(m for m in ('monarch', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


RACE = r"""
import importlib, sys, threading
mods = sys.argv[1:]
errors, barrier = [], threading.Barrier(len(mods))
def load(m):
    barrier.wait()
    try:
        importlib.import_module(m)
    except Exception as e:
        errors.append(f"{m}: {e!r}")
threads = [threading.Thread(target=load, args=(m,)) for m in mods]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
"""


@pytest.mark.parametrize("mods", [
    ("forge_obs.recording.collector", "forge_obs.recording.timeline"),
    ("forge_obs.recording.collector", "forge_obs.controller.fetcher", "forge_obs.recording.timeline", "forge_obs"),
    ("forge_obs.controller.fetcher", "forge_obs.metrics", "forge_obs.timeline", "forge_obs.backends.console"),
    ("forge_obs.backends", "forge_obs.backends.console", "forge_obs.alerts.backend", "forge_obs.alerts"),
])
def test_modules_imported_at_once_by_threads_of_a_new_process(mods):
    """A new mesh process unpickles its fetcher and the user's actors on different threads, each
    importing a part of forge_obs first: no import deadlock (the facade and the packages that
    export their submodules' names import nothing at load)."""
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", RACE, *mods], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=CHILD_PATH), cwd=ROOT)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
