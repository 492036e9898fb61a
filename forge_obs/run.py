"""The experiment's run directory: id, layout and ``meta.json``.

    >>> import tempfile
    >>> from forge_obs.run import RunConfig
    >>> rc = RunConfig.from_config({"id": "exp1", "root": tempfile.mkdtemp()})
    >>> rc.run_id, rc.run_dir.name
    ('exp1', 'exp1')

The id comes from ``init_backends({"run": {"id": ...}})``, else ``FORGE_OBS_RUN_ID``, else a new
time-stamped id. A resumed job passes the same id and appends to the same directory.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SECRET_WORDS = ("key", "token", "secret", "password")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def redact(obj: Any) -> Any:
    """Copy of a config with anything that looks like a credential replaced by ``"***"``."""
    if isinstance(obj, dict):
        return {
            k: ("***" if isinstance(k, str) and any(w in k.lower() for w in _SECRET_WORDS) else redact(v))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


@dataclass
class RunConfig:
    run_id: str
    root: Path

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    VALID_KEYS = ("id", "root")

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None) -> "RunConfig":
        cfg = dict(cfg or {})
        unknown = set(cfg) - set(cls.VALID_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in 'run'; valid: {', '.join(cls.VALID_KEYS)}")
        run_id = str(cfg.get("id") or os.environ.get("FORGE_OBS_RUN_ID") or new_run_id())
        if "/" in run_id or run_id in (".", ".."):
            raise ValueError(f"run id {run_id!r} must be a plain directory name")
        root = Path(cfg.get("root") or os.environ.get("FORGE_OBS_ROOT") or "runs")
        return cls(run_id=run_id, root=root)


def write_meta(run_dir: Path, **fields: Any) -> Path:
    """Create or update ``meta.json`` (merging ``fields`` into what is there)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "meta.json"
    meta: dict[str, Any] = {}
    if path.exists():
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError:
            meta = {}
    if not meta:
        meta = {
            "host": socket.gethostname(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "starts": [],
        }
    if "start_time" in fields:
        meta.setdefault("starts", []).append(fields["start_time"])
    meta.update(redact(fields))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str))
    os.replace(tmp, path)
    return path
