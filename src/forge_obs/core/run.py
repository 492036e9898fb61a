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
from forge_obs.core.safe import safe_repr, safe_str

__all__ = [
    "new_run_id",
    "MASK",
    "SECRET_PARTS",
    "SECRET_WORDS",
    "HARMLESS_WORDS",
    "COUNT_WORDS",
    "is_secret_name",
    "redact_text",
    "redacted_repr",
    "is_secret_field",
    "is_secret_flag",
    "redact_key",
    "redact",
    "redact_string",
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


#: (pattern, replacement, needles): a pattern can match only text that holds one of its needles
#: (``str`` needles are searched in the text as it is, ``low`` ones in its lower case): text without
#: any costs a few substring searches, not a regular-expression scan
_VALUE_PATTERNS: list[tuple[re.Pattern, Any, tuple[str, ...], tuple[str, ...]]] = [
    # PEM private keys
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S), MASK,
     ("PRIVATE KEY-----",), ()),
    # an Authorization header: everything after it on the line
    (re.compile(r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)[^\r\n,;\"']+"), r"\1" + MASK, (), ("authorization",)),
    # bearer tokens
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), r"\1" + MASK, (), ("bearer",)),
    # a password in a URL: scheme://user:password@host
    (re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@"), r"\1" + MASK + "@", ("://",), ()),
    # well-known key formats (OpenAI / Anthropic / Stripe, GitHub, AWS key ids, Hugging Face,
    # Slack, Google, JWTs)
    (re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
                r"|github_pat_[A-Za-z0-9_]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|hf_[A-Za-z0-9]{20,}"
                r"|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
                r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"), MASK,
     ("sk-", "k_live_", "k_test_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "AKIA", "ASIA", "hf_",
      "xox", "AIza", "eyJ"), ()),
]
#: a secret name holds one of these (lower case): text without any has no ``name=value`` to mask
_NAME_NEEDLES = SECRET_PARTS + tuple(sorted(SECRET_WORDS))
#: the letters ``(?i)`` matches to ASCII ones that ``str.lower`` does not map there (dotless i,
#: long s; a dotted capital I lowers to ``i`` + a combining dot, which is dropped)
_FOLD = str.maketrans({"\u0131": "i", "\u017f": "s", "\u0307": None})
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
    PEM private keys). Text without any of their markers is returned as it is, after a few
    substring searches.

        >>> redact_text("postgres://u:pw@h/db")
        'postgres://u:***@h/db'
    """
    low = s.lower()
    if not s.isascii():
        low = low.translate(_FOLD)
    for pat, repl, needles, low_needles in _VALUE_PATTERNS:
        if any(n in s for n in needles) or any(n in low for n in low_needles):
            s = pat.sub(repl, s)
    if not any(n in low for n in _NAME_NEEDLES):  # no secret name: no assignment or query to mask
        return s
    s = _QUERY.sub(_mask_query, s)
    return _ASSIGN.sub(_mask_assign, s)


def redacted_repr(value: Any, limit: int = 200) -> str:
    """How an error message or a log line quotes a user's value: the ``repr`` of its
    :func:`redact` ed copy (a string through :func:`redact_text`), cut to ``limit`` characters.

        >>> redacted_repr("sk-proj-abcdefghijklmnopqrst"), redacted_repr({"api_key": "x", "lr": 0.1})
        ("'***'", "{'api_key': '***', 'lr': 0.1}")
    """
    return safe_repr(redact(value), limit)


def is_secret_field(name: Any, value: Any) -> bool:
    """Whether ``value`` under the dict key ``name`` is masked whole: a secret-looking name
    (:func:`is_secret_name`) holding anything but ``True`` / ``False`` / ``None``."""
    return not (value is None or isinstance(value, bool)) and _secret_name(name)


def is_secret_flag(item: Any) -> bool:
    """Whether a list item is a command-line flag of a secret name (``"--password"``): the item
    after it is masked."""
    return isinstance(item, str) and item.startswith("-") and "=" not in item and _secret_name(item.lstrip("-"))


def redact_key(name: str, taken: Any = ()) -> str:
    """A dict key as it is written: its credential-looking parts masked (:func:`redact_text`);
    a masked key that is already in ``taken`` gets `` (2)``, `` (3)``, ... so that two entries
    stay two."""
    out = redact_text(name)
    if out is name or out == name or out not in taken:
        return out
    n = 2
    while f"{out} ({n})" in taken:
        n += 1
    return f"{out} ({n})"


def redact(obj: Any) -> Any:
    """A copy of a config, safe to write anywhere (meta.json, W&B, logs, reports): the value of
    every secret-looking name (:func:`is_secret_name`, in nested dicts and lists too) replaced by
    ``"***"`` (``True`` / ``False`` / ``None`` are kept: they hold no secret), credential-looking
    dict keys masked (:func:`redact_key`), a JSON object or array held in a string redacted the
    same way, and credential-looking text in every other string (:func:`redact_text`). In lists,
    the item after a secret flag (``["--password", "x"]``) is masked. Mappings become dicts,
    tuples and sets lists, other objects their (redacted) text; never raises.
    :func:`forge_obs.core.plain.plain` applies the same rules to SAMPLE rows.

        >>> redact({"wandb": {"api_key": "abc", "project": "p"}, "max_tokens": 512})
        {'wandb': {'api_key': '***', 'project': 'p'}, 'max_tokens': 512}
    """
    return _redact(obj, set(), 0)


def _redact(obj: Any, path: set, depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return redact_string(obj, path, depth)
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
            return _redact_mapping(obj, path, depth)
        if isinstance(obj, (list, tuple, set, frozenset)):
            out_l = []
            mask_next = False
            for v in obj:
                if mask_next and not (isinstance(v, str) and v.startswith("-")):
                    out_l.append(MASK)
                    mask_next = False
                    continue
                mask_next = is_secret_flag(v)
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


def _redact_mapping(obj: Mapping, path: set, depth: int) -> dict:
    out: dict = {}
    for k, v in obj.items():
        name = k if isinstance(k, (int, float, bool)) or k is None else redact_key(safe_str(k), out)
        out[name] = MASK if is_secret_field(name, v) else _redact(v, path, depth + 1)
    return out


def redact_string(s: str, path: Any = None, depth: int = 0) -> str:
    """A string as :func:`redact` writes it: a JSON object or array it holds is parsed and
    redacted as data (re-serialised only when something was masked); any other text goes through
    :func:`redact_text`. ``path`` / ``depth``: the containers the string is inside of."""
    t = s.strip()
    if t[:1] in ("{", "[") and t[-1:] in ("}", "]"):
        try:
            parsed = json.loads(t)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, (dict, list)):
            out = _redact(parsed, set() if path is None else path, depth + 1)
            return s if out == parsed else json.dumps(out)
    return redact_text(s)


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

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    VALID_KEYS = ("id", "root")

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None) -> "RunConfig":
        """The ``"run"`` section: ``id`` (:data:`RUN_ID_RULE`; default ``FORGE_OBS_RUN_ID``, else
        a new time-stamped id) and ``root`` (default ``FORGE_OBS_ROOT``, else ``runs``);
        ValueError saying the rule for a bad one."""
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
        return cls(run_id=run_id, root=Path(root))


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
