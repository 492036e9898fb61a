"""The experiment's run directory: id, layout and ``meta.json``.

    >>> import tempfile
    >>> from forge_obs.core.run import RunConfig
    >>> rc = RunConfig.from_config({"id": "exp1", "root": tempfile.mkdtemp()})
    >>> rc.run_id, rc.run_dir.name
    ('exp1', 'exp1')

The id comes from ``init_backends({"run": {"id": ...}})``, else ``FORGE_OBS_RUN_ID``, else a new
time-stamped id. A resumed job passes the same id and appends to the same directory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import platform
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_obs.core.options import check_keys
from forge_obs.core.redact import redact, redacted_repr

__all__ = [
    "new_run_id",
    "RUN_ID_RULE",
    "check_run_id",
    "check_run_path",
    "path_in_run",
    "RunConfig",
    "META_RESERVE_BYTES",
    "reserve_meta_space",
    "release_meta_space",
    "write_meta",
]

logger = logging.getLogger("forge_obs")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


#: what a run id is, said in every error about one
RUN_ID_RULE = ("one directory name: printable characters, no '/' or '\\', no space at either end, not '.' or '..', "
               "at most 255 bytes")


def check_run_id(run_id: Any, source: str = "") -> str:
    """``run_id`` if it names one directory (:data:`RUN_ID_RULE`); ValueError saying the rule
    otherwise (``source``: where the id came from, e.g. ``" (from FORGE_OBS_RUN_ID)"``)."""
    if not isinstance(run_id, str):
        raise ValueError(f"run id must be a string, got {type(run_id).__name__} {redacted_repr(run_id)}{source}: "
                         f"{RUN_ID_RULE}")
    if not run_id:
        raise ValueError(f"run id must not be empty{source}: {RUN_ID_RULE}")
    if (not run_id.isprintable() or "/" in run_id or "\\" in run_id or run_id.strip() != run_id
            or run_id in (".", "..") or len(run_id.encode("utf-8", "surrogatepass")) > 255):
        raise ValueError(f"run id {redacted_repr(run_id)}{source} is not {RUN_ID_RULE}")
    return run_id


def check_run_path(value: Any, what: str) -> str:
    """A path from configuration (``what`` names its key): ``value`` if it is a relative path
    inside the run directory (not empty, not absolute, no ``..`` part); ValueError saying so
    otherwise. :func:`path_in_run` resolves it when the run directory is known."""
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{what} must be a relative path inside the run directory, got "
                         f"{type(value).__name__} {redacted_repr(value)}")
    text = os.fspath(value)
    parts = Path(text).parts if isinstance(text, str) else ()
    if not isinstance(text, str) or not text.strip() or "\0" in text or Path(text).is_absolute() or ".." in parts:
        raise ValueError(f"{what} {redacted_repr(text)} must be a relative path inside the run directory "
                         "(no '..', not absolute): every file forge_obs writes stays in the run directory")
    return text


def path_in_run(run_dir: Path, value: Any, what: str) -> Path:
    """``run_dir / value`` (checked by :func:`check_run_path`), with ValueError if it leaves the
    run directory through a symbolic link."""
    path = Path(run_dir) / check_run_path(value, what)
    if not path.resolve().is_relative_to(Path(run_dir).resolve()):
        raise ValueError(f"{what} {redacted_repr(os.fspath(value))} must be a relative path inside the run directory: "
                         f"{path} leads to {path.resolve()} through a symbolic link")
    return path


@dataclass
class RunConfig:
    run_id: str
    root: Path
    #: what people call the run, its tags and notes (as W&B's name / tags / notes): written to
    #: meta.json, shown and searched by ``forge-obs serve``
    name: str | None = None
    tags: tuple[str, ...] = ()
    notes: str | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    VALID_KEYS = ("id", "root", "name", "tags", "notes")

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None) -> "RunConfig":
        """The ``"run"`` section: ``id`` (:data:`RUN_ID_RULE`; default ``FORGE_OBS_RUN_ID``, else
        a new time-stamped id), ``root`` (default ``FORGE_OBS_ROOT``, else ``runs``) and the optional
        ``name``, ``tags``, ``notes``; ValueError saying the rule for a bad one."""
        if cfg is not None and not isinstance(cfg, Mapping):
            raise ValueError(f"the 'run' config must be a dict with keys {', '.join(cls.VALID_KEYS)}, got "
                             f"{type(cfg).__name__}")
        cfg = dict(cfg or {})
        check_keys("run", cfg, cls.VALID_KEYS)
        if cfg.get("id") is not None:
            run_id = check_run_id(cfg["id"])
        elif os.environ.get("FORGE_OBS_RUN_ID"):
            run_id = check_run_id(os.environ["FORGE_OBS_RUN_ID"], " (from FORGE_OBS_RUN_ID)")
        else:
            run_id = new_run_id()
        root = cfg.get("root")
        if root is None:
            root = os.environ.get("FORGE_OBS_ROOT") or "runs"
        if not isinstance(root, (str, os.PathLike)) or isinstance(os.fspath(root), bytes):
            raise ValueError(f"run root must be a path (str or os.PathLike), got {type(root).__name__} "
                             f"{redacted_repr(root)}")
        if not os.fspath(root).strip():
            raise ValueError("run root must not be empty (default: FORGE_OBS_ROOT, else 'runs')")
        return cls(run_id=run_id, root=Path(root), **_run_labels(cfg))

    def labels(self) -> dict[str, Any]:
        """The name, tags and notes that were given, as meta.json holds them."""
        out: dict[str, Any] = {"name": self.name, "tags": list(self.tags), "notes": self.notes}
        return {k: v for k, v in out.items() if v}


def _run_labels(cfg: dict[str, Any]) -> dict[str, Any]:
    """``run``'s ``name``, ``tags`` and ``notes``, checked: text, and a list of texts."""
    out: dict[str, Any] = {}
    for key in ("name", "notes"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"run {key} must be a string, got {type(v).__name__}")
        out[key] = v
    tags = cfg.get("tags", ())
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"run tags must be a list of strings, e.g. [\"grpo\", \"baseline\"], got {type(tags).__name__}")
    out["tags"] = tuple(tags)
    return out


#: bytes kept allocated in a running session's directory, for meta.json's last update on a full disk
META_RESERVE_BYTES = 64 * 1024
_RESERVE = ".meta.json.reserve"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def reserve_meta_space(run_dir: Path) -> None:
    """Keep :data:`META_RESERVE_BYTES` allocated in ``run_dir`` (a hidden file) so that
    :func:`write_meta` can record the run's final status on a full disk: it frees them when the
    disk refuses ``meta.json``. Best effort: without room for it, nothing is reserved."""
    path = Path(run_dir) / _RESERVE
    try:
        if path.is_file() and path.stat().st_blocks * 512 >= META_RESERVE_BYTES:
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, META_RESERVE_BYTES)
        finally:
            os.close(fd)
    except (OSError, AttributeError) as e:
        logger.debug("forge_obs: no space reserved for %s: %s", path.parent / "meta.json", e)
        release_meta_space(run_dir)


def release_meta_space(run_dir: Path) -> bool:
    """Free the space :func:`reserve_meta_space` kept; True if there was some."""
    try:
        (Path(run_dir) / _RESERVE).unlink()
        return True
    except OSError:
        return False


def write_meta(run_dir: Path, **fields: Any) -> Path | None:
    """Create or update ``meta.json`` (merging :func:`redact` ed ``fields`` into what is there).

    Safe when several processes write the same run's meta at once (the read-modify-write holds
    an exclusive lock on the run directory; each writer writes its own temporary file and
    atomically replaces ``meta.json``). On a full disk it uses the space
    :func:`reserve_meta_space` kept, if any. Never raises for a file-system error (disk full, a
    read-only directory): it logs one error (naming the status it could not record) and returns
    None, leaving ``meta.json`` as it was and no temporary file behind.
    """
    run_dir = Path(run_dir)
    path = run_dir / "meta.json"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            _update_meta(run_dir, fields)
        except OSError as e:
            if e.errno not in _DISK_FULL or not release_meta_space(run_dir):
                raise
            _update_meta(run_dir, fields)  # in the space the reserve held
        return path
    except (OSError, ValueError, TypeError) as e:
        lost = f"; its status stays as it was, not {fields['status']!r}" if "status" in fields else ""
        logger.error("forge_obs: could not write %s: %s%s (free disk space or fix the directory's permissions; "
                     "the run's other files are not affected)", path, e, lost)
        return None


def _update_meta(run_dir: Path, fields: dict[str, Any]) -> None:
    """The locked read-modify-write of :func:`write_meta`."""
    path = run_dir / "meta.json"
    with _DirLock(run_dir):
        meta: dict[str, Any] = {}
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(meta, dict):
                meta = {}
        except (OSError, ValueError):
            meta = {}
        if not meta:
            meta = {
                "host": socket.gethostname(),
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "starts": [],
            }
        if "start_time" in fields:
            starts = meta.get("starts")
            meta["starts"] = (starts if isinstance(starts, list) else []) + [fields["start_time"]]
        meta.update(redact(fields))
        _replace_atomically(path, json.dumps(meta, indent=2, default=str))


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file of this writer's own, then rename it over ``path``; the
    temporary file is removed if anything fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _DirLock:
    """An exclusive ``flock`` on a directory (no lock file left behind); a no-op where flock is
    not available."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.fd: int | None = None

    def __enter__(self) -> "_DirLock":
        try:
            import fcntl

            self.fd = os.open(self.d, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError, AttributeError):
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None
