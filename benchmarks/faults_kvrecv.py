"""kvrecv in the fault scenarios of benchmarks/faults.py.

The initiator is a prefill rank (with the bootstrap server): each transfer
is one room of SPEC["size"] bytes (one KV buffer of 4 KiB pages, the whole
buffer), KVSender.send() then poll() until Success or Failed; a failure is
what failure_exception() raises.  The target is a decode rank whose
destination is that buffer; it keeps WINDOW receivers open ahead, so the
prefill's next room always has its decode (the failure is then the room's,
not the bootstrap's).  32: with 4 KiB rooms over a tcp lane ending about
every 0.1 ms, 4 receivers were used up between two steps of the target
(every 0.5 ms), the prefill's next room waited for its request, and a
decode killed then left that room to its bootstrap timeout.  Library
defaults (KVConfig()) on both sides.
"""

from __future__ import annotations

import time

import numpy as np

import kvrecv
from kvrecv import BootstrapServer, KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender

PAGE = 4096
WINDOW = 32


def _args(buf):
    return KVArgs.from_buffers(0, [buf], [min(PAGE, buf.nbytes)])


class Target:
    def __init__(self, spec, dest):
        cfg = KVConfig(ctrl_port=spec.get("port", 0))
        self.mgr = KVManager(_args(dest), "decode", host=spec["host"], config=cfg)
        self.boot = spec["peer"]["bootstrap"]
        self.pages = np.arange(max(1, dest.nbytes // PAGE), dtype=np.int32)
        self.next_room = spec["room0"]
        self.open = []
        self.aborted = False
        self.ended = []  # (room, "Success"/"Failed", time.monotonic()) of the last rooms
        self.info = {"endpoint": self.mgr.endpoint, "room0": spec["room0"],
                     "names": [self.mgr.endpoint, "decode rank 0"],
                     "port": int(self.mgr.endpoint.rpartition(":")[2])}

    def step(self):
        if self.aborted:
            return
        keep = []
        for r in self.open:
            st = r.poll()
            if st == KVPoll.WaitingForInput and not r.meta_sent:
                r.send_metadata(self.pages)
                r.meta_sent = True
            if st in (KVPoll.Success, KVPoll.Failed):
                self.ended = (self.ended + [(r.room, st.name, time.monotonic())])[-6:]
                r.clear()
            else:
                keep.append(r)
        self.open = keep
        while len(self.open) < WINDOW:
            r = KVReceiver(self.mgr, self.boot, self.next_room)
            r.init()
            r.meta_sent = False
            r.room = self.next_room
            self.open.append(r)
            self.next_room += 1

    def state(self):
        """The last rooms the decode saw end, and how."""
        return {"rooms_ended": self.ended}

    def abort(self):
        self.aborted = True
        for r in self.open:
            r.abort()

    def close(self):
        self.mgr.close()


class Initiator:
    def __init__(self, spec, src):
        self.boot = BootstrapServer(spec["host"], 0)
        self.mgr = KVManager(_args(src), "prefill", bootstrap_addr=self.boot.address,
                             host=spec["host"], config=KVConfig())
        self.npages = max(1, src.nbytes // PAGE)
        self.room0 = 0
        self.info = {"bootstrap": self.boot.address}

    def connect(self, info):
        self.room0 = info["room0"]

    def post(self, n):
        s = KVSender(self.mgr, self.boot.address, self.room0 + n)
        s.init(self.npages)
        s.sent = False
        return s

    def check(self, s):
        st = s.poll()
        if st == KVPoll.WaitingForInput and not s.sent:
            s.send(np.arange(self.npages, dtype=np.int32))
            s.sent = True
        elif st == KVPoll.Success:
            s.clear()
            return True
        elif st == KVPoll.Failed:
            try:
                s.failure_exception()
            except kvrecv.KVTransferError as e:
                return {"class": type(e).__name__, "code": e.code, "text": e.failure_reason,
                        "peer": e.peer}
        return None

    def give_up(self, s):
        s.abort()

    def close(self):
        self.mgr.close()
        self.boot.close()
