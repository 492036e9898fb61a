"""Probe: where does Monarch's comm tree reduce the replies to a cast with an accumulating port?

    python -m bench.scale_proto.probe_accum 8            # 8 procs on this host
    python -m bench.scale_proto.probe_accum 4 --hosts 2  # 2 localhost hosts x 4 procs

Each rank replies its rank and pid; the reducer (run by Monarch's comm actors, torchmonarch 0.7.0,
private API) merges replies and notes the pid it ran in. Prints, per cast, how many messages
reached this (controller) process, the pids that reduced, and the latency.
"""

import argparse
import asyncio
import os
import pickle
import time

os.environ.setdefault("MONARCH_FILE_LOG", "error")
from monarch._rust_bindings.monarch_hyperactor.actor import PythonMessage, PythonMessageKind  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.buffers import Buffer  # noqa: E402
from monarch.actor import Actor, context, endpoint, this_host  # noqa: E402


def _fb(b):
    buf = Buffer()
    buf.write(b)
    return buf.freeze()


class Red:
    def __call__(self, left, right):
        a, b = left.decode(), right.decode()
        m = {"ranks": a["ranks"] + b["ranks"], "n": a["n"] + b["n"],
             "red_pids": a.get("red_pids", set()) | b.get("red_pids", set()) | {os.getpid()}}
        return PythonMessage(left.kind, _fb(pickle.dumps(m)), [])


INBOX = []


class Acc:
    reducer = Red()

    def __call__(self, state, update):
        INBOX.append(update.decode())
        return state

    @property
    def initial_state(self):
        return PythonMessage(PythonMessageKind.Result(None), _fb(pickle.dumps(0)), [])


class F(Actor):
    @endpoint(explicit_response_port=True)
    async def cut(self, port, seq):
        port.send({"ranks": [context().actor_instance.rank.rank], "n": 1})


async def probe(pm, n):
    f = pm.spawn("f", F)
    ins = context().actor_instance
    for seq in range(4):
        INBOX.clear()
        handle, _receiver = ins._mailbox.open_accum_port(Acc())
        t0 = time.perf_counter()
        f.cut._send((seq,), {}, handle.bind(), "all")
        while sum(m["n"] for m in INBOX) < n:
            await asyncio.sleep(0.001)
        print(f"cast {seq}: {len(INBOX)} messages for {n} ranks in {(time.perf_counter() - t0) * 1e3:.1f} ms; "
              f"reduced in pids {[sorted(m.get('red_pids', ())) for m in INBOX]} (controller pid {os.getpid()})")
    await pm.stop()


async def main(procs, hosts):
    if hosts <= 1:
        await probe(this_host().spawn_procs(per_host={"procs": procs}, name="p"), procs)
        return
    from bench.scale_proto.hosts import LocalHosts

    with LocalHosts(hosts) as lh:
        await probe(lh.host_mesh().spawn_procs(per_host={"procs": procs}, name="p"), procs * hosts)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("procs", type=int, nargs="?", default=8)
    ap.add_argument("--hosts", type=int, default=1)
    a = ap.parse_args()
    asyncio.run(main(a.procs, a.hosts))
