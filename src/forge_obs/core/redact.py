"""The one redaction rule of everything forge_obs writes, prints or serves: configs (``meta.json``,
the W&B config, the report), SAMPLE rows (:func:`forge_obs.core.plain.plain` applies it where a
row is recorded) and the values error messages quote (:func:`redacted_repr`).

    >>> from forge_obs.core.redact import redact, redact_text
    >>> redact({"wandb": {"api_key": "abc", "project": "p"}, "users": {"ghp_abcdefghijklmnopqrstuv": 1}})
    {'wandb': {'api_key': '***', 'project': 'p'}, 'users': {'***': 1}}
    >>> redact_text("postgres://u:pw@h/db --token x")
    'postgres://u:***@h/db --token ***'

The rule in words: docs/operations.md, "Secrets: what is redacted". No Monarch, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from forge_obs.core.safe import safe_repr, safe_str

__all__ = [
    "MASK",
    "SECRET_PARTS",
    "SECRET_WORDS",
    "HARMLESS_WORDS",
    "COUNT_WORDS",
    "is_secret_name",
    "is_secret_field",
    "is_secret_flag",
    "redact_text",
    "redact_items",
    "redact_key",
    "redact_string",
    "redact",
    "redacted_repr",
]

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
     # each format's prefix holds one of these ("gh": ghp_ ... github_pat_; "IA": AKIA, ASIA)
     ("sk-", "k_", "gh", "IA", "AIza", "hf_", "xox", "eyJ"), ()),
]
#: a secret name holds one of these (lower case; a part that holds another is left out: "pw"
#: finds "pwd", "sig" "signature", "pat" "ghpat"): text without any has no ``name=value`` to mask
_NAME_NEEDLES = tuple(n for n in (*SECRET_PARTS, *sorted(SECRET_WORDS))
                      if not any(m != n and m in n for m in (*SECRET_PARTS, *SECRET_WORDS)))
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
    for pat, repl, needles, low_needles in _VALUE_PATTERNS:  # loops, not any(): this runs per string
        for n in needles:
            if n in s:
                s = pat.sub(repl, s)
                break
        else:
            for n in low_needles:
                if n in low:
                    s = pat.sub(repl, s)
                    break
    for n in _NAME_NEEDLES:
        if n in low:
            break
    else:  # no secret name: no assignment or query to mask
        return s
    s = _QUERY.sub(_mask_query, s)
    return _ASSIGN.sub(_mask_assign, s)


@lru_cache(maxsize=4096)
def _redact_name(name: str) -> str:
    """:func:`redact_text` of a dict key (the same few keys come in every row)."""
    return redact_text(name)


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


def redact_items(items: Any, each: Any) -> list:
    """The items of a list as written: the argument after a secret flag (``["--password", "x"]``)
    masked, ``each(item)`` for every other item."""
    out = []
    mask_next = False
    for v in items:
        if mask_next and not (isinstance(v, str) and v.startswith("-")):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = is_secret_flag(v)
        out.append(each(v))
    return out


def redact_key(name: str, taken: Any = ()) -> str:
    """A dict key as it is written: its credential-looking parts masked (:func:`redact_text`);
    a masked key that is already in ``taken`` gets `` (2)``, `` (3)``, ... so that two entries
    stay two."""
    out = _redact_name(name) if len(name) <= 64 else redact_text(name)
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
            return redact_items(obj, lambda v: _redact(v, path, depth + 1))
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
