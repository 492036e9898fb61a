"""torchforge's ``forge.observability.metrics`` path: this module is
:mod:`forge_obs._compat.metrics` itself, so that what a test patches here takes effect there."""

import sys

from forge_obs._compat import metrics as _module
from forge_obs._compat.metrics import *  # noqa: F401,F403
from forge_obs._compat.metrics import __all__  # noqa: F401

sys.modules[__name__] = _module
