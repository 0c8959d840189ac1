#!/usr/bin/env python3
"""Writes the seed corpora: one or more valid messages of every control
message type (fuzz/corpus/fuzz_wire) and valid data headers
(fuzz/corpus/fuzz_am_header).  The layout is written out here with struct,
independently of the C encoder (see csrc/wire.c).  Existing files are kept:
regression inputs found by fuzzing live in the same folders."""
import hashlib
import hmac
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC = 0x5752564B
(BS_REGISTER, BS_REGISTER_OK, BS_QUERY, BS_QUERY_REPLY, HELLO, HELLO_OK,
 HELLO_REJECT, ROOM_REQ, ROOM_DONE, ROOM_FAIL, PING, PONG, BYE, SIB_FAIL,
 AUTH_REJECT, PATH_LOST) = range(1, 17)


def header(t, epoch=0x0123456789ABCDEF):
    return struct.pack("<IHHQ", MAGIC, 1, t, epoch)


def s(b):
    return struct.pack("<H", len(b)) + b


def layout(page_size, kv, aux):
    return (struct.pack("<II", page_size, len(kv)) + b"".join(struct.pack("<Q", x) for x in kv)
            + struct.pack("<I", len(aux)) + b"".join(struct.pack("<Q", x) for x in aux))


def wire_seeds():
    out = {}
    out["bs_register"] = header(BS_REGISTER) + struct.pack("<I", 0) + s(b"tcp://10.0.0.1:5555")
    out["bs_register_empty"] = header(BS_REGISTER) + struct.pack("<I", 7) + s(b"")
    out["bs_register_ok"] = header(BS_REGISTER_OK) + struct.pack("<I", 3)
    out["bs_query"] = header(BS_QUERY) + struct.pack("<I", 1)
    # DP group and PP stage (two u32 after the rest, only when either > 0)
    out["bs_register_dp_pp"] = out["bs_register"] + struct.pack("<II", 3, 1)
    out["bs_query_dp"] = out["bs_query"] + struct.pack("<II", 65535, 0)
    out["bs_query_reply"] = (header(BS_QUERY_REPLY) + struct.pack("<IBQ", 1, 1, 0xFEEDFACECAFEBEEF)
                             + s(b"tcp://10.0.0.2:6000"))
    out["bs_query_reply_notfound"] = header(BS_QUERY_REPLY) + struct.pack("<IBQ", 2, 0, 0) + s(b"")
    out["hello"] = (header(HELLO) + struct.pack("<I", 0) + layout(16, [4096, 4096, 8192], [128])
                    + struct.pack("<I", 8) + bytes(range(8)))
    # the optional fields: a flags byte (1 tcp receive size, 2 shared-memory
    # sizes, 4 head layout, 8 cross-memory offer, 16 layers, 32 state slicing
    # rules, 64 list components), then each present field in that order
    rx, shm = struct.pack("<I", 512 << 10), struct.pack("<II", 32 << 10, 256)
    heads = struct.pack("<4I", 4, 1, 2, 8)  # tp_size, tp_rank, heads, total_heads
    out["hello_tcp_rx"] = out["hello"] + b"\x01" + rx
    out["hello_heads"] = out["hello"] + b"\x04" + heads
    out["hello_tcp_rx_shm_heads"] = out["hello"] + b"\x07" + rx + shm + heads
    rules = struct.pack("<6I", 5, 1, 1, 4, 1, 0)  # count; outer 1, one group of 4; replicated
    out["hello_heads_state_rules"] = out["hello"] + b"\x24" + heads + rules
    # 64 list components: one byte, bit c for component c
    out["hello_state_lists"] = out["hello"] + b"\x40\x02"
    out["hello_ok"] = (header(HELLO_OK) + struct.pack("<I", 0) + layout(16, [4096, 4096], [])
                       + struct.pack("<I", 8) + bytes(range(8)))
    boot = bytes(range(0xB0, 0xC0))
    out["hello_cma"] = out["hello"] + b"\x0b" + rx + shm + boot
    out["hello_ok_cma"] = out["hello_ok"] + b"\x08" + boot + struct.pack("<IQ", 4242, 0x7F0011223344)
    # 16 layers: pp_size, pp_rank, start_layer, layers (a PP stage)
    out["hello_ok_layers"] = out["hello_ok"] + b"\x14" + heads + struct.pack("<4I", 2, 1, 1, 1)
    out["hello_ok_empty"] = (header(HELLO_OK) + struct.pack("<I", 0) + layout(1, [], [])
                             + struct.pack("<I", 1) + b"\x01")
    out["hello_reject"] = header(HELLO_REJECT) + struct.pack("<IH", 0, 2) + s(b"layout mismatch")
    out["room_req"] = (header(ROOM_REQ) + struct.pack("<QQqI", 42, 7, 3, 4)
                       + struct.pack("<4i", 0, 1, 2, 0x7FFFFFFF))
    out["room_req_noaux"] = header(ROOM_REQ) + struct.pack("<QQqI", 43, 8, -1, 0)
    out["room_req_prefix"] = (header(ROOM_REQ) + struct.pack("<QQqI", 44, 9, 1, 2)
                              + struct.pack("<2i", 5, 6) + struct.pack("<I", 4096))
    # state slots (component 1 a list of 3: its entry is the count), then the list slots
    out["room_req_lists"] = (header(ROOM_REQ) + struct.pack("<QQqI", 45, 10, -1, 1)
                             + struct.pack("<i", 5) + struct.pack("<IH", 0, 2)
                             + struct.pack("<2q", 4, 3) + struct.pack("<I3i", 3, 7, 8, 2))
    out["room_done"] = header(ROOM_DONE) + struct.pack("<QQ", 42, 7)
    out["room_fail"] = (header(ROOM_FAIL) + struct.pack("<QQHi", 42, 7, 3, -1) + s(b"peer lost")
                        + s(b"10.0.0.2:6000"))
    out["ping"] = header(PING) + struct.pack("<I", 0)
    out["pong"] = header(PONG) + struct.pack("<I", 0)
    out["bye"] = header(BYE) + struct.pack("<I", 5)
    out["path_lost"] = header(PATH_LOST) + struct.pack("<I", 5)
    out["sib_fail"] = (header(SIB_FAIL) + struct.pack("<QQHi", 42, 7, 5, 2) + s(b"sibling saw timeout")
                       + s(b""))
    out["auth_reject"] = header(AUTH_REJECT) + s(b"authentication failed at the bootstrap server")
    out["auth_reject_empty"] = header(AUTH_REJECT) + s(b"")
    return out


def am_seeds():
    def am(kind, buf, nbuf, pos, npages, tag, epoch, flags=0):
        return struct.pack("<IHHHHIIQQ", MAGIC, kind, buf, nbuf, flags, pos, npages, tag, epoch)
    return {
        "kv": am(1, 0, 1, 0, 4, 7, 0x0123456789ABCDEF),
        "kv_bufs": am(1, 2, 6, 0, 1, 7, 0x0123456789ABCDEF),
        "kv_max": am(1, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 2**64 - 1, 2**64 - 1),
        "aux": am(2, 1, 1, 0, 1, 8, 1),
        "kv_read": am(1, 0, 1, 0, 64, 7, 0x0123456789ABCDEF, flags=1),
    }


FUZZ_KEY = b"kvrecv-fuzz-key"  # fuzz/fuzz_auth.c


def seal(msg, seq, key=FUZZ_KEY):
    """csrc/auth.h: the flag in the type field, then seq and HMAC-SHA256."""
    b = bytearray(msg)
    b[7] |= 0x80
    b += struct.pack("<Q", seq)
    return bytes(b) + hmac.new(key, bytes(b), hashlib.sha256).digest()


def auth_seeds():
    """Sealed messages that open (a fresh receiver per input)."""
    w = wire_seeds()
    return {"sealed_" + name: seal(w[name], seq)
            for seq, name in enumerate(["ping", "room_req", "hello", "room_fail", "auth_reject"],
                                       start=1)}


def write(folder, seeds):
    os.makedirs(folder, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(folder, "seed_" + name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write(os.path.join(HERE, "corpus", "fuzz_wire"), wire_seeds())
    write(os.path.join(HERE, "corpus", "fuzz_am_header"), am_seeds())
    write(os.path.join(HERE, "corpus", "fuzz_auth"), auth_seeds())
    print("seeds written")
