"""Read the local store back: JSONL files that tolerate a torn last line.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> _ = p.write_text('{"step": 0}\\n{"step": 1}\\n{"step": 2, "metr')
    >>> [r["step"] for r in read_jsonl(p)]
    [0, 1]
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger("forge_obs")


def read_jsonl(path: "str | Path") -> Iterator[dict[str, Any]]:
    """Yield each complete JSON object of ``path``. A torn last line (a writer died mid-line) is
    skipped silently; a corrupt line elsewhere is skipped with a warning."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            last = i == len(lines) - 1 and not line.endswith("\n")
            if not last:
                logger.warning("forge_obs: %s:%d is not valid JSON; skipped", path, i + 1)


def read_metrics(run_dir: "str | Path", mode: str | None = "global_reduce") -> list[dict[str, Any]]:
    """Rows of ``<run_dir>/metrics.jsonl`` (of one mode, or all when ``mode`` is None)."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if mode is None or r.get("mode") == mode]
