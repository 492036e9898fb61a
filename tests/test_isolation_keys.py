"""Keys and strings: every kind of string is treated the same way, and the names forge_obs
writes itself (``obs/…``, the names a dict-valued key such as a distribution is flattened to)
are reserved: a user value under one is dropped, counted by reason, never overwritten or
written twice in a step."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from forge_obs import Reduce, record_metric
from tests.helpers import global_rows, start_logger


def _drops(snap):
    return dict(snap["counters"]["dropped_by_reason"])


@pytest.mark.parametrize("value", ["1.5", np.str_("1.5"), b"1.5", np.bytes_(b"1.5")],
                         ids=["str", "np.str_", "bytes", "np.bytes_"])
def test_every_kind_of_string_is_dropped_for_a_numeric_reduction(fresh_collector, value):
    for red in (Reduce.MEAN, Reduce.SUM, "distribution"):
        record_metric("v", value, red)
    snap = fresh_collector.snapshot()
    assert snap["states"] == {} and _drops(snap) == {"bad_value": 3}


def test_every_kind_of_string_is_kept_as_a_sample_row(fresh_collector):
    record_metric("rows", "1.5", Reduce.SAMPLE)
    record_metric("rows", np.str_("2.5"), Reduce.SAMPLE)
    rows = fresh_collector.snapshot()["states"]["rows"]["rows"]
    assert rows == ["1.5", "2.5"] and all(isinstance(r, str) for r in rows)
