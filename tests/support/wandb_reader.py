"""Read an offline W&B run back from its ``.wandb`` file (W&B 0.31 ships no Python reader).

File layout: a 7-byte header (``:W&B``, a 2-byte magic, a 1-byte version), then LevelDB log
framing: 32 KiB blocks, each record split into chunks with a 7-byte header (CRC32C: 4 bytes,
length: 2 bytes little-endian, type: 1 byte: FULL=1, FIRST=2, MIDDLE=3, LAST=4). A block tail
shorter than a chunk header is zero padding. Each reassembled record is a serialized
``wandb.proto.wandb_internal_pb2.Record``.

    run = read_run(find_run_file(tmp_path / "wandb", "myrun"))
    run.history      # [{"_step": 0, "loss": 0.5, ...}, ...]
    run.config       # {"lr": 0.001, ...}
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

HEADER_LEN = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: "str | Path") -> Iterator[bytes]:
    """Yield each record's bytes."""
    data = Path(path).read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path}: not a .wandb file (header {data[:7]!r})")
    pos = HEADER_LEN
    parts: list[bytes] = []
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block  # zero padding at the end of a block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        pos += CHUNK_HEADER
        if pos + length > len(data):
            break  # a chunk still being written
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            parts.append(chunk)
            yield b"".join(parts)
            parts = []
        else:
            raise ValueError(f"{path}: bad chunk type {kind} at offset {pos - length - CHUNK_HEADER}")


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    metric_defs: list[dict[str, Any]] = field(default_factory=list)
    stats_records: int = 0
    complete: bool = False  # the run's exit record was written (wandb.finish done)

    def keys(self) -> set[str]:
        return {k for row in self.history for k in row}

    def steps(self) -> list[int]:
        return [row["_step"] for row in self.history]


def read_run(path: "str | Path", wait_s: float = 30.0) -> OfflineRun:
    """Parse the run; ``wandb.finish()`` can return before W&B's writer process has written the
    last records, so wait (up to ``wait_s``) for the exit record."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        run = _parse(path)
        if run.complete or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _parse(path: "str | Path") -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun(Path(path))
    for raw in iter_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.name, run.group, run.job_type = r.run_id, r.display_name, r.run_group, r.job_type
            for item in r.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in rec.history.item}
            if rec.history.HasField("step") and "_step" not in row:
                row["_step"] = rec.history.step.num
            run.history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[_item_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            m = rec.metric
            run.metric_defs.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
        elif kind == "stats":
            run.stats_records += 1
        elif kind == "exit":
            run.complete = True
    return run


def find_run_files(wandb_dir: "str | Path") -> list[Path]:
    """Every ``run-*.wandb`` under ``wandb_dir`` (sorted)."""
    return sorted(Path(wandb_dir).rglob("run-*.wandb"))


def find_run_file(wandb_dir: "str | Path", run_id: str) -> Path:
    hits = [p for p in find_run_files(wandb_dir) if p.name == f"run-{run_id}.wandb"]
    if not hits:
        raise FileNotFoundError(f"no run-{run_id}.wandb under {wandb_dir}: {find_run_files(wandb_dir)}")
    return hits[-1]


def run_files_dir(run_file: "str | Path") -> Path:
    """The offline run's ``files/`` folder (its media, tables among them), beside its ``.wandb`` file."""
    return Path(run_file).parent / "files"


def _table_rows(files: Path, ref: Any) -> list[dict]:
    """The rows of the table file a history or summary value refers to (``{"path": ...}``)."""
    path = ref.get("path") if isinstance(ref, dict) else None
    if not path or not (files / path).is_file():
        return []
    data = json.loads((files / path).read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]


def _refs(flat: dict) -> dict[str, dict]:
    """``key -> {field: value}`` of the table values in a row: flattened (``key/path``,
    ``key/_type``: history) or nested (``key: {"_type", "path"}``: the summary)."""
    out: dict[str, dict] = {}
    for k, v in flat.items():
        if isinstance(v, dict) and "path" in v:
            out[k] = v
            continue
        key, _, fld = k.rpartition("/")
        if key and fld in ("path", "_type"):
            out.setdefault(key, {})[fld] = v
    return {k: v for k, v in out.items() if "table" in str(v.get("_type", ""))}


def tables(run: OfflineRun) -> dict[str, list[dict]]:
    """Every table the run logged, by key, as row dicts: a table logged at several steps gives
    the rows of each (an incremental table's parts hold only their new rows, so its whole table
    is their union), and a table in the summary (``summary:<key>``) its rows."""
    files = run_files_dir(run.path)
    out: dict[str, list[dict]] = {}
    seen: set = set()
    for row in run.history:
        for key, ref in _refs(row).items():
            if ref["path"] not in seen:
                seen.add(ref["path"])
                out.setdefault(key, []).extend(_table_rows(files, ref))
    for key, ref in _refs(run.summary).items():
        out[f"summary:{key}"] = _table_rows(files, ref)
    return out
