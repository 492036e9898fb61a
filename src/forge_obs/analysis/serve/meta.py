"""What a run directory says of itself: ``meta.json`` (status, start, name, tags, notes) and
whether the controller process that writes it is gone.

    >>> run_labels({"name": "lr 3e-4", "tags": ["grpo", 7], "notes": None})
    {'name': 'lr 3e-4', 'tags': ['grpo', '7']}

Every file is read through :class:`~forge_obs.analysis.serve.files.Confined` (a link out of the
served root reads as absent).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from forge_obs.analysis.serve.files import Confined

__all__ = ["read_meta", "run_labels", "controller_gone", "LABEL_CHARS"]


def read_meta(run_dir: Path, files: Confined | None = None) -> dict[str, Any]:
    """``run_dir/meta.json`` ({} when absent, unreadable or a link out of ``files``' root)."""
    files = files or Confined(run_dir)
    try:
        meta = json.loads(files.read_bytes(run_dir / "meta.json"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


#: the longest name, tag and notes shown (longer ones are cut, with "…")
LABEL_CHARS = {"name": 200, "tags": 60, "notes": 4000}


def run_labels(meta: dict[str, Any]) -> dict[str, Any]:
    """``name``, ``tags`` (at most 32) and ``notes`` of a run's meta.json, as text.

        >>> run_labels({"tags": "one"})
        {'tags': ['one']}
    """
    def text(v: Any, cap: int) -> str:
        v = str(v)
        return v if len(v) <= cap else v[: cap - 1] + "…"

    out: dict[str, Any] = {}
    for k in ("name", "notes"):
        if isinstance(meta.get(k), (str, int, float)) and str(meta[k]).strip():
            out[k] = text(meta[k], LABEL_CHARS[k])
    tags = meta.get("tags")
    if isinstance(tags, str):
        tags = [tags]
    if isinstance(tags, list):
        tags = [text(t, LABEL_CHARS["tags"]) for t in tags if isinstance(t, (str, int, float)) and str(t).strip()]
        if tags:
            out["tags"] = tags[:32]
    return out


def controller_gone(run_dir: Path, files: Confined) -> str | None:
    """Why the controller that writes ``run_dir`` is known to be gone (the latest controller
    header of its timeline names a pid on this host that no longer exists), else None."""
    host = socket.gethostname()
    latest: dict | None = None
    for p in [p for p in files.listdir(run_dir / "events") if p.suffix == ".jsonl"][:4096]:
        try:
            with files.open(p) as f:
                h = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        if isinstance(h, dict) and h.get("ctl") and isinstance(h.get("pid"), int):
            if latest is None or (_num(h.get("start")) and h["start"] > (latest.get("start") or 0)):
                latest = h
    if latest is None or latest.get("host") != host:
        return None  # another host's process: not judged
    try:
        os.kill(latest["pid"], 0)
    except ProcessLookupError:
        return f"its controller process {latest['pid']} is gone"
    except OSError:
        return None
    return None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
