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

import dataclasses
import errno
import json
import logging
import os
import platform
import re
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from forge_obs.core.options import check_keys
from forge_obs.core.safe import safe_str

__all__ = [
    "new_run_id",
    "MASK",
    "SECRET_PARTS",
    "SECRET_WORDS",
    "HARMLESS_WORDS",
    "COUNT_WORDS",
    "is_secret_name",
    "redact_text",
    "redact",
    "RunConfig",
    "META_RESERVE_BYTES",
    "reserve_meta_space",
    "release_meta_space",
    "write_meta",
]

logger = logging.getLogger("forge_obs")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


# ----------------------------------------------------------------------------- redaction
#: what a redacted value is replaced by
MASK = "***"
#: a name holding one of these (anywhere in a word, case-insensitive) is a secret
SECRET_PARTS = ("key", "secret", "token", "pass", "pwd", "auth", "credential", "private", "cookie", "session")
#: ... and so is a name with one of these as a whole word (``pat`` would catch ``path``)
SECRET_WORDS = frozenset({"pat", "ghpat", "pw", "pin", "otp", "sig", "signature"})
#: words that contain a secret part but are other words (never ``token``/``tokens``/``key``/``keys``:
#: those are harmless only by the context rules below)
HARMLESS_WORDS = frozenset({
    "tokenizer", "tokenizers", "tokenize", "tokenized", "tokenization", "detokenize",
    "detokenizer", "detokenized", "keyword", "keywords", "keyframe", "keyframes", "keyboard",
    "passes", "passage", "passages", "bypass", "compass", "passthrough", "passthru", "multipass",
    "author", "authors", "authored",
})
#: words that count or size what follows (``max_new_tokens``): a ``token``/``tokens`` after one of
#: them, anywhere earlier in the name, is a number of tokens
COUNT_WORDS = frozenset({"max", "min", "num", "n", "total", "count", "limit", "budget", "len", "length", "avg",
                         "mean"})
#: ``token``/``tokens`` right after one of these is a kind of token (``eos_token``, ``prompt_tokens``)
_TOKEN_KINDS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "stop", "start", "end", "special",
                          "image", "audio", "video", "vision", "think", "thinking", "reasoning", "new", "prompt",
                          "completion", "input", "output", "generated", "response", "context", "vocab"})
#: ``token``/``tokens`` right before one of these is a property of tokens (``token_ids``, ``tokens_per_s``)
_TOKEN_PROPERTIES = frozenset({"id", "ids", "index", "idx", "count", "num", "max", "min", "limit", "budget", "len",
                               "length", "type", "types", "level", "logprob", "logprobs", "per"})
_KEY_NEIGHBOURS = frozenset({"prefix", "prefixes", "dim", "dims", "size", "len", "length", "name", "names", "field",
                             "fields", "column", "columns", "col", "fn", "func", "function", "type", "types", "sort",
                             "metric", "metrics", "step", "group", "partition", "shard", "rng", "prng", "seed",
                             "cache", "dict", "lookup", "index", "primary", "join", "order", "by"})
#: word -> (words right before it, words right after it, words anywhere before it) that make it harmless
_CONTEXT_RULES = {
    "token": (_TOKEN_KINDS | COUNT_WORDS, _TOKEN_PROPERTIES, COUNT_WORDS),
    "key": (_KEY_NEIGHBOURS, _KEY_NEIGHBOURS, frozenset()),
}
_CONTEXT_RULES["tokens"] = _CONTEXT_RULES["token"]
_CONTEXT_RULES["keys"] = _CONTEXT_RULES["key"]
#: whole names that are harmless although a word looks like a secret (pass@k metrics)
_HARMLESS_NAMES = re.compile(r"^(pass_(at_)?\d*k?\d*|num_pass|pass_rate|passed|key_value|kv)$")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_SPLIT = re.compile(r"[^a-z0-9]+")


@lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a config name looks like it holds a credential. Deny by default: the name is a
    secret if any of its words (split at ``_``, ``-``, ``.``, camelCase) is ``pat``, ``pw``,
    ``pin``, ``otp``, ``sig``, ``signature``, or contains ``key``, ``secret``, ``token``, ``pass``,
    ``pwd``, ``auth``, ``credential``, ``private``, ``cookie`` or ``session`` -- unless that word is
    another word (``tokenizer``, ``keyword``, ``passage``, ``author``, :data:`HARMLESS_WORDS`), or:

    - ``token`` / ``tokens`` comes after a count word anywhere in the name (``max_tokens``,
      ``max_new_tokens``, ``num_tokens``, ``n_tokens``, ``total_tokens``; :data:`COUNT_WORDS`),
      right after a kind of token (``eos_token``, ``prompt_tokens``, ``special_tokens``) or right
      before a property (``token_ids``, ``tokens_per_s``);
    - ``key`` / ``keys`` is next to a structural word (``key_prefix``, ``sort_key``, ``metric_keys``);
    - the whole name is a pass@k metric (``pass_at_k``, ``pass_rate``) or ``kv``.

    No other word makes a name harmless: ``hf_tokens``, ``refresh_tokens``, ``id_token``,
    ``tokenizer_hf_token`` are secrets.

        >>> is_secret_name("aws_secret_access_key"), is_secret_name("max_tokens"), is_secret_name("hf_tokens")
        (True, False, True)
    """
    words = [w for w in _SPLIT.split(_CAMEL.sub(r"\1_\2", name).lower()) if w]
    if _HARMLESS_NAMES.match("_".join(words)):
        return False
    for i, w in enumerate(words):
        if w in SECRET_WORDS:
            return True
        if w in HARMLESS_WORDS or not any(p in w for p in SECRET_PARTS):
            continue
        if not _harmless_in_context(w, words, i):
            return True
    return False


def _harmless_in_context(word: str, words: list[str], i: int) -> bool:
    """Whether ``words[i]`` (a ``token``/``key`` word) is made harmless by its neighbours (:data:`_CONTEXT_RULES`)."""
    rule = _CONTEXT_RULES.get(word)
    if rule is None:
        return False
    before, after, earlier = rule
    return ((i > 0 and words[i - 1] in before) or (i + 1 < len(words) and words[i + 1] in after)
            or any(w in earlier for w in words[:i]))


def _secret_name(name: Any) -> bool:
    try:
        return is_secret_name(name if type(name) is str else str(name))
    except Exception:  # noqa: BLE001
        return False


_VALUE_PATTERNS: list[tuple[re.Pattern, Any]] = [
    # PEM private keys
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S), MASK),
    # an Authorization header: everything after it on the line
    (re.compile(r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)[^\r\n,;\"']+"), r"\1" + MASK),
    # bearer tokens
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), r"\1" + MASK),
    # a password in a URL: scheme://user:password@host
    (re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@"), r"\1" + MASK + "@"),
    # well-known key formats (OpenAI / Anthropic / Stripe, GitHub, AWS key ids, Hugging Face,
    # Slack, Google, JWTs)
    (re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
                r"|github_pat_[A-Za-z0-9_]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|hf_[A-Za-z0-9]{20,}"
                r"|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
                r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"), MASK),
]
# --name value / --name=value / name=value / name: value / "name": value (JSON or a Python repr
# inside text), masked when the name is a secret name; a [list] or {dict} value is masked whole.
# Two words separated by a space alone are free text, never an assignment.
_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
_ASSIGN = re.compile(rf"(?<![\w-])(?:(--?)({_NAME})(\s*[=:]\s*|\s+)|([\"']?)({_NAME})\4(\s*[=:]\s*))"
                     r"(\"[^\"]*\"?|'[^']*'?|\[[^\]]*\]?|\{[^}]*\}?|[^\s'\",;&]+)")
_QUERY = re.compile(r"([?&;])([^=&#\s]+)=([^&#\s]*)")


def _mask_assign(m: re.Match) -> str:
    dashes, dashed_name, dashed_sep, nq, name, sep, value = m.groups()
    if dashes:
        name, sep, nq = dashed_name, dashed_sep, ""
    if value.startswith((MASK, "-")) or not is_secret_name(name):  # what a harmless name's value holds is scanned too
        return m.group(0) if value[0] not in "[{\"'" else m.group(0)[: -len(value)] + redact_text(value)
    q = value[0] if value[0] in "\"'" else ("\"" if nq == "\"" and value[0] in "[{" else "")
    return f"{dashes or ''}{nq}{name}{nq}{sep}{q}{MASK}{q}"


def _mask_query(m: re.Match) -> str:
    return f"{m.group(1)}{m.group(2)}={MASK}" if _secret_name(m.group(2)) else m.group(0)


def redact_text(s: str) -> str:
    """``s`` with credential-looking parts replaced by ``***``: bearer tokens, Authorization
    headers, URL passwords and secret query parameters, ``name=value`` / ``--name value`` of
    secret names, and well-known key formats (``sk-…``, ``ghp_…``, ``AKIA…``, ``hf_…``, JWTs,
    PEM private keys).

        >>> redact_text("postgres://u:pw@h/db")
        'postgres://u:***@h/db'
    """
    for pat, repl in _VALUE_PATTERNS:
        s = pat.sub(repl, s)
    s = _QUERY.sub(_mask_query, s)
    return _ASSIGN.sub(_mask_assign, s)


def redact(obj: Any) -> Any:
    """A copy of a config, safe to write anywhere (meta.json, W&B, logs, reports): the value of
    every secret-looking name (:func:`is_secret_name`, in nested dicts and lists too) replaced by
    ``"***"`` (``True`` / ``False`` / ``None`` are kept: they hold no secret), a JSON object or
    array held in a string redacted the same way, and credential-looking text in every other
    string (:func:`redact_text`). In lists, the item after a secret flag
    (``["--password", "x"]``) is masked. Mappings become dicts, tuples and sets lists, other
    objects their (redacted) text; never raises.

        >>> redact({"wandb": {"api_key": "abc", "project": "p"}, "max_tokens": 512})
        {'wandb': {'api_key': '***', 'project': 'p'}, 'max_tokens': 512}
    """
    return _redact(obj, set(), 0)


def _redact(obj: Any, path: set, depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return _redact_string(obj, path, depth)
    if depth > 64:
        return "<too deep>"
    oid = id(obj)
    if oid in path:
        return "<cycle>"
    path.add(oid)
    try:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            obj = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                name = k if isinstance(k, (str, int, float, bool)) or k is None else safe_str(k)
                if _secret_name(name) and not (v is None or isinstance(v, bool)):
                    out[name] = MASK
                else:
                    out[name] = _redact(v, path, depth + 1)
            return out
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
            out_l = []
            mask_next = False
            for v in items:
                if mask_next and not (isinstance(v, str) and v.startswith("-")):
                    out_l.append(MASK)
                    mask_next = False
                    continue
                mask_next = isinstance(v, str) and v.startswith("-") and "=" not in v and _secret_name(v.lstrip("-"))
                out_l.append(_redact(v, path, depth + 1))
            return out_l
        if isinstance(obj, bytes):
            return redact_text(obj.decode("utf-8", "replace"))
        item = getattr(obj, "item", None)
        if callable(item):
            try:
                v = item()
                if v is None or isinstance(v, (bool, int, float)):
                    return v
            except Exception:  # noqa: BLE001
                pass
        return redact_text(safe_str(obj))
    except Exception:  # noqa: BLE001 - a config that cannot be read is not written
        return "<unreadable>"
    finally:
        path.discard(oid)


def _redact_string(s: str, path: set, depth: int) -> str:
    """A JSON object or array held in a string is parsed and redacted as data (re-serialised only
    when something was masked); any other text goes through :func:`redact_text`."""
    t = s.strip()
    if t[:1] in ("{", "[") and t[-1:] in ("}", "]"):
        try:
            parsed = json.loads(t)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, (dict, list)):
            out = _redact(parsed, path, depth + 1)
            return s if out == parsed else json.dumps(out)
    return redact_text(s)


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
        cfg = dict(cfg or {})
        check_keys("run", cfg, cls.VALID_KEYS)
        run_id = str(cfg.get("id") or os.environ.get("FORGE_OBS_RUN_ID") or new_run_id())
        if "/" in run_id or run_id in (".", ".."):
            raise ValueError(f"run id {run_id!r} must be a plain directory name")
        root = Path(cfg.get("root") or os.environ.get("FORGE_OBS_ROOT") or "runs")
        return cls(run_id=run_id, root=root, **_run_labels(cfg))

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
