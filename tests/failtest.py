"""Shared by the failure-path tests (test_failures.py, test_peer_death.py;
test_ranks.py takes the waiting helpers): helpers that wait for states and
check pages, and the fixtures (prefixed fail_) that track every manager,
server and child process and check that no native thread outlives a test."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from peer_proc import PeerProcess, peer_mod
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVArgs,
    KVBootstrapError,
    KVLayoutError,
    KVManager,
    KVPeerLostError,
    KVPeerRestartedError,
    KVPoll,
    KVProtocolError,
    KVRefusedError,
    KVReceiver,
    KVRemoteError,
    KVSender,
    KVTimeoutError,
    KVTransferError,
    KVTransportError,
)
from kvtest import describe_failure


NBUF = peer_mod.NBUF
PAGES = peer_mod.PAGES
AUX_ITEM = peer_mod.AUX_ITEM
CANARY = peer_mod.CANARY
ITEMS = peer_mod.item_lens()
PAGE_BYTES = peer_mod.page_bytes()

TERMINAL = (KVPoll.Success, KVPoll.Failed)

CODE_TO_CLASS = {
    "BOOTSTRAP": KVBootstrapError,
    "LAYOUT_MISMATCH": KVLayoutError,
    "PEER_LOST": KVPeerLostError,
    "PEER_RESTARTED": KVPeerRestartedError,
    "TRANSPORT": KVTransportError,
    "TIMEOUT": KVTimeoutError,
    "ABORTED": KVAbortedError,
    "REMOTE": KVRemoteError,
    "PROTOCOL": KVProtocolError,
    "REFUSED": KVRefusedError,
}


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_state(room, states, timeout):
    """Polls room until its state is in states; returns (state, seconds)."""
    t0 = time.monotonic()
    while True:
        st = room.poll()
        el = time.monotonic() - t0
        if st in states or el > timeout:
            return st, el
        time.sleep(0.001)


def _every_rank_fails(recvs, cls, text, t0, timeout=15):
    """Waits until every decode rank's receiver of recvs Failed, each with
    exactly cls and text in its reason (printed with the seconds since t0);
    returns the set of their reasons."""
    reasons = set()
    for rank, r in enumerate(recvs):
        st, el = _wait_state(r, TERMINAL, timeout)
        assert st == KVPoll.Failed, f"decode rank {rank}: {st!r} after {el:.3f} s"
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        e = ei.value
        desc = f"decode rank {rank}: {type(e).__name__} {e.code} {e.failure_reason!r}"
        assert type(e) is cls and text in e.failure_reason, desc
        reasons.add(e.failure_reason)
        print(f"{desc} ({time.monotonic() - t0:.3f} s)")
    return reasons


def _wait_until(pred, timeout, what):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)
    return time.monotonic() - t0


def _wait_all_failed(rooms, t0, timeout, spin=False):
    """Polls every room until all are Failed; returns {room_id: seconds since t0}
    (None for rooms that never failed).  spin: poll back to back, as a busy
    scheduler does (poll() then progresses UCX on this thread, so endpoint
    errors are seen here first and handed to the engine thread)."""
    seen = {}
    while len(seen) < len(rooms) and time.monotonic() - t0 < timeout:
        for rid, r in rooms.items():
            if rid not in seen and r.poll() == KVPoll.Failed:
                seen[rid] = time.monotonic() - t0
        if not spin:
            time.sleep(0.001)
    return {rid: seen.get(rid) for rid in rooms}


def _exc(room) -> KVTransferError:
    with pytest.raises(KVTransferError) as ei:
        room.failure_exception()
    return ei.value


def _prefill(addr, seed, rank=0, config=None, items=None, scale=64):
    kv, aux = peer_mod.source_buffers(seed, scale=scale)
    if items is not None:
        kv = [np.random.default_rng(seed + i).integers(0, 256, PAGES * it, dtype=np.uint8)
              for i, it in enumerate(items)]
    items = list(items or peer_mod.item_lens(scale=scale))
    args = KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM])
    return KVManager(args, "prefill", bootstrap_addr=addr, config=config), kv, aux


def _decode(config=None, rank=0, items=None, scale=64):
    items = list(items or peer_mod.item_lens(scale=scale))
    kv = [np.full(PAGES * it, CANARY, dtype=np.uint8) for it in items]
    aux = [np.full(peer_mod.AUX_ROWS * AUX_ITEM, CANARY, dtype=np.uint8)]
    args = KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM])
    return KVManager(args, "decode", config=config), kv, aux


_pages_equal = peer_mod.pages_equal
_pages_canary = peer_mod.pages_canary


def _assert_still(bufs, seconds, what):
    """Asserts that none of bufs changes during the next `seconds`."""
    snap = [b.copy() for b in bufs]
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for i, (a, b) in enumerate(zip(snap, bufs)):
            assert np.array_equal(a, b), f"{what}: buffer {i} changed after poll() said Failed"
        time.sleep(0.01)


def _open_receiver(dmgr, addr, room, pages, aux=None, timeout=20):
    r = KVReceiver(dmgr, addr, room)
    r.init()
    st, el = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), timeout)
    assert st == KVPoll.WaitingForInput, f"room {room} did not bootstrap: {st} after {el:.3f} s"
    r.send_metadata(np.asarray(pages, dtype=np.int32), aux_index=aux)
    return r


def _check_new_room_in_process(pmgr, pkv, paux, dmgr, dkv, daux, addr, room, dst_pages, dst_aux):
    """The survivor check: one new room moves every byte, and clear() empties
    both managers' room tables."""
    src_pages = [1, 2, 3, 30]
    r = _open_receiver(dmgr, addr, room, dst_pages, aux=dst_aux)
    s = KVSender(pmgr, addr, room)
    s.init(len(src_pages), aux_index=5)
    s.send(np.asarray(src_pages[:2], dtype=np.int32))
    s.send(np.asarray(src_pages[2:], dtype=np.int32))
    st, el = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Success, \
        f"new room {room} on the surviving manager: {describe_failure(r)} after {el:.3f} s"
    st, el = _wait_state(s, TERMINAL, 20)
    assert st == KVPoll.Success, \
        f"new room {room}, prefill side: {describe_failure(s)} after {el:.3f} s"
    assert _pages_equal(pkv, dkv, src_pages, dst_pages), "new room: KV bytes differ"
    assert np.array_equal(paux[0][5 * AUX_ITEM:6 * AUX_ITEM],
                          daux[0][dst_aux * AUX_ITEM:(dst_aux + 1) * AUX_ITEM]), "new room: aux differs"
    r.clear()
    s.clear()


def _assert_no_rooms(*mgrs):
    for m in mgrs:
        st = m.stats()
        assert st["rooms_open"] == 0, f"{m.mode} manager still has rooms after clear(): {st}"
        assert st["rooms_draining"] == 0, f"{m.mode} manager still draining: {st}"


_Peer = PeerProcess

# --------------------------------------------------------------------------
# Fixtures (self-contained: prefixed fail_)
# --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fail_no_thread_leak():
    """After the test: as many Python and native threads as before it."""
    py_before = threading.active_count()
    native_before = _native_threads()
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        threading.active_count() > py_before or _native_threads() > native_before
    ):
        time.sleep(0.01)
    assert threading.active_count() == py_before, (
        f"Python threads: {py_before} before, {threading.active_count()} after: "
        f"{[t.name for t in threading.enumerate()]}"
    )
    assert _native_threads() <= native_before, (
        f"native threads: {native_before} before, {_native_threads()} after"
    )


@pytest.fixture
def fail_closer():
    """Closes what a test registers, in reverse order, also on failure."""
    items = []
    yield items.append
    errors = []
    for obj in reversed(items):
        try:
            obj.close()
        except Exception as e:
            errors.append(repr(e))
    assert not errors, f"teardown errors: {errors}"


@pytest.fixture
def fail_bs(fail_closer):
    bs = BootstrapServer("127.0.0.1", 0)
    fail_closer(bs)
    return bs


@pytest.fixture
def fail_spawn(fail_closer):
    def spawn(role, bootstrap, **kw):
        p = _Peer(role, bootstrap, **kw)
        fail_closer(p)
        return p

    return spawn
