"""A regression check for a behaviour found while building the benchmarks
(not a benchmark): the decode manager is re-created, then the prefill
manager of rank 0 is closed and a new one created on the same bootstrap
server, and the new decode manager's first room resolved the CLOSED
manager's endpoint and failed with BOOTSTRAP ("did not answer the
handshake") after bootstrap_timeout_ms instead of finding the new one.

    UCX_TLS=tcp python benchmarks/repro_stale_bootstrap.py [iterations]

Prints, for every failed iteration, the reason with the endpoint the room
tried and the new and previous prefill endpoints, then the failure count.
Seen 1-6 times in 40 on the build of f9c38e6/123032c; 0 in 80 on 5cf990f
(after a78ed93, "bootstrap re-check for restarted prefills").
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np


def prefill(conn, bootstrap):
    from kvrecv import KVArgs, KVConfig, KVManager, KVPoll, KVSender

    mgr = None
    buf = [np.ones(4096 * 4, dtype=np.uint8)]
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            break
        if cmd == "recreate":
            if mgr is not None:
                mgr.close()
            mgr = KVManager(KVArgs.from_buffers(0, buf, [4096]), "prefill",
                            bootstrap_addr=bootstrap, config=KVConfig(bootstrap_timeout_ms=2000))
            conn.send(mgr.endpoint)
        elif cmd == "send":
            s = KVSender(mgr, bootstrap, arg)
            s.init(1)
            deadline = time.monotonic() + 3
            while s.poll() not in (KVPoll.WaitingForInput, KVPoll.Failed) and time.monotonic() < deadline:
                time.sleep(0.001)
            if s.poll() == KVPoll.WaitingForInput:
                s.send(np.array([0], dtype=np.int32))
            deadline = time.monotonic() + 3
            while s.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
                time.sleep(0.001)
            s.clear()
            conn.send("ok")
    if mgr is not None:
        mgr.close()


def main():
    from kvrecv import BootstrapServer, KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVTransferError

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    server = BootstrapServer(port=0)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(child, server.address), daemon=True)
    proc.start()
    buf = [np.zeros(4096 * 4, dtype=np.uint8)]
    dec = None
    prev = None
    fails = 0
    for i in range(n):
        if dec is not None:
            dec.close()
        dec = KVManager(KVArgs.from_buffers(0, buf, [4096]), "decode",
                        config=KVConfig(bootstrap_timeout_ms=2000))
        conn.send(("recreate", None))
        ep = conn.recv()
        room = 1000 + i
        r = KVReceiver(dec, server.address, room)
        r.init()
        deadline = time.monotonic() + 5
        while r.poll() not in (KVPoll.WaitingForInput, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.001)
        if r.poll() == KVPoll.Failed:
            fails += 1
            try:
                r.failure_exception()
            except KVTransferError as e:
                print(f"iteration {i}: {e.code}: {e.failure_reason} | new prefill {ep}, previous {prev}")
        else:
            r.send_metadata(np.array([1], dtype=np.int32))
            conn.send(("send", room))
            conn.recv()
        r.clear()
        prev = ep
    print(f"{fails} of {n} first rooms after re-creating the managers failed")
    conn.send(("exit", None))
    proc.join(10)
    dec.close()
    server.close()


if __name__ == "__main__":
    main()
