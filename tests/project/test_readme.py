"""Every code block of README.md runs here, as a reader would run it.

- ``python`` blocks run as scripts in a fresh process (real Monarch meshes for the example).
- ``bash`` blocks run in bash from the repository's root, one shell for the block, line by line as
  written; ``<!-- readme-test: run with "ARGS" added to SCRIPT -->`` before a block adds ARGS to
  that script's line so the test stays short (fewer steps of the same job, one test file). They
  install into the checkout's ``.venv``, so they run only from it (``scripts/test.sh``), and skip
  elsewhere.
- ``text`` blocks are either sample output — ``<!-- readme-output: COMMAND -->``: COMMAND runs and
  every line of the sample must appear in its output, in order, character for character but for
  dates and clock times (a value the program computes is shown as it prints it) — or the layout
  (``<!-- readme-test: every path exists -->``).

A block without one of these is a failure: a new block must say how it is checked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.helpers import CHILD_PATH

ROOT = Path(__file__).resolve().parents[2]
#: this checkout\'s forge_obs (src/) and its tests/apps helpers (the root), as a child process sees them
README = ROOT / "README.md"
FENCE = re.compile(r"(?:<!-- (readme-[a-z]+): ?(.*?) -->\n)?```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path = README) -> list[dict]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        out.append({"line": text[: m.start(3)].count("\n") + 1, "note": m.group(1), "arg": m.group(2),
                    "lang": m.group(3), "body": m.group(4)})
    return out


def _by(lang: str) -> list:
    return [pytest.param(b, id=f"line{b['line']}") for b in blocks() if b["lang"] == lang]


#: what may differ between a sample line and the program's output when numbers are exact
_CLOCK = r"(\d{4}-\d{2}-\d{2}|\d{2}:\d{2}:\d{2}(?:[.,]\d+)?)"


def masked(line: str, exact_numbers: bool = False) -> re.Pattern:
    """A sample line as a pattern: dates and clock times may differ, and every other number too
    unless ``exact_numbers``; everything else may not."""
    parts = re.split(_CLOCK if exact_numbers else r"(\d[\d.:e+-]*)", line.rstrip())
    return re.compile("".join(r"[-+\d.:e,]+" if i % 2 else re.escape(p) for i, p in enumerate(parts)) + "$")


def in_order(sample: list[str], output: list[str], exact_numbers: bool = False) -> list[str]:
    """The sample lines not found in ``output`` (each after the previous one's match)."""
    missing, pos = [], 0
    for line in sample:
        pat = masked(line, exact_numbers)
        for i in range(pos, len(output)):
            if pat.match(output[i].rstrip()):
                pos = i + 1
                break
        else:
            missing.append(line)
    return missing


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=CHILD_PATH, MONARCH_FILE_LOG="error")


def test_every_block_says_how_it_is_checked():
    for b in blocks():
        assert b["lang"] in ("python", "bash", "text"), f"README.md:{b['line']}: a block needs a language"
        if b["lang"] == "text":
            assert b["note"] in ("readme-output", "readme-test"), f"README.md:{b['line']}: sample of what?"


@pytest.mark.parametrize("block", _by("python"))
def test_python_block(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block["body"])
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if "get_or_create_metric_logger" in block["body"]:  # the Use example: its steps reached the store
        from forge_obs.analysis.store import read_metrics

        (run_dir,) = list((tmp_path / "runs").iterdir())
        rows = read_metrics(run_dir)
        # the exact cut: each step has exactly its own loss, in the store and on the console
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert [r["metrics"]["trainer/loss"] for r in rows] == [1.0, 0.5, pytest.approx(1 / 3)]
        printed = re.findall(r"METRICS STEP (\d+) ===\n((?:[^=\n].*\n)*)", res.stdout)
        loss = {int(step): float(re.search(r"trainer/loss:\s*(\S+)", body).group(1)) for step, body in printed}
        assert loss == {0: 1.0, 1: 0.5, 2: pytest.approx(1 / 3, rel=1e-3)}, res.stdout  # 4 digits printed


@pytest.mark.parametrize("block", [b for b in _by("text")])
def test_text_block(block, tmp_path):
    if block["note"] == "readme-test":
        assert block["arg"] == "every path exists"
        for line in block["body"].splitlines():
            path = line.split()[0] if line.strip() else ""
            if path:
                assert (ROOT / path).exists(), f"README layout names {path}, which does not exist"
        return
    cmd = shlex.split(block["arg"])
    if cmd[0] == "python":
        cmd[0] = sys.executable
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    missing = in_order(block["body"].splitlines(), res.stdout.splitlines(), exact_numbers=True)
    assert not missing, f"README.md:{block['line']}: not in the output of {block['arg']}: {missing}\n{res.stdout[:4000]}"


def _own_venv() -> bool:
    return (ROOT / ".venv").is_dir() and Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("block", _by("bash"))
def test_bash_block(block):
    if not _own_venv():
        pytest.skip("installs into the checkout's .venv: runs from it (scripts/test.sh)")
    lines = block["body"].splitlines()
    if block["note"] == "readme-test":
        m = re.fullmatch(r'run with "(.*)" added to (\S+)', block["arg"])
        assert m, block["arg"]
        lines = [ln + " " + m.group(1) if m.group(2) in ln else ln for ln in lines]
    runs_before = set((ROOT / "runs").glob("*")) if (ROOT / "runs").is_dir() else set()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p).resolve() != (ROOT / ".venv" / "bin").resolve())
    try:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1100)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        if "scripts/demo.sh" in block["body"]:
            assert "[grpo] run directory: runs/" in res.stdout
            assert "name" in res.stdout and "train_step" in res.stdout  # the sql line, after activation
    finally:
        for p in set((ROOT / "runs").glob("*")) - runs_before if (ROOT / "runs").is_dir() else ():
            import shutil

            shutil.rmtree(p, ignore_errors=True)


def test_a_sample_output_shows_every_number_as_printed_and_only_the_clock_may_differ():
    """The README's sample once said ``trainer/batch_size: 32`` where the demo printed 16 and
    passed: numbers were masked. Now only dates and clock times are."""
    printed = ["trainer/batch_size:       16", "[g/G/r0] 2026-11-27 22:09:20 INFO generator/requests: 4"]
    assert in_order(["trainer/batch_size:       32"], printed, exact_numbers=True) == ["trainer/batch_size:       32"]
    assert in_order(["trainer/batch_size:       16", "[g/G/r0] 2026-11-23 18:42:03 INFO generator/requests: 4"],
                    printed, exact_numbers=True) == []
    assert in_order(["[g/G/r0] 2026-11-23 18:42:03 INFO generator/requests: 5"], printed, exact_numbers=True) != []


def _extras() -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_the_readme_gives_the_install_command_of_every_extra():
    """Each extra of pyproject.toml has its install command in the Set-up section, in the order
    scripts/setup.sh runs it: the environment, the CPU build of torch at setup.sh's pin, then the
    extra (a new extra without a command fails here)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (pin,) = set(re.findall(r'"(torch==[\d.]+)"', setup))
    text = README.read_text()
    section = text[text.index("## Set-up"):text.index("\n## ", text.index("## Set-up") + 1)]
    assert "python3 -m venv .venv" in section
    for extra in _extras():
        rows = [ln for ln in section.splitlines() if ln.startswith(f"| `{extra}` |")]
        assert len(rows) == 1, f"README's Set-up has no row for the extra {extra!r}"
        want = f'`.venv/bin/python -m pip install "{pin}" && .venv/bin/python -m pip install -e ".[{extra}]"'
        assert want in rows[0], rows[0]
