"""provisioner_hooks: the private spawn callback, its fallback, manual attachment, and that a
failure to attach never reaches the user's spawn_procs."""

import logging

import pytest
from monarch.actor import Actor, endpoint, this_host

import provisioner_hooks
from forge_obs import Reduce, get_or_create_metric_logger, record_metric
from forge_obs.backends.base import get_logger_backend_class
from forge_obs.controller import monarch_internals as _monarch_spawn
from tests.support.helpers import global_rows, start_logger


class Rec(Actor):
    @endpoint
    async def rec(self, v: float) -> None:
        record_metric("hooks/v", v, Reduce.SUM)


async def _run_one_mesh(mlogger, name):
    n0 = await mlogger.get_fetcher_count.call_one()
    pm = this_host().spawn_procs(per_host={"procs": 1}, name=name)
    await pm.spawn("Rec", Rec).rec.call(2.0)
    return pm, await mlogger.get_fetcher_count.call_one() - n0


async def test_fallback_wrapper_attaches_when_the_private_callback_is_unavailable(tmp_path, monkeypatch):
    import monarch._src.actor.proc_mesh as pmod

    def gone(cb):
        raise AttributeError("moved in a newer Monarch")

    provisioner_hooks.uninstall()
    monkeypatch.setattr(pmod, "register_proc_mesh_spawn_callback", gone)
    try:
        assert provisioner_hooks.install() == "spawn_procs_wrapper"
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "t"}})
        pm, added = await _run_one_mesh(mlogger, "fallback")
        assert added == 1
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
        await pm.stop()
        assert global_rows(tmp_path)[0]["metrics"]["hooks/v"] == 2.0
    finally:
        provisioner_hooks.uninstall()
        monkeypatch.undo()
        assert provisioner_hooks.install() == "spawn_callback"


async def test_attach_failure_never_reaches_spawn_procs(tmp_path, monkeypatch, caplog):
    import forge_obs.controller.client as la

    mlogger = await start_logger(tmp_path, {})

    def broken(*a, **k):
        raise RuntimeError("attach exploded")

    monkeypatch.setattr(la, "attach_fetcher", broken)
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        pm, added = await _run_one_mesh(mlogger, "unattached")  # spawn_procs still works
    assert added == 0
    assert any("attach exploded" in r.getMessage() for r in caplog.records)
    await mlogger.shutdown.call_one()
    await pm.stop()


async def test_manual_attachment_without_hooks(tmp_path):
    provisioner_hooks.uninstall()
    try:
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "t"}})
        pm = this_host().spawn_procs(per_host={"procs": 1}, name="manual")
        n0 = await mlogger.get_fetcher_count.call_one()
        await get_or_create_metric_logger(proc_mesh=pm)
        await get_or_create_metric_logger(proc_mesh=pm)  # idempotent per mesh
        assert await mlogger.get_fetcher_count.call_one() == n0 + 1
        await pm.spawn("Rec", Rec).rec.call(3.0)
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
        await pm.stop()
        assert global_rows(tmp_path)[0]["metrics"]["hooks/v"] == 3.0
    finally:
        provisioner_hooks.install()


def test_backend_by_import_path_and_bad_paths():
    assert get_logger_backend_class("forge_obs.backends.console:ConsoleBackend").__name__ == "ConsoleBackend"
    with pytest.raises(ValueError, match="cannot import"):
        get_logger_backend_class("nope.module:Thing")
    with pytest.raises(ValueError, match="not a forge_obs.LoggerBackend"):
        get_logger_backend_class("forge_obs.core.types:Metric")
