"""kvrecv's tcp lanes (docs/design.md, tcp lanes): where UCX reaches the
prefill over tcp, the data goes over a tcp connection of kvrecv's own,
written from the prefill's pages and read into the decode's.  Real managers
over loopback tcp: the lane is used and byte exact, either side can turn it
off, strangers on the lane port get nothing, a full handshake queue leaves
the data to UCX, and a malformed frame loses the prefill.  (The deaths of
either process with data on the lane: test_peer_death.py, over tcp.)"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time

import numpy as np
import pytest

from kvrecv import KVPeerLostError, KVPoll, KVReceiver, KVSender
from conftest import Resources
from kvtest import CANARY, Layout, Side, describe_failure, terminal, wait_for, wait_until

pytestmark = pytest.mark.timeout(60)

# Contiguous and scattered pages of three buffers, 1.5 MiB a room.
LAYOUT = Layout((4096, 4096, 16384), 256, (16,), 8)
ROOM_PAGES = 64
HANDSHAKE = b"KVRLANE1"
PENDING_MAX = 32  # KVR_LANE_PENDING_MAX (lanelisten.h)


def managers(res, bs, prefill_cfg=None, decode_cfg=None, seed=5):
    src, dst = Side(LAYOUT, 0, seed=seed), Side(LAYOUT, 0)
    prefill = res.manager(src, "prefill", bs.address, **(prefill_cfg or {}))
    decode = res.manager(dst, "decode", **(decode_cfg or {}))
    return src, dst, prefill, decode


def move_room(bs, prefill, decode, src, dst, room, dst_pages, src_pages):
    """One room, checked byte for byte; returns (receiver, sender)."""
    expected = dst.snapshot()
    r = KVReceiver(decode, bs.address, room)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput, (
        describe_failure(r))
    r.send_metadata(np.asarray(dst_pages, dtype=np.int32), aux_index=room % LAYOUT.aux_rows)
    s = KVSender(prefill, bs.address, room)
    s.init(len(src_pages), room % LAYOUT.aux_rows)
    s.send(np.asarray(src_pages))
    assert wait_for(r, terminal(), 20) == KVPoll.Success, describe_failure(r)
    assert wait_for(s, terminal(), 20) == KVPoll.Success, describe_failure(s)
    expected.apply(src, src_pages, dst_pages, room % LAYOUT.aux_rows, room % LAYOUT.aux_rows)
    expected.check(dst)
    return r, s


def contiguous_room(bs, prefill, decode, src, dst, room):
    move_room(bs, prefill, decode, src, dst, room, range(0, ROOM_PAGES),
              range(100, 100 + ROOM_PAGES))


def random_room(bs, prefill, decode, src, dst, room):
    rng = np.random.default_rng(room)
    move_room(bs, prefill, decode, src, dst, room,
              rng.permutation(np.arange(ROOM_PAGES, 2 * ROOM_PAGES)),
              rng.permutation(np.arange(ROOM_PAGES)))


def two_rooms(bs, prefill, decode, src, dst):
    contiguous_room(bs, prefill, decode, src, dst, 1)
    random_room(bs, prefill, decode, src, dst, 2)


def test_tcp_data_goes_over_the_lane(res):
    """Both sides on (the default): every data message of both rooms goes
    over the lane, and the lane carries any length: the contiguous room is
    one message per buffer (a UCX fragment holds 63 pages of 4 KiB)."""
    bs = res.server()
    src, dst, prefill, decode = managers(res, bs)
    assert prefill.stats()["lane_port"] > 0
    contiguous_room(bs, prefill, decode, src, dst, 1)
    ps, ds = prefill.stats(), decode.stats()
    # one run per buffer: the two 4 KiB buffers' (256 KiB each) in one
    # message, the 16 KiB buffer's (1 MiB, more than a UCX tcp fragment) in
    # one, and the aux row
    assert ps["rma_ops_posted"] == 3, ps["rma_ops_posted"]
    assert ps["lane_messages"] == 3 and ds["lane_messages"] == 3, (ps["lane_messages"],
                                                                  ds["lane_messages"])
    assert ds["data_rendezvous"] == 0
    random_room(bs, prefill, decode, src, dst, 2)
    ps, ds = prefill.stats(), decode.stats()
    assert ps["lane_messages"] == ps["rma_ops_posted"] == ds["lane_messages"], (ps, ds)


def test_send_leaves_a_large_room_to_the_engine_thread(res):
    """send() writes at most KVR_LANE_INLINE_BYTES (8 MiB) of a room to the
    lane itself; the rest waits in the lane's queue for the engine thread.
    A 64 MiB room: before, send() wrote it all while the decode read it
    (the scheduler's thread held for the whole transfer, 0.99 of the time
    to Success); now it returns after a small part of that time."""
    bs = res.server()
    big = Layout((65536,) * 8, 256)
    src, dst = Side(big, 0, seed=3), Side(big, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode")
    ratios = []
    for room in range(1, 6):
        pages = np.arange(128) + 128 * (room % 2)
        r = KVReceiver(decode, bs.address, room)
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
        r.send_metadata(pages.astype(np.int32))
        s = KVSender(prefill, bs.address, room)
        s.init(len(pages))
        assert wait_for(s, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
        t0 = time.perf_counter()
        s.send(pages)
        t_send = time.perf_counter() - t0
        while r.poll() not in (KVPoll.Success, KVPoll.Failed) and time.perf_counter() < t0 + 20:
            pass
        t_done = time.perf_counter() - t0
        assert r.poll() == KVPoll.Success, describe_failure(r)
        assert wait_for(s, terminal(), 20) == KVPoll.Success, describe_failure(s)
        for b in range(len(big.kv_item_lens)):
            assert np.array_equal(dst.pages(b)[pages], src.pages(b)[pages]), (room, b)
        ratios.append((t_send / t_done, t_send, t_done))
        r.clear()
        s.clear()
    assert prefill.stats()["lane_messages"] >= 8 * 4
    best = min(ratios)
    assert best[0] < 0.3, f"send() took {best[1] * 1e3:.1f} ms of {best[2] * 1e3:.1f} ms: {ratios}"


@pytest.mark.parametrize("off", ["prefill", "decode"])
def test_either_side_off_keeps_the_data_on_ucx(res, off):
    bs = res.server()
    cfg = {"tcp_lane": False}
    src, dst, prefill, decode = managers(res, bs, cfg if off == "prefill" else None,
                                         cfg if off == "decode" else None)
    assert (prefill.stats()["lane_port"] == 0) == (off == "prefill")
    contiguous_room(bs, prefill, decode, src, dst, 1)
    # cut into UCX fragments (over a lane: 3 messages, the test above)
    assert prefill.stats()["rma_ops_posted"] > 3
    random_room(bs, prefill, decode, src, dst, 2)
    assert prefill.stats()["lane_messages"] == decode.stats()["lane_messages"] == 0


def _proc_text(name: str) -> str:
    with open("/proc/sys/net/ipv4/" + name) as f:
        return f.read().strip()


def _congestion_of_port(port: int) -> dict:
    """The tcp congestion control of this process's sockets bound to port,
    read from the kernel: {"listener": name, "accepted": [names]}."""
    out = {"listener": None, "accepted": []}
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket (or gone)
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                    sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                continue
            name = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            name = name.split(b"\0", 1)[0].decode()
            try:
                sock.getpeername()
            except OSError:
                out["listener"] = name
            else:
                out["accepted"].append(name)
    return out


@pytest.mark.parametrize("cc", ["default", "host", "cubic"])
def test_lanes_use_the_configured_congestion_control(res, cc):
    """The prefill's lane sockets, the listener and the connection it
    accepted, run the congestion control named by lane_congestion: reno by
    default, the host's default with "", cubic when asked (where this
    process may use it); the room is byte-exact either way."""
    if cc == "cubic" and ("cubic" not in _proc_text("tcp_available_congestion_control").split()
                          or os.geteuid() != 0 and
                          "cubic" not in _proc_text("tcp_allowed_congestion_control").split()):
        pytest.skip("this process may not use cubic here")
    cfg = {} if cc == "default" else {"lane_congestion": "" if cc == "host" else cc}
    want = {"default": "reno", "host": _proc_text("tcp_congestion_control"), "cubic": "cubic"}[cc]
    bs = res.server()
    src, dst, prefill, decode = managers(res, bs, cfg)
    contiguous_room(bs, prefill, decode, src, dst, 1)
    assert prefill.stats()["lane_messages"] == 3
    got = _congestion_of_port(prefill.stats()["lane_port"])
    assert got == {"listener": want, "accepted": [want]}, got


@pytest.mark.parametrize("bad, exc, text", [
    ("nosuchcc", ValueError,
     r"^lane_congestion='nosuchcc' cannot be used here: No such file or directory \(this host "
     r"lets any process use: [a-z0-9 ]+\)$"),
    ("c" * 16, ValueError, r"lane_congestion='c{16}' is not a congestion control name \(ASCII, "
     r"at most 15 characters\)"),
    ("r\u00e9no", ValueError, r"is not a congestion control name"),
    ("re\0no", ValueError, r"is not a congestion control name"),
    (5, TypeError, r"^KVConfig.lane_congestion must be a str, not int$"),
])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_bad_congestion_control_is_refused(res, bad, exc, text, mode):
    bs = res.server()
    with pytest.raises(exc, match=text):
        res.manager(Side(LAYOUT, 0), mode, bs.address, lane_congestion=bad)


def _manager_as_nobody(bs_address: str, cc: str, conn) -> None:
    try:
        os.setgid(65534)
        os.setuid(65534)
        res = Resources()
        try:
            res.manager(Side(LAYOUT, 0), "prefill", bs_address, lane_congestion=cc)
            conn.send("created")
        finally:
            res.close()
    except Exception as e:  # the answer is the exception
        conn.send(f"{type(e).__name__}: {e}")


def test_a_congestion_control_the_host_keeps_to_root_is_refused(res):
    """An unprivileged process naming a congestion control that the kernel
    has but does not let any process use (tcp_allowed_congestion_control):
    EPERM, said at the manager's creation."""
    allowed = _proc_text("tcp_allowed_congestion_control").split()
    kept = [c for c in _proc_text("tcp_available_congestion_control").split() if c not in allowed]
    if os.geteuid() != 0 or not kept:
        pytest.skip("needs root (to become nobody) and a congestion control kept to root")
    bs = res.server()
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_manager_as_nobody, args=(bs.address, kept[0], there))
    p.start()
    assert here.poll(30), "the unprivileged process said nothing"
    got = here.recv()
    p.join(10)
    assert got == (f"ValueError: lane_congestion='{kept[0]}' cannot be used here: Operation not "
                   f"permitted (this host lets any process use: {' '.join(allowed)})"), got


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True if the other end closes sock within timeout (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_strangers_on_the_lane_port_get_nothing(res):
    """A connection that says something else than the handshake, one with a
    token nobody was offered, and one that says nothing for 5 s are closed
    without an answer; the decode's own lane works meanwhile."""
    bs = res.server()
    src, dst, prefill, decode = managers(res, bs)
    port = prefill.stats()["lane_port"]
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    forged = socket.create_connection(("127.0.0.1", port))
    forged.sendall(HANDSHAKE + bytes(16))
    silent = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        assert _closed_by_peer(garbage, 5), "a connection saying garbage was kept"
        assert _closed_by_peer(forged, 5), "a connection with a forged token was kept"
        two_rooms(bs, prefill, decode, src, dst)
        assert decode.stats()["lane_messages"] > 0
        assert _closed_by_peer(silent, 10), "a silent connection was kept"
        waited = time.monotonic() - t0
        assert 4.5 < waited < 10, f"the silent connection was closed after {waited:.1f} s"
    finally:
        for s in (garbage, forged, silent):
            s.close()


def test_a_full_handshake_queue_leaves_the_data_to_ucx(res, caplog):
    """32 connections wait in their handshake: the decode's lane is closed
    unanswered, it says so, and its rooms go through UCX."""
    caplog.set_level(logging.WARNING, logger="kvrecv")
    bs = res.server()
    src, dst, prefill, decode = managers(res, bs)
    port = prefill.stats()["lane_port"]
    squatters = [socket.create_connection(("127.0.0.1", port)) for _ in range(PENDING_MAX)]
    try:
        for s in squatters:
            s.sendall(HANDSHAKE[:3])  # taken in, never finished
        two_rooms(bs, prefill, decode, src, dst)
        assert decode.stats()["lane_messages"] == prefill.stats()["lane_messages"] == 0
        assert wait_until(lambda: "the tcp lane to prefill rank 0" in caplog.text
                          and "was refused or closed; its data comes through UCX" in caplog.text,
                          5), caplog.text
    finally:
        for s in squatters:
            s.close()


def test_a_malformed_frame_loses_the_prefill(res):
    """A frame whose prefix is not kvrecv's (the test hook): the decode
    drops the lane and the prefill with it, naming the frame; the prefill's
    room fails too (its decode closed the lane)."""
    bs = res.server()
    src, dst, prefill, decode = managers(res, bs)
    move_room(bs, prefill, decode, src, dst, 1, range(0, 8), range(100, 108))  # lane up
    prefill._core._test_corrupt_data(11)
    r = KVReceiver(decode, bs.address, 2)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
    r.send_metadata(np.arange(8, 16, dtype=np.int32))
    s = KVSender(prefill, bs.address, 2)
    s.init(8)
    s.send(np.arange(110, 118))
    assert wait_for(r, terminal(), 20) == KVPoll.Failed, describe_failure(r)
    with pytest.raises(KVPeerLostError) as ei:
        r.failure_exception()
    name = "prefill rank 0 at " + prefill.endpoint[len("tcp://"):]
    assert ei.value.failure_reason == (f"room 2: {name} lost: tcp data connection: "
                                       "a malformed frame"), ei.value.failure_reason
    assert wait_for(s, terminal(), 20) == KVPoll.Failed
    with pytest.raises(KVPeerLostError):
        s.failure_exception()
    # The first malformed prefix dropped the lane: nothing of room 2 landed.
    assert all((dst.pages(b)[8:16] == CANARY).all() for b in range(len(LAYOUT.kv_item_lens)))
