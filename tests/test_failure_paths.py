"""Failure causes that the scenario tests do not reach on their own: a code
from a peer that this build does not know (REMOTE), a peer that closes its
manager while rooms are bound, the prefill's own deadline, and a prefill or
a sibling rank that refuses the decode's authentication.  Real managers over
real ZMQ and UCX; forged traffic from raw DEALER sockets (tests/kvtest.py)."""

from __future__ import annotations

import logging
import re
import struct
import time

import pytest

from kvrecv import (
    BootstrapServer,
    KVBootstrapError,
    KVPeerLostError,
    KVPoll,
    KVReceiver,
    KVRemoteError,
    KVSender,
    KVTimeoutError,
)
from kvtest import (
    FakeSibling,
    MSG_BS_REGISTER,
    MSG_BS_REGISTER_OK,
    SECRET,
    SMALL,
    Side,
    assert_all_canary,
    header,
    parse_header,
    seal,
    terminal,
    unseal,
    wait_for,
    wait_until,
    wire_str,
)

pytestmark = pytest.mark.timeout(90)

KEY = SECRET
BAD_TAG = ("authentication tag does not verify (a different secret, or a forged or altered "
           "message); the secret (KVRECV_SECRET, KVConfig.secret, BootstrapServer(secret=)) "
           "must be the same on every decode, prefill and bootstrap server")


def failure(room):
    with pytest.raises(Exception) as ei:
        room.failure_exception()
    return ei.value


def bound_pair(res, rooms, **prefill_config):
    """A prefill and a decode with rooms bound (WaitingForInput on both
    sides, nothing sent yet)."""
    bs = res.server()
    src, dst = Side(SMALL, 0, seed=7), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bs.address, **prefill_config)
    decode = res.manager(dst, "decode")
    recvs, sends = {}, {}
    for i, rid in enumerate(rooms):
        r = KVReceiver(decode, bs.address, rid)
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        r.send_metadata([2 * i, 2 * i + 1])
        s = KVSender(prefill, bs.address, rid)
        s.init(2)
        recvs[rid], sends[rid] = r, s
    assert wait_until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in sends.values()))
    return prefill, decode, dst, recvs, sends


def test_a_failure_code_this_build_does_not_know_is_remote(res, caplog):
    """A sibling (of a newer build, say) reports a cause with a code this
    build has no name for: the room fails with KVRemoteError and the reason
    as sent.  A failure message with code 0 (OK) is malformed and changes
    nothing."""
    caplog.set_level(logging.WARNING, logger="kvrecv")
    bs = res.server()
    decode = res.manager(Side(SMALL, 0), "decode")
    sib = FakeSibling(res, 0x51B)
    sib.attach(decode)
    zero = KVReceiver(decode, bs.address, 30)
    zero.init()
    sib.fail(30, 0, b"room 30: nothing failed")
    r = KVReceiver(decode, bs.address, 31)
    r.init()
    sib.fail(31, 999, b"room 31: a cause from a newer build")
    assert wait_for(r, terminal()) == KVPoll.Failed
    e = failure(r)
    assert type(e) is KVRemoteError and e.code == "REMOTE", (type(e), e.code)
    assert e.failure_reason == "room 31: a cause from a newer build"
    assert e.bootstrap_room == 31 and e.is_from_another_rank
    # The code-0 message came first on the same connection: it was handled
    # (dropped as malformed) before the other failed room 31.
    assert zero.poll() != KVPoll.Failed
    assert wait_until(lambda: any(
        m.getMessage().endswith("malformed control message(s); the last (65 bytes): "
                                "failure code 0") for m in caplog.records), 5), caplog.text
    assert decode.stats()["failures_by_code"]["REMOTE"] == 1


CLOSE_TLS = {"shm": "posix,sysv,cma,self", "tcp": "tcp"}


@pytest.mark.parametrize("tls", sorted(CLOSE_TLS))
@pytest.mark.parametrize("closer", ["prefill", "decode"])
def test_a_peer_closing_its_manager_fails_the_bound_rooms(res, closer, tls, monkeypatch):
    """close() on one side while two rooms are bound: the other side's rooms
    fail with PEER_LOST naming the peer that closed, and nothing is written.
    Over tcp the closing side's endpoints used to fail on the other side
    ("lost: Endpoint timeout") before its BYE arrived, and that reason won
    in about one close in three: the BYE now goes first and an endpoint
    error of a peer that said BYE takes the BYE's reason.  Repeated, since
    the race it guards against is one of timing."""
    monkeypatch.setenv("UCX_TLS", CLOSE_TLS[tls])
    for trial in range(8 if tls == "tcp" else 1):
        rooms = (41 + 10 * trial, 42 + 10 * trial)
        prefill, decode, dst, recvs, sends = bound_pair(res, rooms)
        port = prefill.endpoint.rsplit(":", 1)[1]
        (prefill if closer == "prefill" else decode).close()
        survivors = recvs if closer == "prefill" else sends
        for rid, room in survivors.items():
            assert wait_for(room, terminal(), timeout=10) == KVPoll.Failed
            e = failure(room)
            assert type(e) is KVPeerLostError and e.code == "PEER_LOST", (
                trial, type(e), e.code, e.failure_reason)
            want = (rf"room {rid}: prefill rank 0 at 127\.0\.0\.1:{port} closed its manager"
                    if closer == "prefill" else
                    rf"room {rid}: decode rank 0 \(epoch [0-9a-f]{{16}}\) closed its manager")
            assert re.fullmatch(want, e.failure_reason), (trial, e.failure_reason)
            assert e.bootstrap_room == rid and not e.is_from_another_rank
        survivor = decode if closer == "prefill" else prefill
        if closer == "prefill":
            assert decode.stats()["bytes_moved"] == 0
        assert survivor.stats()["failures_by_code"]["PEER_LOST"] == 2
        assert_all_canary(dst)
        for room in survivors.values():
            room.clear()
        survivor.close()


def test_the_prefills_own_deadline(res):
    """The prefill's deadline passes first (the decode's is far off): the
    prefill fails with its own TIMEOUT reason, and the decode with it."""
    # deadline_floor_bps this high adds no time for the bytes: the deadline
    # is deadline_base_ms exactly.
    prefill, decode, dst, recvs, sends = bound_pair(res, (51,), deadline_base_ms=300,
                                                    deadline_floor_bps=1 << 50)
    s, r = sends[51], recvs[51]
    s.send([3])  # one of the two pages
    t0 = time.monotonic()
    assert wait_for(s, terminal(), timeout=10) == KVPoll.Failed
    el = time.monotonic() - t0
    e = failure(s)
    assert type(e) is KVTimeoutError and e.code == "TIMEOUT", (type(e), e.code)
    assert e.failure_reason == (f"room 51: no completion within its deadline of 300 ms: 1 of 2 "
                                f"pages handed to send(), {2 * SMALL.page_bytes} bytes expected")
    assert el < 5, f"the prefill's 300 ms deadline fired after {el:.3f} s"
    assert wait_for(r, terminal(), timeout=10) == KVPoll.Failed
    e = failure(r)
    assert type(e) is KVTimeoutError and e.failure_reason == (
        f"room 51: no completion within its deadline of 300 ms: 1 of 2 "
        f"pages handed to send(), {2 * SMALL.page_bytes} bytes expected")


def test_a_prefill_that_refuses_the_decodes_authentication(res):
    """The bootstrap server (secret A) names a prefill whose secret is B:
    the prefill refuses the decode's sealed HELLO, and the decode's room
    fails with BOOTSTRAP and the prefill's reason."""
    bs_a = BootstrapServer("127.0.0.1", 0, secret=KEY)
    bs_b = BootstrapServer("127.0.0.1", 0, secret=b"secret B")
    res._servers += [bs_a, bs_b]
    prefill = res.manager(Side(SMALL, 0, seed=3), "prefill", bs_b.address, secret=b"secret B")
    # Register prefill B's endpoint with server A, as a secret holder could.
    reg = res.dealer(f"tcp://{bs_a.address}", recv_timeout_ms=5000)
    ep = prefill.endpoint.encode()
    reg.send(seal(header(MSG_BS_REGISTER, epoch=0x77) + struct.pack("<I", 0) + wire_str(ep),
                  KEY, 1))
    assert parse_header(unseal(reg.recv(), KEY)[0])[2] == MSG_BS_REGISTER_OK
    dst = Side(SMALL, 0)
    decode = res.manager(dst, "decode", secret=KEY)
    r = KVReceiver(decode, bs_a.address, 61)
    r.init()
    assert wait_for(r, terminal(), timeout=10) == KVPoll.Failed
    e = failure(r)
    assert type(e) is KVBootstrapError and e.code == "BOOTSTRAP", (type(e), e.code)
    port = prefill.endpoint.rsplit(":", 1)[1]
    assert e.failure_reason == (
        f"room 61: prefill rank 0 at 127.0.0.1:{port} refused our control messages: "
        f"authentication failed at the kvrecv manager {prefill.endpoint}: {BAD_TAG}")
    assert prefill.stats()["auth_rejected"] >= 1
    assert decode.stats()["auth_refused_by_peer"] >= 1
    assert_all_canary(dst)


def test_a_sibling_that_refuses_the_decodes_authentication(res, caplog):
    """Decode rank 0 (secret A) reports a failure to a sibling whose secret
    is B: the sibling refuses it, rank 0 counts it and says so once."""
    caplog.set_level(logging.WARNING, logger="kvrecv")
    bs = BootstrapServer("127.0.0.1", 0, secret=KEY)
    res._servers.append(bs)
    d0 = res.manager(Side(SMALL, 0), "decode", secret=KEY)
    d1 = res.manager(Side(SMALL, 1), "decode", secret=b"secret B")
    d0.set_siblings([d0.endpoint, d1.endpoint])
    r = KVReceiver(d0, bs.address, 71)
    r.init()
    r.abort()  # a root cause here: reported to the siblings
    assert wait_for(r, terminal()) == KVPoll.Failed
    # Two messages refused: rank 0's PING asking who the sibling is, and
    # the SIB_FAIL.
    assert wait_until(lambda: d0.stats()["auth_refused_by_peer"] == 2, 10), d0.stats()
    assert d1.stats()["auth_rejected"] == 2
    want = (f"decode rank 0: a sibling rank refused our messages: authentication failed at "
            f"the kvrecv manager {d1.endpoint}: {BAD_TAG}")
    assert wait_until(lambda: want in [m.getMessage() for m in caplog.records
                                       if m.levelno == logging.WARNING], 5), caplog.text
