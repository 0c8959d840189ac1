"""Prefill and decode instances of different TP sizes (head layouts,
docs/layouts.md).

Every prefill rank runs in its own child process (tests/failure_peer.py), so
that it can be SIGKILLed; the decode ranks are managers in this process,
joined as siblings, as are the prefill ranks.  Each rank's buffers hold its
heads of one model (hetero_peer.model), and every decode rank's pages are
checked byte for byte against the heads it holds, the aux row too, and
every page the room did not name must still be CANARY.

The layouts: TP 2 -> 1 and 1 -> 2 with 8 KV heads, TP 4 -> 2 with 2 KV
heads (GQA with fewer heads than ranks: the heads are replicated, and each
decode head is read from one replica), MLA TP 2 -> 4 (one latent cache
every rank holds whole), and TP 2 -> 3 with 6 heads (a link takes part of
the page rows on both sides).  Each with a room served, a prefill rank killed in
the middle of a room (every decode rank raises PEER_LOST naming the dead
rank) and an abort on one decode rank (every rank of both sides fails with
ABORTED naming it).  Then the input the layouts refuse.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import hetero_peer as hp
from failtest import _wait_state
from peer_proc import PeerProcess
import kvrecv
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVConfig,
    KVLayoutError,
    KVManager,
    KVPeerLostError,
    KVPoll,
    KVReceiver,
    KVTransferError,
)

TERMINAL = (KVPoll.Success, KVPoll.Failed)
SEED = 11
SRC = [3, 4, 5, 9, 11, 12, 20, 21]
DST = [0, 1, 7, 8, 9, 15, 2, 23]
SRC_AUX, DST_AUX = 2, 1
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}

# (prefill TP, decode TP, total KV heads, MLA)
LAYOUTS = {
    "tp2-to-1": (2, 1, 8, False),
    "tp1-to-2": (1, 2, 8, False),
    "tp4-to-2-gqa": (4, 2, 2, False),
    "mla-tp2-to-4": (2, 4, 1, True),
    "tp2-to-3-both-sliced": (2, 3, 6, False),  # a link takes part of the rows on both sides
}

pytestmark = pytest.mark.timeout(120)


def PrefillRank(bootstrap, tp, rank, total, mla):
    """One prefill rank in a child process (tests/failure_peer.py)."""
    return PeerProcess("prefill", bootstrap, seed=SEED, config=CONFIG, rank=rank,
                       heads={"tp": tp, "total": total, "mla": mla})


class DecodeRank:
    def __init__(self, tp, rank, total, mla, **config):
        self.kv, self.aux = hp.decode_buffers(tp, total)
        self.tp, self.rank, self.total = tp, rank, total
        args = hp.kv_args(kvrecv, self.kv, self.aux, tp, rank, total, mla)
        self.mgr = KVManager(args, "decode", config=KVConfig(**{**CONFIG, **config}))


@pytest.fixture
def deployment(request):
    """deployment(name) -> (bootstrap address, prefill ranks, decode ranks)."""
    made = []

    def make(name):
        ptp, dtp, total, mla = LAYOUTS[name]
        bs = BootstrapServer(port=0)
        made.append(bs)
        prefills = [PrefillRank(bs.address, ptp, r, total, mla) for r in range(ptp)]
        made.extend(prefills)
        for p in prefills:
            p.call("set_siblings", endpoints=[q.endpoint for q in prefills])
        decodes = [DecodeRank(dtp, r, total, mla) for r in range(dtp)]
        made.extend(d.mgr for d in decodes)
        for d in decodes:
            d.mgr.set_siblings([x.mgr.endpoint for x in decodes])
        return bs.address, prefills, decodes

    yield make
    for obj in reversed(made):
        obj.close()


def _open(addr, prefills, decodes, rid, send=True):
    """Receivers on every decode rank (metadata once all are
    WaitingForInput), then a sender on every prefill rank; send: hand over
    the pages in two parts."""
    recvs = [KVReceiver(d.mgr, addr, rid) for d in decodes]
    for r in recvs:
        r.init(prefill_tp_size=len(prefills))
    t0 = time.monotonic()
    while min(r.poll() for r in recvs) == KVPoll.Bootstrapping:
        assert time.monotonic() - t0 < 20, f"room {rid}: {[r.poll() for r in recvs]}"
        time.sleep(0.001)
    assert min(r.poll() for r in recvs) == KVPoll.WaitingForInput, [r.poll() for r in recvs]
    for r in recvs:
        r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX)
    for p in prefills:
        p.call("open_sender", room=rid, n=len(SRC), aux=SRC_AUX)
    if send:
        for p in prefills:
            p.call("send", room=rid, pages=SRC[:3])
        for p in prefills:
            p.call("send", room=rid, pages=SRC[3:])
    return recvs


def _wait_prefill(p, rid, timeout=20):
    return p.wait_room(rid, timeout)


def _check_bytes(decodes, src=SRC, dst=DST):
    for d in decodes:
        want = hp.expected_decode(SEED, d.tp, d.rank, d.total, src, dst)
        for b, (got, exp) in enumerate(zip(d.kv, want)):
            bad = np.flatnonzero(got != exp)
            assert bad.size == 0, (f"decode rank {d.rank} buffer {b}: {bad.size} bytes differ, "
                                   f"first at {bad[0]}")
        aux = hp.aux_rows(SEED)
        a = d.aux[0].reshape(hp.AUX_ROWS, hp.AUX_ITEM)
        assert np.array_equal(a[DST_AUX], aux.reshape(hp.AUX_ROWS, hp.AUX_ITEM)[SRC_AUX]), (
            f"decode rank {d.rank}: aux row differs")
        others = [i for i in range(hp.AUX_ROWS) if i != DST_AUX]
        assert (a[others] == hp.CANARY).all(), f"decode rank {d.rank}: other aux rows touched"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hetero_byte_exact(deployment, name):
    addr, prefills, decodes = deployment(name)
    for rid in (101, 102):  # twice: the second room reuses the connections
        for d in decodes:
            for buf in d.kv + d.aux:
                buf[:] = hp.CANARY
        recvs = _open(addr, prefills, decodes, rid)
        for rank, r in enumerate(recvs):
            st, el = _wait_state(r, TERMINAL, 20)
            assert st == KVPoll.Success, f"{name} room {rid}: decode rank {rank} {st!r}"
        for p in prefills:
            assert _wait_prefill(p, rid) == int(KVPoll.Success), f"{name}: prefill rank {p.rank}"
        _check_bytes(decodes)
        for r in recvs:
            r.clear()
        for p in prefills:
            p.call("clear", room=rid)
    for d in decodes:
        st = d.mgr.stats()
        assert st["rooms_open"] == 0 and st["rooms_draining"] == 0, st


def test_hetero_same_tp_rank_to_rank(deployment):
    """Head layouts on both sides and equal TP sizes, the receiver not told
    the prefill's TP size: decode rank r reads from prefill rank r as
    without head layouts."""
    LAYOUTS["tp2-to-2"] = (2, 2, 8, False)
    try:
        addr, prefills, decodes = deployment("tp2-to-2")
    finally:
        del LAYOUTS["tp2-to-2"]
    recvs = [KVReceiver(d.mgr, addr, 401) for d in decodes]
    for r in recvs:
        r.init()
    for r in recvs:
        _wait_state(r, (KVPoll.WaitingForInput,), 20)
        r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX)
    for p in prefills:
        p.call("open_sender", room=401, n=len(SRC), aux=SRC_AUX)
        p.call("send", room=401, pages=SRC)
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"decode rank {rank}: {st!r}"
    for p in prefills:
        assert _wait_prefill(p, 401) == int(KVPoll.Success)
    _check_bytes(decodes)


# The rank killed in each layout: a rank some decode rank reads from.
KILLED = {"tp2-to-1": 1, "tp1-to-2": 0, "tp4-to-2-gqa": 3, "mla-tp2-to-4": 1,
          "tp2-to-3-both-sliced": 0}


@pytest.mark.parametrize("name, part", [(n, False) for n in LAYOUTS] +
                         [("tp2-to-1", True), ("tp1-to-2", True), ("tp4-to-2-gqa", True)])
def test_hetero_prefill_rank_killed(deployment, name, part):
    """A prefill rank SIGKILLed once every rank has opened the room and
    before it sent (part: after every prefill rank sent the first pages):
    every decode rank's room fails with PEER_LOST naming the dead rank (the
    ranks that read from it see the loss, the others hear it from them as
    siblings)."""
    addr, prefills, decodes = deployment(name)
    rid = 201
    recvs = _open(addr, prefills, decodes, rid, send=False)
    if part:
        for p in prefills:
            p.call("send", room=rid, pages=SRC[:3])
    dead = prefills[KILLED[name]]
    t0 = dead.kill()
    for rank, r in enumerate(recvs):
        st, el = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"{name}: decode rank {rank} {st!r} after {el:.3f} s"
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        e = ei.value
        desc = (f"{name}: decode rank {rank}: {type(e).__name__} {e.code} origin {e.origin_rank} "
                f"{e.failure_reason!r}")
        assert type(e) is KVPeerLostError, desc
        assert f"prefill rank {dead.rank} at 127.0.0.1" in e.failure_reason, desc
        assert e.bootstrap_room == rid, desc
        print(f"{desc} ({time.monotonic() - t0:.3f} s after the kill)")
    if not part:
        for rank, d in enumerate(decodes):
            assert all((buf == hp.CANARY).all() for buf in d.kv), f"decode rank {rank}: bytes landed"
    for r in recvs:
        r.clear()


@pytest.mark.parametrize("name, side", [(n, "decode") for n in LAYOUTS] +
                         [("tp1-to-2", "prefill"), ("tp4-to-2-gqa", "prefill")])
def test_hetero_abort(deployment, name, side):
    """abort() on decode rank 0 (or on the last prefill rank) before any
    byte moved: every decode rank and every prefill rank fails with ABORTED
    naming that rank."""
    addr, prefills, decodes = deployment(name)
    rid = 301
    recvs = _open(addr, prefills, decodes, rid, send=False)
    if side == "decode":
        recvs[0].abort()
        who = "aborted by decode rank 0"
    else:
        prefills[-1].call("abort", room=rid)
        who = f"aborted by prefill rank {prefills[-1].rank}"
    for rank, r in enumerate(recvs):
        st, el = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"{name}: decode rank {rank} {st!r}"
        with pytest.raises(KVAbortedError) as ei:
            r.failure_exception()
        assert who in ei.value.failure_reason, ei.value.failure_reason
    for p in prefills:
        assert _wait_prefill(p, rid, 15) == int(KVPoll.Failed), f"{name}: prefill rank {p.rank}"
        f = p.call("failure", room=rid)
        assert f["code"] == "ABORTED" and who in f["reason"], f
        p.call("send", room=rid, pages=SRC)  # accepted, moves nothing
    time.sleep(0.2)
    for rank, d in enumerate(decodes):
        assert all((buf == hp.CANARY).all() for buf in d.kv), f"decode rank {rank}: bytes landed"
    for r in recvs:
        r.clear()


def _mgr(mode, tp, rank, heads, total, items, addr=None, page_size=hp.PAGE_SIZE):
    kv = [np.zeros(hp.PAGES * it, dtype=np.uint8) for it in items]
    args = kvrecv.KVArgs.from_buffers(rank, kv, items, page_size=page_size, tp_size=tp,
                                      kv_head_num=heads, total_kv_head_num=total)
    return KVManager(args, mode, bootstrap_addr=addr, config=KVConfig(**CONFIG))


def test_hetero_impossible_layouts_raise_value_error():
    items = [hp.PAGE_SIZE * 2 * hp.HEAD_BYTES]
    with pytest.raises(ValueError, match="8 KV heads do not split over tp_size 3 as 2 heads"):
        _mgr("decode", 3, 0, 2, 8, items)
    with pytest.raises(ValueError, match="4 KV heads do not split over tp_size 6"):
        _mgr("decode", 6, 0, 1, 4, items)
    with pytest.raises(ValueError, match=r"kv_item_lens\[0\]=33 is not page_size 2 x 2 KV heads"):
        _mgr("decode", 4, 0, 2, 8, [33])
    with pytest.raises(ValueError, match="engine_rank=4 is not a rank of tp_size=4"):
        _mgr("decode", 4, 4, 2, 8, items)
    with pytest.raises(ValueError, match="kv_head_num and total_kv_head_num go together"):
        kvrecv.KVArgs.from_buffers(0, [np.zeros(64, np.uint8)], [16], kv_head_num=2)
    # A decode without a head layout cannot read from a prefill of another TP.
    plain = KVManager(kvrecv.KVArgs.from_buffers(0, [np.zeros(64, np.uint8)], [16]), "decode")
    try:
        r = KVReceiver(plain, "127.0.0.1:1", 5)
        with pytest.raises(ValueError, match="prefill_tp_size=2 needs the decode's head layout"):
            r.init(prefill_tp_size=2)
        with pytest.raises(ValueError, match="prefill_tp_size=0 must be a positive integer"):
            r.init(prefill_tp_size=0)
    finally:
        plain.close()
    # A prefill TP the heads do not split over.
    d = _mgr("decode", 2, 0, 4, 8, [hp.PAGE_SIZE * 4 * hp.HEAD_BYTES])
    try:
        with pytest.raises(ValueError, match="prefill_tp_size=3: prefill: 8 KV heads do not split"):
            KVReceiver(d, "127.0.0.1:1", 6).init(prefill_tp_size=3)
    finally:
        d.close()


@pytest.mark.parametrize("case", ["head_bytes", "total_heads", "prefill_tp"])
def test_hetero_layout_mismatch_names_both_sides(case):
    """Layouts that cannot be sliced into each other fail the room with
    LAYOUT_MISMATCH naming both sides' numbers, before any byte moves."""
    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        ph = hp.HEAD_BYTES * (2 if case == "head_bytes" else 1)
        ptotal = 4 if case == "total_heads" else 8
        ptp = 4 if case == "prefill_tp" else 2
        pheads = ptotal // ptp
        for r in range(ptp):
            made.append(_mgr("prefill", ptp, r, pheads, ptotal, [hp.PAGE_SIZE * pheads * ph],
                             addr=bs.address))
        dec = _mgr("decode", 1, 0, 8, 8, [hp.PAGE_SIZE * 8 * hp.HEAD_BYTES])
        made.append(dec)
        r = KVReceiver(dec, bs.address, 9)
        r.init(prefill_tp_size=2)
        st, el = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVLayoutError) as ei:
            r.failure_exception()
        why = ei.value.failure_reason
        want = {
            "head_bytes": "KV buffer 0: item_len 256 for 4 heads on the prefill, 256 for 8 heads "
                          "on the decode (page_size 2): the bytes per head differ",
            "total_heads": "4 KV heads in all on the prefill, 8 on the decode",
            "prefill_tp": "the room asks for prefill TP 2, the prefill has TP 4",
        }[case]
        assert want in why, why
        r.clear()
    finally:
        for m in reversed(made):
            m.close()


def _sglang_bag(kv, aux, rank, heads=None, total=None):
    """A KVArgs bag filled as sglang's queues fill theirs."""
    from kvrecv.sglang import KVRecvArgs

    a = KVRecvArgs()
    a.engine_rank = rank
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [b.nbytes // hp.PAGES for b in kv]
    a.aux_data_ptrs = [b.ctypes.data for b in aux]
    a.aux_data_lens = [b.nbytes for b in aux]
    a.aux_item_lens = [hp.AUX_ITEM]
    a.page_size = hp.PAGE_SIZE
    if heads is not None:
        a.kv_head_num, a.total_kv_head_num = heads, total
    return a


def test_hetero_through_the_sglang_adapter():
    """sglang's KVArgs fields (kv_head_num, total_kv_head_num, engine_rank,
    the attention TP size, an MLA backend) reach kvrecv's head layout, and a
    prefill of attention TP 2 serves a decode of TP 1 through the adapter's
    own receiver and sender (the TP sizes learnt from the bootstrap
    server)."""
    import types

    from kvrecv.sglang import KVRecvBootstrapServer, KVRecvManager, KVRecvReceiver, KVRecvSender

    server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
    made = [server]
    try:
        cfg = KVConfig(**CONFIG)
        p_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                                       kvrecv_config=cfg, tp_size=2)
        d_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                                       kvrecv_config=cfg, tp_size=1)
        pbufs = [hp.prefill_buffers(SEED, 2, r, 8) for r in range(2)]
        prefills = [KVRecvManager(_sglang_bag(kv, aux, r, 4, 8), "prefill", p_args, False)
                    for r, (kv, aux) in enumerate(pbufs)]
        made += prefills
        for m in prefills:
            m.set_siblings([x.endpoint for x in prefills])
        dec = DecodeRank(1, 0, 8, False)
        dec.mgr.close()
        decode = KVRecvManager(_sglang_bag(dec.kv, dec.aux, 0, 8, 8), "decode", d_args, False)
        made.append(decode)
        assert [m.kvrecv_args.heads for m in prefills] == [(2, 0, 4, 8), (2, 1, 4, 8)]
        assert decode.kvrecv_args.heads == (1, 0, 8, 8)
        mla = KVRecvManager(_sglang_bag(dec.kv, dec.aux, 0), "decode", d_args, True)
        made.append(mla)
        assert mla.kvrecv_args.heads == (1, 0, 1, 1)
        addr = f"127.0.0.1:{server.port}"
        assert decode.try_ensure_parallel_info(addr)
        rv = KVRecvReceiver(mgr=decode, bootstrap_addr=addr, bootstrap_room=77)
        rv.init(0)
        st, _ = _wait_state(rv, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, st
        rv.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX)
        senders = [KVRecvSender(mgr=m, bootstrap_addr=addr, bootstrap_room=77, dest_tp_ranks=[0],
                                pp_rank=0) for m in prefills]
        for s in senders:
            _wait_state(s, (KVPoll.WaitingForInput,), 20)
            s.init(len(SRC), SRC_AUX)
            s.send(np.asarray(SRC, dtype=np.int32))
        st, _ = _wait_state(rv, TERMINAL, 20)
        assert st == KVPoll.Success, st
        for s in senders:
            assert _wait_state(s, TERMINAL, 20)[0] == KVPoll.Success
        _check_bytes([dec])
        for x in senders + [rv]:
            x.clear()
    finally:
        for m in reversed(made):
            m.close()


def test_hetero_decode_rank_that_never_asks(deployment):
    """TP 1 -> 2 where only decode rank 0 opens the room: rank 0 gets its
    heads, and the prefill room fails with BOOTSTRAP at its bootstrap
    timeout saying how many of its decode ranks asked."""
    CONFIG["bootstrap_timeout_ms"] = 1500
    try:
        addr, prefills, decodes = deployment("tp1-to-2")
    finally:
        del CONFIG["bootstrap_timeout_ms"]
    r = KVReceiver(decodes[0].mgr, addr, 501)
    r.init(prefill_tp_size=1)
    _wait_state(r, (KVPoll.WaitingForInput,), 20)
    r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX)
    p = prefills[0]
    p.call("open_sender", room=501, n=len(SRC), aux=SRC_AUX)
    p.call("send", room=501, pages=SRC)
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Success, st
    _check_bytes(decodes[:1])
    assert _wait_prefill(p, 501, 20) == int(KVPoll.Failed)
    f = p.call("failure", room=501)
    assert f["code"] == "BOOTSTRAP", f
    assert ("only 1 of the 2 decode ranks this prefill rank serves asked for the room within "
            "the bootstrap timeout (1500 ms)") in f["reason"], f
    r.clear()
