"""SAMPLE rows as every backend can write them (:func:`forge_obs.core.plain.plain`): an int too
long for JSON readers keeps its row."""

from __future__ import annotations

import json
import logging

import pytest

from forge_obs.core.plain import JSON_INT_DIGITS, plain
from forge_obs.core.warn import RateLimitedWarner


@pytest.fixture(autouse=True)
def _fresh_warner(monkeypatch):
    """Warnings not rate-limited by earlier tests."""
    import forge_obs.core.plain

    monkeypatch.setattr(forge_obs.core.plain, "WARNER", RateLimitedWarner())


def test_an_int_too_long_for_json_becomes_its_exact_digits_and_the_row_keeps_its_other_fields(caplog):
    caplog.set_level(logging.WARNING, logger="forge_obs")
    row = {"prompt": "p", "n": 10**5000, "m": -(10**5000) - 7, "small": 10**20, "reward": 0.5}
    out = plain(row, "rows/huge")
    assert out["n"] == "1" + "0" * 5000 and out["m"] == "-1" + "0" * 4999 + "7"
    assert {k: out[k] for k in ("prompt", "small", "reward")} == {"prompt": "p", "small": 10**20, "reward": 0.5}
    assert json.loads(json.dumps(out)) == out  # every JSON reader takes the row
    assert "rows/huge" in caplog.text and "5001 digits" in caplog.text and "exact decimal digits" in caplog.text
    assert "contains itself" not in caplog.text


def test_the_longest_int_json_reads_is_kept_as_a_number():
    assert JSON_INT_DIGITS == 4300
    n = 10 ** (JSON_INT_DIGITS - 1)  # 4300 digits
    assert plain({"n": n})["n"] == n
    assert plain({"n": 10 * n})["n"] == "1" + "0" * JSON_INT_DIGITS


def test_an_int_beyond_the_exact_bound_is_written_as_its_exact_hex_digits(caplog):
    """Decimal digits cost time quadratic in their number: beyond 20,000 digits the exact
    hexadecimal form (``int(s, 0)`` reads it back)."""
    caplog.set_level(logging.WARNING, logger="forge_obs")
    n = 3 ** 100_000  # 47,713 digits
    out = plain([n, "x"], "rows/hex")
    assert out[0] == hex(n) and int(out[0], 0) == n and out[1] == "x"
    assert "hexadecimal" in caplog.text


@pytest.mark.parametrize("value", [{"a": 1}, [1, "x"], "text", 5, None])
def test_plain_values_are_returned_as_they_are(value):
    assert plain(value) is value
