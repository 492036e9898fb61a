"""Probe: does a cast with an accumulating response port reduce replies in Monarch's comm tree?"""
import asyncio, os, pickle, sys, threading, time
os.environ.setdefault("MONARCH_FILE_LOG", "error")
from monarch.actor import Actor, endpoint, this_host, context, Port
from monarch._rust_bindings.monarch_hyperactor.actor import PythonMessage, PythonMessageKind
from monarch._rust_bindings.monarch_hyperactor.buffers import Buffer

def _fb(b):
    buf = Buffer(); buf.write(b); return buf.freeze()

def merge(a, b):
    return {"ranks": a["ranks"] + b["ranks"], "pids": a["pids"] | b["pids"], "n": a["n"] + b["n"]}

class Red:
    def __call__(self, left, right):
        l, r = left.decode(), right.decode()
        m = merge(l, r)
        m["red_pids"] = l.get("red_pids", set()) | r.get("red_pids", set()) | {os.getpid()}
        return PythonMessage(left.kind, _fb(pickle.dumps(m)), [])

INBOX = []
class Acc:
    reducer = Red()
    def __call__(self, state, update):
        INBOX.append(update.decode())
        return PythonMessage(update.kind, _fb(pickle.dumps(len(INBOX))), [])
    @property
    def initial_state(self):
        return PythonMessage(PythonMessageKind.Result(None), _fb(pickle.dumps(0)), [])

class F(Actor):
    @endpoint(explicit_response_port=True)
    async def cut(self, port, seq):
        r = context().actor_instance.rank.rank
        port.send({"ranks": [r], "pids": {os.getpid()}, "n": 1})

async def main(n):
    pm = this_host().spawn_procs(per_host={"procs": n}, name="p")
    f = pm.spawn("f", F)
    print("extent", pm.extent if hasattr(pm, "extent") else None)
    ins = context().actor_instance
    handle, receiver = ins._mailbox.open_accum_port(Acc())
    ref = handle.bind()
    for seq in range(3):
        INBOX.clear()
        t0 = time.perf_counter()
        f.cut._send((seq,), {}, ref, "all")
        while sum(m["n"] for m in INBOX) < n:
            await asyncio.sleep(0.001)
        dt = time.perf_counter() - t0
        print(f"seq {seq}: {len(INBOX)} messages for {n} ranks in {dt*1e3:.1f} ms; reduced in pids: {[sorted(m.get('red_pids', ())) for m in INBOX]}; my pid {os.getpid()}")
    await pm.stop()

if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
