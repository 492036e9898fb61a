"""What a user's script hands to forge_obs travels and reads as it does from a module: wrappers
pickle by value, environment flags read one way, torchforge-style accumulators merge, replica
names are recognised. (The same paths with real meshes: tests/project/test_user_scripts.py.)"""

from __future__ import annotations

import subprocess
import sys

import cloudpickle
import pytest

from forge_obs import MetricAccumulator, Reduce, Tracer, record_span, trace
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.core.identity import unique_mesh_name


@pytest.mark.parametrize("kw", [{}, {"timer": "gpu"}, {"track_memory": True}, {"timer": "gpu", "track_memory": True}])
def test_trace_wrappers_pickle_by_value(kw):
    """A wrapper is a nested function: cloudpickle sends it by value with the globals it names."""
    def f(x):
        return x + 1

    async def g(x):
        return x + 1

    for fn in (trace("t/sync", **kw)(f), trace("t/async", **kw)(g), record_span("s")(f), record_span("s")(g)):
        back = cloudpickle.loads(cloudpickle.dumps(fn))
        assert back.__name__ == fn.__name__
    assert cloudpickle.loads(cloudpickle.dumps(trace("t/sync", **kw)(f)))(1) == 2
    for obj in (Tracer("t/obj", **kw), trace("t/ctx", **kw)):
        assert cloudpickle.loads(cloudpickle.dumps(obj)).prefix == obj.prefix


@pytest.mark.parametrize("raw, want", [("on", True), ("ON", True), (" 1 ", True), ("yes", True), ("true", True),
                                       ("True", True), ("off", False), ("0", False), ("false", False), ("no", False),
                                       ("junk", False), ("", False)])
def test_one_parser_for_every_flag(raw, want):
    """FORGE_DISABLE_METRICS as recording reads it, as forge_obs.env reads it, in a fresh process."""
    code = ("import forge_obs.core.env as e, forge_obs.env as v, forge_obs.recording.tracer as t; "
            "print(e.METRICS_DISABLED, v.FORGE_DISABLE_METRICS.get_value(), v.METRIC_TIMER_USES_GPU.get_value(), "
            "e.timer_uses_gpu(), t.perf_metrics_disabled())")
    env = {"FORGE_DISABLE_METRICS": raw, "METRIC_TIMER_USES_GPU": raw, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(want)] * 5


class DocMean(MetricAccumulator):
    """torchforge's document's MeanAccumulator: get_value and get_reduced_value_from_states."""

    def __init__(self, reduction):
        super().__init__(reduction)
        self.sum, self.count = 0.0, 0

    def append(self, value):
        self.sum += float(value)
        self.count += 1

    def get_value(self):
        return self.sum / self.count if self.count else 0.0

    def get_state(self):
        return {"reduction_type": self.reduction_type.value, "sum": self.sum, "count": self.count}

    @classmethod
    def get_reduced_value_from_states(cls, states):
        n = sum(s["count"] for s in states)
        return sum(s["sum"] for s in states) / n if n else 0.0

    def reset(self):
        self.sum, self.count = 0.0, 0


def test_a_torchforge_accumulator_merges_in_any_grouping():
    accs = []
    for values in ([1.0, 2.0], [3.0], [10.0, 20.0, 30.0]):
        a = DocMean("doc_mean")
        for v in values:
            a.append(v)
        accs.append(a.get_state())
    assert accs[0]["reduction_type"] == "doc_mean"
    want = 66.0 / 6
    assert DocMean.value_from_state(DocMean.merge_states(accs)) == want
    # merged in two levels (a host's group first, as aggregation does), the same value
    assert DocMean.value_from_state(DocMean.merge_states([DocMean.merge_states(accs[:2]), accs[2]])) == want


def test_a_class_with_neither_merge_says_so():
    class Neither(MetricAccumulator):
        pass

    with pytest.raises(NotImplementedError, match="Neither defines neither merge_states"):
        Neither.merge_states([{"reduction_type": "x"}])
    assert Reduce.MEAN.value == "mean"


def test_mesh_names_are_unique_and_readable():
    names = [unique_mesh_name(n) for n in ("uniq_gen", "uniq_gen", "uniq_gen_1", "uniq_gen", "a/b")]
    assert names == ["uniq_gen", "uniq_gen_1", "uniq_gen_1_1", "uniq_gen_2", "a_b"]
    assert len({unique_mesh_name(None) for _ in range(3)}) == 3


def test_replicas_are_meshes_of_one_base_running_one_actor():
    ids = Identities()
    for mesh, actor in (("generator", "Gen"), ("generator_1", "Gen"), ("mesh", "Trainer"), ("mesh_1", "Buffer")):
        ids.learn({"mesh": mesh, "actor": actor, "rank": 0})
    assert [ids.replica(m) for m in ("generator", "generator_1", "mesh", "mesh_1")] == [0, 1, None, None]
