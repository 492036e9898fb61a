"""What the secrets rule costs where a SAMPLE row is recorded: ``record_metric(key, row,
Reduce.SAMPLE)`` applies :func:`forge_obs.core.plain.plain`, which redacts the row on the
caller's thread (so no backend, file or server ever holds a credential).

    python bench/bench_sample_rows.py

Baseline, same run: the same call with the rule switched off (plain's tree walk only, as before
the rule applied to rows). Rows: a GSM8K-style rollout (a 150-character prompt, a 1.7 KB
completion) with no credential in it, the same with an ``api_key`` field and a key in its text,
and a short row. Also the full pattern scan of the completion (what text with a credential marker
costs, and what every text cost before the substring pre-checks).
Target (2-core VM): text with no credential marker is redacted in <= 0.25x the full scan (the
substring pre-checks skip the patterns); the extra cost per row is reported beside its baseline.
Writes bench/results/sample_rows.json.
"""

from __future__ import annotations

import json
import os
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/ helpers

from bench._timing import per_call_us  # noqa: E402

COMPLETION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
              "altogether in April and May.\n#### 72\n") * 14
PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
          "many clips did Natalia sell altogether in April and May?")
ROWS = {
    "rollout, no credential": {"prompt": PROMPT, "completion": COMPLETION, "reward": 1.0, "advantage": 0.25},
    "rollout with api_key and a key in text": {"prompt": PROMPT, "completion": COMPLETION + " sk-proj-" + "a" * 24,
                                               "reward": 1.0, "api_key": "abc"},
    "short row": {"prompt": "1+1", "reward": 1.0},
}
#: a word of each pattern's pre-check, none of them a credential: the full scan runs, masks nothing
MARKERS = " (key, bearer, authorization, ://, sk-, PRIVATE KEY-----)"
TARGET_SCAN_RATIO = 0.25


def _rule_off() -> dict:
    """Switch the rule off in plain (the baseline); returns what to put back."""
    import forge_obs.core.plain as plain_mod

    saved = {n: getattr(plain_mod, n) for n in ("redact_string", "redact_key", "is_secret_field")}
    plain_mod.redact_string = lambda s: s
    plain_mod.redact_key = lambda k, taken=(): k
    plain_mod.is_secret_field = lambda name, value: False
    return saved


def _restore(saved: dict) -> None:
    import forge_obs.core.plain as plain_mod

    for n, v in saved.items():
        setattr(plain_mod, n, v)


def main() -> None:
    from forge_obs import Reduce, record_metric
    from forge_obs.core import redact as red
    from forge_obs.recording.collector import MetricCollector

    collector = MetricCollector()
    out: dict = {"rows": {}}
    print("| row | record_metric(SAMPLE) with the rule | without (baseline) | extra |")
    print("|---|---|---|---|")
    for name, row in ROWS.items():
        with_rule = per_call_us(lambda: record_metric("bench/rows", row, Reduce.SAMPLE), collector.reset, 2000, 7)
        saved = _rule_off()
        try:
            without = per_call_us(lambda: record_metric("bench/rows", row, Reduce.SAMPLE), collector.reset, 2000, 7)
        finally:
            _restore(saved)
        extra = with_rule - without
        out["rows"][name] = {"with_rule_us": with_rule, "baseline_us": without, "extra_us": extra}
        print(f"| {name} | {with_rule:.1f} us | {without:.1f} us | {extra:+.1f} us |")

    # the same text with a marker of every pattern appended: every pattern scans it (what text with
    # a credential marker costs, and what every text cost before the substring pre-checks)
    marked = COMPLETION + MARKERS
    scan = min(timeit.repeat(lambda: red.redact_text(marked), number=500, repeat=7)) / 500 * 1e6
    text = min(timeit.repeat(lambda: red.redact_text(COMPLETION), number=500, repeat=7)) / 500 * 1e6
    out.update(full_scan_us=scan, redact_text_us=text, ratio=text / scan)
    print(f"\n| {len(COMPLETION)}-character completion | redact_text | full pattern scan (baseline) | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| no credential marker | {text:.1f} us | {scan:.1f} us | {text / scan:.2f}x | <= {TARGET_SCAN_RATIO}x |")
    path = ROOT / "bench" / "results"
    path.mkdir(parents=True, exist_ok=True)
    (path / "sample_rows.json").write_text(json.dumps(out, indent=2))
    print(f"\nJSON: {path / 'sample_rows.json'}  (load: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
