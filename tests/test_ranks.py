"""Failures across ranks: every rank gets the real reason.

A prefill instance of N=2 ranks and a decode instance of N=2 ranks, one
manager per rank; decode rank r talks only to prefill rank r.  The ranks of
each instance are joined with set_siblings(), so a root cause recorded on one
rank is published to the others: every rank's room fails, and every rank's
failure_exception() raises the origin rank's class, code and reason, with
is_from_another_rank=True and origin_rank set on the other ranks.  The
failure also crosses to the other instance through each rank's own peer.

Every failure is provoked for real (a SIGKILLed rank process, abort() on one
rank, a layout that differs on one rank, a deadline that passes on one rank)
and checked on every surviving rank of both instances: exception class,
code, reason, is_from_another_rank, origin_rank and how long it took.  After
each scenario the surviving managers serve a new room on both ranks and
forget their rooms on clear().

Ranks that get killed run in child processes (tests/failure_peer.py).  Time
bounds are about 2.5 times the expected figure (the machine has 2 cores);
the measured value is printed and is in every assertion message.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from failtest import _native_threads, _wait_state, _wait_until
from peer_proc import PeerProcess, peer_mod
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVArgs,
    KVConfig,
    KVLayoutError,
    KVManager,
    KVPeerLostError,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTimeoutError,
    KVTransferError,
)


PAGES = peer_mod.PAGES
AUX_ROWS = peer_mod.AUX_ROWS
AUX_ITEM = peer_mod.AUX_ITEM
CANARY = peer_mod.CANARY
ITEMS = peer_mod.item_lens()
PAGE_BYTES = peer_mod.page_bytes()

N = 2
RANKS = range(N)
TERMINAL = (KVPoll.Success, KVPoll.Failed)
DST = [0, 1, 2, 3]      # decode pages of a scenario's room
SRC = [10, 11, 12, 13]  # prefill pages of a scenario's room

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------
# Ranks: in this process or in a child process
# --------------------------------------------------------------------------


class _Rank:
    """One rank of an instance in this process: its manager and buffers.
    Prefill memory is random (from seed, as failure_peer.py makes it),
    decode memory is all CANARY."""

    def __init__(self, mode, rank, addr=None, seed=0, items=None, **config):
        items = list(items or ITEMS)
        if mode == "prefill":
            assert items == ITEMS
            self.kv, self.aux = peer_mod.source_buffers(seed)
        else:
            self.kv = [np.full(PAGES * it, CANARY, dtype=np.uint8) for it in items]
            self.aux = [np.full(AUX_ROWS * AUX_ITEM, CANARY, dtype=np.uint8)]
        args = KVArgs.from_buffers(rank, self.kv, items, self.aux, [AUX_ITEM])
        self.mgr = KVManager(args, mode, bootstrap_addr=addr if mode == "prefill" else None,
                             config=KVConfig(**config))
        self.mode = mode
        self.rank = rank

    @property
    def endpoint(self) -> str:
        return self.mgr.endpoint

    def set_siblings(self, endpoints):
        self.mgr.set_siblings(endpoints)

    def stats(self) -> dict:
        return self.mgr.stats()

    def close(self):
        self.mgr.close()


def _ChildRank(role, bootstrap, rank, seed=1, config=None, startup_timeout=60):
    return PeerProcess(role, bootstrap, seed=seed, config=config, startup_timeout=startup_timeout,
                       rank=rank)


def _join(instance):
    """Joins the ranks of one instance: each gets every rank's endpoint."""
    endpoints = [m.endpoint for m in instance]
    for m in instance:
        m.set_siblings(endpoints)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _wait_failed(rooms, t0, timeout):
    """Polls every room (label -> room) until all are Failed; returns
    {label: seconds since t0}, None for a room that never failed."""
    seen = {}
    while len(seen) < len(rooms) and time.monotonic() - t0 < timeout:
        for label, r in rooms.items():
            if label not in seen and r.poll() == KVPoll.Failed:
                seen[label] = time.monotonic() - t0
        time.sleep(0.0005)
    return {label: seen.get(label) for label in rooms}


def _fmt_times(times):
    return ", ".join(f"{k}: {'never' if v is None else f'{v * 1e3:.1f} ms'}" for k, v in times.items())


def _assert_times(times, bound, what):
    for label, t in times.items():
        assert t is not None, f"{what}: {label} never Failed ({_fmt_times(times)})"
        assert t < bound, f"{what}: {label} Failed after {t:.3f} s, want < {bound} s ({_fmt_times(times)})"


def _failure(room):
    """Calls failure_exception() as a scheduler does; returns (exception, seconds)."""
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as ei:
        room.failure_exception()
    return ei.value, time.monotonic() - t0


def _describe(e):
    return (f"{type(e).__name__} code={e.code} origin_rank={e.origin_rank} "
            f"is_from_another_rank={e.is_from_another_rank} peer={e.peer!r} "
            f"reason={e.failure_reason!r}")


def _assert_every_rank(rooms, cls, code, origin, words, bootstrap_room):
    """rooms: label -> (room, own rank).  failure_exception() on every one
    raises cls/code with one and the same reason, origin_rank=origin, and
    is_from_another_rank=False only on the ranks numbered origin.  With a
    record in hand the call returns at once (no sibling wait)."""
    got = {}
    for label, (room, rank) in rooms.items():
        e, el = _failure(room)
        got[label] = e
        desc = f"{label}: {_describe(e)}"
        assert type(e) is cls, desc
        assert e.code == code, desc
        assert e.origin_rank == origin, desc
        assert e.is_from_another_rank is (rank != origin), desc
        assert e.bootstrap_room == bootstrap_room, desc
        for w in words:
            assert w in e.failure_reason, f"{w!r} not in the reason; {desc}"
        assert el < 0.5, f"{label}: failure_exception() took {el:.3f} s with a record; {desc}"
    reasons = {e.failure_reason for e in got.values()}
    assert len(reasons) == 1, "ranks disagree on the reason:\n" + "\n".join(
        f"  {label}: {_describe(e)}" for label, e in got.items())
    print(f"room {bootstrap_room}: {code} from rank {origin}: {reasons.pop()!r}")
    return got


def _open_receivers(decodes, addr, rid, pages, aux=None, timeout=20):
    """Scheduler-style: a KVReceiver per decode rank, metadata sent once
    every rank is WaitingForInput (the MIN over the ranks)."""
    recvs = [KVReceiver(d.mgr, addr, rid) for d in decodes]
    for r in recvs:
        r.init()
    t0 = time.monotonic()
    while min(r.poll() for r in recvs) == KVPoll.Bootstrapping:
        assert time.monotonic() - t0 < timeout, f"room {rid}: {[r.poll() for r in recvs]}"
        time.sleep(0.001)
    states = [r.poll() for r in recvs]
    assert min(states) == KVPoll.WaitingForInput, f"room {rid} did not bootstrap: {states}"
    for r in recvs:
        r.send_metadata(np.asarray(pages, dtype=np.int32), aux_index=aux)
    return recvs


_pages_equal = peer_mod.pages_equal
_pages_canary = peer_mod.pages_canary


def _serve_new_room(prefills, decodes, addr, rid, dst_pages, dst_aux):
    """The survivor check: one new room on every rank pair moves every byte,
    each decode rank getting its own prefill rank's bytes."""
    src_pages = [1, 2, 3, 30]
    recvs = _open_receivers(decodes, addr, rid, dst_pages, aux=dst_aux)
    senders = []
    for p in prefills:
        s = KVSender(p.mgr, addr, rid)
        s.init(len(src_pages), aux_index=5)
        s.send(np.asarray(src_pages[:2], dtype=np.int32))
        s.send(np.asarray(src_pages[2:], dtype=np.int32))
        senders.append(s)
    for rank, (r, s, p, d) in enumerate(zip(recvs, senders, prefills, decodes)):
        st, el = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"new room {rid}, decode rank {rank}: {st} after {el:.3f} s"
        st, el = _wait_state(s, TERMINAL, 20)
        assert st == KVPoll.Success, f"new room {rid}, prefill rank {rank}: {st} after {el:.3f} s"
        assert _pages_equal(p.kv, d.kv, src_pages, dst_pages), f"new room {rid}: rank {rank} KV bytes differ"
        assert np.array_equal(p.aux[0][5 * AUX_ITEM:6 * AUX_ITEM],
                              d.aux[0][dst_aux * AUX_ITEM:(dst_aux + 1) * AUX_ITEM]), (
            f"new room {rid}: rank {rank} aux differs")
    for x in recvs + senders:
        x.clear()


def _assert_no_rooms(*ranks):
    for m in ranks:
        st = m.stats()
        assert st["rooms_open"] == 0, f"{m.mode} rank {m.rank} still has rooms after clear(): {st}"
        assert st["rooms_draining"] == 0, f"{m.mode} rank {m.rank} still draining: {st}"


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def rk_no_thread_leak():
    """After the test: as many Python and native threads as before it."""
    py_before = threading.active_count()
    native_before = _native_threads()
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        threading.active_count() > py_before or _native_threads() > native_before
    ):
        time.sleep(0.01)
    assert threading.active_count() == py_before, [t.name for t in threading.enumerate()]
    assert _native_threads() <= native_before, (
        f"native threads: {native_before} before, {_native_threads()} after")


@pytest.fixture
def rk_closer():
    """Closes what a test registers, in reverse order, also on failure."""
    items = []

    def add(obj):
        items.append(obj)
        return obj

    yield add
    errors = []
    for obj in reversed(items):
        try:
            obj.close()
        except Exception as e:
            errors.append(repr(e))
    assert not errors, f"teardown errors: {errors}"


@pytest.fixture
def rk_bs(rk_closer):
    return rk_closer(BootstrapServer("127.0.0.1", 0))


@pytest.fixture
def rk_instances(rk_bs, rk_closer):
    """make(prefill_config=..., decode_config=..., decode_items=...) -> two
    joined prefill ranks and two joined decode ranks, in this process."""

    def make(prefill_config=None, decode_config=None, decode_items=None, seed=100):
        prefill_config = prefill_config or [{}] * N
        decode_config = decode_config or [{}] * N
        decode_items = decode_items or [None] * N
        p = [rk_closer(_Rank("prefill", r, rk_bs.address, seed=seed + r, **prefill_config[r]))
             for r in RANKS]
        d = [rk_closer(_Rank("decode", r, items=decode_items[r], **decode_config[r])) for r in RANKS]
        _join(p)
        _join(d)
        return p, d

    return make


# --------------------------------------------------------------------------
# 1. Prefill rank 0 is killed
# --------------------------------------------------------------------------


def test_prefill_rank0_killed(rk_bs, rk_closer):
    addr = rk_bs.address
    p0 = rk_closer(_ChildRank("prefill", addr, rank=0, seed=11))
    p1 = rk_closer(_Rank("prefill", 1, addr, seed=12))
    _join([p0, p1])
    d = [rk_closer(_Rank("decode", r)) for r in RANKS]
    _join(d)

    # Room 1101: half of the pages sent on both ranks; room 1103: both
    # prefill ranks bound to the room, nothing sent yet.
    rid, idle = 1101, 1103
    recvs = _open_receivers(d, addr, rid, DST)
    idle_r = _open_receivers(d, addr, idle, [8, 9, 10, 11])
    p0.call("open_sender", room=rid, n=len(SRC))
    p0.call("send", room=rid, pages=SRC[:2])
    p0.call("open_sender", room=idle, n=4)
    s1 = KVSender(p1.mgr, addr, rid)
    s1.init(len(SRC))
    s1.send(np.asarray(SRC[:2], dtype=np.int32))
    idle_s1 = KVSender(p1.mgr, addr, idle)
    idle_s1.init(4)
    for x in d:
        _wait_until(lambda: x.stats()["bytes_moved"] == 2 * PAGE_BYTES, 20,
                    f"half of decode rank {x.rank}'s room landed")
    st, el = _wait_state(idle_s1, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
    assert st == KVPoll.WaitingForInput, f"room {idle}, prefill rank 1 not bound: {st} after {el:.3f} s"
    assert p0.call("wait", room=idle, states=[int(KVPoll.WaitingForInput)])["state"] == KVPoll.WaitingForInput
    states = [recvs[0].poll(), recvs[1].poll(), s1.poll(), idle_r[0].poll(), idle_r[1].poll()]
    assert states == [KVPoll.Transferring] * 5, states

    t_kill = p0.kill()
    survivors = {"decode rank 0": recvs[0], "decode rank 1": recvs[1], "prefill rank 1": s1,
                 "idle decode rank 0": idle_r[0], "idle decode rank 1": idle_r[1],
                 "idle prefill rank 1": idle_s1}
    times = _wait_failed(survivors, t_kill, 6)
    print(f"prefill rank 0 SIGKILL: Failed after {_fmt_times(times)}")
    _assert_times(times, 2.5, "prefill rank 0 SIGKILL")

    peer_name = f"prefill rank 0 at 127.0.0.1:{p0.port}"
    for room, (r0, r1, ps1) in ((rid, (recvs[0], recvs[1], s1)), (idle, (idle_r[0], idle_r[1], idle_s1))):
        _assert_every_rank(
            {"decode rank 0": (r0, 0), "decode rank 1": (r1, 1), "prefill rank 1": (ps1, 1)},
            KVPeerLostError, "PEER_LOST", 0, [peer_name], room)
    pkv = [peer_mod.source_buffers(11)[0], p1.kv]
    for r in RANKS:
        assert _pages_equal(pkv[r], d[r].kv, SRC[:2], DST[:2]), f"decode rank {r}: first half wrong"
    # The surviving prefill rank hands over the rest now: it must go nowhere.
    s1.send(np.asarray(SRC[2:], dtype=np.int32))
    idle_s1.send(np.asarray([20, 21, 22, 23], dtype=np.int32))
    time.sleep(0.3)
    for r in RANKS:
        assert _pages_canary(d[r].kv, DST[2:] + [8, 9, 10, 11]), (
            f"decode rank {r}: bytes landed after Failed")
    for x in d + [p1]:
        assert x.stats()["failures_by_code"]["PEER_LOST"] == 2, x.stats()

    # A new prefill rank 0 joins the surviving rank 1; both ranks serve a room.
    regs = rk_bs.stats()["registrations"]
    p0_new = rk_closer(_Rank("prefill", 0, addr, seed=13))
    _join([p0_new, p1])
    _wait_until(lambda: rk_bs.stats()["registrations"] > regs, 20, "the new rank 0's registration")
    _serve_new_room([p0_new, p1], d, addr, 1102, [4, 5, 6, 7], 1)
    for x in recvs + idle_r + [s1, idle_s1]:
        x.clear()
    _assert_no_rooms(*d, p1, p0_new)


# --------------------------------------------------------------------------
# 2. Decode rank 1 is killed
# --------------------------------------------------------------------------


def test_decode_rank1_killed(rk_bs, rk_closer):
    addr = rk_bs.address
    p = [rk_closer(_Rank("prefill", r, addr, seed=21 + r)) for r in RANKS]
    _join(p)
    d0 = rk_closer(_Rank("decode", 0))
    d1 = rk_closer(_ChildRank("decode", addr, rank=1))
    _join([d0, d1])

    # Room 1201: half of the pages sent on both ranks; room 1203: bound on
    # both ranks, nothing sent yet.
    rid, idle = 1201, 1203
    plan = {rid: DST, idle: [8, 9, 10, 11]}
    senders, r0 = {}, {}
    for room, pages in plan.items():
        senders[room] = [KVSender(x.mgr, addr, room) for x in p]
        for s in senders[room]:
            s.init(len(pages))
        r0[room] = KVReceiver(d0.mgr, addr, room)
        r0[room].init()
        st = d1.call("open_receiver", room=room, pages=pages)["state"]
        assert st in (KVPoll.WaitingForInput, KVPoll.Transferring), st
        st, el = _wait_state(r0[room], (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, f"room {room}, decode rank 0: {st} after {el:.3f} s"
        r0[room].send_metadata(np.asarray(pages, dtype=np.int32))
        for rank, s in enumerate(senders[room]):
            st, el = _wait_state(s, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
            assert st == KVPoll.WaitingForInput, (
                f"room {room}, prefill rank {rank} not bound: {st} after {el:.3f} s")
    for s in senders[rid]:
        s.send(np.asarray(SRC[:2], dtype=np.int32))
    for x in p:
        _wait_until(lambda: x.stats()["bytes_moved"] == 2 * PAGE_BYTES, 20,
                    f"half of prefill rank {x.rank}'s room sent")
    states = [senders[rid][0].poll(), senders[rid][1].poll(), r0[rid].poll(), r0[idle].poll()]
    assert states == [KVPoll.Transferring] * 4, states

    t_kill = d1.kill()
    survivors = {}
    for room in plan:
        tag = "" if room == rid else "idle "
        survivors.update({f"{tag}prefill rank 0": senders[room][0],
                          f"{tag}prefill rank 1": senders[room][1],
                          f"{tag}decode rank 0": r0[room]})
    times = _wait_failed(survivors, t_kill, 6)
    print(f"decode rank 1 SIGKILL: Failed after {_fmt_times(times)}")
    _assert_times(times, 2.5, "decode rank 1 SIGKILL")

    for room in plan:
        _assert_every_rank(
            {"prefill rank 0": (senders[room][0], 0), "prefill rank 1": (senders[room][1], 1),
             "decode rank 0": (r0[room], 0)},
            KVPeerLostError, "PEER_LOST", 1, ["decode rank 1"], room)
    assert _pages_equal(p[0].kv, d0.kv, SRC[:2], DST[:2]), "decode rank 0: first half wrong"
    # Prefill rank 0 hands over the rest now: it must go nowhere.
    senders[rid][0].send(np.asarray(SRC[2:], dtype=np.int32))
    senders[idle][0].send(np.asarray(SRC, dtype=np.int32))
    time.sleep(0.3)
    assert _pages_canary(d0.kv, DST[2:] + plan[idle]), "decode rank 0: bytes landed after Failed"
    for x in p + [d0]:
        assert x.stats()["failures_by_code"]["PEER_LOST"] == 2, x.stats()

    # A new decode rank 1 joins the surviving rank 0; both ranks serve a room.
    d1_new = rk_closer(_Rank("decode", 1))
    _join([d0, d1_new])
    _serve_new_room(p, [d0, d1_new], addr, 1202, [4, 5, 6, 7], 1)
    for x in senders[rid] + senders[idle] + list(r0.values()):
        x.clear()
    _assert_no_rooms(*p, d0, d1_new)


# --------------------------------------------------------------------------
# 3/4. abort() on one rank
# --------------------------------------------------------------------------


@pytest.mark.parametrize("side, rank", [("decode", 0), ("prefill", 1)],
                         ids=["decode_rank0", "prefill_rank1"])
def test_abort_on_one_rank(rk_bs, rk_instances, side, rank):
    addr = rk_bs.address
    p, d = rk_instances()
    # After a decode abort the prefill rank of the same number hands over the
    # rest at once, before it hears of it: that data reaches the decode rank
    # whose room failed and must go nowhere.  (The other ranks wait: a rank
    # whose pages all land before it hears of the abort may end in Success.)
    # Whether the data leaves before the prefill hears is a race, so the
    # decode case repeats until the decode refused some.
    for attempt in range(20):
        rid = 1300 + 10 * rank + (side == "prefill") + 1000 * attempt
        for x in d:
            for buf in x.kv + x.aux:
                buf.fill(CANARY)
        base = [x.stats()["bytes_moved"] for x in d]
        recvs = _open_receivers(d, addr, rid, DST)
        senders = [KVSender(x.mgr, addr, rid) for x in p]
        for s in senders:
            s.init(len(SRC))
            s.send(np.asarray(SRC[:2], dtype=np.int32))
        for x, b in zip(d, base):
            _wait_until(lambda: x.stats()["bytes_moved"] - b == 2 * PAGE_BYTES, 20,
                        f"half of decode rank {x.rank}'s room landed")
        rooms = {f"decode rank {r}": recvs[r] for r in RANKS}
        rooms.update({f"prefill rank {r}": senders[r] for r in RANKS})
        states = {k: v.poll() for k, v in rooms.items()}
        assert set(states.values()) == {KVPoll.Transferring}, states

        target = (recvs if side == "decode" else senders)[rank]
        rejected0 = sum(x.stats()["data_rejected"] for x in d)
        t0 = time.monotonic()
        target.abort()
        if side == "decode":
            senders[rank].send(np.asarray(SRC[2:], dtype=np.int32))
        times = _wait_failed(rooms, t0, 6)
        print(f"abort() on {side} rank {rank}, attempt {attempt + 1}: Failed after "
              f"{_fmt_times(times)}")
        _assert_times(times, 2.5, f"abort() on {side} rank {rank}")

        _assert_every_rank({k: (v, int(k[-1])) for k, v in rooms.items()},
                           KVAbortedError, "ABORTED", rank, [f"aborted by {side} rank {rank}"], rid)
        # The rest of the pages are handed over after the abort: they must go nowhere.
        for r, s in enumerate(senders):
            if side == "prefill" or r != rank:
                s.send(np.asarray(SRC[2:], dtype=np.int32))
        time.sleep(0.3)
        rejected = sum(x.stats()["data_rejected"] for x in d) - rejected0
        print(f"the decode ranks refused {rejected} data messages after the abort")
        for r in RANKS:
            assert _pages_equal(p[r].kv, d[r].kv, SRC[:2], DST[:2]), (
                f"decode rank {r}: first half wrong")
            assert _pages_canary(d[r].kv, DST[2:]), f"decode rank {r}: bytes landed after the abort"
        for x in p + d:
            assert x.stats()["failures_by_code"]["ABORTED"] == attempt + 1, (
                x.mode, x.rank, x.stats())
        for x in recvs + senders:
            x.clear()
        if side == "prefill" or rejected > 0:
            break
    else:
        pytest.fail("no data reached a decode rank after the abort in 20 attempts: "
                    "nothing was tested")

    _serve_new_room(p, d, addr, rid + 100, [4, 5, 6, 7], 1)
    _assert_no_rooms(*p, *d)


# --------------------------------------------------------------------------
# 5. Layout mismatch on rank 1 only
# --------------------------------------------------------------------------

BAD_ITEMS = [64, 160, 192, 256]  # the standard layout is [64, 128, 192, 256]
LAYOUT_WORDS = ["KV buffer 1", "item_len", "128", "160", "prefill rank 1", "decode rank 1"]


def _layout_mismatch_setup(rk_instances, addr, rid, **prefill_config):
    """Decode rank 1 has another item_len than prefill rank 1.  Both prefill
    ranks hand over every page at once; the decode ranks send metadata only
    when every rank is WaitingForInput (the scheduler's MIN).  Returns the
    instances, receivers, senders and the decode ranks' failure times."""
    p, d = rk_instances(prefill_config=[prefill_config] * N, decode_items=[None, BAD_ITEMS])
    senders = [KVSender(x.mgr, addr, rid) for x in p]
    for s in senders:
        s.init(len(SRC), aux_index=0)
        s.send(np.asarray(SRC, dtype=np.int32))
    recvs = [KVReceiver(x.mgr, addr, rid) for x in d]
    t0 = time.monotonic()
    recvs[1].init()
    recvs[0].init()
    rooms = {"decode rank 0": recvs[0], "decode rank 1": recvs[1]}
    seen = {}
    while len(seen) < N and time.monotonic() - t0 < 6:
        states = [r.poll() for r in recvs]
        assert min(states) != KVPoll.WaitingForInput, (
            f"every decode rank reached WaitingForInput despite the mismatch: {states}")
        for label, r in rooms.items():
            if label not in seen and r.poll() == KVPoll.Failed:
                seen[label] = time.monotonic() - t0
        time.sleep(0.0005)
    times = {label: seen.get(label) for label in rooms}
    return p, d, recvs, senders, times, t0


def test_layout_mismatch_on_rank1(rk_bs, rk_instances, rk_closer):
    addr = rk_bs.address
    rid = 1501
    p, d, recvs, senders, times, _ = _layout_mismatch_setup(rk_instances, addr, rid)
    print(f"layout mismatch on rank 1: decode Failed after {_fmt_times(times)}")
    _assert_times(times, 2.5, "layout mismatch on rank 1")
    _assert_every_rank({"decode rank 0": (recvs[0], 0), "decode rank 1": (recvs[1], 1)},
                       KVLayoutError, "LAYOUT_MISMATCH", 1, LAYOUT_WORDS, rid)
    # No byte reached either decode rank.
    time.sleep(0.2)
    for x in d:
        for b, buf in enumerate(x.kv):
            assert (buf == CANARY).all(), f"decode rank {x.rank}: KV buffer {b} was written"
        assert (x.aux[0] == CANARY).all(), f"decode rank {x.rank}: aux buffer was written"
        assert x.stats()["bytes_moved"] == 0, x.stats()
    for x in p:
        assert x.stats()["bytes_moved"] == 0, x.stats()

    # A room that the sibling failed before decode rank 0 opened it.
    rid2 = 1502
    late1 = KVReceiver(d[1].mgr, addr, rid2)
    late1.init()
    st, el = _wait_state(late1, TERMINAL, 6)
    assert st == KVPoll.Failed, f"decode rank 1, room {rid2}: {st} after {el:.3f} s"
    late0 = KVReceiver(d[0].mgr, addr, rid2)
    t0 = time.monotonic()
    late0.init()
    st, el = _wait_state(late0, TERMINAL, 6)
    print(f"layout mismatch, room opened later on decode rank 0: Failed after {el * 1e3:.1f} ms")
    assert st == KVPoll.Failed and el < 2.5, f"decode rank 0, room {rid2}: {st} after {el:.3f} s"
    _assert_every_rank({"decode rank 0": (late0, 0), "decode rank 1": (late1, 1)},
                       KVLayoutError, "LAYOUT_MISMATCH", 1, LAYOUT_WORDS, rid2)
    for x in d:
        assert x.stats()["bytes_moved"] == 0, x.stats()

    # The mismatched rank is replaced by one with the right layout.
    for x in recvs + senders + [late0, late1]:
        x.clear()
    d1_new = rk_closer(_Rank("decode", 1))
    _join([d[0], d1_new])
    _serve_new_room(p, [d[0], d1_new], addr, 1503, [4, 5, 6, 7], 1)
    _assert_no_rooms(*p, *d, d1_new)


def test_layout_mismatch_on_rank1_reaches_prefill(rk_bs, rk_instances):
    addr = rk_bs.address
    rid = 1511
    p, d, recvs, senders, times, t0 = _layout_mismatch_setup(
        rk_instances, addr, rid, bootstrap_timeout_ms=1500)
    _assert_times(times, 2.5, "layout mismatch on rank 1")
    ptimes = _wait_failed({"prefill rank 0": senders[0], "prefill rank 1": senders[1]}, t0, 3)
    print(f"layout mismatch on rank 1: prefill Failed after {_fmt_times(ptimes)}")
    try:
        _assert_times(ptimes, 2.5, "layout mismatch on rank 1, prefill side")
        _assert_every_rank({"prefill rank 0": (senders[0], 0), "prefill rank 1": (senders[1], 1),
                            "decode rank 0": (recvs[0], 0), "decode rank 1": (recvs[1], 1)},
                           KVLayoutError, "LAYOUT_MISMATCH", 1, LAYOUT_WORDS, rid)
    finally:
        for x in recvs + senders:
            x.clear()


# --------------------------------------------------------------------------
# 6. Deadline on one rank
# --------------------------------------------------------------------------


DEADLINE_MS = 500


def test_timeout_on_rank0(rk_bs, rk_instances):
    addr = rk_bs.address
    p, d = rk_instances(decode_config=[dict(deadline_base_ms=DEADLINE_MS), {}])
    rid, done = 1601, 1603
    senders = [KVSender(x.mgr, addr, rid) for x in p]
    for s in senders:
        s.init(len(SRC))
    # Prefill rank 0 never sends; prefill rank 1 sends half of its pages.
    senders[1].send(np.asarray(SRC[:2], dtype=np.int32))
    # Room `done`: prefill rank 0 never sends either, but rank 1's transfer
    # completes before rank 0's deadline.  Rank 1 must stay Success.
    done_s = [KVSender(x.mgr, addr, done) for x in p]
    for s in done_s:
        s.init(2)
    done_s[1].send(np.asarray([20, 21], dtype=np.int32))
    # Rank 1's metadata goes first; rank 0's (which starts its deadline)
    # only once rank 1 is Success on both sides, however slow the machine.
    done_r = [KVReceiver(x.mgr, addr, done) for x in d]
    for r in done_r:
        r.init()
    for rank, r in enumerate(done_r):
        st, el = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, f"room {done}, decode rank {rank}: {st} after {el:.3f} s"
    done_r[1].send_metadata(np.asarray([8, 9], dtype=np.int32))
    st, el = _wait_state(done_r[1], TERMINAL, 20)
    assert st == KVPoll.Success, f"room {done}, decode rank 1: {st} after {el:.3f} s"
    st, el = _wait_state(done_s[1], TERMINAL, 20)
    assert st == KVPoll.Success, f"room {done}, prefill rank 1: {st} after {el:.3f} s"
    done_r[0].send_metadata(np.asarray([8, 9], dtype=np.int32))
    recvs = _open_receivers(d, addr, rid, DST)
    t0 = time.monotonic()  # the metadata is out: decode rank 0's deadline runs
    rooms = {"decode rank 0": recvs[0], "decode rank 1": recvs[1],
             "prefill rank 0": senders[0], "prefill rank 1": senders[1]}
    times = _wait_failed(rooms, t0, 6)
    print(f"timeout on decode rank 0 (deadline_base_ms={DEADLINE_MS}): Failed after {_fmt_times(times)}")
    assert times["decode rank 0"] is not None and times["decode rank 0"] >= DEADLINE_MS / 1e3 - 0.01, (
        _fmt_times(times))
    _assert_times(times, DEADLINE_MS / 1e3 * 2.5, "timeout on decode rank 0")

    expected = len(DST) * PAGE_BYTES
    _assert_every_rank({k: (v, int(k[-1])) for k, v in rooms.items()},
                       KVTimeoutError, "TIMEOUT", 0, [f"0 of {expected} bytes"], rid)
    # Decode rank 1 had half of its pages; the rest goes nowhere.
    assert _pages_equal(p[1].kv, d[1].kv, SRC[:2], DST[:2]), "decode rank 1: first half wrong"
    for s in senders:
        s.send(np.asarray(SRC[2:], dtype=np.int32))
    senders[0].send(np.asarray(SRC[:2], dtype=np.int32))
    time.sleep(0.3)
    assert _pages_canary(d[0].kv, DST), "decode rank 0: bytes landed after its TIMEOUT"
    assert _pages_canary(d[1].kv, DST[2:]), "decode rank 1: bytes landed after Failed"

    # Room `done`: rank 0 timed out too, rank 1 stays Success on both sides.
    times = _wait_failed({"decode rank 0": done_r[0], "prefill rank 0": done_s[0]}, t0, 3)
    _assert_times(times, DEADLINE_MS / 1e3 * 2.5, f"room {done}: timeout on decode rank 0")
    _assert_every_rank({"decode rank 0": (done_r[0], 0), "prefill rank 0": (done_s[0], 0)},
                       KVTimeoutError, "TIMEOUT", 0, [f"0 of {2 * PAGE_BYTES} bytes"], done)
    time.sleep(0.1)
    assert done_r[1].poll() == KVPoll.Success and done_s[1].poll() == KVPoll.Success, (
        f"room {done}: a finished rank changed state: {done_r[1].poll()!r}, {done_s[1].poll()!r}")
    assert _pages_equal(p[1].kv, d[1].kv, [20, 21], [8, 9])
    for x in p[:1] + d[:1]:
        assert x.stats()["failures_by_code"]["TIMEOUT"] == 2, (x.mode, x.rank, x.stats())
    for x in p[1:] + d[1:]:
        assert x.stats()["failures_by_code"]["TIMEOUT"] == 1, (x.mode, x.rank, x.stats())

    _serve_new_room(p, d, addr, 1602, [4, 5, 6, 7], 1)
    for x in recvs + senders + done_r + done_s:
        x.clear()
    _assert_no_rooms(*p, *d)


# --------------------------------------------------------------------------
# 7. The sibling wait in failure_exception() is bounded
# --------------------------------------------------------------------------


def test_sibling_wait_bounded(rk_bs, rk_instances, rk_closer):
    addr = rk_bs.address
    # The prefill's wait is long (10 s) so that a wait ended by a record is
    # told from one that ran out by seconds, however loaded the machine.
    p, d = rk_instances(prefill_config=[dict(sibling_wait_ms=10000)] * N,
                        decode_config=[dict(sibling_wait_ms=200)] * N)

    # A healthy room and no record on any rank: the generic error after
    # about sibling_wait_ms.
    rid = 1701
    recvs = _open_receivers(d, addr, rid, DST)
    for rank, r in enumerate(recvs):
        e, el = _failure(r)
        print(f"decode rank {rank}, no record anywhere (sibling_wait_ms=200): "
              f"failure_exception() took {el * 1e3:.1f} ms")
        assert type(e) is KVTransferError, _describe(e)
        assert e.failure_reason == "KVReceiver Exception", _describe(e)
        assert e.is_from_another_rank is True and e.code is None, _describe(e)
        assert e.bootstrap_room == rid
        assert 0.15 <= el < 2.0, f"decode rank {rank}: failure_exception() took {el:.3f} s"

    # The wait ends as soon as a sibling's record arrives: prefill rank 1
    # waits (sibling_wait_ms=10000) while prefill rank 0 aborts 100 ms later.
    rid2 = 1702
    senders = [KVSender(x.mgr, addr, rid2) for x in p]
    for s in senders:
        s.init(len(SRC))
    recvs2 = _open_receivers(d, addr, rid2, DST)
    for rank, s in enumerate(senders):
        st, el = _wait_state(s, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, f"prefill rank {rank}: {st} after {el:.3f} s"
    started = threading.Event()
    out = {}

    def waiter():
        started.set()
        t = time.monotonic()
        try:
            senders[1].failure_exception()
        except KVTransferError as e:
            out["exc"] = e
        out["elapsed"] = time.monotonic() - t

    th = threading.Thread(target=waiter, name="rk-sibling-waiter")
    th.start()
    started.wait(5)
    time.sleep(0.1)
    senders[0].abort()
    th.join(10)
    assert not th.is_alive(), "failure_exception() still blocked 10 s later"
    e = out.get("exc")
    print(f"prefill rank 1 waiting for a sibling record: returned after {out['elapsed'] * 1e3:.1f} ms "
          f"with {e and _describe(e)}")
    assert e is not None, "failure_exception() returned without raising"
    assert type(e) is KVAbortedError and e.code == "ABORTED", _describe(e)
    assert e.is_from_another_rank is True and e.origin_rank == 0, _describe(e)
    assert "aborted by prefill rank 0" in e.failure_reason, _describe(e)
    # The abort comes 0.1 s into the wait; the full wait would be 10 s.
    assert 0.09 <= out["elapsed"] < 5.0, (
        f"returned after {out['elapsed']:.3f} s, the abort came after 0.1 s (sibling_wait_ms=10000)")
    times = _wait_failed({f"decode rank {r}": recvs2[r] for r in RANKS}, time.monotonic(), 3)
    _assert_times(times, 2.5, "abort() on prefill rank 0")
    _assert_every_rank({"prefill rank 0": (senders[0], 0), "decode rank 0": (recvs2[0], 0),
                        "decode rank 1": (recvs2[1], 1)},
                       KVAbortedError, "ABORTED", 0, ["aborted by prefill rank 0"], rid2)

    # Without siblings there is nothing to wait for: the call returns at once.
    solo = rk_closer(_Rank("decode", 0, sibling_wait_ms=5000))
    r_solo = KVReceiver(solo.mgr, addr, 1703)
    e, el = _failure(r_solo)
    print(f"decode without siblings: failure_exception() took {el * 1e3:.2f} ms")
    assert type(e) is KVTransferError and e.failure_reason == "KVReceiver Exception", _describe(e)
    assert e.is_from_another_rank is True
    assert el < 1.0, f"failure_exception() without siblings took {el:.3f} s (sibling_wait_ms=5000)"

    # The healthy room 1701 is unharmed by the calls: feed it and it succeeds.
    s1701 = [KVSender(x.mgr, addr, rid) for x in p]
    for s in s1701:
        s.init(len(SRC))
        s.send(np.asarray(SRC, dtype=np.int32))
    for rank, r in enumerate(recvs):
        st, el = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"room {rid}, decode rank {rank}: {st} after {el:.3f} s"

    for x in recvs + recvs2 + senders + s1701 + [r_solo]:
        x.clear()
    _serve_new_room(p, d, addr, 1704, [8, 9, 10, 11], 2)
    _assert_no_rooms(*p, *d, solo)


# --------------------------------------------------------------------------
# 8. set_siblings() input errors
# --------------------------------------------------------------------------


def test_set_siblings_input_errors(rk_bs, rk_closer):
    addr = rk_bs.address
    p = [rk_closer(_Rank("prefill", r, addr, seed=80 + r)) for r in RANKS]
    d = [rk_closer(_Rank("decode", r, sibling_wait_ms=500)) for r in RANKS]

    with pytest.raises(TypeError, match="str"):
        d[0].mgr.set_siblings(d[1].endpoint)
    with pytest.raises(ValueError) as ei:
        d[0].mgr.set_siblings([d[0].endpoint, d[1].endpoint, "not-an-endpoint"])
    assert "not-an-endpoint" in str(ei.value), str(ei.value)

    # The rejected calls set no siblings: nothing to wait for.
    r = KVReceiver(d[0].mgr, addr, 1801)
    e, el = _failure(r)
    assert type(e) is KVTransferError and el < 0.05, (
        f"failure_exception() after rejected set_siblings took {el:.3f} s: {_describe(e)}")
    r.clear()

    # A proper join afterwards works: an abort on decode rank 1 reaches rank 0.
    _join(p)
    _join(d)
    rid = 1802
    recvs = _open_receivers(d, addr, rid, DST)
    t0 = time.monotonic()
    recvs[1].abort()
    times = _wait_failed({"decode rank 0": recvs[0], "decode rank 1": recvs[1]}, t0, 6)
    _assert_times(times, 2.5, "abort() on decode rank 1")
    _assert_every_rank({"decode rank 0": (recvs[0], 0), "decode rank 1": (recvs[1], 1)},
                       KVAbortedError, "ABORTED", 1, ["aborted by decode rank 1"], rid)
    for x in recvs:
        x.clear()
    _serve_new_room(p, d, addr, 1803, [4, 5, 6, 7], 1)
    _assert_no_rooms(*p, *d)


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:abc", "tcp://:5555", "tcp://127.0.0.1:"])
def test_set_siblings_malformed_endpoint(rk_closer, bad):
    d = rk_closer(_Rank("decode", 0))
    with pytest.raises(ValueError) as ei:
        d.mgr.set_siblings([bad])
    assert bad in str(ei.value)
