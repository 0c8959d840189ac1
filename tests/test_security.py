"""Authentication of control messages (a shared secret, HMAC-SHA256), the
binding of a decode room's pages to the prefill it asked, and the bounds a
decode peer meets on the prefill side.  Everything goes over real ZMQ and
UCX on 127.0.0.1; forged traffic comes from raw ZMQ DEALER sockets."""

from __future__ import annotations

import logging
import struct
import time

import numpy as np
import pytest

from kvrecv import (
    BootstrapServer,
    KVBootstrapError,
    KVPoll,
    KVProtocolError,
    KVReceiver,
    KVRefusedError,
    KVSender,
    KVTransportError,
)
from kvtest import (
    MSG_BS_QUERY_REPLY,
    MSG_HELLO,
    MSG_HELLO_OK,
    MSG_PONG,
    MSG_ROOM_FAIL,
    MSG_ROOM_REQ,
    SECRET,
    SMALL,
    STD,
    TCP_NO_EAGER_FRAGMENT,
    Side,
    assert_all_canary,
    auth_reject_reason,
    bs_query,
    describe_failure,
    hello,
    parse_header,
    ping,
    relay_for_rank0,
    room_req,
    seal,
    terminal,
    unseal,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

KEY = SECRET


def server(res, secret=None) -> BootstrapServer:
    bs = BootstrapServer("127.0.0.1", 0, secret=secret)
    res._servers.append(bs)
    return bs


def transfer_ok(prefill, decode, addr, src, dst, room, dpages=(3, 1, 2), spages=(10, 11, 12)):
    expected = dst.snapshot()
    r = KVReceiver(decode, addr, room)
    s = KVSender(prefill, addr, room)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r)
    r.send_metadata(list(dpages), aux_index=4)
    s.init(len(spages), aux_index=5)
    s.send(list(spages))
    assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
    assert wait_for(s, terminal()) == KVPoll.Success, describe_failure(s)
    expected.apply(src, list(spages), list(dpages), 5, 4)
    expected.check(dst)
    r.clear()
    s.clear()


def warnings_with(caplog, *words):
    return [r.getMessage() for r in caplog.records
            if r.name == "kvrecv" and r.levelno == logging.WARNING
            and all(w in r.getMessage() for w in words)]


# --------------------------------------------------------------------------
# A: authentication
# --------------------------------------------------------------------------


def test_transfer_with_a_shared_secret_from_the_environment(res, monkeypatch):
    monkeypatch.setenv("KVRECV_SECRET", KEY.decode())
    bs = server(res)  # secret=None: KVRECV_SECRET
    src, dst = Side(SMALL, 0, seed=3), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode")
    transfer_ok(prefill, decode, bs.address, src, dst, 1)
    for m in (prefill, decode):
        st = m.stats()
        assert st["auth_rejected"] == 0 and st["auth_refused_by_peer"] == 0, st
        assert st["ctrl_dropped"] == 0, st
    assert bs.stats()["auth_rejected"] == 0 and bs.stats()["registrations"] == 1


def test_bootstrap_server_answers_only_sealed_queries(res):
    bs = server(res, KEY)
    d = res.dealer("tcp://" + bs.address, recv_timeout_ms=2000)
    d.send(bs_query(3))  # no secret: refused, answered with AUTH_REJECT
    reason = auth_reject_reason(d.recv())
    assert "authentication failed at the bootstrap server" in reason and "KVRECV_SECRET" in reason
    assert bs.stats()["auth_rejected"] == 1 and bs.stats()["dropped"] == 1
    assert "127.0.0.1" in bs.stats()["last_auth_rejected"]
    d.send(seal(bs_query(3, epoch=77), KEY, 1))
    body, seq = unseal(d.recv(), KEY)  # the reply is sealed too
    assert parse_header(body)[2] == MSG_BS_QUERY_REPLY and seq >= 1
    assert struct.unpack_from("<IB", body, 16) == (3, 0)
    assert bs.stats()["auth_rejected"] == 1


@pytest.mark.parametrize("deployment,decode_secret", [
    (KEY, b"another secret"),
    (KEY, None),
    (None, KEY),
], ids=["different", "decode_has_none", "only_decode_has_one"])
def test_decode_with_a_mismatched_secret_fails_fast_with_the_reason(res, deployment,
                                                                    decode_secret):
    bs = server(res, deployment or "")
    src, dst = Side(SMALL, 0, seed=4), Side(SMALL, 0)
    res.manager(src, "prefill", bs.address, secret=deployment or "")
    decode = res.manager(dst, "decode", secret=decode_secret or "")
    r = KVReceiver(decode, bs.address, 9)
    t0 = time.monotonic()
    r.init()
    assert wait_for(r, terminal(), timeout=10) == KVPoll.Failed
    assert time.monotonic() - t0 < 5, "must not wait for the 20 s bootstrap timeout"
    with pytest.raises(KVBootstrapError) as ei:
        r.failure_exception()
    reason = ei.value.failure_reason
    assert "authentication failed at the bootstrap server" in reason, reason
    assert "KVRECV_SECRET" in reason and "room 9" in reason, reason
    assert decode.stats()["auth_refused_by_peer"] >= 1
    assert bs.stats()["auth_rejected"] >= 1
    assert decode.stats()["bytes_moved"] == 0
    assert_all_canary(dst)


def test_prefill_with_another_secret_cannot_register_and_says_why(res, caplog):
    caplog.set_level(logging.WARNING, logger="kvrecv")
    bs = server(res, KEY)
    src = Side(SMALL, 0, seed=5)
    prefill = res.manager(src, "prefill", bs.address, secret="not the deployment's")
    s = KVSender(prefill, bs.address, 5)
    s.init(2)
    assert wait_for(s, terminal(), timeout=10) == KVPoll.Failed
    with pytest.raises(KVBootstrapError) as ei:
        s.failure_exception()
    reason = ei.value.failure_reason
    assert "cannot register with the bootstrap server" in reason, reason
    assert "authentication failed" in reason and "KVRECV_SECRET" in reason, reason
    assert prefill.stats()["auth_refused_by_peer"] >= 1
    assert bs.stats()["registrations"] == 0 and bs.stats()["auth_rejected"] >= 1
    assert wait_until(lambda: warnings_with(caplog, "cannot register", "authentication failed"))


def forged_cases():
    rng = np.random.default_rng(11)
    good = seal(ping(rank=1, epoch=0xABC), KEY, 1)
    flip_tag = bytearray(good)
    flip_tag[-1] ^= 1
    flip_body = bytearray(good)
    flip_body[17] ^= 1  # the rank
    return {
        "plain_ping": ping(),
        "plain_hello": hello(0, SMALL, b"\x01" * 32),
        "plain_room_req": room_req(5, 1, -1, [0, 1]),
        "random_100_bytes": rng.bytes(100),
        "sealed_with_another_key": seal(ping(epoch=0xABC), b"guess", 1),
        "flipped_tag_bit": bytes(flip_tag),
        "flipped_body_bit": bytes(flip_body),
        "trailer_cut_short": good[:-1],
        "flag_without_trailer": seal(ping(), KEY, 1)[:20],
    }


def test_unauthenticated_and_forged_messages_are_refused_counted_and_logged(res, caplog):
    caplog.set_level(logging.WARNING, logger="kvrecv")
    bs = server(res, KEY)
    src, dst = Side(SMALL, 0, seed=6), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bs.address, secret=KEY)
    decode = res.manager(dst, "decode", secret=KEY)
    d = res.dealer(prefill.endpoint, recv_timeout_ms=2000)
    cases = forged_cases()
    for i, (name, msg) in enumerate(cases.items()):
        d.send(msg)
        if name != "flag_without_trailer":  # too short to be a sealed message
            reply = d.recv()
            assert reply is not None, f"{name}: no AUTH_REJECT"
            reason = auth_reject_reason(reply)
            assert "authentication failed at the kvrecv manager" in reason, (name, reason)
        assert wait_until(lambda: prefill.stats()["auth_rejected"] == i + 1), \
            (name, prefill.stats())
    st = prefill.stats()
    assert st["auth_rejected"] == len(cases) and st["ctrl_dropped"] == len(cases)
    assert st["peers"] == 0 and st["pending_requests"] == 0 and st["rooms_open"] == 0
    assert wait_until(lambda: warnings_with(caplog, "refused a control message", "127.0.0.1"))
    # Nothing of it touched memory or the manager's ability to serve.
    assert_all_canary(dst)
    transfer_ok(prefill, decode, bs.address, src, dst, 7)
    assert prefill.stats()["auth_rejected"] == len(cases)


def test_replayed_and_reflected_messages_are_refused(res):
    bs = server(res, KEY)
    prefill = res.manager(Side(SMALL, 0, seed=7), "prefill", bs.address, secret=KEY)
    d = res.dealer(prefill.endpoint, recv_timeout_ms=1500)
    epoch = 0x5151

    def pong(msg, expect=True):
        before = prefill.stats()["auth_rejected"]
        d.send(msg)
        reply = d.recv()
        if expect:
            assert reply is not None, "no PONG"
            body, _ = unseal(reply, KEY)
            assert parse_header(body)[2] == MSG_PONG
            assert prefill.stats()["auth_rejected"] == before
        else:
            assert reply is None, "a replayed message was answered"
            assert prefill.stats()["auth_rejected"] == before + 1

    first = seal(ping(rank=2, epoch=epoch), KEY, 1)
    pong(first)
    pong(first, expect=False)                                         # the same bytes again
    pong(seal(ping(rank=2, epoch=epoch), KEY, 3))
    pong(seal(ping(rank=2, epoch=epoch), KEY, 2))                     # late, inside the window
    pong(seal(ping(rank=2, epoch=epoch), KEY, 2), expect=False)       # ... but only once
    pong(seal(ping(rank=2, epoch=epoch), KEY, 500))
    pong(seal(ping(rank=2, epoch=epoch), KEY, 100), expect=False)     # older than the window
    pong(seal(ping(rank=2, epoch=prefill._core.epoch), KEY, 1), expect=False)  # reflected
    # Freshness is per sender instance, not per connection.
    d2 = res.dealer(prefill.endpoint, recv_timeout_ms=1500)
    d2.send(first)
    assert d2.recv() is None
    assert prefill.stats()["auth_rejected"] == 5


def test_oversized_control_message_is_refused_and_counted(res, pair, caplog):
    caplog.set_level(logging.WARNING, logger="kvrecv")
    d = res.dealer(pair.decode.endpoint)
    d.send(b"\x00" * 100_000)  # a decode's socket takes at most 64 KiB
    assert wait_until(lambda: pair.decode.stats()["ctrl_oversized"] == 1), pair.decode.stats()
    assert pair.decode.stats()["ctrl_dropped"] == 1
    assert wait_until(lambda: warnings_with(caplog, "oversized control message (100000 bytes)",
                                            "127.0.0.1"))
    transfer_ok(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 3)


# --------------------------------------------------------------------------
# C: bounds on what one decode peer may ask of a prefill
# --------------------------------------------------------------------------


def test_rooms_over_max_rooms_per_peer_are_refused_with_the_reason(res, bootstrap, caplog):
    caplog.set_level(logging.WARNING, logger="kvrecv")
    src, dst = Side(SMALL, 0, seed=8), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bootstrap.address, max_rooms_per_peer=3)
    decode = res.manager(dst, "decode")
    recvs = [KVReceiver(decode, bootstrap.address, 100 + i) for i in range(6)]
    for r in recvs:
        r.init()
    for r in recvs:
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    for i, r in enumerate(recvs[:3]):
        r.send_metadata([i])
    assert wait_until(lambda: prefill.stats()["pending_requests"] == 3), prefill.stats()
    for i, r in enumerate(recvs[3:]):
        r.send_metadata([3 + i])
    for r in recvs[3:]:
        assert wait_for(r, terminal()) == KVPoll.Failed
        with pytest.raises(KVRefusedError) as ei:
            r.failure_exception()
        reason = ei.value.failure_reason
        assert "refused the request" in reason and "max_rooms_per_peer=3" in reason, reason
        assert "3 rooms pending or open" in reason, reason
    st = prefill.stats()
    assert st["requests_refused"] == 3 and st["pending_requests"] == 3, st
    assert wait_until(lambda: warnings_with(caplog, "max_rooms_per_peer=3"))
    # The three admitted rooms are served.
    sends = []
    for i, r in enumerate(recvs[:3]):
        assert r.poll() == KVPoll.Transferring
        s = KVSender(prefill, bootstrap.address, 100 + i)
        s.init(1)
        s.send([10 + i])
        sends.append(s)
    for r, s in zip(recvs[:3], sends):
        assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
        assert wait_for(s, terminal()) == KVPoll.Success, describe_failure(s)
    # A refused room's sender, created later, is not served either ...
    late = KVSender(prefill, bootstrap.address, 103)
    late.init(1)
    for x in recvs + sends + [late]:
        x.clear()
    # ... and clearing rooms frees the peer's quota.
    transfer_ok(prefill, decode, bootstrap.address, src, dst, 300)
    assert prefill.stats()["requests_refused"] == 3


# --------------------------------------------------------------------------
# B: a room's pages are written only by the prefill it is bound to
# --------------------------------------------------------------------------


def recv_type(dealer, mtype, tries=50):
    """The next message of type mtype (PINGs and others in between skipped)."""
    for _ in range(tries):
        m = dealer.recv()
        assert m is not None, f"no message of type {mtype}"
        if parse_header(m)[2] == mtype:
            return m
    raise AssertionError(f"no message of type {mtype} in {tries}")


def test_data_from_a_prefill_the_room_is_not_bound_to_is_refused(res, bootstrap, caplog,
                                                                  monkeypatch):
    """A relay registers itself for rank 0 under its own epoch, so the decode
    binds its room to the relay; it hands the decode's HELLO and request to
    the real prefill, which then sends the room's data with its own epoch.
    The decode refuses every byte and fails the room with PROTOCOL: the
    sender is not the room's peer."""
    caplog.set_level(logging.WARNING, logger="kvrecv")
    # 128 STD pages (1 MiB): with tcp fragments too small for kvrecv's
    # one-fragment messages the data goes in rendezvous messages, whose
    # refusal the sender sees (a refused eager message is dropped silently).
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", TCP_NO_EAGER_FRAGMENT)
    src, dst = Side(STD, 0, seed=9), Side(STD, 0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    # Data through UCX: no cross-memory offer (its probe would read the real
    # prefill's epoch, not the relay's, and the decode would say HELLO again).
    decode = res.manager(dst, "decode", cross_memory_bytes=0)
    assert wait_until(lambda: bootstrap.stats()["registrations"] == 1)
    relay_epoch = 0x7777
    relay = relay_for_rank0(res, bootstrap.address, relay_epoch)

    r = KVReceiver(decode, bootstrap.address, 41)
    r.init()
    hello_msg = recv_type(relay, MSG_HELLO)
    decode_epoch = parse_header(hello_msg)[3]
    to_prefill = res.dealer(prefill.endpoint)
    to_prefill.send(hello_msg)
    ok = recv_type(to_prefill, MSG_HELLO_OK)
    relay.send(ok[:8] + struct.pack("<Q", relay_epoch) + ok[16:])
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r)
    r.send_metadata(list(range(100, 228)))
    req = recv_type(relay, MSG_ROOM_REQ)
    room, tag = struct.unpack_from("<QQ", req, 16)
    assert room == 41

    # Room tags are random 64-bit values, not a counter.
    r2 = KVReceiver(decode, bootstrap.address, 42)
    r2.init()
    assert wait_for(r2, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    r2.send_metadata([7])
    tag2 = struct.unpack_from("<QQ", recv_type(relay, MSG_ROOM_REQ), 16)[1]
    assert tag != tag2 and abs(tag - tag2) > 1 << 20 and max(tag, tag2) > 1 << 40

    to_prefill.send(req)
    s = KVSender(prefill, bootstrap.address, 41)
    s.init(128)
    s.send(list(range(128)))
    # It holds the room's tag (the relay passed the request on) but is not
    # the instance the room is bound to: the room fails with PROTOCOL.
    assert wait_for(r, terminal()) == KVPoll.Failed, decode.stats()
    with pytest.raises(KVProtocolError) as ei:
        r.failure_exception()
    assert ei.value.failure_reason.endswith(
        "sent a bad data message: sender epoch is not the room's prefill's")
    assert decode.stats()["bytes_moved"] == 0
    assert decode.stats()["data_rejected"] >= 1
    assert_all_canary(dst)
    # The prefill learns its data was refused; a refusing decode that says
    # nothing more (this one never heard of the sender's room) leaves it
    # with TRANSPORT after two heartbeat intervals, told to the decode.
    assert wait_for(s, KVPoll.Failed) == KVPoll.Failed, (prefill.stats(), decode.stats())
    with pytest.raises(KVTransportError) as ei:
        s.failure_exception()
    assert "Operation rejected by remote peer" in ei.value.failure_reason
    assert "the decode sent no reason within" in ei.value.failure_reason
    assert prefill.stats()["data_rejected"] >= 1
    fail = recv_type(to_prefill, MSG_ROOM_FAIL)
    assert struct.unpack_from("<QQH", fail, 16) == (41, tag, 5)  # TRANSPORT

    # C: indices a decode's registration cannot have are refused by the
    # prefill with a reason the decode sees.
    to_prefill.send(room_req(43, 99, -1, [0, -5], epoch=decode_epoch))
    fail = recv_type(to_prefill, MSG_ROOM_FAIL)
    froom, ftag, code = struct.unpack_from("<QQH", fail, 16)
    (n,) = struct.unpack_from("<H", fail, 16 + 22)
    reason = fail[16 + 24:16 + 24 + n].decode()
    assert (froom, ftag, code) == (43, 99, 9), reason  # PROTOCOL
    assert "kv_indices[1]=-5 is negative" in reason
    to_prefill.send(room_req(44, 98, -7, [0], epoch=decode_epoch))
    fail = recv_type(to_prefill, MSG_ROOM_FAIL)
    assert struct.unpack_from("<QQH", fail, 16) == (44, 98, 9)
    assert prefill.stats()["requests_refused"] == 2
    assert prefill.stats()["pending_requests"] == 0
