"""torchforge's ``forge.env`` path: this module is
:mod:`forge_obs._compat.env` itself, so that what a test patches here takes effect there."""

import sys

from forge_obs._compat import env as _module
from forge_obs._compat.env import *  # noqa: F401,F403
from forge_obs._compat.env import __all__  # noqa: F401

sys.modules[__name__] = _module
