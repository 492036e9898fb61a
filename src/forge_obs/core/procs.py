"""Whether the process that started this one still runs (a child process of forge_obs's exits
when it is gone).

    >>> import os
    >>> from forge_obs.core.procs import parent_alive
    >>> parent_alive(os.getppid()), parent_alive(os.getpid())
    (True, False)
"""

from __future__ import annotations

import os

__all__ = ["parent_alive"]


def parent_alive(pid: int) -> bool:
    """Whether process ``pid``, this process's parent, still runs: it exists and is still this
    process's parent (once it died this process was re-parented, so another process given the
    same pid is not taken for it); one this process may not signal exists, so it counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid
