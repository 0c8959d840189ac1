"""Mooncake reference: its Python TransferEngine (TCP transport, P2PHANDSHAKE
metadata), DRAM -> DRAM, on the same plans as kvrecv and NIXL.

    python benchmarks/mooncake_bench.py --serve     # requests on stdin (run.py)

This process is the prefill (the initiator); the decode is a spawned child
that registers the destination buffers.  Per round and room the prefill
submits one batch with one entry per contiguous run of pages per KV buffer
(batch_transfer_async_write; MAX_BATCH entries at most), then waits for every room's batch
(get_batch_transfer_status, which returns once the batch ended: a write
completes when the target acknowledged it).  GB/s: bytes / (last batch
done - t0 before the first submit), CLOCK_MONOTONIC.  The sampled pages
are checked in the decode after each round.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common as C  # noqa: E402
from nixl_bench import descs_for  # noqa: E402


# Entries per batch: a batch of 4096 entries fails (-1) where 1024 pass, so a
# room's runs go in batches of at most this many.
MAX_BATCH = 1024


def engine():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return e


def version():
    from importlib import metadata

    try:
        return f"mooncake-transfer-engine-non-cuda {metadata.version('mooncake-transfer-engine-non-cuda')}"
    except metadata.PackageNotFoundError:
        return "?"


def decode_main(conn):
    e = engine()
    bufs, plan, point, samples = None, None, None, None
    conn.send(("ready", f"127.0.0.1:{e.get_rpc_port()}"))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "setup":
                point = arg
                bufs = C.dest_pool(point)
                for b in bufs:
                    if e.register_memory(b.ctypes.data, b.nbytes) != 0:
                        raise RuntimeError("register_memory failed")
                plan = C.make_plan(point)
                samples = C.sample_pages(point["nbuf"], plan)
                conn.send(("ok", [b.ctypes.data for b in bufs]))
            elif cmd == "clear":
                C.clear_samples(bufs, point["item"], plan, samples)
                conn.send(("ok", C.cpu_now()))
            elif cmd == "check":
                conn.send(("ok", {"cpu": C.cpu_now(),
                                  "bad": C.check_pages(bufs, point["item"], plan, samples)[:4]}))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Bench:
    def __init__(self):
        self.proc = None
        self.e = engine()
        self.cur = None

    def _start_decode(self):
        """A new decode per point: a P2PHANDSHAKE initiator keeps the
        target's segment (its registered buffers) as it first fetched it,
        so buffers the same target registers later are unknown to it
        (writes to them fail with -1)."""
        if self.proc is not None:
            self.close()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_main, args=(child,), daemon=True)
        self.proc.start()
        _tag, self.session = self.conn.recv()

    def call(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        if not self.conn.poll(240):
            raise RuntimeError("decode child did not answer")
        tag, val = self.conn.recv()
        if tag == "error":
            raise RuntimeError("decode child: " + val)
        return val

    def point(self, point, nrounds, warmup=1, reuse=False):
        if not (reuse and self.cur is not None and self.cur[0] == point):
            if self.cur is not None:
                for b in self.cur[1]:
                    self.e.unregister_memory(b.ctypes.data)
            bufs = [np.empty(C.pool_pages(point) * point["item"], dtype=np.uint8)
                    for _ in range(point["nbuf"])]
            for b, buf in enumerate(bufs):
                C.fill_pattern(buf, b)
                if self.e.register_memory(buf.ctypes.data, buf.nbytes) != 0:
                    raise RuntimeError("register_memory failed")
            self._start_decode()
            remote = self.call("setup", point)
            rooms = descs_for(point, C.make_plan(point), ([b.ctypes.data for b in bufs], remote))
            rooms = [([int(x) for x in s[:, 0]], [int(x) for x in d[:, 0]],
                      [int(x) for x in s[:, 1]]) for s, d in rooms]
            self.cur = (point, bufs, rooms)
        rooms = self.cur[2]
        out = {"point": point, "name": C.point_name(point),
               "descs_per_room": int(np.median([len(s) for s, _d, _n in rooms])), "rounds": []}
        for i in range(warmup + nrounds):
            dcpu0 = self.call("clear")
            cpu0 = C.cpu_now()
            t0 = C.now_ns()
            ids = []
            for s, d, n in rooms:
                for j in range(0, len(s), MAX_BATCH):
                    b = self.e.batch_transfer_async_write(self.session, s[j:j + MAX_BATCH],
                                                          d[j:j + MAX_BATCH], n[j:j + MAX_BATCH])
                    if b == 0:
                        raise RuntimeError("batch_transfer_async_write returned 0")
                    ids.append(b)
            t_posted = C.now_ns()
            for b in ids:
                st = self.e.get_batch_transfer_status([b])
                if st != 0:
                    raise RuntimeError(f"get_batch_transfer_status returned {st}")
            t1 = C.now_ns()
            cpu1 = C.cpu_now()
            dec = self.call("check")
            rec = {"seconds": (t1 - t0) / 1e9, "post_seconds": (t_posted - t0) / 1e9,
                   "initiator_done_seconds": (t1 - t0) / 1e9,
                   "gbps": C.round_bytes(point) / ((t1 - t0) / 1e9) / 1e9,
                   "prefill_cpu": cpu1 - cpu0, "decode_cpu": dec["cpu"] - dcpu0, "bad": dec["bad"]}
            (out["rounds"] if i >= warmup else out.setdefault("warmup", [])).append(rec)
        return C.summarize_nixl_rounds(out, point)

    def close(self):
        try:
            self.call("exit")
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def serve():
    """Long-lived mode for run.py."""
    b = Bench()
    C.serve_points(b, lambda: {"version": version()})


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(__doc__)
        sys.exit(2)
