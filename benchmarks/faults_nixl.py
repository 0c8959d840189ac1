"""NIXL (UCX backend, DRAM) in the fault scenarios of benchmarks/faults.py.

The initiator writes SPEC["size"] bytes to the target's registered
destination per transfer: initialize_xfer("WRITE", ...), transfer(), then
check_xfer_state() until "DONE" or "ERR" (or an exception).  Both agents run
without NIXL's progress thread (it spins a core each on this shared
machine): the initiator progresses in check_xfer_state(), the target in
get_new_notifs(), both polled in a loop.  The target's only way to abort is
to withdraw its memory registration (deregister_memory), which is what the
abort scenario does.
"""

from __future__ import annotations

import base64

from nixl_bench import load_nixl

NAME = "target"


def _agent(nx, name):
    return nx.nixl_agent(name, nx.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class Target:
    def __init__(self, spec, dest):
        self.nx = load_nixl()
        self.agent = _agent(self.nx, NAME)
        self.dest = dest
        self.reg = self.agent.register_memory([(dest.ctypes.data, dest.nbytes, 0, "")], "DRAM")
        self.info = {"meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                     "addr": dest.ctypes.data, "names": [NAME]}

    def state(self):
        return {}

    def step(self):
        self.agent.get_new_notifs()

    def abort(self):
        self.agent.deregister_memory(self.reg)
        self.reg = None

    def close(self):
        pass


class Initiator:
    def __init__(self, spec, src):
        self.nx = load_nixl()
        self.agent = _agent(self.nx, "initiator")
        self.src = src
        self.reg = self.agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        self.remote = None
        self.addr = None
        self.info = {}

    def connect(self, info):
        if self.remote is not None:
            try:
                self.agent.remove_remote_agent(self.remote)
            except Exception:  # noqa: BLE001 - an agent whose peer died may refuse; go on
                pass
        self.remote = self.agent.add_remote_agent(base64.b64decode(info["meta"]))
        self.addr = info["addr"]

    def post(self, n):
        ls = self.agent.get_xfer_descs([(self.src.ctypes.data, self.src.nbytes, 0)], "DRAM")
        rd = self.agent.get_xfer_descs([(self.addr, self.src.nbytes, 0)], "DRAM")
        h = self.agent.initialize_xfer("WRITE", ls, rd, self.remote)
        st = self.agent.transfer(h)
        return [h, st]

    def check(self, hs):
        h, st = hs
        try:
            if st != "ERR":
                st = self.agent.check_xfer_state(h)
        except Exception as e:  # noqa: BLE001 - what the caller receives
            return {"class": type(e).__name__, "text": str(e)[:500]}
        if st == "DONE":
            self.agent.release_xfer_handle(h)
            return True
        if st == "ERR":
            return {"class": None, "code": "ERR", "text": "check_xfer_state() returned 'ERR'"}
        return None

    def give_up(self, hs):
        try:
            self.agent.release_xfer_handle(hs[0])
        except Exception:  # noqa: BLE001 - NIXL may refuse to release a transfer in flight
            pass

    def close(self):
        pass
