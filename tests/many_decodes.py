"""Child process for tests/test_peer_death.py: n decode managers (ranks 0..n-1
of n decode instances) in one process, each with one room bound to the prefill
rank 0 registered at the bootstrap server, so that one SIGKILL takes n peers
of that prefill down at the same moment.  argv[1]: JSON {"bootstrap", "n"}.
Prints one JSON line once every room waits for its data; then
{"state": [...]} for each line read ("poll")."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvrecv import KVArgs, KVManager, KVPoll, KVReceiver

ITEM = 64  # one KV buffer of 64-byte items and one aux buffer, as the prefill's
PAGES = 4
AUX_ITEM = 16


def main() -> int:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")
    mgrs, rooms, bufs = [], [], []
    for i in range(int(spec["n"])):
        kv = np.zeros(PAGES * ITEM, dtype=np.uint8)
        aux = np.zeros(PAGES * AUX_ITEM, dtype=np.uint8)
        bufs += [kv, aux]
        m = KVManager(KVArgs.from_buffers(0, [kv], [ITEM], [aux], [AUX_ITEM]), "decode")
        mgrs.append(m)
        r = KVReceiver(m, spec["bootstrap"], 9000 + i)
        r.init()
        rooms.append(r)
    deadline = time.monotonic() + 60
    while any(r.poll() != KVPoll.WaitingForInput for r in rooms):
        if time.monotonic() > deadline or any(r.poll() == KVPoll.Failed for r in rooms):
            out.write(json.dumps({"error": [int(r.poll()) for r in rooms]}) + "\n")
            out.flush()
            return 1
        time.sleep(0.005)
    for r in rooms:
        r.send_metadata(np.asarray([1], dtype=np.int32))
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps({"state": [int(r.poll()) for r in rooms]}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
