"""Parts of one update done at once: each part but the first in a forked child process, the first
in this one (the machine's cores are what a large build is bounded by).

    >>> forked([lambda: {"part": 0}, lambda: {"part": 1}])
    [{'part': 0}, {'part': 1}]

A child writes its result (JSON) to a pipe and exits without running anything of this
process's (``os._exit``). No DuckDB connection may be open in this process when it forks: a
part opens its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any, Callable

__all__ = ["forked"]


def forked(jobs: list, passthrough: tuple = ()) -> list:
    """``[job() for job in jobs]``, computed at once: ``jobs[1:]`` each in a forked child,
    ``jobs[0]`` here; results must be JSON-able. An exception of a class in ``passthrough`` is
    raised here as itself (after every part ended); any other failure of a child as
    ``RuntimeError``; a failure here kills the children first."""
    kids = [_start(job, passthrough) for job in jobs[1:]]
    try:
        first = jobs[0]()
    except BaseException:
        for pid, r in kids:
            os.kill(pid, signal.SIGKILL)
            os.close(r)
            os.waitpid(pid, 0)
        raise
    out, passed = [first], None
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _pid, status = os.waitpid(pid, 0)
        try:
            res = json.loads(data)
        except ValueError:
            res = {"error": f"exit status {status}"}
        if "raise" in res:
            passed = passthrough[res["raise"]]
        elif "error" in res or status != 0:
            raise RuntimeError(f"a worker process of the index failed: {res.get('error', status)}")
        else:
            out.append(res["ok"])
    if passed is not None:
        raise passed()
    return out


def _start(job: Callable[[], Any], passthrough: tuple) -> tuple:
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    os.close(r)  # the child
    try:
        try:
            res: dict = {"ok": job()}
        except passthrough as e:
            res = {"raise": next(i for i, c in enumerate(passthrough) if isinstance(e, c))}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            traceback.print_exc(file=sys.stderr)
            res = {"error": f"{type(e).__name__}: {e}"}
        data = json.dumps(res).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    finally:
        sys.stderr.flush()
        os._exit(0)
