"""``forge-obs report runs/<run_id>``: one self-contained ``report.html`` for a run.

    from forge_obs.analysis.report import write_report
    write_report("runs/exp1")        # -> runs/exp1/report.html

See :mod:`forge_obs.analysis.report.html` for what the page shows.
"""

from forge_obs.core.lazy import lazy_exports

__all__ = ["render_report", "write_report"]
_EXPORTS = {"render_report": "forge_obs.analysis.report.html", "write_report": "forge_obs.analysis.report.html"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
