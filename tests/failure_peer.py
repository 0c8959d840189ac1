"""Child-process peer for tests/test_failures.py, tests/test_peer_death.py
and tests/test_ranks.py.

Runs one kvrecv manager (prefill or decode) in its own process so that the
tests can kill it for real (SIGKILL) and watch the survivor.  It takes a JSON
spec as argv[1], prints one JSON line {"ready": ...} once its manager exists,
then obeys JSON commands, one per line on stdin, answering each with exactly
one JSON line on stdout ({"error": ...} if the command raised).

The buffer layout and contents are defined here and imported by the tests,
so both processes agree on what every byte should be.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

NBUF = 4
PAGES = 32
AUX_ROWS = 8
AUX_ITEM = 16
CANARY = 0xA5


def item_lens(nbuf: int = NBUF, scale: int = 64) -> list:
    return [scale * (i + 1) for i in range(nbuf)]


def page_bytes(nbuf: int = NBUF, scale: int = 64) -> int:
    return sum(item_lens(nbuf, scale))


def source_buffers(seed: int, nbuf: int = NBUF, scale: int = 64):
    """Prefill buffers: random bytes, reproducible from seed."""
    rng = np.random.default_rng(seed)
    kv = [rng.integers(0, 256, size=PAGES * it, dtype=np.uint8) for it in item_lens(nbuf, scale)]
    aux = [rng.integers(0, 256, size=AUX_ROWS * AUX_ITEM, dtype=np.uint8)]
    return kv, aux


def canary_buffers(nbuf: int = NBUF, scale: int = 64, path=None):
    """Decode buffers: every byte is CANARY until a transfer lands.  path:
    the KV buffers, one after the other, in that file (kv_file)."""
    if path is None:
        kv = [np.full(PAGES * it, CANARY, dtype=np.uint8) for it in item_lens(nbuf, scale)]
    else:
        kv = kv_file(path, nbuf, scale)
        for b in kv:
            b.fill(CANARY)
    aux = [np.full(AUX_ROWS * AUX_ITEM, CANARY, dtype=np.uint8)]
    return kv, aux


def kv_file(path, nbuf: int = NBUF, scale: int = 64) -> list:
    """The KV buffers of a decode as views of a shared file mapping."""
    lens = [PAGES * it for it in item_lens(nbuf, scale)]
    m = np.memmap(path, dtype=np.uint8, mode="r+" if os.path.exists(path) else "w+",
                  shape=(sum(lens),))
    offs = np.cumsum([0] + lens)
    return [m[offs[i]:offs[i + 1]] for i in range(nbuf)]


def pages_equal(src_kv, dst_kv, src_pages, dst_pages) -> bool:
    """Every KV buffer's destination pages hold the source pages' bytes."""
    for b in range(len(dst_kv)):
        it = len(dst_kv[b]) // PAGES
        for sp, dp in zip(src_pages, dst_pages):
            if not np.array_equal(src_kv[b][sp * it:(sp + 1) * it], dst_kv[b][dp * it:(dp + 1) * it]):
                return False
    return True


def pages_canary(dst_kv, dst_pages) -> bool:
    """Every KV buffer's dst_pages still hold CANARY (nothing landed)."""
    for b in range(len(dst_kv)):
        it = len(dst_kv[b]) // PAGES
        for dp in dst_pages:
            if not (dst_kv[b][dp * it:(dp + 1) * it] == CANARY).all():
                return False
    return True


def _failure(room_obj, kvrecv):
    try:
        room_obj.failure_exception()
    except kvrecv.KVTransferError as e:  # noqa: PERF203
        return {
            "cls": type(e).__name__,
            "code": e.code,
            "reason": e.failure_reason,
            "room": e.bootstrap_room,
            "peer": e.peer,
        }
    return {"cls": None}


def main() -> int:
    spec = json.loads(sys.argv[1])
    # The protocol gets its own copy of stdout; anything a library prints to
    # fd 1 goes to stderr instead of corrupting it.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import kvrecv
    from kvrecv import KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender

    role = spec["role"]
    bootstrap = spec["bootstrap"]
    rank = int(spec.get("rank", 0))
    scale = int(spec.get("scale", 64))
    if spec.get("heads"):  # a prefill rank of a head layout (tests/hetero_peer.py)
        import hetero_peer as hp
        h = spec["heads"]
        kv, aux = hp.prefill_buffers(int(spec.get("seed", 1)), h["tp"], rank, h["total"],
                                     h.get("pp"))
        args = hp.kv_args(kvrecv, kv, aux, h["tp"], rank, h["total"], h.get("mla", False),
                          h.get("dp", 0), stage=h.get("pp"))
        if h.get("state"):  # with state buffers sliced over the ranks (tests/statetp_peer.py)
            import statetp_peer as stp
            state = stp.prefill_state(int(spec.get("seed", 1)), h["tp"], rank)
            args = stp.kv_args(kvrecv, kv, aux, h["tp"], rank, h["total"], state)
    elif spec.get("state"):  # a prefill with state buffers (tests/state_peer.py,
        import importlib  # or with a list component: tests/statelist_peer.py)

        sp = importlib.import_module("statelist_peer" if spec["state"] == "list" else "state_peer")
        kv, aux = source_buffers(int(spec.get("seed", 1)))
        args = sp.kv_args(KVArgs, rank, kv, aux, sp.source(int(spec.get("seed", 1))))
    elif role == "prefill":
        kv, aux = source_buffers(int(spec.get("seed", 1)), scale=scale)
        args = KVArgs.from_buffers(rank, kv, item_lens(scale=scale), aux, [AUX_ITEM])
    else:
        kv, aux = canary_buffers(scale=scale, path=spec.get("kv_path"))
        args = KVArgs.from_buffers(rank, kv, item_lens(scale=scale), aux, [AUX_ITEM])
    cfg = KVConfig(**spec.get("config", {}))
    sender_class = KVSender
    if (spec.get("heads") or {}).get("sglang"):  # through the sglang adapter (tests/sglang_args.py)
        import sglang_args
        from kvrecv.sglang import KVRecvManager, KVRecvSender

        sender_class = KVRecvSender
        sg_args, server_args = sglang_args.prefill(args, spec["heads"], bootstrap, cfg)
        mgr = KVRecvManager(sg_args, "prefill", server_args, False)
    else:
        mgr = KVManager(args, role, bootstrap_addr=bootstrap if role == "prefill" else None,
                        config=cfg)
    rooms = {}

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    reply({"ready": True, "pid": os.getpid(), "endpoint": mgr.endpoint,
           "transport": mgr.transport})

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "open_sender":
                s = sender_class(mgr, bootstrap, cmd["room"])
                s.init(cmd["n"], aux_index=cmd.get("aux"))
                rooms[cmd["room"]] = s
                reply({"state": int(s.poll())})
            elif op == "send":
                rooms[cmd["room"]].send(np.asarray(cmd["pages"], dtype=np.int32),
                                        state_indices=cmd.get("state"))
                reply({"state": int(rooms[cmd["room"]].poll())})
            elif op == "open_receiver":
                r = KVReceiver(mgr, bootstrap, cmd["room"])
                r.init()
                rooms[cmd["room"]] = r
                deadline = time.monotonic() + float(cmd.get("wait_s", 20))
                while r.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
                    time.sleep(0.001)
                if r.poll() == KVPoll.WaitingForInput:
                    r.send_metadata(np.asarray(cmd["pages"], dtype=np.int32),
                                    aux_index=cmd.get("aux"))
                reply({"state": int(r.poll())})
            elif op == "wait":
                obj = rooms[cmd["room"]]
                want = set(cmd["states"])
                t0 = time.monotonic()
                deadline = t0 + float(cmd.get("timeout", 10))
                while int(obj.poll()) not in want and time.monotonic() < deadline:
                    time.sleep(0.001)
                reply({"state": int(obj.poll()), "elapsed": time.monotonic() - t0})
            elif op == "poll":
                reply({"state": int(rooms[cmd["room"]].poll())})
            elif op == "failure":
                reply(_failure(rooms[cmd["room"]], kvrecv))
            elif op == "canary":  # decode: nothing landed on these pages
                reply({"canary": pages_canary(kv, cmd["pages"])})
            elif op == "stats":
                reply(mgr.stats())
            elif op == "clear":
                rooms.pop(cmd["room"]).clear()
                reply({"ok": True})
            elif op == "abort":
                rooms[cmd["room"]].abort()
                reply({"ok": True})
            elif op == "set_siblings":
                # Joins this rank with the other ranks of its instance.
                mgr.set_siblings(list(cmd["endpoints"]))
                reply({"ok": True})
            elif op == "exit":
                for obj in rooms.values():
                    obj.clear()
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
