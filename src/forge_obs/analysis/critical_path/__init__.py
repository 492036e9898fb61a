"""Why was step N slow: the per-step critical path across actors, from a run directory.

    >>> import tempfile, time
    >>> from forge_obs import timeline
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(0)
    >>> with timeline.record_span("controller_step"):
    ...     with timeline.record_span("update"):
    ...         time.sleep(0.001)  # spans are written in µs: one shorter than 1 µs may not be a stage
    >>> timeline.close()
    >>> r = critical_path(run_dir, 0)
    >>> sorted(s["name"] for s in r["stages"]), r["cause"]["name"]
    (['controller_step', 'update'], 'update')

- :func:`critical_path` (one step) and :func:`why` (several: ``steps``, ``slowest``) return
  plain JSON-serialisable dicts (``forge-obs why --json`` prints :func:`why`'s);
- :mod:`.graph` builds the span graph (links), :mod:`.walk` walks it back from a step's end,
  :mod:`.summary` turns a path into stages, slack, the one-line answer and the comparison.

The model (what a link is, what is inferred, what the walk cannot see) is in docs/timeline.md,
"Critical path".
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

from forge_obs.analysis.critical_path.graph import Graph, load
from forge_obs.analysis.critical_path.summary import (Busy, answer, compare, fast_half, median_duration, medians,
                                                      slowest_in, step_result)
from forge_obs.analysis.critical_path.walk import PathConfig, Walker

__all__ = ["PathConfig", "critical_path", "why", "analyse", "explain", "format_text"]


def _config(settings: dict) -> PathConfig:
    valid = [f.name for f in fields(PathConfig)]
    bad = [k for k in settings if k not in valid]
    if bad:
        raise ValueError(f"unknown critical path setting {bad[0]!r}; valid: {', '.join(valid)}")
    return PathConfig(**settings)


def _indexed(settings: dict, index: bool) -> bool:
    """Whether the stored per-step results answer: the index is asked for, and the settings are
    the defaults the results were computed with (other settings walk the run again)."""
    from forge_obs.analysis.index import available

    return index and _config(settings) == PathConfig() and available()


def analyse(run: "str | Path | Graph", *, index: bool = True, first: "int | None" = None,
            last: "int | None" = None, update: bool = True, **settings: Any) -> list:
    """Every controller step's result (path, stages, slack, cause, one-line answer), by step
    (``first`` / ``last``: only the steps in that range). From a run directory with the default
    settings, read from the run's index (:mod:`forge_obs.analysis.index`; ``update=False``: as it
    is, not brought up to date first); from a :class:`Graph` (or with ``index=False``), computed."""
    if not isinstance(run, Graph) and _indexed(settings, index):
        from forge_obs.analysis.index import open_index
        from forge_obs.analysis.index.answers import all_results

        return all_results(open_index(run, update=update, warn=update), first, last)
    g = run if isinstance(run, Graph) else load(run)
    walker = Walker(g, _config(settings))
    busy = Busy(g, walker)
    results = [step_result(g, walker, busy, w) for w in g.windows]
    fast = fast_half(results)
    med, fast_med = medians(fast), median_duration(fast)
    for r in results:
        answer(r, med, fast_med)
    if first is not None or last is not None:
        lo, hi = first if first is not None else -(1 << 62), last if last is not None else 1 << 62
        results = [r for r in results if lo <= r["step"] <= hi]
    return results


def why(run_dir: "str | Path", steps: "Iterable[int] | None" = None, slowest: int | None = None, *,
        index: bool = True, update: bool = True, **settings: Any) -> dict:
    """The critical path of the chosen steps: ``steps`` (ids), or the ``slowest`` K (unfinished
    steps first), or (neither) the slowest one. Each step's result also has ``compare``: what grew on its path against the
    fast half of the run's steps. ``settings``: fields of :class:`PathConfig`. With the default
    settings the answers are lookups in the run's index (``index=False``: the run is walked;
    ``update=False``: the index as it is, not brought up to date first)."""
    if _indexed(settings, index):
        from forge_obs.analysis.index import open_index
        from forge_obs.analysis.index.answers import why as indexed_why

        idx = open_index(run_dir, update=update, warn=update)
        return indexed_why(idx, None if steps is None else list(steps), slowest)
    results = analyse(run_dir, index=False, **settings)
    by_step = {r["step"]: r for r in results}
    if steps is not None:
        want = list(steps)
        missing = [s for s in want if s not in by_step]
        if missing:
            have = f"{results[0]['step']}..{results[-1]['step']}" if results else "none"
            raise ValueError(f"step {missing[0]} has no controller step in {run_dir} (steps: {have})")
        chosen = [by_step[s] for s in want]
    else:
        chosen = sorted(results, key=lambda r: (not r["unfinished"], -r["duration_s"]))[:max(int(slowest or 1), 1)]
    fast = fast_half(results)
    for r in chosen:
        r["compare"] = compare(r, fast)
    durs = sorted(r["duration_s"] for r in results)
    return {"run_dir": str(run_dir), "steps_total": len(results),
            "median_step_s": durs[(len(durs) - 1) // 2] if durs else None, "steps": chosen}


def critical_path(run_dir: "str | Path", step: int, *, index: bool = True, **settings: Any) -> dict:
    """The critical path of controller step ``step`` (a dict; see :func:`why`)."""
    return why(run_dir, steps=[step], index=index, **settings)["steps"][0]


def explain(run_dir: "str | Path", first_step: int, last_step: int, history: int = 32, **settings: Any) -> dict | None:
    """The slowest finished controller step in ``[first_step, last_step]`` with its answer, judged
    against the fast half of the (up to) ``history`` steps before it: what a live alert cites.
    None when none of those steps is on disk yet."""
    g = load(run_dir)
    walker = Walker(g, _config(settings))
    busy = Busy(g, walker)
    wins = [w for w in g.windows if first_step - history <= w.step <= last_step and not w.unfinished]
    return slowest_in([step_result(g, walker, busy, w) for w in wins], first_step, last_step)


def format_text(result: dict, path_rows: int = 12) -> str:
    """``forge-obs why``'s text: per step the answer, the stages on the path, the slack, the change."""
    lines = [f"why: {result['steps_total']} step(s), median {result['median_step_s'] or 0:.3f} s"]
    for r in result["steps"]:
        lines.append(r["answer"])
        lines.append("  on the path:")
        for a in r["stages"][:path_rows]:
            flag = " (wait)" if a["wait"] else ""
            lines.append(f"    {a['path_s']:8.3f} s {100 * a['share']:5.1f} %  {a['mesh']}/r{a['rank']} {a['name']}{flag}")
        if r["slack"]:
            lines.append("  busy / idle while the step ran:")
            for s in r["slack"]:
                lines.append(f"    {s['mesh']}/r{s['rank']}: busy {s['busy_s']:.3f} s, waiting {s['waiting_s']:.3f} s, "
                             f"idle {s['idle_s']:.3f} s, on the path {s['on_path_s']:.3f} s")
        c = r.get("compare")
        if c and c["grew"]:
            lines.append(f"  against the {c['fast_steps']} fast step(s) (median {c['fast_median_s']:.3f} s):")
            for x in c["grew"]:
                lines.append(f"    +{x['delta_s']:.3f} s  {x['mesh']}/r{x['rank']} {x['name']} "
                             f"({x['fast_s']:.3f} -> {x['step_s']:.3f} s)")
    return "\n".join(lines)
