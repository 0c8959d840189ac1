"""A process inside a network namespace for tests/test_netns.py.

Started as `ip netns exec NS python tests/netns_peer.py SPEC` (SPEC is JSON:
role "bootstrap", "prefill" or "decode", host, bootstrap, rank, seed, pages,
config).  It prints one JSON line once it is ready, then obeys JSON commands,
one per line on stdin, with exactly one JSON line each ({"error": ...} when a
command raised).  A manager peer keeps its own rooms, so one command can
open, abort, wait for or verify thousands of them.

Layout: KV buffers of item lengths ITEMS (times `scale`), `pages` pages, AUX_ROWS aux
rows of AUX_ITEM bytes.  A prefill's bytes come from a seeded generator
(source(seed, rank, pages)), so a decode can check every byte it received;
a decode's buffers start as CANARY.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import sys
import threading
import time

import numpy as np

ITEMS = [64, 128, 192, 256]
AUX_ITEM = 16
AUX_ROWS = 1024
CANARY = 0xA5


def item_lens(scale: int = 1):
    return [it * scale for it in ITEMS]


def source(seed: int, rank: int, pages: int, scale: int = 1):
    rng = np.random.default_rng([seed, rank])
    kv = [rng.integers(0, 256, size=pages * it, dtype=np.uint8) for it in item_lens(scale)]
    aux = [rng.integers(0, 256, size=AUX_ROWS * AUX_ITEM, dtype=np.uint8)]
    return kv, aux


def _failure(obj, kvrecv):
    try:
        obj.failure_exception()
    except kvrecv.KVTransferError as e:
        return base64.b64encode(pickle.dumps(e)).decode()
    return None


def main() -> int:
    spec = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import kvrecv
    from kvrecv import BootstrapServer, KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender

    role = spec["role"]
    host = spec["host"]
    if role == "bootstrap":
        bs = BootstrapServer(host, int(spec.get("port", 0)))
        reply({"ready": True, "pid": os.getpid(), "address": bs.address})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "stats":
                reply(bs.stats())
            elif cmd["op"] == "exit":
                bs.close()
                reply({"bye": True})
                return 0
            else:
                reply({"error": f"unknown op {cmd['op']!r}"})
        bs.close()
        return 0

    bootstrap = spec["bootstrap"]
    rank = int(spec.get("rank", 0))
    pages = int(spec.get("pages", 64))
    scale = int(spec.get("scale", 1))
    ITEMS = item_lens(scale)  # noqa: N806 (this process's item lengths)
    if role == "prefill":
        kv, aux = source(int(spec["seed"]), rank, pages, scale)
    else:
        kv = [np.full(pages * it, CANARY, dtype=np.uint8) for it in ITEMS]
        aux = [np.full(AUX_ROWS * AUX_ITEM, CANARY, dtype=np.uint8)]
    args = KVArgs.from_buffers(rank, kv, ITEMS, aux, [AUX_ITEM])
    mgr = KVManager(args, role, bootstrap_addr=bootstrap if role == "prefill" else None,
                    host=host, config=KVConfig(**spec.get("config", {})))
    rooms = {}
    done_at = {}  # room -> monotonic time its terminal state was first seen
    sources = {}

    def src_of(seed, src_rank):
        key = (seed, src_rank)
        if key not in sources:
            sources[key] = source(seed, src_rank, int(spec.get("src_pages", pages)), scale)
        return sources[key]

    def kvpages(bufs, b, idx):
        it = ITEMS[b]
        return bufs[b].reshape(-1, it)[np.asarray(idx, dtype=np.int64)]

    def proc_status():
        out = {}
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith(("VmRSS:", "Threads:")):
                    k, v = ln.split(":", 1)
                    out[k] = int(v.split()[0])
        return {"rss_kb": out.get("VmRSS"), "threads": out.get("Threads"),
                "py_threads": threading.active_count(), "rooms_held": len(rooms)}

    reply({"ready": True, "pid": os.getpid(), "endpoint": mgr.endpoint,
           "transport": mgr.transport, **proc_status()})

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "open_receivers":
                # [[room, dst_pages, aux_row or None], ...]
                for rid, dst, arow in cmd["rooms"]:
                    for b in range(len(ITEMS)):
                        kv[b].reshape(-1, ITEMS[b])[np.asarray(dst, dtype=np.int64)] = CANARY
                    if arow is not None:
                        aux[0].reshape(-1, AUX_ITEM)[arow] = CANARY
                    r = KVReceiver(mgr, bootstrap, rid)
                    r.init()
                    r.send_metadata(np.asarray(dst, dtype=np.int32), aux_index=arow)
                    rooms[rid] = r
                    done_at.pop(rid, None)
                reply({"ok": len(cmd["rooms"])})
            elif op == "open_senders":
                # [[room, num_pages, aux_row or None], ...]
                for rid, n, arow in cmd["rooms"]:
                    s = KVSender(mgr, bootstrap, rid)
                    s.init(n, arow)
                    rooms[rid] = s
                    done_at.pop(rid, None)
                reply({"ok": len(cmd["rooms"])})
            elif op == "send":
                # [[room, pages], ...]: one send() per entry, in order
                for rid, pg in cmd["chunks"]:
                    rooms[rid].send(np.asarray(pg, dtype=np.int32))
                reply({"ok": len(cmd["chunks"])})
            elif op == "abort":
                for rid in cmd["rooms"]:
                    rooms[rid].abort()
                reply({"ok": True})
            elif op == "states":
                reply({str(rid): int(rooms[rid].poll()) for rid in cmd.get("rooms") or rooms})
            elif op == "wait":
                # Polls the rooms until every one is Success or Failed, doing
                # the scheduled aborts ({room: seconds after the start}).
                want = [int(x) for x in (cmd.get("rooms") or list(rooms))]
                aborts = sorted((float(t), int(rid)) for rid, t in (cmd.get("aborts") or {}).items())
                t0 = time.monotonic()
                deadline = t0 + float(cmd.get("timeout", 30))
                pending = [rid for rid in want if rid not in done_at]
                aborted = []
                while True:
                    now = time.monotonic()
                    while aborts and now - t0 >= aborts[0][0]:
                        _, rid = aborts.pop(0)
                        if rooms[rid].poll() not in (KVPoll.Success, KVPoll.Failed):
                            rooms[rid].abort()
                            aborted.append(rid)
                    still = []
                    for rid in pending:
                        if int(rooms[rid].poll()) in (0, 4):
                            done_at[rid] = now
                        else:
                            still.append(rid)
                    pending = still
                    if (not pending and not aborts) or now > deadline:
                        break
                    time.sleep(0.001)
                out = {}
                for rid in want:
                    st = int(rooms[rid].poll())
                    o = {"state": st, "t": done_at.get(rid)}
                    if st == 0:
                        o["exc"] = _failure(rooms[rid], kvrecv)
                    out[str(rid)] = o
                reply({"rooms": out, "aborted": aborted})
            elif op == "verify":
                # [[room, dst_pages, dst_aux, seed, src_rank, src_pages, src_aux], ...]
                bad = []
                for rid, dst, daux, seed, srank, spg, saux in cmd["rooms"]:
                    skv, saux_b = src_of(seed, srank)
                    for b in range(len(ITEMS)):
                        if not np.array_equal(kvpages(kv, b, dst), kvpages(skv, b, spg)):
                            bad.append([rid, f"kv buffer {b}"])
                            break
                    if daux is not None:
                        got = aux[0].reshape(-1, AUX_ITEM)[daux]
                        if not np.array_equal(got, saux_b[0].reshape(-1, AUX_ITEM)[saux]):
                            bad.append([rid, "aux row"])
                reply({"bad": bad})
            elif op == "canary":
                # Are these pages / aux rows untouched (still CANARY)?
                dst = np.asarray(cmd["pages"], dtype=np.int64)
                ok = all((kv[b].reshape(-1, ITEMS[b])[dst] == CANARY).all()
                         for b in range(len(ITEMS)))
                for arow in cmd.get("aux_rows") or []:
                    ok = ok and bool((aux[0].reshape(-1, AUX_ITEM)[arow] == CANARY).all())
                reply({"canary": bool(ok)})
            elif op == "clear":
                for rid in [int(x) for x in (cmd.get("rooms") or list(rooms))]:
                    rooms.pop(rid).clear()
                    done_at.pop(rid, None)
                reply({"ok": True})
            elif op == "digest":
                h = hashlib.sha1()
                for buf in kv + aux:
                    h.update(buf.tobytes())
                reply({"digest": h.hexdigest()})
            elif op == "stats":
                reply({"stats": mgr.stats(), **proc_status()})
            elif op == "exit":
                for obj in rooms.values():
                    obj.clear()
                rooms.clear()
                mgr.close()
                reply({"bye": True})
                return 0
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # reported to the parent, which fails the test
            reply({"error": f"{type(e).__name__}: {e}"})
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
