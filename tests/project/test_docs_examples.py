"""The docs' Python examples that are whole programs run as scripts, as a reader would run one
copied into a file: a fresh process whose working directory is not the repository, so actors
defined in the example travel by value. A block that defines an actor must be a whole program.
The other blocks are fragments of a program (a config, a class to plug in)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.helpers import run_as_user

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list:
    out = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        text = md.read_text()
        for m in FENCE.finditer(text):
            out.append(pytest.param(md.name, m.group(1), id=f"{md.name}:{text[: m.start()].count(chr(10)) + 1}"))
    return out


def _values(out: str, key: str) -> list[str]:
    return re.findall(rf"^{re.escape(key)}:\s*(.+)$", out, re.M)


#: what each whole program must print: file -> check(stdout)
CHECKS = {
    "tracer.md": lambda out: (_values(out, "loss") and len(_values(out, "loss")) == 2
                              and [v.endswith("n=2") for v in _values(out, "generator/generate/total_duration_dist_s")] == [True, True]
                              and [v.endswith("n=1") for v in _values(out, "trainer/step/total_duration_dist_s")] == [True, True]
                              and len(_values(out, "generator/score/parse/duration_avg_s")) == 2),
    "alerts.md": lambda out: "ALERT firing threshold trainer/loss > 10" in out and "ALERT resolved" in out,
    "migrating-from-torchforge.md": lambda out: _values(out, "my_sum_metric") == ["6"] and _values(out, "my_mean_metric") == ["2"],
}


@pytest.mark.parametrize("name, body", _blocks())
def test_docs_python_block(name, body, tmp_path):
    if "asyncio.run(" not in body:
        assert not re.search(r"^class \w+\(Actor\)", body, re.M), f"{name}: an example defining an actor must be a whole program"
        return
    script = tmp_path / "example.py"
    script.write_text(body)
    out = run_as_user(script, tmp_path).stdout
    assert CHECKS[name](out), out[-4000:]
