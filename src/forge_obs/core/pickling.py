"""How one value is pickled to travel: the standard pickler for plain data, cloudpickle (what
Monarch uses) for what only it can pickle. The collector's export pickles each structured state
once (its picklability check), and the wire reuses those bytes.

    >>> from forge_obs.core.pickling import pickle_value
    >>> import pickle; pickle.loads(pickle_value({"a": 1}))
    {'a': 1}
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["PICKLED", "pickle_value"]

#: a snapshot's field that holds ``{key: pickled state}`` (encoded states, or a collector's
#: export: the bytes its picklability check made, reused on the wire)
PICKLED = "pickled"


def pickle_value(x: Any) -> bytes:
    """Pickle ``x``: the standard pickler (fastest) for plain data, cloudpickle (what Monarch
    uses) for what only it can pickle, e.g. a SAMPLE row holding a lambda. Raises if neither can."""
    try:
        return pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        import cloudpickle

        return cloudpickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
