"""torchforge's ``forge.observability.utils`` path: this module is
:mod:`forge_obs._compat.utils` itself, so that what a test patches here takes effect there."""

import sys

from forge_obs._compat import utils as _module
from forge_obs._compat.utils import *  # noqa: F401,F403
from forge_obs._compat.utils import __all__  # noqa: F401

sys.modules[__name__] = _module
