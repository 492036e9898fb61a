"""Telemetry (issue 39): what every process samples at its cuts (forge_obs.recording.telemetry).
Real /proc files, real threads and processes, CPU hogs started here and stopped by SIGKILL. The
GPU part runs with a stand-in NVML module: this machine has no GPU (bench/gpu_telemetry.py runs
the real thing on one)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_obs.recording.collector import MetricCollector, record_metric
from forge_obs.recording.reduce import Reduce
from forge_obs.recording.telemetry import gpu as gpu_mod
from forge_obs.recording.telemetry import options, proc, sampler
from forge_obs.recording.telemetry.host import HostLease, HostReader
from forge_obs.recording.telemetry.keys import GPU, HOST, KEYS, PROC
from forge_obs.recording.telemetry.options import TelemetryOptions
from forge_obs.recording.telemetry.sampler import Sampler
from forge_obs.wire import rank_cut
from forge_obs.wire.merge import reduce_snapshots
from forge_obs.wire.snapshot import loads

ROOT = Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="the process and host figures are read from Linux's /proc")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _burn(cpu_seconds: float) -> None:
    """Use this much CPU time (however long a busy host makes it take)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def _hog() -> None:  # a CPU hog, in a process of its own
    while True:
        pass


@pytest.fixture
def hogs():
    """CPU hogs beside this process (2 per core), stopped by SIGKILL."""
    procs = []

    def start(n: int | None = None) -> None:
        for _ in range(n or 2 * (os.cpu_count() or 1)):
            p = mp.get_context("fork").Process(target=_hog, daemon=True)
            p.start()
            procs.append(p)

    yield start
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)


# ---------------------------------------------------------------- the process


def test_the_process_figures_of_an_interval():
    """CPU time of a 0.2 s spin, memory that grew, threads that started: read again from the same
    open files (pread at offset 0 gives the figures anew)."""
    s = Sampler(TelemetryOptions(gpu=False, host=False, interval_s=0.0))
    try:
        s.sample()
        _burn(0.2)
        blob = bytearray(64 << 20)  # 64 MiB resident
        blob[::4096] = b"x" * len(blob[::4096])
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait) for _ in range(4)]
        for t in threads:
            t.start()
        s.proc.delays.refreshed = -1e18  # the thread list is read again at the next sample
        v = s.sample()
        stop.set()
        for t in threads:
            t.join()
    finally:
        s.close()
    assert 0.2 <= v[PROC + "cpu_s"] <= v[PROC + "interval_s"] + 0.05, v
    assert v[PROC + "cpu_util"] == pytest.approx(v[PROC + "cpu_s"] / v[PROC + "interval_s"])
    assert v[PROC + "rss_gb"] >= 0.064
    assert v[PROC + "threads"] >= 5
    assert v[PROC + "ctx_voluntary"] >= 0 and v[PROC + "ctx_involuntary"] >= 0
    assert set(v) <= set(KEYS) and not any(k.startswith(HOST) for k in v)


def test_a_starved_process_waits_for_a_cpu_a_sleeping_one_does_not(hogs):
    """Its run-queue wait is what tells a starved process from a sleeping one: a spin beside
    2 hogs per core waits for a CPU most of its wall time; a sleep waits for none. 60 idle threads
    beside the spinning one (a runtime's workers): the one that woke up is found at once."""
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, daemon=True) for _ in range(60)]
    for t in idle:
        t.start()
    s = Sampler(TelemetryOptions(gpu=False, host=False, interval_s=0.0))
    try:
        s.sample()
        time.sleep(0.3)
        slept = s.sample()
        hogs()
        time.sleep(0.2)
        s.sample()
        _spin(0.6)
        starved = s.sample()
    finally:
        s.close()
        stop.set()
    if not s.proc.delays.available:
        pytest.skip("this kernel has no schedstat")
    assert slept[PROC + "runq_wait_s"] < 0.05, slept
    assert starved[PROC + "runq_wait_share"] > 0.3, starved
    waited_or_ran = starved[PROC + "runq_wait_s"] + starved[PROC + "cpu_s"]
    assert waited_or_ran == pytest.approx(starved[PROC + "interval_s"], abs=0.25)


def test_many_threads_cost_a_bounded_number_of_reads(monkeypatch):
    """80 idle threads: each is read once when the thread list first has it (its starting
    point); then a sample reads at most max_reads thread files (the busy ones first, the idle
    ones in turn), and over enough samples every thread has been read again."""
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(80)]
    for t in threads:
        t.start()
    reads = []
    real = proc.read_fd
    monkeypatch.setattr(proc, "read_fd", lambda fd, size=4096: reads.append(fd) or real(fd, size))
    d = proc.ThreadDelays(os.getpid(), max_reads=12)  # (8 by default)
    try:
        assert d.read() is not None
        assert d.threads >= 81 and d.threads <= len(reads) <= d.threads + 12  # each once, then the bound
        again = {}
        for _ in range(60):
            reads.clear()
            assert d.read() is not None
            assert len(reads) <= 12
            again.update(dict.fromkeys(reads))
        assert len(again) >= d.threads  # every thread was read again by now
    finally:
        stop.set()
        d.close()


# ---------------------------------------------------------------- the host: one reader


def test_the_host_figures():
    h = HostReader()
    try:
        a = h.read()
        _spin(0.1)
        b = h.read()
    finally:
        h.close()
    assert a["cores"] == os.cpu_count() and b["runnable"] >= 1 and b["load1"] >= 0
    assert b["cpu_ticks"] > a["cpu_ticks"] and b["idle_ticks"] >= a["idle_ticks"]
    if Path("/proc/pressure/cpu").exists():
        assert b["cpu_stall_us"] >= a["cpu_stall_us"]


def _lease_child(name: str, q) -> None:
    lease = HostLease(name, retry_s=0.05)
    q.put(lease.held())
    for _ in range(200):  # until the holder is gone: it takes over
        if lease.held():
            q.put("took over")
            return
        time.sleep(0.05)
    q.put("never")


def test_one_process_per_host_reads_the_host_and_another_takes_over_when_it_ends():
    key = f"test-{os.getpid()}-{time.time()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    holder = HostLease(key)
    assert holder.held()
    child = ctx.Process(target=_lease_child, args=(key, q))
    child.start()
    try:
        assert q.get(timeout=60) is False  # the host has its reader: this process reads no host figure
        holder.release()  # as when the reader's process ends: the kernel frees the name
        assert q.get(timeout=60) == "took over"
    finally:
        child.join(30)
        holder.release()
    other_run = HostLease(key + "-other")
    assert other_run.held()  # another run on the host has a reader of its own
    other_run.release()


def test_only_the_hosts_reader_samples_the_host():
    a = Sampler(TelemetryOptions(gpu=False, interval_s=0.0), run_key=f"r-{time.time()}")
    b = Sampler(TelemetryOptions(gpu=False, interval_s=0.0), run_key=a.run_key)
    try:
        a.sample(), b.sample()
        _spin(0.05)
        va, vb = a.sample(), b.sample()
    finally:
        a.close()
        b.close()
    assert HOST + "runnable_per_core" in va and HOST + "cpu_util" in va and HOST + "steal_share" in va
    assert not any(k.startswith(HOST) for k in vb)


# ---------------------------------------------------------------- a cut's values


def test_a_cut_carries_the_sample_as_values_not_counted_as_recorded(tmp_path):
    """rank_cut.export (the Monarch fetcher's and the SPMD shipper's) adds the sample to the cut:
    obs/sys/... keys reduced by their reduction across ranks, obs/values_recorded unchanged; a
    cut between the stride's steps carries none; off (configure(False)): none."""
    rank_cut.take(0)
    sampler.configure({"gpu": False, "interval_s": 0.0}, str(tmp_path))
    try:
        rank_cut.export(rank_cut.take(1))
        record_metric("loss", 1.0, Reduce.MEAN)
        snaps = [loads(rank_cut.export(rank_cut.take(2))) for _ in range(1)]
        _spin(0.02)
        record_metric("loss", 3.0, Reduce.MEAN)
        snaps.append(loads(rank_cut.export(rank_cut.take(3))))
        assert snaps[0]["counters"]["values_recorded"] == 1
        merged = {m.key: m for m in reduce_snapshots(snaps)}
        assert merged["loss"].value == 2.0
        for key in (PROC + "cpu_s", PROC + "interval_s", PROC + "runq_wait_s"):
            assert merged[key].reduction is KEYS[key].reduction, key
        assert merged[PROC + "cpu_s"].value > 0
        sampler.configure({"gpu": False, "interval_s": 60.0}, str(tmp_path))
        rank_cut.export(rank_cut.take(4))
        keys = _keys(loads(rank_cut.export(rank_cut.take(5))))
        assert not any(k.startswith("obs/sys/") for k in keys)
        sampler.configure(False)
        assert sampler.current() is None
        assert not any(k.startswith("obs/sys/") for k in _keys(loads(rank_cut.export(rank_cut.take(6)))))
    finally:
        sampler.configure(False)


def test_the_sample_joins_the_cuts_own_groups_of_the_same_reduction(tmp_path):
    """The sample's rows go after the cut's own rows of the same reductions (SUM, MAX: the user's
    keys in columns; MEAN rows as (sum, count)), and the cut of a rank that did not sample
    reduces with it: every user value exact, each telemetry key from the rank that sampled."""
    sampler.configure({"gpu": False, "host": False, "interval_s": 0.0}, str(tmp_path))
    try:
        rank_cut.export(rank_cut.take(0))  # the baseline sample
        snaps = []
        for rank, sample in ((0, True), (1, False)):
            if not sample:
                sampler.configure(False)
            record_metric("u/sum", 2.0 + rank, Reduce.SUM)
            record_metric("u/max", 5.0 * rank, Reduce.MAX)
            record_metric("u/mean", 4.0, Reduce.MEAN)
            record_metric("u/mean", 6.0 + rank, Reduce.MEAN)
            snaps.append(loads(rank_cut.export(rank_cut.take(1))))
    finally:
        sampler.configure(False)
    assert {k for k in _keys(snaps[0]) if k.startswith("obs/sys/")} >= {PROC + "cpu_s", PROC + "threads"}
    assert not any(k.startswith("obs/sys/") for k in _keys(snaps[1]))
    for snap in snaps:
        assert snap["counters"]["values_recorded"] == 4
    merged = {m.key: m.value for m in reduce_snapshots(snaps)}
    assert (merged["u/sum"], merged["u/max"], merged["u/mean"]) == (5.0, 5.0, 5.25)
    assert merged[PROC + "threads"] == float(snaps[0]["packed"]["sum"][1][snaps[0]["packed"]["sum"][0].index(
        PROC + "threads")])
    assert merged[PROC + "cpu_s"] >= 0


def test_processes_sample_the_same_steps_at_most_4_apart():
    """Two processes of a run cut the same steps ~0.1 s apart (each with its own jitter): with
    interval_s 0.5 both sample every 4th step (the stride, a power of two, at most 4), the same
    steps; the samples' intervals add up to the time covered (nothing lost between samples). A
    slow step (longer than interval_s) is sampled at once, and from then every step is; steps of
    1 ms still have a sample every 4 steps; interval_s 0.2 at 0.1 s steps: every 2nd step."""
    opts = TelemetryOptions(gpu=False, host=False, interval_s=0.5)
    a, b = Sampler(opts), Sampler(opts)
    try:
        sampled: dict = {a: [], b: []}
        covered = {a: 0.0, b: 0.0}
        for step in range(40):
            for s, jitter in ((a, 0.003 * (step % 3)), (b, -0.002 * (step % 2))):
                v = s.sample(now=100.0 + 0.1 * step + jitter, step=step)
                if v is not None:
                    sampled[s].append(step)
                    covered[s] += v.get(PROC + "interval_s", 0.0)
        assert sampled[a] == sampled[b] == list(range(0, 40, 4)) and a.stride() == 4
        assert covered[a] == pytest.approx(0.1 * 36 + 0.003 * (36 % 3), abs=1e-9)
        assert a.sample(now=100.0 + 0.1 * 39 + 0.7, step=41) is not None  # a slow step: sampled
        assert a.stride() == 1 and a.sample(now=100.0 + 0.1 * 39 + 1.4, step=42) is not None
        fast = Sampler(opts)
        got = [st for st in range(200) if fast.sample(now=1.0 + 0.001 * st, step=st) is not None]
        assert got == list(range(0, 200, 4)) and fast.stride() == 4
        fast.close()
        every2 = Sampler(TelemetryOptions(gpu=False, host=False, interval_s=0.2))
        got = [st for st in range(20) if every2.sample(now=1.0 + 0.1 * st, step=st) is not None]
        assert got == list(range(0, 20, 2))
        every2.close()
    finally:
        a.close()
        b.close()


def _keys(snap: dict) -> set:
    keys = set(snap.get("states") or {})
    for ks, _rows in (snap.get("packed") or {}).values():
        keys.update(ks)
    return keys


def test_the_options_and_the_environment_switch(monkeypatch):
    assert options.parse(None) == TelemetryOptions()
    assert options.parse(False).enabled is False and options.parse({"host": False}).host is False
    for bad, msg in (({"intervl_s": 1}, "unknown key"), ({"interval_s": -1}, "interval_s"), ({"gpu": "no"}, "gpu must"),
                     ("on", "telemetry must be a dict")):
        with pytest.raises(ValueError, match=msg):
            options.parse(bad)
    monkeypatch.setenv("FORGE_OBS_TELEMETRY", "off")
    assert options.parse(None).enabled is False and options.parse({"gpu": False}).enabled is False
    assert options.parse({"enabled": True}).enabled is True
    from forge_obs.controller.config import LoggerConfig

    assert LoggerConfig.parse({"run": {"root": "/tmp"}}).telemetry.enabled is False
    monkeypatch.setenv("FORGE_OBS_TELEMETRY", "1")
    assert LoggerConfig.parse({"run": {"root": "/tmp"}, "telemetry": {"interval_s": 1}}).telemetry.interval_s == 1.0
    valid = r"telemetry: unknown key\(s\) \['gpus'\]; valid: enabled, host, gpu, interval_s"
    with pytest.raises(ValueError, match=valid):
        LoggerConfig.parse({"run": {"root": "/tmp"}, "telemetry": {"gpus": False}})


def test_every_key_is_documented():
    """docs/telemetry.md lists every key of keys.KEYS, and no other obs/sys/ key."""
    doc = (ROOT / "docs" / "telemetry.md").read_text()
    documented = set(re.findall(r"`(obs/sys/[a-z0-9_/]+)`", doc))
    assert documented == set(KEYS), (set(KEYS) - documented, documented - set(KEYS))


# ---------------------------------------------------------------- GPUs (stand-in NVML: no GPU here)


class FakeNvml:
    """A stand-in for nvidia-ml-py's ``pynvml`` (a mock only because this machine has no GPU):
    two devices; this process runs on device 1; device 1 has no power reading."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-uuid-{h[1]}".encode()

    def nvmlDeviceGetName(self, h):
        return "Fake H100"

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=self.pid)] if h == "h1" else [SimpleNamespace(pid=1)]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=30e9, total=80e9)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 71

    def nvmlDeviceGetPowerUsage(self, h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {1: 1410, 2: 2619}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 | 0x40  # power cap, hardware thermal slowdown


def test_a_process_reads_the_gpu_it_runs_on_by_its_uuid():
    nv = FakeNvml(os.getpid())
    found = []
    g = gpu_mod.GpuReader(nvml=nv)
    g.on_device = found.append
    v = g.read(now=0.0)
    assert found == [{"uuid": "GPU-uuid-1", "index": 1, "name": "Fake H100"}]
    assert v == {GPU + "util": 0.87, GPU + "memory_used_gb": 30.0, GPU + "temperature_c": 71.0,
                 GPU + "sm_clock_mhz": 1410.0, GPU + "memory_clock_mhz": 2619.0, GPU + "throttle_power": 1.0,
                 GPU + "throttle_thermal": 1.0, GPU + "throttle_hw": 0.0}
    assert "power_w" in g.unsupported and g.read(now=1.0) == v  # not asked again, nothing else lost
    g.close()
    assert nv.calls == ["init", "shutdown"]


def test_a_process_on_no_gpu_and_gpu_figures_in_a_cut(tmp_path):
    nv = FakeNvml(pid=-1)  # NVML lists other processes only
    g = gpu_mod.GpuReader(nvml=nv)
    assert g.read(now=0.0) == {} and g.devices == []
    s = Sampler(TelemetryOptions(host=False, interval_s=0.0), nvml=FakeNvml(os.getpid()))
    try:
        s.sample()
        assert s.sample()[GPU + "util"] == 0.87
    finally:
        s.close()


def test_without_nvml_there_is_a_clear_note_and_nothing_breaks(monkeypatch, tmp_path):
    """nvidia-ml-py not installed (an import that fails), or NVML that does not start (no driver):
    no obs/sys/gpu key, the sampler's status says why, the process's other figures are there."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert gpu_mod.import_nvml() is None
    s = Sampler(TelemetryOptions(interval_s=0.0), run_key=str(tmp_path))
    try:
        s.sample()
        v = s.sample()
    finally:
        s.close()
    assert PROC + "cpu_s" in v and not any(k.startswith(GPU) for k in v)
    assert s.gpu.note == "GPU telemetry off: nvidia-ml-py is not installed (pip install 'forge-obs[gpu]')"
    sampler.configure({"interval_s": 0.0}, str(tmp_path))
    try:
        st = sampler.status()
        assert st["enabled"] and st["gpu"].startswith("GPU telemetry off: nvidia-ml-py is not installed")
    finally:
        sampler.configure(False)

    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    g = gpu_mod.GpuReader(nvml=NoDriver(os.getpid()))
    assert g.read() == {} and "NVML did not start (RuntimeError: NVML_ERROR_DRIVER_NOT_LOADED)" in g.note


def test_import_forge_obs_reads_nothing_and_loads_no_nvml():
    code = ("import sys, forge_obs; from forge_obs.wire import rank_cut; "
            "print('pynvml' in sys.modules, forge_obs.recording.telemetry.current())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}"))
    assert out.stdout.split() == ["False", "None"], out.stderr


def _fake_threads(monkeypatch, counters: dict, **bounds) -> "proc.ThreadDelays":
    """ThreadDelays over made-up threads: ``counters`` (tid -> [run ns, run delay ns]) is what
    their schedstat files say when read; ``bounds``: its read bounds (8, 2 and 24 unless given)."""
    monkeypatch.setattr(proc.os, "listdir", lambda path: [str(t) for t in counters])
    monkeypatch.setattr(proc, "open_file", lambda path: int(path.split("/")[-2]))
    monkeypatch.setattr(proc, "read_fd", lambda fd, size=4096: f"{counters[fd][0]} {counters[fd][1]} 1".encode())
    monkeypatch.setattr(proc, "close_fd", lambda fd: None)
    d = proc.ThreadDelays(99, **(dict(max_reads=8, cold_reads=2, scan_reads=24) | bounds), refresh_s=1e9)
    d.available = True
    return d


def test_a_woken_thread_among_many_hot_ones_is_found_in_the_same_sample(monkeypatch):
    """More hot threads than a sample reads (a runtime's busy workers) and one more, hot too, that
    ran and waited for a CPU this interval without being in this sample's turn: the process's CPU
    time the threads read do not account for makes the same sample read the rest, the hot ones
    included, so its wait is in this interval (not one or more samples later)."""
    counters = {tid: [0, 0] for tid in range(1, 21)}  # tid -> [run ns, run delay ns]
    d = _fake_threads(monkeypatch, counters)
    d.read(now=0.0)
    for step in range(1, 6):  # every thread runs a little: all hot, read in turn, 6 a sample
        for c in counters.values():
            c[0] += 1000
        d.read(now=float(step), cpu_ns=20 * 1000)
    base = d.total_ns
    starved = 20  # the last one in the turn: not among the next sample's hot reads
    counters[starved][0] += 300_000_000  # ran 0.3 s
    counters[starved][1] += 400_000_000  # and waited 0.4 s for a CPU
    assert d.read(now=6.0, cpu_ns=300_000_000) - base == 400_000_000


def test_a_thread_seen_for_the_first_time_is_read_again_first_at_the_next_sample(monkeypatch):
    """A thread is read once when the thread list first has it (its starting point); read again in
    the same sample it shows no change and looked idle, so a busy thread among many idle ones
    (the main thread beside 60 pool workers) went to the back of the idle turn and its wait was
    missed until its turn came. Now the new threads are read first at the next sample."""
    counters = {tid: [0, 0] for tid in range(1, 62)}  # tid 1: the busy one
    d = _fake_threads(monkeypatch, counters)
    base = d.read(now=0.0)
    counters[1][0] += 300_000_000  # ran 0.3 s
    counters[1][1] += 400_000_000  # and waited 0.4 s for a CPU
    assert d.read(now=0.5, cpu_ns=300_000_000) - base == 400_000_000
    assert d.top == 1  # the one that ran the most: read at every sample from now on


def test_the_thread_that_ran_is_found_whatever_its_number_and_place_in_the_turns(monkeypatch):
    """Thread ids wrap around (``pid_max`` 32768: a long-lived process beside many others), so a
    busy main thread can have a higher id than 60 idle threads started after it; one that slept
    a while is in the idle turn behind them, and 80 waking workers are hot. The default bounds
    (4 reads, 24 more when CPU time is unaccounted for): the threads that have run the most are
    read first when looking for the one that ran, so its wait is in the interval where it waited.
    (The full suite's starved-process test read 0.0 there: its main thread was behind the idle
    ones in thread-id order.)"""
    main = 30_000
    counters = {tid: [0, 0] for tid in range(1, 61)}  # started after main, lower ids: idle
    counters |= {tid: [1_000_000, 0] for tid in range(100, 180)}  # 80 waking workers
    counters[main] = [90_000_000_000, 5_000_000_000]  # ran 90 s so far: the suite's main thread
    d = _fake_threads(monkeypatch, counters, max_reads=4, cold_reads=1, scan_reads=24)
    d.read(now=0.0)
    for step in range(1, 40):  # the workers wake and run a little; the main thread sleeps
        for tid in range(100, 180):
            counters[tid][0] += 50_000
        d.read(now=float(step), cpu_ns=80 * 50_000)
    assert main in d.cold and len(d.hot) > 28
    base = d.total_ns
    counters[main][0] += 200_000_000  # spun 0.2 s
    counters[main][1] += 400_000_000  # and waited 0.4 s for a CPU
    assert d.read(now=40.0, cpu_ns=200_000_000) - base == 400_000_000


def test_new_threads_are_read_first_those_that_ran_the_most_first(monkeypatch):
    """The same wrapped thread ids, the main thread seen for the first time (a sampler made in a
    process that ran a while): it is the first thread read at the next sample, whatever its id."""
    counters = {tid: [0, 0] for tid in range(1, 61)}
    counters[30_000] = [90_000_000_000, 0]
    d = _fake_threads(monkeypatch, counters, max_reads=4, cold_reads=1, scan_reads=24)
    d.read(now=0.0)
    assert d.cold[0] == 30_000


def test_the_busiest_thread_is_read_at_every_sample_and_no_more_reads_are_needed(monkeypatch):
    """A loop's thread busy at every interval beside 80 waking workers: after the first samples
    it is read at every sample (pinned: it ran the most at its last read), so its wait is in every
    interval and no sample reads more than ``max_reads`` threads looking for the CPU time."""
    main = 30_000
    counters = {tid: [0, 0] for tid in range(100, 180)}
    counters[main] = [90_000_000_000, 0]
    d = _fake_threads(monkeypatch, counters, max_reads=4, cold_reads=1, scan_reads=24)
    reads = []
    fake = proc.read_fd
    monkeypatch.setattr(proc, "read_fd", lambda fd, size=4096: reads.append(fd) or fake(fd, size))
    d.read(now=0.0)
    for step in range(1, 60):
        reads.clear()
        for tid in range(100, 180):
            counters[tid][0] += 20_000
        counters[main][0] += 50_000_000  # ran 50 ms
        counters[main][1] += 10_000_000  # and waited 10 ms
        base = d.total_ns
        d.read(now=float(step), cpu_ns=50_000_000 + 80 * 20_000)
        if step >= 2:
            assert main in reads and len(reads) <= 4, (step, reads)
            assert d.total_ns - base == 10_000_000
