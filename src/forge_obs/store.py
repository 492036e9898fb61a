"""Read a run's ``metrics.jsonl`` back in Python (public API; the implementation lives in
:mod:`forge_obs.analysis.store`).

    >>> import tempfile, pathlib
    >>> from forge_obs.store import read_metrics
    >>> run_dir = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (run_dir / "metrics.jsonl").write_text(
    ...     '{"step": 0, "mode": "global_reduce", "metrics": {"loss": 1.5}}\\n'
    ...     '{"step": 1, "mode": "global_reduce", "metr')          # a torn last line is skipped
    >>> [(r["step"], r["metrics"]["loss"]) for r in read_metrics(run_dir)]
    [(0, 1.5)]
"""

from forge_obs.core.lazy import lazy_exports

__all__ = ["read_metrics", "read_jsonl", "metric_row_problem"]
_EXPORTS = dict.fromkeys(__all__, "forge_obs.analysis.store")
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
