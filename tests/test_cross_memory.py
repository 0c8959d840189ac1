"""Cross-memory reads (csrc/cma.c): with cross_memory_bytes set on both
sides of one host, contiguous pieces at least that long go as read
descriptors, which the decode checks as data and reads from the prefill's
pages itself.  Byte-exact rooms through the path (in one process and across
two), the path off on either side, a prefill in another pid namespace or
whose memory the kernel refuses the decode (the offer's probe fails: the
bytes come through UCX), and descriptors that break
the rules: outside the room (PROTOCOL), from an unmapped source, with a
lease that is not the room's (TRANSPORT); no byte outside the room's pages;
the decode's reader threads (cross_memory_readers, csrc/readers.c), through
which every read test here goes.  The prefill killed mid-room is in
test_peer_death.py, an abort with reads in flight in test_failures.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvrecv import (KVConfig, KVPoll, KVProtocolError, KVReceiver, KVSender, KVTransportError)
from kvtest import (CANARY, TRANSPORTS, Expected, Layout, Side, describe_failure, terminal,
                    wait_all, wait_for)

pytestmark = pytest.mark.timeout(90)

READ = 64 << 10  # cross_memory_bytes of these tests
# Odd item lengths (not multiples of a page of memory), 160 pages.
ODD = Layout((12288, 20480, 20488), 160)


def plans():
    """(room, src pages, dst pages): a long run; scattered pages then a long
    run ending at the last page on both sides; a contiguous source into
    scattered destination pages; two pages, whose first two buffers share
    a message of exactly READ bytes (read) and whose third goes as bytes."""
    rng = np.random.default_rng(5)
    scattered = rng.choice(np.arange(60, 100), 12, replace=False)
    return [
        (1, np.arange(0, 41), np.arange(60, 101)),
        (2, np.concatenate([scattered, np.arange(130, 160)]),
         np.concatenate([np.arange(0, 12), np.arange(130, 160)])),
        (3, np.arange(41, 50), np.array([12, 14, 16, 18, 20, 22, 24, 26, 28])),
        (4, np.array([50, 52]), np.array([40, 42])),
    ]


def test_plans_have_disjoint_destinations():
    dst = np.concatenate([d for _r, _s, d in plans()])
    assert len(np.unique(dst)) == len(dst)


def long_run_bytes():
    """The bytes of plans() that go as reads: every page of the first three
    rooms (their messages, one per buffer, are at least READ bytes each)
    and room 4's first two buffers (2 x 12288 + 2 x 20480 = READ)."""
    return (41 + 42 + 9) * sum(ODD.kv_item_lens) + READ


def run_rooms(res, bs, prefill, decode, src, dst, rooms, expect_ok=True):
    exp = Expected(dst)
    rs, ss = [], []
    for room, sp, dp in rooms:
        r = KVReceiver(decode, bs.address, room)
        r.init()
        rs.append(r)
    for r, (room, sp, dp) in zip(rs, rooms):
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        r.send_metadata(dp.astype(np.int32))
    for room, sp, dp in rooms:
        s = KVSender(prefill, bs.address, room)
        s.init(len(sp))
        s.send(sp.astype(np.int32))
        ss.append(s)
        exp.apply(src, sp, dp)
    states = wait_all(rs + ss, terminal(), timeout=30)
    if expect_ok:
        assert all(st == KVPoll.Success for st in states), [describe_failure(x) for x in rs + ss]
        assert exp.mismatches(dst) == []
    return rs, ss


@pytest.fixture
def shm(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TRANSPORTS["shm"])


RANDOM = Layout((65536,) * 4, 64)


def test_scattered_large_pages_are_read_byte_exact(res, shm):
    """Random 64 KiB pages: a message of several source pieces is read with
    one descriptor (up to 63 pieces) and scattered into the room's pages."""
    bs = res.server()
    src, dst = Side(RANDOM, 0, seed=4), Side(RANDOM, 0)
    prefill = res.manager(src, "prefill", bs.address, cross_memory_bytes=READ)
    decode = res.manager(dst, "decode", cross_memory_bytes=READ)
    rng = np.random.default_rng(9)
    sp, dp = rng.permutation(64)[:40], rng.permutation(64)[:40]
    run_rooms(res, bs, prefill, decode, src, dst, [(21, sp, dp)])
    st = decode.stats()
    assert st["cma_bytes"] == st["bytes_moved"] == 40 * 4 * 65536, st


@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_default_reads_messages_of_a_mib_over_shared_memory_only(res, monkeypatch, tls):
    """Both sides at the default cross_memory_bytes (1 MiB): over shared
    memory a buffer's 2.5 MiB run of 64 KiB pages is one read; with
    UCX_TLS=tcp (no shared memory for UCX) the same room comes as bytes over
    tcp, though the run is one message there too.  Byte-exact either way."""
    monkeypatch.setenv("UCX_TLS", TRANSPORTS[tls])
    bs = res.server()
    src, dst = Side(RANDOM, 0, seed=6), Side(RANDOM, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode")
    assert KVConfig().cross_memory_bytes == 1 << 20
    run_rooms(res, bs, prefill, decode, src, dst, [(22, np.arange(0, 40), np.arange(20, 60))])
    st = decode.stats()
    assert st["bytes_moved"] == 40 * 4 * 65536, st
    assert st["cma_bytes"] == (st["bytes_moved"] if tls == "shm" else 0), st


@pytest.mark.parametrize("readers", [1, 2, 4])
def test_reads_made_by_reader_threads(res, shm, readers):
    """cross_memory_readers: the decode's threads that make reads (the
    thread handling the descriptors and readers - 1 helpers, each taking a
    whole read, csrc/readers.c).  A 16 MiB room of 1 MiB reads is
    byte-exact at every count; with helpers they made some of the reads
    (cma_helper_bytes, whole reads), with one reader none."""
    bs = res.server()
    src, dst = Side(RANDOM, 0, seed=8), Side(RANDOM, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode", cross_memory_readers=readers)
    assert KVConfig().cross_memory_readers == 2
    run_rooms(res, bs, prefill, decode, src, dst, [(23, np.arange(0, 64), np.arange(0, 64))])
    st = decode.stats()
    assert st["cma_bytes"] == st["bytes_moved"] == 64 * 4 * 65536, st
    if readers == 1:
        assert st["cma_helper_bytes"] == 0, st
    else:
        assert 0 < st["cma_helper_bytes"] <= st["cma_bytes"], st
        assert st["cma_helper_bytes"] % (1 << 20) == 0, st


@pytest.mark.parametrize("bad,text", [(0, r"^cross_memory_readers=0 is not in 1-16$"),
                                      (17, r"^config\[cross_memory_readers\] must be at most 16$")])
def test_reader_count_out_of_range_refused(res, bad, text):
    with pytest.raises(ValueError, match=text):
        res.manager(Side(RANDOM, 0), "decode", cross_memory_readers=bad)


def test_large_runs_are_read_byte_exact(res, shm):
    bs = res.server()
    src, dst = Side(ODD, 0, seed=3), Side(ODD, 0)
    prefill = res.manager(src, "prefill", bs.address, cross_memory_bytes=READ)
    decode = res.manager(dst, "decode", cross_memory_bytes=READ)
    run_rooms(res, bs, prefill, decode, src, dst, plans())
    st = decode.stats()
    # Every long run of every buffer, one read each; the rest came as bytes.
    assert st["cma_bytes"] == long_run_bytes(), st
    assert st["cma_reads"] == 4 * 3 + 1, st
    assert st["bytes_moved"] == sum(len(p[1]) for p in plans()) * sum(ODD.kv_item_lens)


def test_large_runs_are_read_from_another_process(res, shm):
    bs = res.server()
    dst = Side(ODD, 0)
    decode = res.manager(dst, "decode", cross_memory_bytes=READ)
    child = res.child_prefill(ODD, 0, 7, bs.address, config={"cross_memory_bytes": READ})
    src = Side(ODD, 0, seed=7)  # the child's buffers, derived from its seed
    exp = Expected(dst)
    rs = []
    for room, sp, dp in plans():
        r = KVReceiver(decode, bs.address, room)
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        r.send_metadata(dp.astype(np.int32))
        rs.append(r)
        exp.apply(src, sp, dp)
    child.call("send", [(room, len(sp), None, [sp.tolist()]) for room, sp, _ in plans()])
    states = wait_all(rs, terminal(), timeout=30)
    assert all(s == KVPoll.Success for s in states), [describe_failure(r) for r in rs]
    assert exp.mismatches(dst) == []
    assert decode.stats()["cma_bytes"] == long_run_bytes(), decode.stats()


@pytest.mark.parametrize("off", ["decode", "prefill"])
def test_off_on_either_side_sends_bytes(res, shm, off):
    bs = res.server()
    src, dst = Side(ODD, 0, seed=3), Side(ODD, 0)
    prefill = res.manager(src, "prefill", bs.address,
                          cross_memory_bytes=0 if off == "prefill" else READ)
    decode = res.manager(dst, "decode", cross_memory_bytes=0 if off == "decode" else READ)
    run_rooms(res, bs, prefill, decode, src, dst, plans())
    assert decode.stats()["cma_reads"] == 0


def test_prefill_in_another_pid_namespace_sends_bytes(res, caplog):
    """The prefill's pid means another process to the decode: the probe of
    the offer reads the wrong memory (or none), the decode says HELLO again
    without the offer, and the room comes through UCX.  Over tcp: the
    shared-memory address of a process in another pid namespace is not one
    kvrecv takes (ucxaddr.c); the offer does not depend on the transport."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--pid", "--fork", "true"]).returncode != 0:
        pytest.skip("cannot make a pid namespace here")
    from failtest import _decode
    from kvrecv import KVConfig
    from peer_proc import PeerProcess, peer_mod
    bs = res.server()
    items = peer_mod.item_lens()
    decode, dkv, _daux = _decode(config=KVConfig(cross_memory_bytes=64))
    res._managers.append(decode)
    child = PeerProcess("prefill", bs.address, seed=3, config={"cross_memory_bytes": 64},
                        argv_prefix=[unshare, "--pid", "--fork", "--kill-child"])
    try:
        pages = list(range(0, 8))
        r = KVReceiver(decode, bs.address, 11)
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
            describe_failure(r)
        r.send_metadata(np.array(pages, dtype=np.int32))
        child.call("open_sender", room=11, n=len(pages))
        child.call("send", room=11, pages=pages)
        assert wait_for(r, terminal(), timeout=30) == KVPoll.Success, describe_failure(r)
        kv, _aux = peer_mod.source_buffers(3)
        for b, item in enumerate(items):
            got = dkv[b].reshape(-1, item)[pages]
            assert (got == kv[b].reshape(-1, item)[pages]).all()
        assert decode.stats()["cma_reads"] == 0
        assert any("cannot read the memory of prefill rank 0" in m for m in caplog.messages), \
            caplog.messages
    finally:
        child.close()


# hook value, exception, what the decode says ({name}: the prefill's name)
BAD = {
    "outside_the_room": (1, KVProtocolError, "{name} sent a bad data message: run outside the room"),
    "more_bytes_than_positions": (3, KVProtocolError, "{name} sent a bad data message: read "
                                  "descriptor's pieces do not match the run length"),
    "sent_twice": (4, KVProtocolError,
                   "{name} sent a bad data message: data for positions already received"),
    "unmapped_source": (7, KVTransportError, "cross-memory read from {name} failed: Bad address"),
    "not_the_lease": (8, KVTransportError, "{name} released the pages before they were read"),
}


@pytest.mark.parametrize("prefill_bytes,why", [
    (0, "read descriptor not offered"),
    (1 << 30, "read descriptor has the wrong length"),
], ids=["not_offered", "bytes_flagged"])
def test_data_flagged_as_a_read_fails_the_room(res, shm, prefill_bytes, why):
    """Data bytes flagged as a read descriptor (test hook 9): to a decode
    that was not offered reads (the prefill does not take part), and to one
    that was (the prefill's threshold is never reached, so it sends bytes):
    PROTOCOL, nothing lands."""
    bs = res.server()
    src, dst = Side(ODD, 0, seed=3), Side(ODD, 0)
    prefill = res.manager(src, "prefill", bs.address, cross_memory_bytes=prefill_bytes)
    decode = res.manager(dst, "decode", cross_memory_bytes=READ, deadline_base_ms=5000)
    prefill._core._test_corrupt_data(9)
    room, sp, dp = plans()[0]
    rs, ss = run_rooms(res, bs, prefill, decode, src, dst, [(room, sp, dp)], expect_ok=False)
    assert rs[0].poll() == KVPoll.Failed, describe_failure(rs[0])
    with pytest.raises(KVProtocolError) as ei:
        rs[0].failure_exception()
    name = "prefill rank 0 at " + prefill.endpoint[len("tcp://"):]
    assert ei.value.failure_reason == f"room {room}: {name} sent a bad data message: {why}"
    assert all((buf == CANARY).all() for buf in dst.kv)
    assert decode.stats()["cma_reads"] == 0


@pytest.mark.parametrize("mode", sorted(BAD))
def test_bad_descriptor_fails_the_room(res, shm, mode):
    hook, exc, why = BAD[mode]
    bs = res.server()
    src, dst = Side(ODD, 0, seed=3), Side(ODD, 0)
    prefill = res.manager(src, "prefill", bs.address, cross_memory_bytes=READ)
    decode = res.manager(dst, "decode", cross_memory_bytes=READ, deadline_base_ms=5000)
    prefill._core._test_corrupt_data(hook)
    room, sp, dp = plans()[0]  # one long run: descriptors only
    rs, ss = run_rooms(res, bs, prefill, decode, src, dst, [(room, sp, dp)], expect_ok=False)
    assert rs[0].poll() == KVPoll.Failed, describe_failure(rs[0])
    with pytest.raises(exc) as ei:
        rs[0].failure_exception()
    name = "prefill rank 0 at " + prefill.endpoint[len("tcp://"):]
    assert ei.value.failure_reason == f"room {room}: " + why.format(name=name)
    assert wait_for(ss[0], terminal(), timeout=15) == KVPoll.Failed
    # No byte outside the room's pages; a bad descriptor lands nothing.
    keep = np.ones(ODD.num_pages, dtype=bool)
    keep[dp] = False
    for b, item in enumerate(ODD.kv_item_lens):
        assert (dst.kv[b].reshape(-1, item)[keep] == CANARY).all()
    if mode not in ("not_the_lease", "sent_twice"):  # those land a read first
        assert all((buf == CANARY).all() for buf in dst.kv)
        assert decode.stats()["cma_reads"] == 0


def test_decode_refused_the_prefills_memory_sends_bytes(res, shm, tmp_path):
    """The decode runs without CAP_SYS_PTRACE, which the prefill holds, so
    the kernel refuses it the prefill's memory (EPERM, as for a prefill of
    another user or under Yama ptrace_scope 1): the probe fails, the decode
    logs it once and says HELLO again without the offer, and the room comes
    through UCX, byte-exact."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or not _may_ptrace():
        pytest.skip("needs setpriv and CAP_SYS_PTRACE to drop it")
    from failtest import _prefill
    from kvrecv import KVConfig
    from peer_proc import PeerProcess, peer_mod
    bs = res.server()
    prefill, kv, _aux = _prefill(bs.address, 3, config=KVConfig(cross_memory_bytes=64))
    res._managers.append(prefill)
    path = str(tmp_path / "kv")  # the decode's KV buffers, mapped here too
    child = PeerProcess("decode", bs.address, config={"cross_memory_bytes": 64}, kv_path=path,
                        argv_prefix=[setpriv, "--bounding-set=-sys_ptrace",
                                     "--inh-caps=-sys_ptrace"])
    try:
        pages = list(range(0, 8))
        st = child.call("open_receiver", room=12, pages=pages)["state"]
        assert st in (KVPoll.WaitingForInput, KVPoll.Transferring), (st, child.stderr())
        s = KVSender(prefill, bs.address, 12)
        s.init(len(pages))
        assert wait_for(s, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        s.send(np.array(pages, dtype=np.int32))
        assert child.call("wait", room=12, states=[int(KVPoll.Success), int(KVPoll.Failed)],
                          timeout=30)["state"] == KVPoll.Success, child.call("failure", room=12)
        assert wait_for(s, terminal(), timeout=15) == KVPoll.Success
        assert peer_mod.pages_equal(kv, peer_mod.kv_file(path), pages, pages)
        assert child.call("canary", pages=[8, 9])["canary"] is True
        assert child.stats()["cma_reads"] == 0
        err = child.stderr()
        assert err.count("cannot read the memory of prefill rank 0") == 1, err
        assert "Operation not permitted; its data comes through UCX" in err, err
    finally:
        child.close()


def _may_ptrace() -> bool:
    """Whether this process holds CAP_SYS_PTRACE (bit 19)."""
    with open("/proc/self/status") as f:
        eff = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(eff.split()[1], 16) >> 19 & 1)
