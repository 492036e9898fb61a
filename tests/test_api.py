"""The public API is a small facade: every name in ``forge_obs.__all__`` is importable and
listed by ``dir()``, torchforge's public names are all there, and the recording API loads
neither Monarch nor torch."""

import subprocess
import sys

import forge_obs

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
