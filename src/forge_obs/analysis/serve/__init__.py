"""``forge-obs serve``: a live local web view of one run or of every run under a root.

    forge-obs serve runs/            # every run under runs/, on http://127.0.0.1:<port>/
    forge-obs serve runs/<run_id>    # one run

The server (:mod:`.server`, the standard library's ``ThreadingHTTPServer``) answers the JSON API
(:mod:`.api`) from each run's state (:mod:`.state`: its files read incrementally by :mod:`.tail`
into bounded, downsampled :mod:`.series`; a step range read back exactly by :mod:`.ranges`;
:mod:`.meta`: what meta.json says). Every file is read through :mod:`.files` (nothing through a
link out of the served root); :mod:`.analyses` runs what reads a run by itself (the doctor, the
critical path, the Perfetto export). The page (``static/``: its own script and uPlot, vendored
from its npm release, so it works offline) polls once a second and draws only the charts in
view. See docs/serve.md.
"""

from forge_obs.core.lazy import lazy_exports

__all__ = ["Runs", "RunState", "ServeConfig", "ServeServer"]
_EXPORTS = {"Runs": "forge_obs.analysis.serve.api", "ServeServer": "forge_obs.analysis.serve.server",
            "RunState": "forge_obs.analysis.serve.state", "ServeConfig": "forge_obs.analysis.serve.held"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
