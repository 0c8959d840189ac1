"""Control messages from the network that are malformed, truncated, of the
wrong version or from nobody the manager knows are dropped and counted,
never crash anything, and leave the manager able to transfer."""

from __future__ import annotations

import pathlib
import struct
import time

import numpy as np
import pytest

from kvrecv import KVPoll, KVReceiver, KVSender
from kvtest import (
    MAGIC,
    MSG_BS_QUERY,
    MSG_BS_QUERY_REPLY,
    MSG_BS_REGISTER,
    MSG_BS_REGISTER_OK,
    MSG_BYE,
    MSG_HELLO,
    MSG_HELLO_OK,
    MSG_HELLO_REJECT,
    MSG_PING,
    MSG_PONG,
    MSG_ROOM_DONE,
    MSG_ROOM_FAIL,
    MSG_ROOM_REQ,
    SMALL,
    STD,
    Layout,
    Side,
    bs_query,
    describe_failure,
    header,
    hello,
    parse_header,
    ping,
    room_fail,
    room_req,
    terminal,
    wait_for,
    wait_until,
    wire_layout,
    wire_str,
)


pytestmark = pytest.mark.timeout(60)


def u32(v):
    return struct.pack("<I", v)


def malformed_cases():
    """Messages no decoder may accept, each sent as a list of frames."""
    rng = np.random.default_rng(4)
    rnd16 = rng.bytes(16)
    assert struct.unpack_from("<I", rnd16)[0] != MAGIC
    c = {
        "empty": [b""],
        "one_byte": [b"\x4b"],
        "header_minus_one_byte": [header(MSG_PING)[:15]],
        "random_16_bytes": [rnd16],
        "random_4096_bytes": [rng.bytes(4096)],
        "random_1MiB": [rng.bytes(1 << 20)],
        "bad_magic": [header(MSG_PING, magic=MAGIC ^ 1) + u32(0)],
        "big_endian_magic": [struct.pack(">IHHQ", MAGIC, 1, MSG_PING, 1) + u32(0)],
        "version_0": [header(MSG_PING, version=0) + u32(0)],
        "version_2": [header(MSG_PING, version=2) + u32(0)],
        "version_ffff": [header(MSG_PING, version=0xFFFF) + u32(0)],
        "type_0": [header(0) + u32(0)],
        "type_14": [header(14) + u32(0)],
        "type_ffff": [header(0xFFFF) + u32(0)],
        "header_only_ping": [header(MSG_PING)],
        "ping_trailing_byte": [ping() + b"\x00"],
        "room_req_truncated_room": [header(MSG_ROOM_REQ) + b"\x01\x02\x03"],
        "room_req_npages_u32_max": [room_req(1, 1, -1, [], npages=0xFFFFFFFF)],
        "room_req_npages_over_limit": [room_req(1, 1, -1, [], npages=(1 << 24) + 1)],
        "room_req_truncated_pages": [room_req(1, 1, -1, [1, 2], npages=1 << 24)],
        "room_req_trailing_page": [room_req(1, 1, -1, [1, 2, 3], npages=2)],
        "hello_too_many_kv_buffers": [header(MSG_HELLO) + u32(0) + struct.pack("<II", 1, 5000)],
        "hello_truncated_item_lens": [header(MSG_HELLO) + u32(0) + struct.pack("<II", 1, 8)
                                      + b"\x40" * 20],
        "hello_too_many_aux_buffers": [header(MSG_HELLO) + u32(0) + struct.pack("<IIQI", 1, 1, 64,
                                                                                 4097)],
        "hello_empty_worker_address": [hello(0, STD, b"")],
        "hello_worker_address_over_limit": [header(MSG_HELLO) + u32(0) + wire_layout(STD)
                                            + u32(1 << 20) + b"x" * 64],
        "hello_truncated_worker_address": [header(MSG_HELLO) + u32(0) + wire_layout(STD)
                                           + u32(100) + b"x" * 99],
        "hello_explicit_zero_tcp_rx_seg": [hello(0, STD, b"\x01" * 16, tcp_rx_seg=0) + b"\x01"
                                           + u32(0)],
        "hello_truncated_tcp_rx_seg": [hello(0, STD, b"\x01" * 16, tcp_rx_seg=0)
                                       + b"\x01\x00\x00"],
        "hello_unknown_fields": [hello(0, STD, b"\x01" * 16, tcp_rx_seg=0) + b"\x08" + u32(1)],
        "hello_explicit_empty_fields": [hello(0, STD, b"\x01" * 16, tcp_rx_seg=0) + b"\x00"],
        "hello_trailing_byte": [hello(0, STD, b"\x01" * 16) + b"\x00"],
        "hello_ok_truncated_layout": [header(MSG_HELLO_OK) + u32(0) + b"\x01"],
        "hello_reject_truncated_reason": [header(MSG_HELLO_REJECT) + u32(0)
                                          + struct.pack("<H", 2) + wire_str(b"ab", 50)],
        "room_fail_reason_len_ffff": [header(MSG_ROOM_FAIL) + struct.pack("<QQHi", 1, 1, 7, 0)
                                      + wire_str(b"x" * 10, 0xFFFF)],
        "room_fail_reason_over_limit": [header(MSG_ROOM_FAIL) + struct.pack("<QQHi", 1, 1, 7, 0)
                                        + wire_str(b"x" * 1025) + wire_str(b"")],
        "room_fail_missing_peer": [header(MSG_ROOM_FAIL) + struct.pack("<QQHi", 1, 1, 7, 0)
                                   + wire_str(b"reason")],
        "bs_query_reply_truncated": [header(MSG_BS_QUERY_REPLY) + u32(0) + b"\x01"],
        "two_frames": [ping(), ping()],
        "three_frames": [b"a", b"b", b"c"],
    }
    return c


def stranger_cases():
    """Well-formed messages from a connection that is no known peer."""
    return {
        "room_req": [room_req(31, 1, -1, [0, 1])],
        "room_done": [header(MSG_ROOM_DONE) + struct.pack("<QQ", 31, 1)],
        "room_fail": [room_fail(31, 1, 7, 0, b"forged", b"nobody")],
        "bye": [header(MSG_BYE) + u32(0)],
        "pong": [header(MSG_PONG) + u32(0)],
        "hello_ok": [header(MSG_HELLO_OK) + u32(0) + wire_layout(STD)],
        "bs_register": [header(MSG_BS_REGISTER) + u32(0) + wire_str(b"tcp://127.0.0.1:1")],
        "bs_register_ok": [header(MSG_BS_REGISTER_OK) + u32(0)],
        "bs_query": [bs_query(0)],
    }


def ping_pong(dealer):
    """Sends a PING and waits for the PONG: every message the dealer sent
    before has then been handled (one connection, handled in order)."""
    dealer.send(ping(rank=9))
    reply = dealer.recv()
    assert reply is not None, "no PONG: the manager stopped answering"
    magic, version, mtype, _ = parse_header(reply)
    assert (magic, version, mtype) == (MAGIC, 1, MSG_PONG)


def transfer_works(prefill, decode, addr, src, dst, room):
    r = KVReceiver(decode, addr, room)
    s = KVSender(prefill, addr, room)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r)
    r.send_metadata([3, 1, 2], aux_index=4)
    s.init(3, aux_index=5)
    s.send([10, 11])
    s.send([12])
    assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
    assert wait_for(s, terminal()) == KVPoll.Success, describe_failure(s)
    expected = Side(dst.layout, dst.rank).snapshot()
    expected.apply(src, [10, 11, 12], [3, 1, 2], 5, 4)
    expected.check(dst)


# --------------------------------------------------------------------------


def test_prefill_drops_and_counts_malformed_messages(res, pair):
    d = res.dealer(pair.prefill.endpoint)
    ping_pong(d)
    assert pair.prefill.stats()["ctrl_dropped"] == 0
    cases = dict(malformed_cases())
    cases.update({"stranger_" + k: v for k, v in stranger_cases().items()})
    for name, frames in cases.items():
        before = pair.prefill.stats()["ctrl_dropped"]
        d.send_multipart(frames)
        ping_pong(d)
        after = pair.prefill.stats()["ctrl_dropped"]
        assert after == before + 1, f"{name}: ctrl_dropped went {before} -> {after}"
    st = pair.prefill.stats()
    assert st["ctrl_dropped"] == len(cases)
    assert st["rooms_open"] == 0 and st["pending_requests"] == 0
    assert all(v == 0 for v in st["failures_by_code"].values())
    transfer_works(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 31)
    assert pair.prefill.stats()["ctrl_dropped"] == len(cases)
    assert pair.decode.stats()["ctrl_dropped"] == 0


def test_prefill_survives_seeded_random_messages(res, pair):
    """Random bodies behind headers of every type but HELLO and PING (which
    are answered, not dropped), plus bit flips of a valid request."""
    rng = np.random.default_rng(2024)
    d = res.dealer(pair.prefill.endpoint)
    ping_pong(d)
    types = [t for t in range(0, 16) if t not in (MSG_HELLO, MSG_PING)]
    valid = room_req(5, 1, 2, [1, 2, 3])
    n = 0
    for i in range(400):
        if i % 2:
            msg = header(int(rng.choice(types))) + rng.bytes(int(rng.integers(0, 80)))
        else:
            b = bytearray(valid)
            for _ in range(int(rng.integers(1, 4))):
                pos = int(rng.integers(0, len(b)))
                b[pos] ^= 1 << int(rng.integers(0, 8))
            if b[6] in (MSG_HELLO, MSG_PING) and b[7] == 0:
                continue
            msg = bytes(b)
        d.send(msg)
        n += 1
    ping_pong(d)
    assert pair.prefill.stats()["ctrl_dropped"] == n
    transfer_works(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 32)


def test_forged_messages_about_a_live_room_do_not_touch_it(res, pair):
    """A stranger, even one that copies the decode's epoch, cannot fail,
    complete or redirect a room it does not own."""
    r = KVReceiver(pair.decode, pair.addr, 31)
    s = KVSender(pair.prefill, pair.addr, 31)
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    epoch = pair.decode._core.epoch
    d = res.dealer(pair.prefill.endpoint)
    forged = [
        room_fail(31, 1, 7, 0, b"forged abort", b"nobody"),
        room_fail(31, 1, 7, 0, b"forged abort", b"nobody", epoch=epoch),
        room_req(31, 1, -1, [0, 1, 2], epoch=epoch),
        header(MSG_ROOM_DONE, epoch=epoch) + struct.pack("<QQ", 31, 1),
        header(MSG_BYE, epoch=epoch) + u32(0),
    ]
    for m in forged:
        d.send(m)
    ping_pong(d)
    assert pair.prefill.stats()["ctrl_dropped"] == len(forged)
    assert s.poll() == KVPoll.Bootstrapping  # no request was bound from the stranger
    r.send_metadata([7, 8, 9])
    s.init(3)
    s.send([1, 2, 3])
    assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
    assert wait_for(s, terminal()) == KVPoll.Success, describe_failure(s)
    expected = Side(STD, 0).snapshot()
    expected.apply(pair.src, [1, 2, 3], [7, 8, 9])
    expected.check(pair.dst)


def test_hello_with_a_different_layout_is_rejected_with_the_reason(res, pair):
    d = res.dealer(pair.prefill.endpoint)
    other = Layout((64, 128), 16)
    d.send(hello(0, other, b"\x01" * 32))
    reply = d.recv()
    assert reply is not None
    magic, _, mtype, _ = parse_header(reply)
    assert (magic, mtype) == (MAGIC, MSG_HELLO_REJECT)
    rank, code, n = struct.unpack_from("<IHH", reply, 16)
    reason = reply[24:24 + n].decode()
    assert code == 2, reason  # LAYOUT_MISMATCH
    assert "layout" in reason and "8 KV buffers here, 2 there" in reason
    ping_pong(d)
    transfer_works(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 33)


@pytest.mark.parametrize("rx, refused", [(0, True), (64 << 10, True), ((256 << 10) - 1, True),
                                         (256 << 10, False), (0xFFFFFFFF, False)],
                         ids=["not_said", "ucx_default", "one_byte_short", "equal", "no_tcp"])
def test_hello_tcp_receive_size_against_the_prefill_fragments(res, bootstrap, monkeypatch, rx,
                                                             refused):
    """A prefill sending 256 KiB tcp fragments refuses, with TRANSPORT and a
    reason naming both sizes, a decode whose HELLO says it receives into
    smaller buffers, or says nothing (an older build: UCX's default, 64
    KiB); it accepts one that receives at least as much, or has no tcp."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    prefill = res.manager(Side(STD, 0, seed=2), "prefill", bootstrap.address)
    assert "UCX_TCP_TX_SEG_SIZE=256K" in prefill.transport, prefill.transport
    d = res.dealer(prefill.endpoint)
    d.send(hello(0, STD, b"\x01" * 32, tcp_rx_seg=rx))
    reply = d.recv()
    assert reply is not None
    assert parse_header(reply)[2] == MSG_HELLO_REJECT
    rank, code, n = struct.unpack_from("<IHH", reply, 16)
    reason = reply[24:24 + n].decode()
    assert code == 5, reason  # TRANSPORT
    if not refused:  # past the size check, refused for the made-up worker address
        assert "UCX_TCP" not in reason and "worker address" in reason, reason
        return
    assert "up to 262144 bytes (UCX_TCP_TX_SEG_SIZE)" in reason, reason
    assert f"receives into {rx or 65536}-byte buffers (UCX_TCP_RX_SEG_SIZE)" in reason, reason
    ping_pong(d)


@pytest.mark.timeout(90)
def test_hello_with_a_garbage_worker_address_does_not_crash_the_prefill(res, bootstrap):
    # In a child process: the failure mode is an abort().
    child = res.child_prefill(STD, 0, 3, bootstrap.address)
    d = res.dealer(child.endpoint, recv_timeout_ms=3000)
    ping_pong(d)
    d.send(hello(0, STD, b"\xff"))
    reply = d.recv()
    assert reply is not None, f"no answer to HELLO; child alive={child.alive()}"
    assert parse_header(reply)[2] == MSG_HELLO_REJECT
    ping_pong(d)
    assert child.alive()


@pytest.mark.parametrize("name, why", [
    ("overread_1", "(16 bytes): transport attributes past the end at byte 13"),
    ("overread_2", "(87 bytes): transport cf19 address lengths 0 and device 6, not this UCX's "
                   "at byte 36")])
def test_hello_with_a_worker_address_running_past_its_length_is_rejected(res, pair, name, why):
    """Addresses on which UCX 1.13 read past the end (it takes no length):
    their header and length are plausible, their fields are not (the
    second: a tcp iface address without its port).  The prefill refuses them with TRANSPORT before UCX sees them."""
    addr = (pathlib.Path(__file__).parent.parent / "fuzz" / "corpus" / "fuzz_worker_addr"
            / name).read_bytes()
    d = res.dealer(pair.prefill.endpoint)
    d.send(hello(0, STD, addr))
    reply = d.recv()
    assert reply is not None
    assert parse_header(reply)[2] == MSG_HELLO_REJECT
    rank, code, n = struct.unpack_from("<IHH", reply, 16)
    assert code == 5, reply  # TRANSPORT
    assert reply[24:24 + n].decode() == "malformed UCX worker address " + why
    ping_pong(d)
    transfer_works(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 34)


def test_bootstrap_server_drops_and_counts_malformed_messages(res, bootstrap):
    d = res.dealer("tcp://" + bootstrap.address)

    def sync():
        d.send(bs_query(4242))
        reply = d.recv()
        assert reply is not None, "bootstrap server stopped answering"
        magic, _, mtype, _ = parse_header(reply)
        assert (magic, mtype) == (MAGIC, MSG_BS_QUERY_REPLY)
        assert struct.unpack_from("<IB", reply, 16) == (4242, 0)  # not found

    sync()
    assert bootstrap.stats()["dropped"] == 0
    cases = dict(malformed_cases())
    del cases["random_1MiB"]  # over the server's message size limit: see below
    cases.update({
        "register_missing_endpoint": [header(MSG_BS_REGISTER) + u32(0)],
        "register_endpoint_over_limit": [header(MSG_BS_REGISTER) + u32(0)
                                         + wire_str(b"e" * 1025)],
        "register_endpoint_truncated": [header(MSG_BS_REGISTER) + u32(0)
                                        + wire_str(b"tcp://x", 40)],
        "query_header_only": [header(MSG_BS_QUERY)],
        "query_trailing_byte": [bs_query(0) + b"\x00"],
        "wellformed_ping": [ping()],
        "wellformed_hello": [hello(0, STD, b"\x01" * 16)],
        "wellformed_room_req": [room_req(1, 1, -1, [1])],
        "wellformed_register_ok": [header(MSG_BS_REGISTER_OK) + u32(0)],
    })
    for name, frames in cases.items():
        before = bootstrap.stats()["dropped"]
        d.send_multipart(frames)
        sync()
        after = bootstrap.stats()["dropped"]
        assert after == before + 1, f"{name}: dropped went {before} -> {after}"
    assert bootstrap.stats()["registrations"] == 0

    # The server still introduces prefill and decode ranks to each other.
    src, dst = Side(SMALL, 0, seed=8), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode")
    transfer_works(prefill, decode, bootstrap.address, src, dst, 1)
    assert bootstrap.stats()["registrations"] == 1
    assert bootstrap.stats()["dropped"] == len(cases)


def test_bootstrap_server_survives_oversized_and_random_messages(res, bootstrap):
    rng = np.random.default_rng(77)
    big = res.dealer("tcp://" + bootstrap.address)
    big.send(rng.bytes(1 << 17))  # over its 64 KiB limit: the connection is dropped
    types = [t for t in range(0, 16) if t not in (MSG_BS_REGISTER, MSG_BS_QUERY)]
    d = res.dealer("tcp://" + bootstrap.address)
    for _ in range(300):
        d.send(header(int(rng.choice(types))) + rng.bytes(int(rng.integers(0, 64))))
    d.send(bs_query(7))
    reply = d.recv()
    assert reply is not None and parse_header(reply)[2] == MSG_BS_QUERY_REPLY
    assert bootstrap.stats()["dropped"] == 300
    src, dst = Side(SMALL, 0, seed=9), Side(SMALL, 0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode")
    transfer_works(prefill, decode, bootstrap.address, src, dst, 2)


def test_decode_drops_everything_on_its_control_socket(res, pair):
    """Everything but a PING (a sibling asking who listens here: answered
    with a PONG naming the decode's epoch) is dropped."""
    d = res.dealer(pair.decode.endpoint)
    msgs = [frames for frames in malformed_cases().values()]
    msgs += [[hello(0, STD, b"\xff")], [room_req(1, 1, -1, [1])],
             [room_fail(1, 1, 7, 0, b"x", b"y")], [header(MSG_BYE) + u32(0)]]
    for frames in msgs:
        d.send_multipart(frames)
    d.send(ping())
    pong = d.recv()
    assert parse_header(pong)[2:] == (MSG_PONG, pair.decode._core.epoch)
    assert wait_until(lambda: pair.decode.stats()["ctrl_dropped"] >= len(msgs), timeout=10), \
        pair.decode.stats()
    time.sleep(0.1)
    assert pair.decode.stats()["ctrl_dropped"] == len(msgs)
    transfer_works(pair.prefill, pair.decode, pair.addr, pair.src, pair.dst, 34)
    assert pair.decode.stats()["ctrl_dropped"] == len(msgs)
