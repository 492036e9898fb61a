"""Prototype: the cut's acks and states reduced in Monarch's comm tree (an accumulating port).

    from bench.scale_proto import accum
    accum.enable()              # before get_or_create_metric_logger / spawning meshes

Each flush opens an accumulating port (``Mailbox.open_accum_port``, private in torchmonarch
0.7.0) whose reducer merges *packets* (acks + a bundle of merged states,
:mod:`bench.scale_proto.bundle`) and casts ``cut_accum`` with that port as the response port.
Monarch splits the port at every comm actor the cast goes through, so replies are reduced on the
way up, in the processes of the cast tree, by the reducer (Python, under that process's GIL).
The controller's accumulator hands each arriving packet to the pipeline of
:mod:`bench.scale_proto.hostagg` (ack batches and bundles).

What 0.7.0 does with it (measured with bench/bench_scale.py): the root of the tree is the
controller's own comm actor, which casts to every proc of the first host and to the first proc of
each other host; so the controller process runs the reducer for the first host's ranks itself, and
the split ports are *streaming* reducers (they forward what they have 1 ms after the first reply,
then back off up to ``split_max_buffer_age`` = 50 ms), which adds 10-50 ms to every ack.
"""

from __future__ import annotations

import collections
import logging
import pickle
import time
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.actor import PythonMessage, PythonMessageKind
from monarch._rust_bindings.monarch_hyperactor.buffers import Buffer
from monarch.actor import context, endpoint

import forge_obs.client as _client
import forge_obs.controller as _controller
from forge_obs.fetcher import LocalFetcherActor, _clock_sample, _COLLECTOR, _cut_children
from forge_obs.registry import LOCAL_MESHES

from bench.scale_proto import hostagg
from bench.scale_proto.bundle import make_bundle, merge_bundles

logger = logging.getLogger("forge_obs")



def _frozen(obj: Any) -> Any:
    buf = Buffer()
    buf.write(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return buf.freeze()


def merge_packets(a: dict, b: dict) -> dict:
    bundles = [x for x in (a.get("bundle"), b.get("bundle")) if x is not None]
    return {"seq": a["seq"], "acks": a["acks"] + b["acks"],
            "bundle": bundles[0] if len(bundles) == 1 else (merge_bundles(bundles) if bundles else None)}


class PacketReducer:
    """Runs in the comm actors of the cast tree (Monarch's ``CommReducer``)."""

    def __call__(self, left: Any, right: Any) -> Any:
        return PythonMessage(left.kind, _frozen(merge_packets(left.decode(), right.decode())), [])


class PacketAccumulator:
    """The controller's end of one cut's port: every packet goes to the pipeline at once."""

    reducer = PacketReducer()

    def __call__(self, state: Any, update: Any) -> Any:
        try:
            hostagg.INBOX_COUNT[0] += 1
            packet = update.decode()
            pipeline = _controller._STATE.pipeline
            if pipeline is not None:
                if packet["acks"]:
                    pipeline.ack_batch(packet["seq"], packet["acks"])
                if packet["bundle"] is not None:
                    pipeline.bundle(packet["seq"], packet["bundle"])
        except Exception:  # noqa: BLE001
            logger.exception("forge_obs: could not take a packet")
        return state

    @property
    def initial_state(self) -> Any:
        return PythonMessage(PythonMessageKind.Result(None), _frozen(0), [])


class AccumFetcher(LocalFetcherActor):
    @endpoint(explicit_response_port=True)
    async def cut_accum(self, port: Any, seq: int, step: int, actor: str, ctl_us: int | None, per_rank: bool) -> None:
        taken = _COLLECTOR.swap()
        self.last_seq = seq
        if actor and self.identity.actor != actor:
            self.identity.actor = actor
        children = _cut_children(seq, step)
        port.send({"seq": seq, "acks": [(self.key, children)], "bundle": None})
        snap = _COLLECTOR.export(taken, packed=True)
        port.send({"seq": seq, "acks": [], "bundle": make_bundle({self.key: snap}, {self.key: self.identity.to_dict()}, per_rank)})
        if ctl_us is not None:
            _clock_sample(ctl_us)


_PORTS: collections.deque = collections.deque(maxlen=64)  # a cut's port lives for 64 more cuts


def start_flush(step: Any, final: bool = False) -> Any:
    step = _controller.check_step(step)
    st = _controller._STATE
    pipeline = st.pipeline
    if pipeline is None:
        return _controller.FlushWait(None, None)
    taken = _controller._COLLECTOR.swap()
    live, stopped = LOCAL_MESHES.take_for_cut()
    ranks = {(e.mesh_id, r): e.label(r) for e in live for r in range(e.size)}
    stopping = {(e.mesh_id, r): e.label(r) for e in stopped for r in range(e.size)}
    cut = pipeline.begin_cut(step, taken, ranks, stopping, final=final)
    st.last_step = step
    handle, receiver = context().actor_instance._mailbox.open_accum_port(PacketAccumulator())
    ref = handle.bind()
    _PORTS.append((handle, receiver))
    from forge_obs.timeline.writer import now_us

    ctl_us = now_us()
    for e in live:
        try:
            e.fetchers.cut_accum._send((cut.seq, step, e.actor_label, ctl_us, pipeline._need_per_rank), {}, ref, "all")
        except Exception as ex:  # noqa: BLE001
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)
    return _controller.FlushWait(cut, pipeline)


_enabled = [False]


def enable() -> None:
    if _enabled[0]:
        return
    _enabled[0] = True
    _client.LocalFetcherActor = AccumFetcher
    _client.start_flush = start_flush
    _controller.start_flush = start_flush
    _controller.FlushPipeline = hostagg.AggPipeline
