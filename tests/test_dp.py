"""Two prefill DP groups behind one bootstrap server (KVArgs.attn_dp_rank,
KVReceiver.init(prefill_dp_rank)).

Group 0 runs TP 1, group 1 TP 2, each rank in its own child process
(tests/failure_peer.py) holding its heads of its own model: the groups'
buffers come from different seeds, so a byte read from the wrong group
shows.  Both groups register TP rank 0 with the same server.  The decode
instance runs TP 2 in this process.  Rooms of DP 0 read each decode rank's
heads from group 0's one rank (TP 1 -> 2); rooms of DP 1 read rank to rank
from group 1, with and without the prefill's TP size given.
"""

from __future__ import annotations

import numpy as np
import pytest

import hetero_peer as hp
from failtest import _wait_state
from peer_proc import PeerProcess
import kvrecv
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVBootstrapError,
    KVConfig,
    KVManager,
    KVPeerLostError,
    KVPoll,
    KVReceiver,
    KVTransferError,
)

TERMINAL = (KVPoll.Success, KVPoll.Failed)
TOTAL = 8  # KV heads
DECODE_TP = 2
GROUP_TP = {0: 1, 1: 2}
SEEDS = {0: 21, 1: 22}
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}
# Per room: (DP group, prefill pages, decode pages, prefill aux row, decode aux row).
ROOM_A = (0, [3, 4, 5, 9], [0, 1, 7, 8], 2, 0)
ROOM_B = (1, [11, 12, 20, 21], [9, 15, 2, 23], 3, 1)

pytestmark = pytest.mark.timeout(120)


class DecodeRank:
    def __init__(self, rank, **config):
        self.kv, self.aux = hp.decode_buffers(DECODE_TP, TOTAL)
        self.rank = rank
        args = hp.kv_args(kvrecv, self.kv, self.aux, DECODE_TP, rank, TOTAL)
        self.mgr = KVManager(args, "decode", config=KVConfig(**{**CONFIG, **config}))

    def reset(self):
        for buf in self.kv + self.aux:
            buf[:] = hp.CANARY


@pytest.fixture
def deployment():
    """(bootstrap address, {dp: prefill ranks}, decode ranks)."""
    made = []
    bs = BootstrapServer(port=0)
    made.append(bs)
    try:
        groups = {}
        for dp, tp in GROUP_TP.items():
            groups[dp] = [PeerProcess("prefill", bs.address, seed=SEEDS[dp], config=CONFIG,
                                      rank=r, heads={"tp": tp, "total": TOTAL, "dp": dp})
                          for r in range(tp)]
            made.extend(groups[dp])
            for p in groups[dp]:  # the ranks of one group are one instance
                p.call("set_siblings", endpoints=[q.endpoint for q in groups[dp]])
        decodes = [DecodeRank(r) for r in range(DECODE_TP)]
        made.extend(d.mgr for d in decodes)
        for d in decodes:
            d.mgr.set_siblings([x.mgr.endpoint for x in decodes])
        yield bs.address, groups, decodes
    finally:
        for obj in reversed(made):
            obj.close()


def _open(addr, groups, decodes, rid, room, tp_given=True):
    """Receivers on every decode rank for DP group room[0] (its TP size
    given to init() unless tp_given is False), then senders on every rank
    of that group; returns the receivers."""
    dp, src, dst, src_aux, dst_aux = room
    recvs = [KVReceiver(d.mgr, addr, rid) for d in decodes]
    for r in recvs:
        if tp_given:
            r.init(prefill_dp_rank=dp, prefill_tp_size=GROUP_TP[dp])
        else:
            r.init(dp)
    for r in recvs:
        st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, f"room {rid}: {st!r}"
        r.send_metadata(np.asarray(dst, dtype=np.int32), aux_index=dst_aux)
    for p in groups[dp]:
        p.call("open_sender", room=rid, n=len(src), aux=src_aux)
    return recvs


def _send(groups, rid, room):
    for p in groups[room[0]]:
        p.call("send", room=rid, pages=room[1])



def _check_bytes(decodes, rooms):
    """Every decode rank holds, for each room, its heads of that room's
    group's model in the room's pages and aux row, and CANARY elsewhere."""
    for d in decodes:
        heads = hp.rank_heads(DECODE_TP, d.rank, TOTAL)
        want = [np.full((hp.PAGES, hp.PAGE_SIZE, len(heads), hp.HEAD_BYTES), hp.CANARY,
                        dtype=np.uint8) for _ in range(hp.NBUF)]
        want_aux = np.full((hp.AUX_ROWS, hp.AUX_ITEM), hp.CANARY, dtype=np.uint8)
        for dp, src, dst, src_aux, dst_aux in rooms:
            for w, g in zip(want, hp.model(SEEDS[dp], TOTAL)):
                for s, t in zip(src, dst):
                    w[t] = g[s][:, heads, :]
            want_aux[dst_aux] = hp.aux_rows(SEEDS[dp]).reshape(hp.AUX_ROWS, hp.AUX_ITEM)[src_aux]
        for b, (got, exp) in enumerate(zip(d.kv, want)):
            bad = np.flatnonzero(got != exp.reshape(-1))
            assert bad.size == 0, (f"decode rank {d.rank} buffer {b}: {bad.size} bytes differ, "
                                   f"first at {bad[0]}")
        assert np.array_equal(d.aux[0].reshape(hp.AUX_ROWS, hp.AUX_ITEM), want_aux), (
            f"decode rank {d.rank}: aux rows differ")


def _succeed(recvs, groups, rid, dp):
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"room {rid} (DP {dp}): decode rank {rank} {st!r}"
    for p in groups[dp]:
        assert p.wait_room(rid) == int(KVPoll.Success), f"DP {dp} prefill rank {p.rank}"


def test_dp_groups_byte_exact(deployment):
    """A room of each DP group at once, then a DP 1 room without the
    prefill's TP size (rank to rank, both groups' TP rank 0 registered):
    each reads its group's bytes."""
    addr, groups, decodes = deployment
    ra = _open(addr, groups, decodes, 11, ROOM_A)
    rb = _open(addr, groups, decodes, 12, ROOM_B)
    _send(groups, 12, ROOM_B)
    _send(groups, 11, ROOM_A)
    _succeed(ra, groups, 11, 0)
    _succeed(rb, groups, 12, 1)
    _check_bytes(decodes, [ROOM_A, ROOM_B])
    for r in ra + rb:
        r.clear()
    for d in decodes:
        st = d.mgr.stats()
        assert st["rooms_open"] == 0 and st["rooms_draining"] == 0, st
    # Rank to rank needs a decode of its own: one decode manager cannot
    # reach one prefill rank both as a group leg and rank to rank (two
    # connections with one routing id; docs/layouts.md).
    plain = [DecodeRank(r) for r in range(DECODE_TP)]
    try:
        for d in plain:
            d.mgr.set_siblings([x.mgr.endpoint for x in plain])
        rc = _open(addr, groups, plain, 13, ROOM_B, tp_given=False)
        _send(groups, 13, ROOM_B)
        _succeed(rc, groups, 13, 1)
        _check_bytes(plain, [ROOM_B])
        for r in rc:
            r.clear()
    finally:
        for d in plain:
            d.mgr.close()


def test_dp_group_rank_killed_fails_only_its_rooms(deployment):
    """Rank 1 of group 1 SIGKILLed while a room of each group is open:
    the DP 1 room fails on every decode rank with PEER_LOST naming that
    rank and group (decode rank 0 reads only from group 1's rank 0 and
    hears it from its sibling); the DP 0 room and a new one succeed."""
    addr, groups, decodes = deployment
    ra = _open(addr, groups, decodes, 21, ROOM_A)
    rb = _open(addr, groups, decodes, 22, ROOM_B)
    dead = groups[1][1]
    dead.kill()
    for rank, r in enumerate(rb):
        st, el = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"decode rank {rank} {st!r} after {el:.3f} s"
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        e = ei.value
        desc = f"decode rank {rank}: {type(e).__name__} {e.failure_reason!r}"
        assert type(e) is KVPeerLostError, desc
        assert "prefill rank 1 of DP group 1 at 127.0.0.1:" in e.failure_reason, desc
        assert e.bootstrap_room == 22, desc
    alive = (KVPoll.WaitingForInput, KVPoll.Transferring)
    assert all(r.poll() in alive for r in ra), [r.poll() for r in ra]
    _send(groups, 21, ROOM_A)
    _succeed(ra, groups, 21, 0)
    _check_bytes(decodes, [ROOM_A])
    for d in decodes:
        d.reset()
    again = _open(addr, groups, decodes, 23, ROOM_A)
    _send(groups, 23, ROOM_A)
    _succeed(again, groups, 23, 0)
    _check_bytes(decodes, [ROOM_A])
    for r in ra + rb + again:
        r.clear()


def test_dp_group_abort_leaves_the_other_group(deployment):
    """abort() of a DP 1 room on decode rank 1: both decode ranks and both
    ranks of group 1 fail with ABORTED naming it; group 0's room, open at
    the same time, succeeds."""
    addr, groups, decodes = deployment
    ra = _open(addr, groups, decodes, 31, ROOM_A)
    rb = _open(addr, groups, decodes, 32, ROOM_B)
    rb[1].abort()
    for rank, r in enumerate(rb):
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"decode rank {rank} {st!r}"
        with pytest.raises(KVAbortedError) as ei:
            r.failure_exception()
        assert "aborted by decode rank 1" in ei.value.failure_reason, ei.value.failure_reason
    for p in groups[1]:
        assert p.wait_room(32, 15) == int(KVPoll.Failed), f"DP 1 prefill rank {p.rank}"
        f = p.call("failure", room=32)
        assert f["code"] == "ABORTED" and "aborted by decode rank 1" in f["reason"], f
    _send(groups, 31, ROOM_A)
    _succeed(ra, groups, 31, 0)
    _check_bytes(decodes, [ROOM_A])
    for r in ra + rb:
        r.clear()


@pytest.mark.parametrize("tp_given", [True, False])
def test_dp_group_that_does_not_exist(tp_given):
    """A DP group no prefill registered: the room fails at the bootstrap
    timeout with BOOTSTRAP naming the group and the rank asked for."""
    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        kv, aux = hp.prefill_buffers(SEEDS[0], 1, 0, TOTAL)
        made.append(KVManager(hp.kv_args(kvrecv, kv, aux, 1, 0, TOTAL), "prefill",
                              bootstrap_addr=bs.address, config=KVConfig(**CONFIG)))
        d = DecodeRank(0, bootstrap_timeout_ms=1000)
        made.append(d.mgr)
        r = KVReceiver(d.mgr, bs.address, 41)
        if tp_given:
            r.init(prefill_dp_rank=5, prefill_tp_size=1)
        else:
            r.init(5)
        st, el = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVBootstrapError) as ei:
            r.failure_exception()
        assert (f"{bs.address} (prefill DP group 5, rank 0) was not found at the bootstrap "
                "server") in ei.value.failure_reason, ei.value.failure_reason
        assert "within the bootstrap timeout (1000 ms)" in ei.value.failure_reason
        r.clear()
    finally:
        for m in reversed(made):
            m.close()


def test_dp_ranks_out_of_range_raise_value_error():
    with pytest.raises(ValueError, match=r"attn_dp_rank=-1 must be an integer in \[0, 65535\]"):
        hp.kv_args(kvrecv, *hp.decode_buffers(1, TOTAL), 1, 0, TOTAL, dp=-1)
    with pytest.raises(ValueError, match=r"attn_dp_rank=65536 must be an integer"):
        hp.kv_args(kvrecv, *hp.decode_buffers(1, TOTAL), 1, 0, TOTAL, dp=65536)
    d = DecodeRank(0)
    try:
        r = KVReceiver(d.mgr, "127.0.0.1:1", 51)
        for bad in (-1, 65536, True, 1.0):
            with pytest.raises(ValueError, match=rf"prefill_dp_rank={bad!r} must be an integer"):
                r.init(prefill_dp_rank=bad)
        # The core's own check, for callers of recv_init.
        with pytest.raises(ValueError, match=r"prefill_dp_rank=70000 is not in \[0, 65535\]"):
            r.recv_init(70000)
    finally:
        d.mgr.close()
