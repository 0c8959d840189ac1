"""What a peer's control messages must not be able to do: crash a
scheduler's error handling, grow a manager's memory without bound, take over
another decode's request, or make the engine work before it authenticated
them.  Forged traffic comes from raw ZMQ DEALER sockets (tests/kvtest.py),
the managers are real."""

from __future__ import annotations

import logging
import struct
import time

import pytest

from kvrecv import BootstrapServer, KVPoll, KVReceiver, KVTransferError
from kvtest import (
    FakeSibling,
    MSG_HELLO_OK,
    MSG_HELLO_REJECT,
    MSG_PONG,
    MSG_ROOM_FAIL,
    SMALL,
    Side,
    hello,
    parse_header,
    ping,
    room_fail,
    room_req,
    terminal,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)


def test_reason_not_utf8_still_raises_kvtransfererror(res, caplog):
    """A sibling's reason with bytes that are not UTF-8, and one cut in the
    middle of a character at the registry's 384 bytes: failure_exception()
    raises KVTransferError (never UnicodeDecodeError), and the log pump keeps
    working afterwards."""
    caplog.set_level(logging.DEBUG, logger="kvrecv")
    bs = res.server()
    decode = res.manager(Side(SMALL, 0), "decode")
    sib = FakeSibling(res, 0x51B)
    sib.attach(decode)
    cut = b"x" * 382 + "\u00e9".encode()  # 384 bytes: the copy keeps 383
    for room, reason, want in ((7, b"bad \xff\xfe bytes", "bad \ufffd\ufffd bytes"),
                               (8, cut, "x" * 382)):
        r = KVReceiver(decode, bs.address, room)
        r.init()
        sib.fail(room, 6, reason, b"peer \xc3")
        assert wait_for(r, terminal()) == KVPoll.Failed
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        assert ei.value.failure_reason == want
        assert ei.value.is_from_another_rank
        r.clear()
    # The pump survived: a record written after them arrives.
    caplog.clear()
    r = KVReceiver(decode, bs.address, 9)
    r.init()
    r.abort()
    assert wait_until(lambda: any("aborted by decode rank 0" in m.getMessage()
                                  for m in caplog.records), 5)


def test_failures_for_rooms_never_opened_are_bounded(res):
    """5000 SIB_FAIL messages for rooms this rank never opened: only the
    newest 1024 are kept (KVR_REGISTRY_EARLY_MAX), so the oldest room ids
    open clean, and a room among the newest still gets its sibling's cause."""
    bs = res.server()
    decode = res.manager(Side(SMALL, 0), "decode")
    sib = FakeSibling(res, 0x51B)
    sib.attach(decode)
    n = 5000
    for room in range(1, n + 1):
        sib.fail(room, 6, b"injected %d" % room)
    def opened_failed(room):
        r = KVReceiver(decode, bs.address, room)
        failed = r.poll() == KVPoll.Failed
        r.clear()
        return failed

    # Room n - 1 stays open until its sibling's cause has reached it (kept
    # before the room opened, or arriving after): the messages before it,
    # on the same connection, have then all been handled.
    r = KVReceiver(decode, bs.address, n - 1)
    assert wait_until(lambda: r.poll() == KVPoll.Failed, 10)
    with pytest.raises(KVTransferError) as ei:
        r.failure_exception()
    assert ei.value.failure_reason == "injected %d" % (n - 1)
    assert ei.value.is_from_another_rank
    r.clear()
    assert not any(opened_failed(room) for room in (1, 2, 100, n - 1024 - 1))


WORKER_ADDR = b"\x00" + b"\x01" * 8 + b"\xff"  # a well-formed v1 address naming no device


def forged_decode(res, prefill, epoch: int):
    """A DEALER that said HELLO to prefill as decode rank 0 with epoch."""
    d = res.dealer(prefill.endpoint, recv_timeout_ms=5000)
    d.send(hello(0, SMALL, WORKER_ADDR, epoch=epoch))
    assert parse_header(d.recv())[2] == MSG_HELLO_OK
    return d


def fail_reason(msg: bytes):
    assert parse_header(msg)[2] == MSG_ROOM_FAIL, parse_header(msg)
    room, tag, code = struct.unpack_from("<QQH", msg, 16)
    (n,) = struct.unpack_from("<H", msg, 16 + 22)
    return room, tag, code, msg[16 + 24:16 + 24 + n].decode()


def test_a_decode_cannot_take_over_another_decodes_pending_request(res):
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address)
    a = forged_decode(res, prefill, 5)
    b = forged_decode(res, prefill, 6)
    a.send(room_req(42, 111, -1, [1, 2], epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)
    b.send(room_req(42, 222, -1, [3, 4], epoch=6))
    room, tag, code, reason = fail_reason(b.recv())
    assert (room, tag, code) == (42, 222, 9)  # PROTOCOL
    assert reason == ("room 42: prefill rank 0 refused the request of decode rank 0 (epoch "
                      "0000000000000006): decode rank 0 (epoch 0000000000000005) already "
                      "asked for this room")
    # Neither B's ROOM_FAIL nor A's with another tag removes A's request.
    b.send(room_fail(42, 222, 6, 0, b"b gives up", b"", epoch=6))
    a.send(room_fail(42, 999, 6, 0, b"stale", b"", epoch=5))
    a.send(ping(epoch=5))
    assert parse_header(a.recv())[2] == MSG_PONG
    assert prefill.stats()["pending_requests"] == 1
    a.send(room_fail(42, 111, 6, 0, b"a gives up", b"", epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 0)


def hello_reject(msg: bytes):
    assert parse_header(msg)[2] == MSG_HELLO_REJECT, parse_header(msg)
    rank, code = struct.unpack_from("<IH", msg, 16)
    (n,) = struct.unpack_from("<H", msg, 22)
    return code, msg[24:24 + n].decode()


def test_hellos_beyond_max_peers_are_refused_and_workers_stay_bounded(res):
    """Each HELLO costs the prefill a UCX worker: at most max_peers decode
    ranks at once; more are refused with REFUSED, and decodes that went
    away leave neither a worker nor a peer behind for the next ones."""
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address, max_peers=4,
                          heartbeat_timeout_ms=300)
    live = [forged_decode(res, prefill, 100 + i) for i in range(4)]
    extra = res.dealer(prefill.endpoint, recv_timeout_ms=5000)
    extra.send(hello(0, SMALL, WORKER_ADDR, epoch=200))
    code, reason = hello_reject(extra.recv())
    assert code == 10  # REFUSED
    assert reason == (f"prefill rank 0 ({prefill.endpoint}) refused decode rank 0 (epoch "
                      f"00000000000000c8): it already serves 4 decode ranks (max_peers=4)")
    assert prefill.stats()["ucx_workers"] <= 4
    # The four go silent: the heartbeat timeout fails them; 20 decodes more,
    # four at a time, reuse what they left.
    for d in live:
        d.close()
    for wave in range(5):
        time.sleep(0.5)
        assert wait_until(lambda: prefill.stats()["ucx_workers"] == 0, 10), prefill.stats()
        for i in range(4):
            d = forged_decode(res, prefill, 1000 + 10 * wave + i)
            d.close()
    st = prefill.stats()
    assert st["ucx_workers"] <= 4 and st["ucx_workers_created"] == 24, st
    assert st["peers"] <= 5, st  # the four, the refused one: reused since


def test_a_request_for_more_pages_than_registered_is_refused(res):
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address)
    d = forged_decode(res, prefill, 5)
    d.send(room_req(42, 111, -1, list(range(SMALL.num_pages)) + [0], epoch=5))
    room, tag, code, reason = fail_reason(d.recv())
    assert (room, tag, code) == (42, 111, 10)  # REFUSED
    assert reason == ("room 42: prefill rank 0 refused the request of decode rank 0 (epoch "
                      "0000000000000005): it asks for 33 pages, more than the 32 this "
                      "prefill has registered")
    assert prefill.stats()["pending_requests"] == 0
    d.send(room_req(43, 112, -1, list(range(SMALL.num_pages)), epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)


def test_large_messages_other_than_requests_are_refused_before_authentication(res):
    """With a secret set, a 1 MiB HELLO is refused as oversized (only a room
    request may exceed 64 KiB) before its MAC is computed: it counts as
    oversized, not as a failed authentication."""
    bs = BootstrapServer("127.0.0.1", 0, secret="a secret")
    res._servers.append(bs)
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address,
                          secret="a secret")
    d = res.dealer(prefill.endpoint)
    big = hello(0, SMALL, WORKER_ADDR + b"\x00" * (1 << 20), epoch=5)
    d.send(big)
    d.send(big[:16] + b"\x00" * 1000)  # small and unsealed: an authentication failure
    assert wait_until(lambda: prefill.stats()["auth_rejected"] == 1), prefill.stats()
    st = prefill.stats()
    assert st["ctrl_oversized"] == 1 and st["auth_rejected"] == 1, st
