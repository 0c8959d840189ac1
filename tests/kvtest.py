"""Helpers shared by the kvrecv tests.

* Layout / Side: one rank's registered memory (numpy uint8 buffers), either
  filled from a seeded generator (a prefill rank's source data, which any
  process can rebuild from the seed) or with a canary byte (a decode rank's
  destination, so that bytes nobody should have written are recognisable).
* Expected: a model of what the decode buffers must hold after a set of
  transfers; compared byte for byte with the real buffers.
* wait_for / wait_all: poll loops with deadlines.
* Dealer: a raw ZMQ DEALER socket through ctypes (libzmq.so.5), to speak to
  the control endpoints without the library.
* ChildPrefill: a prefill rank living in a child process ("spawn"), driven
  through a pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import hmac
import multiprocessing
import os
import socket
import struct
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

CANARY = 0xA5

# UCX_TLS values of the two transports the suite covers.
TRANSPORTS = {"tcp": "tcp", "shm": "posix,sysv,cma,self"}

# Timeouts that keep a loaded 2-core machine from turning slowness into
# failures (the library's defaults declare a peer lost after 600 ms).
ROBUST_CONFIG = dict(heartbeat_timeout_ms=15000, bootstrap_timeout_ms=20000)

POLL_SLEEP = 0.0005


# --------------------------------------------------------------------------
# Memory layouts
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    kv_item_lens: Tuple[int, ...]
    num_pages: int
    aux_item_lens: Tuple[int, ...] = ()
    aux_rows: int = 0

    @property
    def page_bytes(self) -> int:
        return sum(self.kv_item_lens)

    @property
    def aux_bytes(self) -> int:
        return sum(self.aux_item_lens)

    def transfer_bytes(self, npages: int, with_aux: bool) -> int:
        return npages * self.page_bytes + (self.aux_bytes if with_aux else 0)


# 8 KV buffers with different item lengths (64..4096 bytes), 2 aux buffers.
STD = Layout((64, 96, 128, 256, 512, 1024, 2048, 4096), 256, (24, 40), 64)
# Same item lengths, enough pages for hundreds of rooms with disjoint pages.
WIDE = Layout((64, 96, 128, 256, 512, 1024, 2048, 4096), 1024, (24, 40), 512)
# A small layout for argument checks.
SMALL = Layout((64, 128), 32, (16,), 8)


class Side:
    """The buffers of one rank.  seed=None fills them with CANARY."""

    def __init__(self, layout: Layout, rank: int = 0, seed: Optional[int] = None):
        self.layout = layout
        self.rank = rank
        self.seed = seed
        rng = np.random.default_rng(seed) if seed is not None else None

        def buf(n):
            if rng is None:
                return np.full(n, CANARY, dtype=np.uint8)
            return rng.integers(0, 256, size=n, dtype=np.uint8)

        self.kv = [buf(item * layout.num_pages) for item in layout.kv_item_lens]
        self.aux = [buf(item * layout.aux_rows) for item in layout.aux_item_lens]

    def args(self, page_size: int = 1):
        from kvrecv import KVArgs

        return KVArgs.from_buffers(
            self.rank,
            self.kv,
            list(self.layout.kv_item_lens),
            self.aux,
            list(self.layout.aux_item_lens),
            page_size=page_size,
        )

    def pages(self, b: int) -> np.ndarray:
        """KV buffer b as a (num_pages, item_len) view."""
        return self.kv[b].reshape(self.layout.num_pages, self.layout.kv_item_lens[b])

    def rows(self, a: int) -> np.ndarray:
        return self.aux[a].reshape(self.layout.aux_rows, self.layout.aux_item_lens[a])

    def snapshot(self) -> "Expected":
        return Expected(self)


class Expected:
    """What a decode Side must hold: starts as a copy of it, and every
    transfer the test expects is applied to the copy."""

    def __init__(self, side: Side):
        self.layout = side.layout
        self.kv = [b.copy() for b in side.kv]
        self.aux = [b.copy() for b in side.aux]

    def apply(self, src: Side, src_pages, dst_pages, src_aux=None, dst_aux=None) -> None:
        src_pages = np.asarray(src_pages, dtype=np.int64)
        dst_pages = np.asarray(dst_pages, dtype=np.int64)
        assert len(src_pages) == len(dst_pages)
        for b, item in enumerate(self.layout.kv_item_lens):
            view = self.kv[b].reshape(self.layout.num_pages, item)
            view[dst_pages] = src.pages(b)[src_pages]
        if dst_aux is not None:
            for a, item in enumerate(self.layout.aux_item_lens):
                view = self.aux[a].reshape(self.layout.aux_rows, item)
                view[dst_aux] = src.rows(a)[src_aux]

    def mismatches(self, side: Side) -> List[str]:
        out = []
        for b, item in enumerate(self.layout.kv_item_lens):
            want = self.kv[b].reshape(-1, item)
            got = side.kv[b].reshape(-1, item)
            bad = np.nonzero((want != got).any(axis=1))[0]
            if len(bad):
                out.append(f"kv buffer {b} (item {item}): pages {bad[:10].tolist()} differ"
                           f" ({len(bad)} pages)")
        for a, item in enumerate(self.layout.aux_item_lens):
            want = self.aux[a].reshape(-1, item)
            got = side.aux[a].reshape(-1, item)
            bad = np.nonzero((want != got).any(axis=1))[0]
            if len(bad):
                out.append(f"aux buffer {a} (item {item}): rows {bad[:10].tolist()} differ")
        return out

    def check(self, side: Side) -> None:
        bad = self.mismatches(side)
        assert not bad, "decode memory differs from the expected bytes:\n" + "\n".join(bad)


def assert_all_canary(side: Side) -> None:
    for b, buf in enumerate(side.kv):
        assert (buf == CANARY).all(), f"kv buffer {b} was written"
    for a, buf in enumerate(side.aux):
        assert (buf == CANARY).all(), f"aux buffer {a} was written"


def count_runs(src: Sequence[int], dst: Sequence[int]) -> int:
    """Runs where both the source and the destination pages are consecutive."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


MAX_IOV = 1024  # pieces per coalesced message (KVR_MAX_IOV)
COALESCE_BYTES = 1 << 20  # KVConfig.coalesce_bytes default
SHM_EAGER_BYTES = 8 << 10  # eager message size over shared memory (KVR_TP_SHM_EAGER_BYTES)
SHM_EAGER_ROOM_BYTES = 512 << 10  # rooms sent as such messages (KVR_SHM_EAGER_ROOM_BYTES)


# A message of at most this many bytes goes as one tcp fragment: the tcp
# fragment kvrecv sets (ucxtune.c, 256 KiB) less KVR_TP_TCP_EAGER_HEADROOM.
TCP_EAGER_BYTES = (256 << 10) - 1024
# A UCX_TCP_TX_SEG_SIZE too small for those one-fragment messages: a test of
# what a refused rendezvous tells the sender sets it (a refused eager message
# is dropped without an answer).
TCP_NO_EAGER_FRAGMENT = "2K"


def auto_run_bytes(transport: str, item_max: int = 0) -> int:
    """KVConfig.coalesce_run_bytes=0 (auto): every run over shared memory
    and over tcp with kvrecv's tcp lane (transport "tcp", the default);
    through UCX's tcp (transport "tcp-ucx": tcp_lane off, or fragments too
    small for a lane) runs under one fragment (TCP_EAGER_BYTES) if an item
    fits one, else runs under 64 KiB (KVR_TCP_RUN_BYTES)."""
    if transport in ("shm", "tcp"):
        return 1 << 62
    return TCP_EAGER_BYTES if item_max <= TCP_EAGER_BYTES else 64 << 10


def shm_eager_room(kv_items, aux_items, npages: int) -> bool:
    """Over shared memory, a room of host buffers this small (items of at
    most SHM_EAGER_BYTES, at most SHM_EAGER_ROOM_BYTES in all) goes as eager
    messages of at most SHM_EAGER_BYTES (post.c, kvr_post_limits)."""
    return (max(kv_items) <= SHM_EAGER_BYTES and max(aux_items, default=0) <= SHM_EAGER_BYTES
            and npages * sum(kv_items) + sum(aux_items) <= SHM_EAGER_ROOM_BYTES)


def position_groups(src, dst, item_max: int, run_bytes: int, cap: int = COALESCE_BYTES,
                    max_pages: int = 1 << 62):
    """The position ranges of a room's data messages, for pages handed over
    at once: the engine's rule (plan.c, kvr_post_plan).  A run
    (consecutive on both sides) of at least run_bytes or max_pages pages
    goes alone, cut at max_pages; shorter runs in a row share a range of at
    most cap bytes, max_pages pages and MAX_IOV runs (the first run of a
    range always fits).  Returns (pages, source pieces) per range: pieces
    are the runs of consecutive source pages."""
    runs = []
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append([i, 1])
        elif runs[-1][1] == max_pages:
            runs.append([i, 1])  # a run is cut at max_pages
        else:
            runs[-1][1] += 1
    groups = []
    i = 0
    while i < len(runs):
        start, pages, k = runs[i][0], runs[i][1], 1
        i += 1
        if pages * item_max < run_bytes and pages < max_pages:
            while (i < len(runs) and k < MAX_IOV and runs[i][1] * item_max < run_bytes
                   and runs[i][1] < max_pages and (pages + runs[i][1]) * item_max <= cap
                   and pages + runs[i][1] <= max_pages):
                pages += runs[i][1]
                k += 1
                i += 1
        seg = src[start:start + pages]
        pieces = 1 + sum(1 for j in range(1, len(seg)) if seg[j] != seg[j - 1] + 1)
        groups.append((pages, pieces))
    return groups


def count_messages(src, dst, item_max: int, run_bytes: int, cap: int = COALESCE_BYTES) -> int:
    """Position ranges (data messages per buffer when buffers do not share)."""
    return len(position_groups(src, dst, item_max, run_bytes, cap))


def buffer_groups(items, npages: int, pieces: int, merge: int) -> int:
    """Messages for the buffers of one position range (plan.c,
    kvr_plan_buf_group): consecutive buffers share one while it stays within
    merge bytes and MAX_IOV pieces."""
    msgs, b = 0, 0
    while b < len(items):
        nb, size = 1, npages * items[b]
        while (b + nb < len(items) and (nb + 1) * pieces <= MAX_IOV
               and size + npages * items[b + nb] <= merge):
            size += npages * items[b + nb]
            nb += 1
        msgs += 1
        b += nb
    return msgs


def room_messages(src, dst, kv_items, aux_items, run_bytes: int, cap: int = COALESCE_BYTES,
                  transport: str = "") -> int:
    """All data messages of a room of host buffers handed over at once
    (aux_items: the aux buffers' item lengths if the room has an aux row,
    else empty).  cap 0: no coalescing, one message per run and buffer.
    transport "shm": small rooms go as eager messages; "tcp-ucx": messages of
    KV pages are cut to one UCX fragment; "tcp" (a tcp lane) or "": neither
    limit."""
    max_pages = 1 << 62
    if transport == "shm" and shm_eager_room(kv_items, aux_items, len(src)):
        max_pages = SHM_EAGER_BYTES // max(kv_items)
        cap = min(cap, SHM_EAGER_BYTES)
    elif transport == "tcp-ucx" and max(kv_items) <= TCP_EAGER_BYTES:
        max_pages = TCP_EAGER_BYTES // max(kv_items)
        cap = min(cap, TCP_EAGER_BYTES)
    merge = min(run_bytes, cap)
    total = sum(buffer_groups(kv_items, pages, pieces, merge)
                for pages, pieces in position_groups(src, dst, max(kv_items), run_bytes, cap,
                                                     max_pages))
    if aux_items:
        total += buffer_groups(aux_items, 1, 1, merge)
    return total


def min_messages(src, dst, item_max: int, cap: int = COALESCE_BYTES) -> int:
    """The fewest messages per buffer any split of the pages into send()
    chunks can give: greedy over positions, a message being a piece of one
    run, or at most cap bytes in at most MAX_IOV pieces of runs."""
    n = len(src)
    msgs = a = 0
    while a < n:
        msgs += 1
        run_end = a + 1
        while run_end < n and src[run_end] == src[run_end - 1] + 1 and dst[run_end] == dst[run_end - 1] + 1:
            run_end += 1
        b, pieces = a + 1, 1
        while b < n and (b + 1 - a) * item_max <= cap:
            new_piece = src[b] != src[b - 1] + 1 or dst[b] != dst[b - 1] + 1
            if new_piece and pieces == MAX_IOV:
                break
            pieces += new_piece
            b += 1
        a = max(b, run_end)
    return msgs


def split_chunks(rng: np.random.Generator, seq, nchunks: int) -> List:
    """Splits seq into nchunks non-empty consecutive chunks (nchunks <= len)."""
    n = len(seq)
    nchunks = max(1, min(nchunks, n))
    cuts = sorted(rng.choice(np.arange(1, n), size=nchunks - 1, replace=False).tolist()) if nchunks > 1 else []
    bounds = [0] + cuts + [n]
    return [seq[bounds[i]:bounds[i + 1]] for i in range(nchunks)]


# --------------------------------------------------------------------------
# Polling
# --------------------------------------------------------------------------


@contextlib.contextmanager
def refusing_port():
    """A loopback port that refuses connections for as long as the block
    runs: bound by this process but not listening (a port bound, closed and
    named later could be taken by another process meanwhile)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
    finally:
        s.close()


def wait_for(room, targets, timeout: float = 10.0):
    """Polls room until its state is in targets (a KVPoll or a collection of
    them) or the deadline passes; returns the last state seen."""
    if not isinstance(targets, (set, frozenset, tuple, list)):
        targets = (targets,)
    deadline = time.monotonic() + timeout
    state = room.poll()
    while state not in targets and time.monotonic() < deadline:
        time.sleep(POLL_SLEEP)
        state = room.poll()
    return state


def wait_all(rooms, targets, timeout: float = 20.0) -> list:
    if not isinstance(targets, (set, frozenset, tuple, list)):
        targets = (targets,)
    deadline = time.monotonic() + timeout
    pending = list(rooms)
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if r.poll() not in targets]
        if pending:
            time.sleep(POLL_SLEEP)
    return [r.poll() for r in rooms]


def wait_until(pred, timeout: float = 10.0, interval: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def terminal():
    from kvrecv import KVPoll

    return (KVPoll.Success, KVPoll.Failed)


def describe_failure(room) -> str:
    from kvrecv import KVPoll, KVTransferError

    if room.poll() != KVPoll.Failed:
        return f"state {room.poll()!r}"
    try:
        room.failure_exception()
    except KVTransferError as e:  # always raised
        return f"{type(e).__name__}[{e.code}]: {e}"
    return "failure_exception() did not raise"


# --------------------------------------------------------------------------
# A raw ZMQ DEALER through ctypes
# --------------------------------------------------------------------------

ZMQ_DEALER = 5
ZMQ_ROUTING_ID = 5
ZMQ_SNDHWM = 23
ZMQ_DONTWAIT = 1
ZMQ_SNDMORE = 2
ZMQ_LINGER = 17
ZMQ_RCVTIMEO = 27
ZMQ_SNDTIMEO = 28

_zmq = None


def _libzmq():
    global _zmq
    if _zmq is None:
        z = ctypes.CDLL("libzmq.so.5", use_errno=True)
        z.zmq_ctx_new.restype = ctypes.c_void_p
        z.zmq_ctx_new.argtypes = []
        z.zmq_ctx_term.argtypes = [ctypes.c_void_p]
        z.zmq_socket.restype = ctypes.c_void_p
        z.zmq_socket.argtypes = [ctypes.c_void_p, ctypes.c_int]
        z.zmq_close.argtypes = [ctypes.c_void_p]
        z.zmq_connect.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        z.zmq_bind.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        z.zmq_getsockopt.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_size_t)]
        z.zmq_setsockopt.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_size_t]
        z.zmq_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        z.zmq_send.restype = ctypes.c_int
        z.zmq_recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        z.zmq_recv.restype = ctypes.c_int
        _zmq = z
    return _zmq


class Dealer:
    """A DEALER connected to endpoint ("tcp://host:port")."""

    def __init__(self, endpoint: str, recv_timeout_ms: int = 5000, bind: bool = False,
                 routing_id: Optional[bytes] = None, sndhwm: int = 1000):
        z = _libzmq()
        self._z = z
        self.ctx = z.zmq_ctx_new()
        assert self.ctx, "zmq_ctx_new failed"
        self.sock = z.zmq_socket(self.ctx, ZMQ_DEALER)
        assert self.sock, "zmq_socket failed"
        for opt, val in ((ZMQ_LINGER, 0), (ZMQ_RCVTIMEO, recv_timeout_ms), (ZMQ_SNDTIMEO, 5000),
                         (ZMQ_SNDHWM, sndhwm)):
            v = ctypes.c_int(val)
            assert z.zmq_setsockopt(self.sock, opt, ctypes.byref(v), ctypes.sizeof(v)) == 0
        if routing_id is not None:
            rid = ctypes.create_string_buffer(routing_id, len(routing_id))
            assert z.zmq_setsockopt(self.sock, ZMQ_ROUTING_ID, rid, len(routing_id)) == 0
        if bind:
            # A DEALER that others connect to (DEALER-DEALER: no routing ids).
            assert z.zmq_bind(self.sock, endpoint.encode()) == 0, f"zmq_bind({endpoint}) failed"
            buf = ctypes.create_string_buffer(256)
            n = ctypes.c_size_t(256)
            assert z.zmq_getsockopt(self.sock, 32, buf, ctypes.byref(n)) == 0  # LAST_ENDPOINT
            self.endpoint = buf.value.decode()
        else:
            rc = z.zmq_connect(self.sock, endpoint.encode())
            assert rc == 0, f"zmq_connect({endpoint}) failed"
            self.endpoint = endpoint

    def send(self, data: bytes, more: bool = False) -> None:
        buf = ctypes.create_string_buffer(data, max(len(data), 1))
        n = self._z.zmq_send(self.sock, buf, len(data), ZMQ_SNDMORE if more else 0)
        assert n == len(data), f"zmq_send returned {n}"

    def try_send(self, buf) -> bool:
        """Sends buf (a ctypes buffer) unless the queue is full."""
        return self._z.zmq_send(self.sock, buf, len(buf), ZMQ_DONTWAIT) == len(buf)

    def send_multipart(self, frames: Sequence[bytes]) -> None:
        for i, f in enumerate(frames):
            self.send(f, more=i < len(frames) - 1)

    def recv(self, maxlen: int = 1 << 20) -> Optional[bytes]:
        """One frame, or None on timeout."""
        buf = ctypes.create_string_buffer(maxlen)
        n = self._z.zmq_recv(self.sock, buf, maxlen, 0)
        if n < 0:
            return None
        return buf.raw[: min(n, maxlen)]

    def close(self) -> None:
        if self.sock:
            self._z.zmq_close(self.sock)
            self.sock = None
        if self.ctx:
            self._z.zmq_ctx_term(self.ctx)
            self.ctx = None


# --------------------------------------------------------------------------
# The wire format (csrc/wire.h), for crafting messages
# --------------------------------------------------------------------------

MAGIC = 0x5752564B
VERSION = 1
# The shared secret of the tests that use one (csrc/auth.h).
SECRET = b"kvrecv-test-secret"
(MSG_BS_REGISTER, MSG_BS_REGISTER_OK, MSG_BS_QUERY, MSG_BS_QUERY_REPLY, MSG_HELLO, MSG_HELLO_OK,
 MSG_HELLO_REJECT, MSG_ROOM_REQ, MSG_ROOM_DONE, MSG_ROOM_FAIL, MSG_PING, MSG_PONG,
 MSG_BYE, MSG_SIB_FAIL, MSG_AUTH_REJECT, MSG_PATH_LOST) = range(1, 17)
AUTH_FLAG = 0x8000


def seal(msg: bytes, key: bytes, seq: int) -> bytes:
    """What a sender with the secret key sends (csrc/auth.h): the flag in
    the type field, then seq and HMAC-SHA256 over everything before it."""
    b = bytearray(msg)
    b[7] |= AUTH_FLAG >> 8
    b += struct.pack("<Q", seq)
    return bytes(b) + hmac.new(key, bytes(b), hashlib.sha256).digest()


def unseal(data: bytes, key: bytes) -> Tuple[bytes, int]:
    """Checks a sealed message's tag; returns (message without trailer and
    flag, seq).  Raises AssertionError if it does not verify."""
    assert len(data) >= 56 and data[7] & (AUTH_FLAG >> 8), "not sealed"
    body, seq, mac = data[:-40], data[-40:-32], data[-32:]
    assert hmac.compare_digest(hmac.new(key, body + seq, hashlib.sha256).digest(), mac), \
        "the tag does not verify"
    b = bytearray(body)
    b[7] &= ~(AUTH_FLAG >> 8) & 0xFF
    return bytes(b), struct.unpack("<Q", seq)[0]


def auth_reject_reason(data: bytes) -> str:
    """The reason of an AUTH_REJECT message."""
    assert parse_header(data)[2] == MSG_AUTH_REJECT, parse_header(data)
    (n,) = struct.unpack_from("<H", data, 16)
    return data[18:18 + n].decode()


def header(msg_type: int, epoch: int = 0x1122334455667788, magic: int = MAGIC,
           version: int = VERSION) -> bytes:
    return struct.pack("<IHHQ", magic, version, msg_type, epoch)


def parse_header(data: bytes) -> Tuple[int, int, int, int]:
    return struct.unpack_from("<IHHQ", data)


def wire_str(s: bytes, length: Optional[int] = None) -> bytes:
    return struct.pack("<H", len(s) if length is None else length) + s


def wire_layout(layout: Layout, page_size: int = 1) -> bytes:
    out = struct.pack("<II", page_size, len(layout.kv_item_lens))
    out += b"".join(struct.pack("<Q", v) for v in layout.kv_item_lens)
    out += struct.pack("<I", len(layout.aux_item_lens))
    out += b"".join(struct.pack("<Q", v) for v in layout.aux_item_lens)
    return out


def room_req(room: int, tag: int, aux_index: int, pages: Sequence[int],
             npages: Optional[int] = None, **hk) -> bytes:
    body = struct.pack("<QQqI", room, tag, aux_index, len(pages) if npages is None else npages)
    body += b"".join(struct.pack("<i", p) for p in pages)
    return header(MSG_ROOM_REQ, **hk) + body


def room_fail(room: int, tag: int, code: int, origin: int, reason: bytes, peer: bytes,
              **hk) -> bytes:
    return (header(MSG_ROOM_FAIL, **hk) + struct.pack("<QQHi", room, tag, code, origin)
            + wire_str(reason) + wire_str(peer))


def ping(rank: int = 0, **hk) -> bytes:
    return header(MSG_PING, **hk) + struct.pack("<I", rank)


def bs_query(rank: int, **hk) -> bytes:
    return header(MSG_BS_QUERY, **hk) + struct.pack("<I", rank)


def hello(rank: int, layout: Layout, worker_addr: bytes, tcp_rx_seg: int = 512 << 10,
          **hk) -> bytes:
    """HELLO as a decode sends it; tcp_rx_seg (the decode's UCX tcp receive
    buffer size) is on the wire only when > 0, as the optional fields'
    flags byte (1: tcp receive size) and the size."""
    return (header(MSG_HELLO, **hk) + struct.pack("<I", rank) + wire_layout(layout)
            + struct.pack("<I", len(worker_addr)) + worker_addr
            + (struct.pack("<BI", 1, tcp_rx_seg) if tcp_rx_seg else b""))


def sib_fail(room: int, code: int, origin: int, reason: bytes, peer: bytes = b"",
             **hk) -> bytes:
    return (header(MSG_SIB_FAIL, **hk) + struct.pack("<QQHi", room, 0, code, origin)
            + wire_str(reason) + wire_str(peer))


def relay_for_rank0(res, bootstrap_address: str, epoch: int) -> "Dealer":
    """A bound DEALER registered with the bootstrap server as prefill rank 0
    (instance epoch): a decode resolving rank 0 sends it its HELLO."""
    relay = res.dealer("tcp://127.0.0.1:*", bind=True, recv_timeout_ms=5000)
    reg = res.dealer("tcp://" + bootstrap_address)
    reg.send(header(MSG_BS_REGISTER, epoch=epoch) + struct.pack("<I", 0)
             + wire_str(relay.endpoint.encode()))
    assert parse_header(reg.recv())[2] == MSG_BS_REGISTER_OK
    return relay


class FakeSibling:
    """A sibling rank of a manager, on raw sockets: it listens at the
    endpoint the manager is told about (a bound DEALER), answers the
    manager's PINGs there with PONG (its epoch and rank), and sends to the
    manager's ROUTER under its routing id (epoch, rank), as a real sibling
    does.  With key, everything it sends is sealed."""

    def __init__(self, res, epoch: int, rank: int = 1, key: Optional[bytes] = None):
        self.res, self.epoch, self.rank, self.key, self.seq = res, epoch, rank, key, 0
        self.listen = res.dealer("tcp://127.0.0.1:*", bind=True, recv_timeout_ms=5000)
        self.endpoint = self.listen.endpoint
        self.out = None

    def _sealed(self, msg: bytes) -> bytes:
        if self.key is None:
            return msg
        self.seq += 1
        return seal(msg, self.key, self.seq)

    def attach(self, mgr) -> None:
        """Becomes mgr's only sibling and answers its first PING."""
        mgr.set_siblings([self.endpoint])
        self.answer()
        self.out = self.res.dealer(mgr.endpoint,
                                   routing_id=struct.pack("<QI", self.epoch, self.rank))

    def answer(self) -> None:
        """Answers the manager's next PING on the sibling endpoint (what it
        sent before, its own SIB_FAILs, is skipped)."""
        while True:
            m = self.listen.recv()
            assert m is not None, "no PING from the manager"
            if self.key is not None:
                m = unseal(m, self.key)[0]
            if parse_header(m)[2] == MSG_PING:
                break
        self.listen.send(self._sealed(header(MSG_PONG, epoch=self.epoch)
                                      + struct.pack("<I", self.rank)))

    def send(self, msg: bytes) -> None:
        self.out.send(self._sealed(msg))

    def fail(self, room: int, code: int, reason: bytes, peer: bytes = b"") -> None:
        self.send(sib_fail(room, code, self.rank, reason, peer, epoch=self.epoch))


# --------------------------------------------------------------------------
# A prefill rank in a child process
# --------------------------------------------------------------------------


def _prefill_child_main(conn, layout: Layout, rank: int, seed: int, bootstrap_addr: str,
                        env: Dict[str, str], config: Dict[str, int]) -> None:
    """Child process: owns a prefill KVManager; answers commands on conn."""
    os.environ.update(env)
    from kvrecv import KVConfig, KVManager, KVPoll, KVSender

    side = Side(layout, rank, seed)
    mgr = KVManager(side.args(), "prefill", bootstrap_addr=bootstrap_addr,
                    config=KVConfig(**config))
    senders: Dict[int, KVSender] = {}
    conn.send(("ready", {"endpoint": mgr.endpoint, "transport": mgr.transport,
                         "pid": os.getpid()}))
    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                elif cmd == "send":
                    # arg: list of (room, num_pages, aux_index, [chunk, ...])
                    for room, num, aux, chunks in arg:
                        s = senders.get(room)
                        if s is None:
                            s = senders[room] = KVSender(mgr, bootstrap_addr, room)
                        s.init(num, aux)
                        for c in chunks:
                            s.send(np.asarray(c, dtype=np.int32))
                    conn.send(("ok", None))
                elif cmd == "wait":
                    rooms, timeout = arg
                    rs = [senders[r] for r in rooms]
                    wait_all(rs, (KVPoll.Success, KVPoll.Failed), timeout)
                    conn.send(("ok", {r: (int(s.poll()), describe_failure(s))
                                      for r, s in zip(rooms, rs)}))
                elif cmd == "clear":
                    for r in arg:
                        senders.pop(r).clear()
                    conn.send(("ok", None))
                elif cmd == "stats":
                    conn.send(("ok", mgr.stats()))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        senders.clear()
        mgr.close()


class ChildError(AssertionError):
    pass


class ChildPrefill:
    """Parent side of a prefill rank in a spawned child process."""

    def __init__(self, layout: Layout, rank: int, seed: int, bootstrap_addr: str,
                 env: Optional[Dict[str, str]] = None, config: Optional[Dict[str, int]] = None,
                 start_timeout: float = 60.0):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.layout = layout
        self.rank = rank
        self.seed = seed
        env = dict(env or {})
        env.setdefault("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
        self.proc = ctx.Process(
            target=_prefill_child_main,
            args=(child_conn, layout, rank, seed, bootstrap_addr, env,
                  dict(ROBUST_CONFIG, **(config or {}))),
            daemon=True,
            name=f"kvrecv-prefill-rank{rank}",
        )
        self.proc.start()
        child_conn.close()
        kind, info = self._recv(start_timeout)
        if kind != "ready":
            raise ChildError(f"prefill child failed to start: {info}")
        self.endpoint = info["endpoint"]
        self.transport = info["transport"]

    def side(self) -> Side:
        """The child's source memory, rebuilt from the same seed."""
        return Side(self.layout, self.rank, self.seed)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise ChildError(f"prefill child rank {self.rank} did not answer within {timeout}s "
                             f"(alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(2)
            raise ChildError(f"prefill child rank {self.rank} died "
                             f"(exitcode={self.proc.exitcode})") from None

    def call(self, cmd: str, arg=None, timeout: float = 30.0):
        self.conn.send((cmd, arg))
        kind, value = self._recv(timeout)
        if kind != "ok":
            raise ChildError(f"prefill child rank {self.rank}: {value}")
        return value

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", None))
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError, BrokenPipeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
