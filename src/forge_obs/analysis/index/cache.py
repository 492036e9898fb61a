"""Answers derived from the whole index, kept beside it until the index changes: a command asked
again about a run that did not change reads its last answer instead of computing it again.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> from forge_obs.analysis.index import open_index
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.close()
    >>> idx = open_index(run_dir)
    >>> calls = []
    >>> cached(idx, "answer", {"x": 1}, lambda: calls.append(1) or {"n": 42})
    {'n': 42}
    >>> cached(idx, "answer", {"x": 1}, lambda: calls.append(1) or {"n": 42}), len(calls)
    ({'n': 42}, 1)

An answer is stored as ``index/<name>.json`` with what it was computed from: the index's
generation (every update that indexed something makes a new one), the caller's ``key`` (its
settings, the state of any file it reads beside the index) and a digest of forge_obs's own
source (another version of the code computes it again). Anything else is computed again and
replaces it; an index that cannot be written computes it every time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

__all__ = ["cached", "file_state"]

_CODE: list = []


def _code_digest() -> str:
    """A digest of every source file of the installed forge_obs package (computed once)."""
    if not _CODE:
        root = Path(__file__).resolve().parents[2]
        h = hashlib.sha1()
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
        _CODE.append(h.hexdigest())
    return _CODE[0]


def file_state(path: "str | Path") -> list:
    """What :func:`cached` compares of a file the answer also reads: its size and modification
    time (None when absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return [None]
    return [st.st_size, st.st_mtime_ns]


def cached(idx: Any, name: str, key: dict, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a JSON-able answer) of index ``idx`` for ``key``, or the answer stored for
    the same generation, key and code."""
    made_of = {"gen": idx.gen, "key": json.loads(json.dumps(key, default=str)), "code": _code_digest()}
    path = idx.dir / f"{name}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("made_of") == made_of:
            return data["answer"]
    except (OSError, ValueError, AttributeError):
        pass
    answer = compute()
    try:
        tmp = idx.dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"made_of": made_of, "answer": answer}, default=str))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only index: computed again next time
    return json.loads(json.dumps(answer, default=str))
