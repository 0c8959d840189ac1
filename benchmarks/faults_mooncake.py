"""Mooncake's Python TransferEngine in the fault scenarios of
benchmarks/faults.py: TCP transport, P2PHANDSHAKE metadata (no metadata
server; a peer is named "host:rpc_port"); over shared memory the protocol
named "shm" is asked for.

The initiator writes SPEC["size"] bytes per transfer with
transfer_submit_write() and polls transfer_check_status() (0: in flight,
1: done, negative: failed; get_batch_transfer_status() would block until
the end).  The target only owns registered memory; its abort is
unregister_memory() of the destination, the one receiver-side cancel its API
has.
"""

from __future__ import annotations

from mooncake.engine import TransferEngine


def _engine(spec, port=0):
    e = TransferEngine()
    host = spec["host"]
    rc = e.initialize(f"{host}:{port}" if port else host, "P2PHANDSHAKE", spec["mooncake_protocol"],
                      "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return e


class Target:
    def __init__(self, spec, dest):
        self.e = _engine(spec, spec.get("port", 0))
        self.dest = dest
        rc = self.e.register_memory(dest.ctypes.data, dest.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        session = f"{spec['host']}:{self.e.get_rpc_port()}"
        self.info = {"session": session, "addr": dest.ctypes.data, "names": [session],
                     "port": self.e.get_rpc_port()}

    def state(self):
        return {}

    def step(self):
        pass

    def abort(self):
        self.e.unregister_memory(self.dest.ctypes.data)

    def close(self):
        pass


class Initiator:
    def __init__(self, spec, src):
        self.e = _engine(spec)
        self.src = src
        rc = self.e.register_memory(src.ctypes.data, src.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self.session = self.addr = None
        self.info = {}

    def connect(self, info):
        self.session, self.addr = info["session"], info["addr"]

    def post(self, n):
        return self.e.transfer_submit_write(self.session, self.src.ctypes.data, self.addr,
                                            self.src.nbytes)

    def check(self, bid):
        if bid < 0:
            return {"class": None, "code": bid, "text": f"transfer_submit_write returned {bid}"}
        st = self.e.transfer_check_status(bid)
        if st == 1:
            return True
        if st < 0:
            return {"class": None, "code": st, "text": f"transfer_check_status returned {st}"}
        return None

    def give_up(self, bid):
        pass

    def close(self):
        pass
