"""torchforge's ``forge.observability.metric_actors`` path: this module is
:mod:`forge_obs._compat.metric_actors` itself, so that what a test patches here takes effect there."""

import sys

from forge_obs._compat import metric_actors as _module
from forge_obs._compat.metric_actors import *  # noqa: F401,F403
from forge_obs._compat.metric_actors import __all__  # noqa: F401

sys.modules[__name__] = _module
