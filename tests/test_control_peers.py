"""What a peer on the control plane must not be able to do with messages
that are well formed: end a prefill's room as Success before its data left,
take over another decode's routing id, or fail rooms as a sibling it is
not.  Forged traffic comes from raw ZMQ sockets (tests/kvtest.py); the
managers are real."""

from __future__ import annotations

import ctypes
import os
import struct
import time

import pytest

from kvrecv import (
    BootstrapServer,
    KVPeerLostError,
    KVPoll,
    KVProtocolError,
    KVReceiver,
    KVSender,
    KVTransferError,
)
from kvtest import (
    MSG_HELLO,
    MSG_HELLO_OK,
    MSG_PATH_LOST,
    MSG_PONG,
    MSG_ROOM_DONE,
    MSG_ROOM_REQ,
    SECRET,
    SMALL,
    FakeSibling,
    Layout,
    Side,
    describe_failure,
    header,
    parse_header,
    ping,
    relay_for_rank0,
    room_req,
    terminal,
    wait_for,
    wait_until,
)
from test_peer_input import fail_reason, hello_reject
from test_security import recv_type

pytestmark = pytest.mark.timeout(90)


def room_done(room: int, tag: int, **hk) -> bytes:
    return header(MSG_ROOM_DONE, **hk) + struct.pack("<QQ", room, tag)


def real_decode_hello(res, relay_epoch: int = 0x7777):
    """The HELLO a real decode manager sends (its UCX worker address is one
    a prefill can reach), caught by a relay registered for rank 0 with a
    bootstrap server of its own.  Returns (hello bytes, the decode)."""
    bs = res.server()
    decode = res.manager(Side(SMALL, 0), "decode")
    relay = relay_for_rank0(res, bs.address, relay_epoch)
    r = KVReceiver(decode, bs.address, 1)
    r.init()
    return recv_type(relay, MSG_HELLO), decode


def with_epoch(msg: bytes, epoch: int) -> bytes:
    return msg[:8] + struct.pack("<Q", epoch) + msg[16:]


def decode_at(res, prefill, hello_msg: bytes, epoch: int, **kw):
    """A DEALER that said hello_msg (with epoch) to prefill and was accepted."""
    d = res.dealer(prefill.endpoint, recv_timeout_ms=5000, **kw)
    d.send(with_epoch(hello_msg, epoch))
    assert parse_header(recv_type(d, MSG_HELLO_OK))[2] == MSG_HELLO_OK
    return d


def room_with_fake_decode(res):
    """A prefill, a DEALER it accepted as decode rank 0 (epoch 5, a real
    decode's HELLO), and the prefill's sender of room 42 (2 pages) that
    DEALER requested (tag 111, pages 1 and 2)."""
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address)
    hello_msg, _ = real_decode_hello(res)
    d = decode_at(res, prefill, hello_msg, 5)
    d.send(room_req(42, 111, -1, [1, 2], epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)
    s = KVSender(prefill, bs.address, 42)
    s.init(2)
    return prefill, d, s


@pytest.mark.parametrize("given", [0, 1])
def test_room_done_before_the_data_was_sent_is_protocol(res, given):
    """A decode that reports every byte landed while the prefill has sent
    none (or part) of the room: the prefill's room fails with PROTOCOL, it
    never becomes Success, and the decode is told why."""
    prefill, d, s = room_with_fake_decode(res)
    if given:
        # Half of the room is handed over; the other page never is.
        s.send([3])
        assert wait_until(lambda: prefill.stats()["rma_ops_posted"] >= 1 or s.poll() == KVPoll.Failed)
    d.send(room_done(42, 111, epoch=5))
    assert wait_for(s, terminal()) == KVPoll.Failed, prefill.stats()
    with pytest.raises(KVProtocolError) as ei:
        s.failure_exception()
    want = ("room 42: decode rank 0 (epoch 0000000000000005) reported every byte landed "
            "before the prefill sent them (%d of 2 pages posted)" % (given and 1))
    assert ei.value.failure_reason == want
    room, tag, code, reason = fail_reason(d.recv())
    assert (room, tag, code, reason) == (42, 111, 9, want)
    assert prefill.stats()["rooms_succeeded"] == 0


def test_prefill_that_dropped_its_data_path_fails_the_decode_room_at_once(res):
    """A prefill that found its data path to a decode stalled while the
    control channel still answered fails its rooms with that decode, closes
    its side of the data path and says so (PATH_LOST).  The decode fails
    its room with that prefill at once, PEER_LOST with that cause -- not
    when the dead connection errors out, which failed a room opened after
    the path came back (tests/test_netns.py's blackholed data path, with
    2 MiB tcp fragments: nothing was in flight on the decode).  Here
    the decode's room is bound to a relay that passes its HELLO to a real
    prefill and then says PATH_LOST."""
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address)
    # No cross-memory offer: its probe would read the real prefill's epoch,
    # not the relay's (test_security.py, the same relay).
    decode = res.manager(Side(SMALL, 0), "decode", heartbeat_timeout_ms=30000,
                         cross_memory_bytes=0)
    assert wait_until(lambda: bs.stats()["registrations"] == 1)
    relay_epoch = 0x7777
    relay = relay_for_rank0(res, bs.address, relay_epoch)
    r = KVReceiver(decode, bs.address, 41)
    r.init()
    to_prefill = res.dealer(prefill.endpoint)
    to_prefill.send(recv_type(relay, MSG_HELLO))
    relay.send(with_epoch(recv_type(to_prefill, MSG_HELLO_OK), relay_epoch))
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r)
    r.send_metadata([1, 2])
    recv_type(relay, MSG_ROOM_REQ)
    t0 = time.monotonic()
    relay.send(header(MSG_PATH_LOST, epoch=relay_epoch) + struct.pack("<I", 0))
    assert wait_for(r, terminal()) == KVPoll.Failed, describe_failure(r)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(KVPeerLostError) as ei:
        r.failure_exception()
    port = relay.endpoint.rsplit(":", 1)[1]
    assert ei.value.failure_reason == (
        f"room 41: prefill rank 0 at 127.0.0.1:{port} lost: it found its data path to this "
        "decode stalled while the control channel still answered, and dropped it"), \
        ei.value.failure_reason
    assert ei.value.is_from_another_rank is False


def test_decode_that_dropped_its_data_path_fails_the_prefill_room_at_once(res):
    """The other way: a decode says PATH_LOST (it found the data path
    stalled and dropped it); the prefill fails its room with that decode at
    once, PEER_LOST with that cause."""
    prefill, d, s = room_with_fake_decode(res)
    assert wait_for(s, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    t0 = time.monotonic()
    d.send(header(MSG_PATH_LOST, epoch=5) + struct.pack("<I", 0))
    assert wait_for(s, terminal()) == KVPoll.Failed, describe_failure(s)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(KVPeerLostError) as ei:
        s.failure_exception()
    assert ei.value.failure_reason == (
        "room 42: decode rank 0 (epoch 0000000000000005) lost: it found its data path to this "
        "prefill stalled while the control channel still answered, and dropped it"), \
        ei.value.failure_reason


def decode_ident(mgr) -> bytes:
    """A decode manager's routing id on the prefills' ROUTERs: epoch, rank."""
    return struct.pack("<QI", mgr._core.epoch, 0)


def test_a_connection_reusing_a_live_decodes_routing_id_cannot_take_it_over(res):
    """A second connection names a live decode's routing id and says HELLO
    as another instance with a worker of its own, between the decode's
    HELLO and its request: it is not heard at all (not even its PING), and
    the decode's room still arrives byte-exact."""
    bs = res.server()
    src, dst = Side(SMALL, 0, seed=3), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode")
    r = KVReceiver(decode, bs.address, 7)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    hello_msg, _ = real_decode_hello(res)
    thief = res.dealer(prefill.endpoint, recv_timeout_ms=1000, routing_id=decode_ident(decode))
    thief.send(with_epoch(hello_msg, 0x666))
    assert thief.recv() is None  # no HELLO_OK, no HELLO_REJECT: not heard
    thief.send(ping(epoch=0x666))
    assert thief.recv() is None
    want = dst.snapshot()
    dst_pages, src_pages = [5, 9, 10], [1, 2, 30]
    want.apply(src, src_pages, dst_pages, 3, 4)
    r.send_metadata(dst_pages, 4)
    s = KVSender(prefill, bs.address, 7)
    s.init(3, 3)
    s.send(src_pages)
    assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
    assert wait_for(s, terminal()) == KVPoll.Success, describe_failure(s)
    want.check(dst)


def test_a_hello_under_a_live_peers_routing_id_is_refused_until_it_died(res):
    """Decode instance A (epoch 5) holds a routing id and has a request
    pending; its connection closes without a word.  Instance B (epoch 6)
    says HELLO under the same id while A is alive: HELLO_REJECT naming A,
    and A's request stays.  Once A is silent past the heartbeat timeout, B's
    HELLO is accepted (a restarted decode reclaims its id) and A's request
    is gone."""
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address,
                          heartbeat_interval_ms=100, heartbeat_timeout_ms=2000)
    hello_msg, _ = real_decode_hello(res)
    rid = b"\x01decode-x"
    a = decode_at(res, prefill, hello_msg, 5, routing_id=rid)
    a.send(room_req(42, 111, -1, [1, 2], epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)
    a.close()
    b = res.dealer(prefill.endpoint, recv_timeout_ms=5000, routing_id=rid)
    b.send(with_epoch(hello_msg, 6))
    code, reason = hello_reject(b.recv())
    assert code == 10  # REFUSED
    assert reason.startswith(
        f"prefill rank 0 ({prefill.endpoint}) refused decode rank 0 (epoch 0000000000000006): "
        "its routing id belongs to decode rank 0 (epoch 0000000000000005), which is alive "
        "(heard "), reason
    assert prefill.stats()["pending_requests"] == 1
    # A is declared lost after 2 s of silence: its request goes with it.
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 0, 10), prefill.stats()
    b.send(with_epoch(hello_msg, 6))
    assert parse_header(recv_type(b, MSG_HELLO_OK))[2] == MSG_HELLO_OK
    b.send(room_req(43, 112, -1, [1, 2], epoch=6))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)


@pytest.mark.parametrize("key", [None, SECRET], ids=["plain", "secret"])
def test_sib_fail_is_taken_only_from_a_configured_sibling(res, key):
    """A SIB_FAIL for an open room from a connection that is not the
    configured sibling -- its own epoch, or the sibling's epoch under
    another routing id (with a secret: sealed, so it authenticated, but not
    as the sibling) -- is refused, counted and logged, and the room stays
    open; the sibling's own SIB_FAIL fails it with the sibling's reason."""
    bs = BootstrapServer("127.0.0.1", 0, secret=key)
    res._servers.append(bs)
    cfg = {} if key is None else {"secret": key}
    decode = res.manager(Side(SMALL, 0), "decode", **cfg)
    sib = FakeSibling(res, 0x51B, key=key)
    sib.attach(decode)
    r = KVReceiver(decode, bs.address, 7)
    r.init()
    for epoch, rid in ((0x666, b"\x00stranger"), (0x51B, b"\x00stranger2")):
        stranger = FakeSibling(res, epoch, key=key)
        stranger.out = res.dealer(decode.endpoint, routing_id=rid)
        # Sealed messages are fresh per sender epoch: one that poses under
        # the sibling's epoch goes on from the sibling's sequence numbers.
        stranger.seq = sib.seq if epoch == sib.epoch else 0
        refused = decode.stats()["sib_fail_refused"]
        stranger.fail(7, 6, b"room 7: forged")
        if epoch == sib.epoch:
            sib.seq = stranger.seq
        assert not wait_until(lambda: r.poll() == KVPoll.Failed, 0.5), r.failure_exception()
        sib.answer()  # the round of PINGs the unknown sender started
        assert wait_until(lambda: decode.stats()["sib_fail_refused"] == refused + 1, 10), \
            decode.stats()
        assert r.poll() != KVPoll.Failed
    sib.fail(7, 6, b"room 7: the sibling's cause")
    assert wait_for(r, terminal()) == KVPoll.Failed
    with pytest.raises(KVTransferError) as ei:
        r.failure_exception()
    assert ei.value.failure_reason == "room 7: the sibling's cause"
    assert ei.value.is_from_another_rank
    assert decode.stats()["sib_fail_refused"] == 2


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_the_largest_requests_stays_within_the_queue_bound(res, monkeypatch):
    """A sender without the secret floods a prefill (in a child process)
    with room requests of the largest size its socket takes (4 MiB: it
    registered 2^20 pages), each of which costs the engine an HMAC before
    it is refused.  ZMQ queues at most ctrl_queue_bytes of them for the
    engine: the child's memory grows by less than that plus one message in
    reading, and every message is still handled (refused, counted) once
    the engine catches up."""
    layout = Layout((4,), 1 << 20)
    bs = BootstrapServer("127.0.0.1", 0, secret=SECRET)
    res._servers.append(bs)
    queue = 32 << 20
    # Under AddressSanitizer (scripts/sanitize.sh) freed messages would stay
    # in its quarantine and count as the child's memory.
    monkeypatch.setenv("ASAN_OPTIONS",
                       os.environ.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=0")
    child = res.child_prefill(layout, 0, None, bs.address,
                              config={"secret": SECRET.decode(), "ctrl_queue_bytes": queue})
    pid = child.proc.pid
    msg = bytearray(room_req(1, 1, -1, [0] * (1 << 20), epoch=0x777))
    msg[7] |= 0x80  # sealed, with a tag that does not verify
    msg += b"\x00" * 40
    buf = ctypes.create_string_buffer(bytes(msg), len(msg))
    flood = res.dealer(child.endpoint, sndhwm=1)
    base = _rss(pid)
    peak, sent, t0 = base, 0, time.monotonic()
    while sent < 100 and time.monotonic() - t0 < 60:
        if flood.try_send(buf):
            sent += 1
        else:
            time.sleep(0.002)
        peak = max(peak, _rss(pid))
    assert sent == 100, f"only {sent} sent in 60 s"
    assert wait_until(lambda: child.call("stats")["auth_rejected"] == sent, 60), \
        child.call("stats")
    grew = peak - base
    print(f"flood of {sent} x {len(msg)} bytes: the prefill grew by {grew >> 20} MiB "
          f"(ctrl_queue_bytes {queue >> 20} MiB)")
    assert grew < queue + 2 * len(msg) + (16 << 20), grew


def test_a_decode_whose_routing_id_is_still_held_says_hello_again(res):
    """The prefill's ROUTER still holds the decode's routing id for a
    connection the decode no longer has (its link died without a FIN): the
    decode's HELLO on its new connection is not heard.  Once that stale
    connection is gone, the decode's next HELLO, on a fresh connection
    after heartbeat_timeout_ms, is answered and its room arrives
    byte-exact."""
    bs = res.server()
    src, dst = Side(SMALL, 0, seed=4), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode", heartbeat_timeout_ms=1000)
    stale = res.dealer(prefill.endpoint, routing_id=decode_ident(decode))
    stale.send(ping(epoch=decode._core.epoch))
    assert parse_header(stale.recv())[2] == MSG_PONG
    r = KVReceiver(decode, bs.address, 7)
    r.init()
    assert not wait_until(lambda: r.poll() != KVPoll.Bootstrapping, 0.5)
    stale.close()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed), 10) == KVPoll.WaitingForInput, \
        describe_failure(r)
    want = dst.snapshot()
    want.apply(src, [1, 2], [3, 4])
    r.send_metadata([3, 4])
    s = KVSender(prefill, bs.address, 7)
    s.init(2)
    s.send([1, 2])
    assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
    want.check(dst)
