"""Readers only ever yield well-formed rows: malformed lines of any shape or encoding are
skipped and counted with one warning, and ``forge-obs show | sql | doctor | report`` keep
working on such a run (real files, the real CLI in a subprocess)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_obs.recording import timeline as tl
from forge_obs.analysis import reader
from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.core.types import Metric
from forge_obs.backends.record import RunContext, StepRecord
from forge_obs.analysis.store import read_jsonl, read_metrics
from tests.support.helpers import CHILD_PATH

ROOT = Path(__file__).resolve().parents[2]

# well-formed JSON of the wrong shape, and bytes that are not UTF-8
BAD_METRIC_LINES = [
    b"123", b"null", b'"text"', b"[1, 2]", b'{"no_step": 1}', b'{"step": "3"}', b'{"step": -1}', b'{"step": true}',
    b'{"step": 1.5}', b'{"step": 99999999999999999999999}', b'{"step": 3, "metrics": [1, 2]}',
    b'{"step": 3, "source": "trainer"}', b'{"step": 3, "values": "x"}', b'{"step": 3, "values": [["k"]]}',
    b'{"step": 3, "values": [[1, 2, 3]]}', b'{"step": 3, "values": [["k", 1, "t"]]}', b'{"step": 3, "missing": "r1"}',
    b'{"step": 3, "wall_time": "now"}', b'{"step": 3, "mode": 7}', b'{"step": 3, "source": {"rank": "0"}}',
    b'{"step": 3, "metrics": {"a": 1}, "x": "\xff\xfe"}', b"\xff\xfe\xfa", b"[" * 100_000, b'{"step": 3, "metr',
    b'{"step": 3} {"step": 4}', b'{"step": 3}x',  # a value followed by more than whitespace
]


def _metric_rows(run_dir: Path, steps: int = 3) -> None:
    be = JsonlBackend({"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]})
    be.init(run=RunContext(run_id="r", run_dir=run_dir))
    for step in range(steps):
        lbl = "trainer/T/r0"
        be.log_step(StepRecord(step=step, run_id="r", wall_time=100.0 + step,
                               global_metrics=[Metric("loss", 1.0 + step), Metric("d", {"p50": 1.0, "count": 2})],
                               per_rank={lbl: [Metric("loss", 1.0, source=lbl)]}, raw={lbl: [("loss", 1.0, 5.0)]},
                               sources={lbl: {"label": lbl, "mesh": "trainer", "rank": 0}}))
    be.finish()


def _corrupt_metrics(run_dir: Path) -> None:
    with open(run_dir / "metrics.jsonl", "ab") as f:
        for line in BAD_METRIC_LINES:
            f.write(line + b"\n")
        f.write(b'{"run_id": "r", "step": 9, "mode": "global_reduce", "metrics": {"loss": 9.0}}\n')
        f.write(b'{"step": 10, "metrics": {"lo')  # torn last line: silent


def test_read_jsonl_yields_only_well_formed_rows(tmp_path, caplog):
    _metric_rows(tmp_path)
    _corrupt_metrics(tmp_path)
    stats: dict = {}
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        rows = list(read_jsonl(tmp_path / "metrics.jsonl", stats=stats))
    assert [r["step"] for r in rows if r["mode"] == "global_reduce"] == [0, 1, 2, 9]
    assert len(rows) == 3 * 3 + 1
    assert stats == {"malformed": len(BAD_METRIC_LINES)}  # the torn last line is not counted
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and f"{len(BAD_METRIC_LINES)} malformed line(s)" in warnings[0]
    # any object is accepted when no row check is asked for
    assert len(list(read_jsonl(tmp_path / "metrics.jsonl", check=None))) > len(rows)


def _timeline_run(run_dir: Path) -> None:
    tl.close()
    assert tl.configure(run_dir, open_after_s=60)
    tl.set_step(1)
    with tl.record_span("train_step", lr=0.1):
        tl.record_event("weights_pushed", flow="v1")
    tl.add_step_tag("eval")
    tl.close()


BAD_EVENT_LINES = [
    b'["D", 0] trailing', b'["Z", 5]["Z", 6]',  # a well-formed record followed by more than whitespace
    b"123", b"null", b'"x"', b"[]", b'["I"]', b'["S", "x", 0, 1]', b"[1, 2]", b'[1, 2, 3, 4, "step"]',
    b'[1, 2, [0], 1, 1]', b'[1, 2, 0, 1, 1, [1]]', b'[1, 2, 0, 1, 1, {"a": [1]}]', b'["N", 1]', b'["N", 1, 5]',
    b'["L", [1], "x", 0]', b'["B", 1, 2, 3]', b'["E"]', b'["C", "a", "b"]', b'["M", 5]', b'["D", "x"]', b'["Z"]',
    b'["T", 1, 0, 1, 5]', b'["Q", 1]', b'{"not": "a header"}', b'[99999999999999999999999, 1, 0, 1, 1]',
    b"\xff\xfe\x00[1,2", b'{"h": 1, "pid": "abc", "rank": [0], "t0": "x", "clk": "bad", "file": null}',
]


def _corrupt_events(run_dir: Path) -> Path:
    (path,) = (run_dir / "events").glob("*.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    # malformed lines inside the records (after the header), and a torn last line
    path.write_bytes(lines[0] + b"".join(b + b"\n" for b in BAD_EVENT_LINES[:-1]) + b"".join(lines[1:])
                     + BAD_EVENT_LINES[-1] + b"\n" + b'[1, 2, 0')
    return path


def _items(run_dir: Path) -> tuple:
    run = reader.scan(run_dir)
    items = [tuple(x for x in it if not isinstance(x, reader.Stream)) for it in reader.walk(run)]
    return run, items


def test_timeline_reader_yields_only_well_formed_records(tmp_path, caplog):
    _timeline_run(tmp_path)
    _run0, clean = _items(tmp_path)
    _corrupt_events(tmp_path)
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        run, items = _items(tmp_path)
    # the last line was a header with bad fields: its well-typed fields are kept, a new session
    # starts (no records), so the records are exactly those of the clean file
    assert [it for it in items if it[0] != reader.END] == [it for it in clean if it[0] != reader.END]
    assert run.malformed == len(BAD_EVENT_LINES) - 1  # the bad header is cleaned, not skipped
    warnings = [r.getMessage() for r in caplog.records if "malformed timeline" in r.getMessage()]
    assert len(warnings) == 1
    for st in run.streams.values():
        assert isinstance(st.pid, int) and isinstance(st.rank, int)


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    return subprocess.run([sys.executable, "-m", "forge_obs.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


@pytest.fixture
def corrupted_run(tmp_path):
    run_dir = tmp_path / "r"
    _metric_rows(run_dir)
    _timeline_run(run_dir)
    _corrupt_metrics(run_dir)
    _corrupt_events(run_dir)
    return run_dir


def test_show_and_sql_work_on_a_corrupted_run(corrupted_run):
    p = _cli("show", str(corrupted_run))
    assert p.returncode == 0 and "Traceback" not in p.stderr
    assert [json.loads(line)["step"] for line in p.stdout.splitlines()] == [0, 1, 2, 9]
    assert p.stderr.count("malformed line(s)") == 1
    p = _cli("sql", str(corrupted_run), "SELECT count(*) AS n, max(step) AS s FROM metrics WHERE source = 'global'",
             "--format", "json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [{"n": 2 * 3 + 1, "s": 9}]
    p = _cli("sql", str(corrupted_run), "SELECT name, count(*) AS n FROM spans GROUP BY name", "--format", "json")
    assert p.returncode == 0 and json.loads(p.stdout) == [{"name": "train_step", "n": 1}], p.stderr


def test_doctor_report_and_trace_work_on_a_corrupted_run(corrupted_run, tmp_path):
    for args in (("doctor", str(corrupted_run)), ("report", str(corrupted_run), "-o", str(tmp_path / "r.html")),
                 ("trace", str(corrupted_run), "-o", str(tmp_path / "t.json"))):
        p = _cli(*args)
        assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (args, p.stderr)
    assert json.loads((tmp_path / "t.json").read_text())
    assert "loss" in (tmp_path / "r.html").read_text()


def test_show_into_a_closed_pipe_is_quiet(tmp_path):
    run_dir = tmp_path / "r"
    _metric_rows(run_dir, steps=3000)  # far more than a pipe buffer
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    p = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m forge_obs.cli show {run_dir} --mode all | head -1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and json.loads(p.stdout)["step"] == 0


def test_show_rejects_an_unknown_mode_naming_the_valid_ones(tmp_path):
    _metric_rows(tmp_path / "r")
    p = _cli("show", str(tmp_path / "r"), "--mode", "bogus")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0  # one line
    for mode in ("global_reduce", "per_rank_reduce", "per_rank_no_reduce", "all"):
        assert mode in p.stderr
    p = _cli("show", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "run directory" in p.stderr


def test_read_metrics_of_one_mode(tmp_path):
    _metric_rows(tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path, "per_rank_reduce")] == [0, 1, 2]
