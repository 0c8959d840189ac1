"""What a peer on the control plane must not be able to do with messages
that are well formed: end a prefill's room as Success before its data left,
take over another decode's routing id, or fail rooms as a sibling it is
not.  Forged traffic comes from raw ZMQ sockets (tests/kvtest.py); the
managers are real."""

from __future__ import annotations

import struct

import pytest

from kvrecv import KVPoll, KVProtocolError, KVReceiver, KVSender
from kvtest import (
    MSG_BS_REGISTER,
    MSG_BS_REGISTER_OK,
    MSG_HELLO,
    MSG_HELLO_OK,
    MSG_ROOM_DONE,
    SMALL,
    Side,
    header,
    parse_header,
    room_req,
    terminal,
    wait_for,
    wait_until,
    wire_str,
)
from test_peer_input import fail_reason
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
    relay = res.dealer("tcp://127.0.0.1:*", bind=True, recv_timeout_ms=5000)
    reg = res.dealer("tcp://" + bs.address)
    reg.send(header(MSG_BS_REGISTER, epoch=relay_epoch) + struct.pack("<I", 0)
             + wire_str(relay.endpoint.encode()))
    assert parse_header(reg.recv())[2] == MSG_BS_REGISTER_OK
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


@pytest.mark.parametrize("given", [0, 1])
def test_room_done_before_the_data_was_sent_is_protocol(res, given):
    """A decode that reports every byte landed while the prefill has sent
    none (or part) of the room: the prefill's room fails with PROTOCOL, it
    never becomes Success, and the decode is told why."""
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=1), "prefill", bs.address)
    hello_msg, _ = real_decode_hello(res)
    d = decode_at(res, prefill, hello_msg, 5)
    d.send(room_req(42, 111, -1, [1, 2], epoch=5))
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 1)
    s = KVSender(prefill, bs.address, 42)
    s.init(2)
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
