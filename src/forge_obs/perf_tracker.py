"""torchforge's ``forge.observability.perf_tracker`` path: this module is
:mod:`forge_obs._compat.perf_tracker` itself, so that what a test patches here takes effect there."""

import sys

from forge_obs._compat import perf_tracker as _module
from forge_obs._compat.perf_tracker import *  # noqa: F401,F403
from forge_obs._compat.perf_tracker import __all__  # noqa: F401

sys.modules[__name__] = _module
