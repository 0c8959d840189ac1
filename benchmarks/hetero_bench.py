"""Prefill and decode of different TP sizes against equal ones, in one run.

    python benchmarks/hetero_bench.py [--pages 32] [--rooms 4] [--reps 9]

The same model (8 KV heads, 8 KV buffers, page_size 16 tokens, 256 bytes
per head per token: a TP 1 page of a buffer is 32 KiB) and the same total
bytes per room are moved with prefill TP 1 -> decode TP 1, 2 -> 1 and
1 -> 2.  The prefill ranks run in a child process per layout, the decode
ranks here; each round opens `rooms` rooms of `pages` scattered pages,
hands every prefill rank's pages to send() at once and times from that
command to the last decode rank's Success.  The layouts take turns, round
after round, so that the host's load falls on all of them alike.  Prints
the median GB/s per layout, the median (and range) of its ratio to TP
1 -> 1 in the same round, and the data operations per room (prefill
messages posted, all ranks, divided by rooms) at `pages` and at 4x as many
pages.  Every byte is checked in the first round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

HEADS, NBUF, PS, HB = 8, 8, 16, 256
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _heads(tp, rank):
    n = HEADS // tp
    return list(range(rank * n, (rank + 1) * n))


def _item(tp):
    return PS * (HEADS // tp) * HB


def _model(npages, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(npages, PS, HEADS, HB), dtype=np.uint8) for _ in range(NBUF)]


def _args(kvrecv, kv, tp, rank):
    return kvrecv.KVArgs.from_buffers(rank, kv, [_item(tp)] * NBUF, page_size=PS, tp_size=tp,
                                      kv_head_num=HEADS // tp, total_kv_head_num=HEADS)


def prefill_main(conn, addr, tp, npages):
    import kvrecv
    from kvrecv import KVManager, KVPoll, KVSender

    g = _model(npages)
    mgrs = []
    for r in range(tp):
        kv = [np.ascontiguousarray(b[:, :, _heads(tp, r), :]).reshape(-1) for b in g]
        mgrs.append((KVManager(_args(kvrecv, kv, tp, r), "prefill", bootstrap_addr=addr), kv))
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        rids, src = cmd
        senders = []
        for rid in rids:
            for m, _ in mgrs:
                s = KVSender(m, addr, rid)
                s.init(len(src))
                senders.append(s)
        for s in senders:
            s.send(np.asarray(src, dtype=np.int32))
        t0 = time.monotonic()
        while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders):
            if time.monotonic() - t0 > 60:
                print("prefill stuck:", [int(s.poll()) for s in senders],
                      [m.stats() for m, _ in mgrs], file=sys.stderr, flush=True)
                break
            time.sleep(0.0001)
        ok = all(s.poll() == KVPoll.Success for s in senders)
        ops = sum(m.stats()["rma_ops_posted"] for m, _ in mgrs)
        for s in senders:
            s.clear()
        conn.send((ok, ops))
    for m, _ in mgrs:
        m.close()


class Deployment:
    """A prefill instance of TP ptp (a child process) and a decode instance
    of TP dtp (this process) over one model of npages pages."""

    def __init__(self, ptp, dtp, npages):
        import kvrecv
        from kvrecv import BootstrapServer, KVManager

        self.ptp, self.dtp, self.npages = ptp, dtp, npages
        self.bs = BootstrapServer(port=0)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, self.bs.address, ptp, npages))
        self.proc.start()
        assert self.conn.recv() == "ready"
        self.decs = []
        for r in range(dtp):
            kv = [np.zeros(npages * _item(dtp), dtype=np.uint8) for _ in range(NBUF)]
            self.decs.append((KVManager(_args(kvrecv, kv, dtp, r), "decode"), kv))
        self.rng = np.random.default_rng(7)
        self.rid = 1
        self.rounds = 0

    def round(self, rooms, check=False):
        """Moves `rooms` rooms of npages / rooms scattered pages; returns
        (GB/s, prefill data operations per room so far)."""
        import kvrecv
        from kvrecv import KVPoll, KVReceiver

        use = self.npages // rooms
        src = [int(x) for x in self.rng.permutation(self.npages)[:use]]
        dsts = self.rng.permutation(self.npages)
        recvs = []
        for k in range(rooms):
            dst = [int(x) for x in dsts[k * use:(k + 1) * use]]
            for m, _ in self.decs:
                r = KVReceiver(m, self.bs.address, self.rid + k)
                r.init(prefill_tp_size=self.ptp)
                recvs.append((r, dst))
        rids = list(range(self.rid, self.rid + rooms))
        self.rid += rooms
        tb = time.monotonic()
        while any(r.poll() == KVPoll.Bootstrapping for r, _ in recvs):
            if time.monotonic() - tb > 60:
                raise SystemExit(f"TP {self.ptp} -> {self.dtp}: not bootstrapped: "
                                 f"{[int(r.poll()) for r, _ in recvs]}")
            time.sleep(0.0001)
        for r, dst in recvs:
            r.send_metadata(np.asarray(dst, dtype=np.int32))
        t0 = time.perf_counter()
        self.conn.send((rids, src))
        while any(r.poll() not in (KVPoll.Success, KVPoll.Failed) for r, _ in recvs):
            if time.perf_counter() - t0 > 60:
                raise SystemExit(f"TP {self.ptp} -> {self.dtp}: stuck: "
                                 f"{[int(r.poll()) for r, _ in recvs]}")
            time.sleep(0.00005)
        dt = time.perf_counter() - t0
        ok, ops = self.conn.recv()
        for r, _ in recvs:
            if r.poll() != KVPoll.Success:
                try:
                    r.failure_exception()
                except kvrecv.KVTransferError as e:
                    raise SystemExit(f"TP {self.ptp} -> {self.dtp}: room failed: {e}")
        assert ok, f"TP {self.ptp} -> {self.dtp}: a prefill room failed"
        if check:
            g = _model(self.npages)
            for d, (m, kv) in enumerate(self.decs):
                heads = _heads(self.dtp, d)
                for b in range(NBUF):
                    got = kv[b].reshape(self.npages, PS, len(heads), HB)
                    for k in range(rooms):
                        dst = [int(x) for x in dsts[k * use:(k + 1) * use]]
                        assert np.array_equal(got[dst], g[b][src][:, :, heads, :]), "bytes differ"
        for r, _ in recvs:
            r.clear()
        self.rounds += 1
        return rooms * use * PS * HEADS * HB * NBUF / dt / 1e9, ops / rooms / self.rounds

    def close(self):
        self.conn.send(None)
        self.proc.join(30)
        for m, _ in self.decs:
            m.close()
        self.bs.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=32, help="pages per room")
    ap.add_argument("--rooms", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    npages = a.pages * a.rooms
    deps = [Deployment(ptp, dtp, npages) for ptp, dtp in LAYOUTS]
    gbs = {l: [] for l in LAYOUTS}
    ratios = {l: [] for l in LAYOUTS}
    ops = {}
    for rep in range(a.reps):
        # Interleaved, so that the host's load falls on every layout alike.
        got = {l: d.round(a.rooms, check=rep == 0) for l, d in zip(LAYOUTS, deps)}
        for l in LAYOUTS:
            gbs[l].append(got[l][0])
            ratios[l].append(got[l][0] / got[LAYOUTS[0]][0])
            ops[l] = got[l][1]
    for d in deps:
        d.close()
    ops4 = {}
    for ptp, dtp in LAYOUTS:
        d = Deployment(ptp, dtp, npages * 4)
        ops4[(ptp, dtp)] = d.round(a.rooms)[1]
        d.close()
    mib = a.pages * PS * HEADS * HB * NBUF / 2**20
    print(f"{a.rooms} rooms x {a.pages} pages ({mib:.0f} MiB a room), {a.reps} interleaved "
          f"rounds; UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    print(f"{'layout':12} {'GB/s med':>9} {'vs 1->1 med':>12} {'(min-max)':>12} {'ops/room':>9} "
          f"{'at 4x pages':>12}")
    for l in LAYOUTS:
        r = sorted(ratios[l])
        print(f"TP {l[0]} -> {l[1]:<5} {np.median(gbs[l]):9.2f} {np.median(r):12.2f} "
              f"{r[0]:5.2f}-{r[-1]:<5.2f} {ops[l]:9.1f} {ops4[l]:12.1f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
