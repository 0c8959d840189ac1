"""State rows between prefill and decode of different TP sizes
(state_slicing, docs/layouts.md): each prefill rank in a child process
(tests/failure_peer.py, spec "heads" with "state"), the decode ranks in
this process, both joined as siblings, as in tests/test_hetero.py.

Two state components (tests/statetp_peer.py): a Mamba layer (a conv state
of three groups sliced independently, an ssm state sliced by heads) and a
replicated buffer next to one of three outer rows.  The layouts: TP 2 -> 1,
1 -> 2, 4 -> 2, 2 -> 4, 2 -> 3 (a link takes part of a rank's share on
both sides) and 2 -> 2 (rules given, rows whole).  Every decode rank's
rows at the slots asked for must hold its share of the model's rows byte
for byte, every other slot CANARY; a killed prefill rank, an abort and the
layouts that cannot move state leave every state byte CANARY.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import hetero_peer as hp
import statetp_peer as stp
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
    KVProtocolError,
    KVReceiver,
    KVSender,
    KVTransferError,
)

TERMINAL = (KVPoll.Success, KVPoll.Failed)
SEED = 17
TOTAL = 8  # KV heads
SRC = [3, 4, 5, 9, 11, 12]
DST = [0, 1, 7, 8, 15, 2]
SRC_AUX, DST_AUX = 2, 1
SRC_SLOTS, DST_SLOTS = [2, 4], [3, 1]
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}
# (prefill TP, decode TP, KV heads)
LAYOUTS = {"tp2-to-1": (2, 1, 8), "tp1-to-2": (1, 2, 8), "tp4-to-2": (4, 2, 8),
           "tp2-to-4": (2, 4, 8),
           "tp2-to-3": (2, 3, 6),  # a link takes part of a rank's share on both sides
           "tp2-to-2": (2, 2, 8)}  # equal sizes: the rules given, rows whole

pytestmark = pytest.mark.timeout(120)


class DecodeRank:
    def __init__(self, tp, rank, total, sglang_addr=None):
        """sglang_addr: made through the sglang adapter (KVRecvManager) from
        sglang-shaped KVArgs (tests/sglang_args.py), whose state_slicing it
        maps from sglang's slicing fields."""
        self.tp, self.rank, self.total = tp, rank, total
        self.kv, self.aux = hp.decode_buffers(tp, total)
        self.state = stp.decode_state(tp)
        args = stp.kv_args(kvrecv, self.kv, self.aux, tp, rank, total, self.state,
                           slicing=sglang_addr is None)
        if sglang_addr is None:
            self.mgr = KVManager(args, "decode", config=KVConfig(**CONFIG))
            return
        import sglang_args
        from kvrecv.sglang import KVRecvManager

        sa = sglang_args.server_args(sglang_addr, tp, 1, KVConfig(**CONFIG))
        self.mgr = KVRecvManager(sglang_args.kv_args(args, {"tp": tp, "total": total}),
                                 "decode", sa, False)

    def state_canary(self) -> bool:
        return all((b == stp.CANARY).all() for c in self.state for b in c)


@pytest.fixture
def deployment():
    made = []

    def make(name, sglang=False):
        """sglang: every rank through the sglang adapter, behind its
        bootstrap server (KVRecvBootstrapServer)."""
        ptp, dtp, total = LAYOUTS[name]
        if sglang:
            from kvrecv.sglang import KVRecvBootstrapServer
            bs = KVRecvBootstrapServer(host="127.0.0.1", port=0)
        else:
            bs = BootstrapServer(port=0)
        made.append(bs)
        prefills = [PeerProcess("prefill", bs.address, seed=SEED, config=CONFIG, rank=r,
                                heads={"tp": ptp, "total": total, "state": True,
                                       "sglang": sglang})
                    for r in range(ptp)]
        made.extend(prefills)
        for p in prefills:
            p.call("set_siblings", endpoints=[q.endpoint for q in prefills])
        decodes = [DecodeRank(dtp, r, total, bs.address if sglang else None)
                   for r in range(dtp)]
        made.extend(d.mgr for d in decodes)
        for d in decodes:
            d.mgr.set_siblings([x.mgr.endpoint for x in decodes])
        return bs.address, prefills, decodes

    yield make
    for obj in reversed(made):
        obj.close()


def _open(addr, prefills, decodes, rid):
    """Receivers on every decode rank asking for both components' slots,
    senders on every prefill rank, the first pages handed over (the state
    slots go with the last chunk, _finish)."""
    from kvrecv.sglang import KVRecvManager, KVRecvReceiver

    if isinstance(decodes[0].mgr, KVRecvManager):  # sglang's receiver learns the TP size
        recvs = [KVRecvReceiver(d.mgr, addr, rid) for d in decodes]
        for r in recvs:
            r.init()
    else:
        recvs = [KVReceiver(d.mgr, addr, rid) for d in decodes]
        for r in recvs:
            r.init(prefill_tp_size=len(prefills))
    t0 = time.monotonic()
    while min(r.poll() for r in recvs) == KVPoll.Bootstrapping:
        assert time.monotonic() - t0 < 20, [r.poll() for r in recvs]
        time.sleep(0.001)
    for r in recvs:
        r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX,
                        state_indices=[[s] for s in DST_SLOTS])
    for p in prefills:
        p.call("open_sender", room=rid, n=len(SRC), aux=SRC_AUX)
    for p in prefills:
        p.call("send", room=rid, pages=SRC[:3])
    return recvs


def _finish(prefills, rid, who=None):
    for p in prefills if who is None else who:
        p.call("send", room=rid, pages=SRC[3:], state=[[s] for s in SRC_SLOTS])


def _succeed(name, recvs, prefills, rid):
    """Every decode and prefill rank's room succeeds."""
    for rank, r in enumerate(recvs):
        st, el = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"{name}: decode rank {rank} {st!r} after {el:.2f} s"
    for p in prefills:
        assert p.wait_room(rid, 20) == int(KVPoll.Success), f"prefill rank {p.rank}"


def _check_state(decodes):
    for d in decodes:
        want = stp.expected_rows(SEED, d.tp, d.rank)
        for c, comp in enumerate(d.state):
            for k, buf in enumerate(comp):
                rows = buf.reshape(stp.SLOTS, -1)
                exp = want[c][k]
                for s in range(stp.SLOTS):
                    if s == DST_SLOTS[c]:
                        bad = np.flatnonzero(rows[s] != exp[SRC_SLOTS[c]])
                        assert bad.size == 0, (f"decode rank {d.rank} state [{c}][{k}]: "
                                               f"{bad.size} bytes differ, first at {bad[0]}")
                    else:
                        assert (rows[s] == stp.CANARY).all(), (
                            f"decode rank {d.rank} state [{c}][{k}] slot {s} touched")


def _failure(r):
    with pytest.raises(KVTransferError) as ei:
        r.failure_exception()
    return ei.value


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_tp_byte_exact(deployment, name):
    """Every decode rank assembles its share of every sliced row from the
    prefill ranks it reads, and the replicated rows whole from one of
    them; the KV pages and the aux row land as without state."""
    addr, prefills, decodes = deployment(name)
    rid = 101
    recvs = _open(addr, prefills, decodes, rid)
    _finish(prefills, rid)
    _succeed(name, recvs, prefills, rid)
    for d in decodes:
        want = hp.expected_decode(SEED, d.tp, d.rank, d.total, SRC, DST)
        assert all(np.array_equal(a, b) for a, b in zip(want, d.kv)), f"decode rank {d.rank}"
    _check_state(decodes)
    # Data messages: per link two KV messages (two chunks of consecutive
    # pages) and the rows in one or two messages (a row message covers a
    # run of the buffers the link carries), never one per piece of a row
    # (the rows here are cut into 3 + 1 + 3 pieces on a side).
    ptp, dtp = len(prefills), len(decodes)
    for p in prefills:
        links = sum(p.rank * dtp < (d + 1) * ptp and d * ptp < (p.rank + 1) * dtp
                    for d in range(dtp)) if ptp != dtp else 1
        ops = p.stats()["rma_ops_posted"]
        assert ops <= 4 * links, f"prefill rank {p.rank}: {ops} data messages for {links} links"
    for r in recvs:
        r.clear()


@pytest.mark.parametrize("name", ["tp2-to-1", "tp1-to-2", "tp2-to-3"])
def test_state_tp_through_the_sglang_adapter(deployment, name):
    """sglang's state_dim_per_tensor, state_slice_outer_counts and
    state_conv_shard_groups (tests/sglang_args.py) become each side's
    state_slicing in the adapter (the rules tests/statetp_peer.py gives
    kvrecv directly), the decode reads the prefill's TP size from GET
    /route, and every decode rank's rows land byte for byte."""
    addr, prefills, decodes = deployment(name, sglang=True)
    for d in decodes:
        want = stp.kv_args(kvrecv, d.kv, d.aux, d.tp, d.rank, d.total, d.state).state_rules
        assert want is not None and d.mgr.kvrecv_args.state_rules == want
        assert d.mgr.try_ensure_parallel_info(addr), d.mgr.bootstrap_failure(addr)
    recvs = _open(addr, prefills, decodes, 111)
    _finish(prefills, 111)
    _succeed(name, recvs, prefills, 111)
    _check_state(decodes)


@pytest.mark.parametrize("name, dead", [("tp2-to-1", 1), ("tp1-to-2", 0)])
def test_state_tp_prefill_rank_killed(deployment, name, dead):
    """A prefill rank SIGKILLed after the first pages, before the state
    slots were handed over: every decode rank raises PEER_LOST naming it,
    and no state byte lands, not even once the surviving ranks hand over
    their last chunk with the slots."""
    addr, prefills, decodes = deployment(name)
    rid = 201
    recvs = _open(addr, prefills, decodes, rid)
    victim = prefills[dead]
    victim.kill()
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"{name}: decode rank {rank} {st!r}"
        e = _failure(r)
        assert type(e) is KVPeerLostError, (rank, e.failure_reason)
        assert f"prefill rank {victim.rank} at 127.0.0.1" in e.failure_reason, e.failure_reason
    _finish(prefills, rid, [p for p in prefills if p is not victim])
    time.sleep(0.3)
    for d in decodes:
        assert d.state_canary(), f"decode rank {d.rank}: state bytes landed"
    for r in recvs:
        r.clear()


@pytest.mark.parametrize("name, side", [("tp2-to-1", "decode"), ("tp1-to-2", "decode"),
                                        ("tp2-to-1", "prefill")])
def test_state_tp_abort(deployment, name, side):
    """abort() on decode rank 0 (or the last prefill rank) before the state
    slots were handed over: every rank of both sides fails with ABORTED
    naming it, and the last chunk with the slots moves nothing."""
    addr, prefills, decodes = deployment(name)
    rid = 301
    recvs = _open(addr, prefills, decodes, rid)
    if side == "decode":
        recvs[0].abort()
        who = "aborted by decode rank 0"
    else:
        prefills[-1].call("abort", room=rid)
        who = f"aborted by prefill rank {prefills[-1].rank}"
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"{name}: decode rank {rank} {st!r}"
        e = _failure(r)
        assert type(e) is KVAbortedError and who in e.failure_reason, (rank, e.failure_reason)
    for p in prefills:
        assert p.wait_room(rid, 15) == int(KVPoll.Failed), f"prefill rank {p.rank}"
        f = p.call("failure", room=rid)
        assert f["code"] == "ABORTED" and who in f["reason"], f
    _finish(prefills, rid)
    time.sleep(0.3)
    for d in decodes:
        assert d.state_canary(), f"decode rank {d.rank}: state bytes landed"
    for r in recvs:
        r.clear()


def _in_process(made, ptp, dtp, total, pre_kw, dec_kw, prefill_items=None, decode_items=None):
    """Prefill ranks of TP ptp and decode rank 0 of TP dtp, all in this
    process (appended to made): (bootstrap address, prefills, decode,
    decode state buffers, CANARY)."""
    bs = BootstrapServer(port=0)
    made.append(bs)
    prefills = []
    for r in range(ptp):
        kv, aux = hp.prefill_buffers(SEED, ptp, r, total)
        state = stp.prefill_state(SEED, ptp, r) if prefill_items is None else \
            [[np.zeros(stp.SLOTS * it, dtype=np.uint8) for it in c] for c in prefill_items]
        args = kvrecv.KVArgs.from_buffers(
            r, kv, [hp.item_len(ptp, total)] * hp.NBUF, aux, [hp.AUX_ITEM],
            page_size=hp.PAGE_SIZE, tp_size=ptp,
            kv_head_num=len(hp.rank_heads(ptp, r, total)), total_kv_head_num=total,
            state_buffers=state, state_item_lens=prefill_items or stp.items(ptp), **pre_kw)
        prefills.append(KVManager(args, "prefill", bootstrap_addr=bs.address,
                                  config=KVConfig(**CONFIG)))
        made.append(prefills[-1])
    dkv, daux = hp.decode_buffers(dtp, total)
    items = decode_items or stp.items(dtp)
    dstate = [[np.full(stp.SLOTS * it, stp.CANARY, dtype=np.uint8) for it in c] for c in items]
    args = kvrecv.KVArgs.from_buffers(
        0, dkv, [hp.item_len(dtp, total)] * hp.NBUF, daux, [hp.AUX_ITEM],
        page_size=hp.PAGE_SIZE, tp_size=dtp, kv_head_num=len(hp.rank_heads(dtp, 0, total)),
        total_kv_head_num=total, state_buffers=dstate, state_item_lens=items, **dec_kw)
    dec = KVManager(args, "decode", config=KVConfig(**CONFIG))
    made.append(dec)
    return bs.address, prefills, dec, dstate


def _mismatch(ptp, dtp, total, pre_kw, dec_kw, prefill_items=None, decode_items=None):
    """A room between prefill ranks and decode rank 0 of the given
    layouts: its failure, with every decode state byte CANARY."""
    made = []
    try:
        addr, _, dec, dstate = _in_process(made, ptp, dtp, total, pre_kw, dec_kw,
                                           prefill_items, decode_items)
        r = KVReceiver(dec, addr, 91)
        r.init(prefill_tp_size=ptp)
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Failed, st
        e = _failure(r)
        assert type(e) is KVLayoutError, e.failure_reason
        assert all((b == stp.CANARY).all() for c in dstate for b in c)
        r.clear()
        return e.failure_reason
    finally:
        for obj in reversed(made):
            obj.close()


def test_state_tp_replicated_row_over_another_link_is_protocol(monkeypatch):
    """TP 2 -> 1, the last state buffer replicated: prefill rank 1 (whose
    link does not carry replicated rows) sends a row message naming it.
    The decode refuses it with PROTOCOL naming that rank, before any byte
    of it lands; prefill rank 0 has not sent its rows, so no state byte
    lands at all."""
    monkeypatch.setattr(stp, "BUFFERS", [stp.BUFFERS[0], [(3, [8], 2), None]])
    made = []
    try:
        addr, prefills, dec, dstate = _in_process(
            made, 2, 1, TOTAL, {"state_slicing": stp.rules(2)}, {"state_slicing": stp.rules(1)})
        prefills[1]._core._test_corrupt_data(6)  # row messages name the last row buffer
        r = KVReceiver(dec, addr, 93)
        r.init(prefill_tp_size=2)
        st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, st
        r.send_metadata(np.asarray(DST, dtype=np.int32), state_indices=[[s] for s in DST_SLOTS])
        senders = [KVSender(p, addr, 93) for p in prefills]
        for s in senders:
            s.init(len(SRC))
        senders[0].send(np.asarray(SRC[:3], dtype=np.int32))
        senders[1].send(np.asarray(SRC, dtype=np.int32), state_indices=[[s] for s in SRC_SLOTS])
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Failed, st
        e = _failure(r)
        assert type(e) is KVProtocolError, e.failure_reason
        assert "prefill rank 1" in e.failure_reason and e.failure_reason.endswith(
            "sent a bad data message: state row the room did not ask for"), e.failure_reason
        assert all((b == stp.CANARY).all() for c in dstate for b in c)
        for s in senders:
            s.clear()
        r.clear()
    finally:
        for obj in reversed(made):
            obj.close()


def _units_rules(tp, ssm_units):
    rules = stp.rules(tp)
    rules[0][1] = ssm_units
    return rules


@pytest.mark.parametrize("case", ["one-side", "units", "replicated", "bytes", "gqa"])
def test_state_tp_layout_mismatch_names_both_sides(case):
    """Layouts whose state cannot move across the TP sizes fail the room
    with LAYOUT_MISMATCH naming both sides' numbers, before any byte."""
    if case == "one-side":
        why = _mismatch(2, 1, TOTAL, {"state_slicing": stp.rules(2)}, {})
        want = ("state buffers move between equal TP sizes only, unless both sides give "
                "state_slicing: prefill TP 2 (given), decode TP 1 (not given)")
    elif case == "units":
        # The decode's ssm state: 8 heads of 60 bytes (the model's 24 of 20 on the prefill).
        why = _mismatch(2, 1, TOTAL, {"state_slicing": stp.rules(2)},
                        {"state_slicing": _units_rules(1, 8)})
        want = ("state buffer [0][1], group 0: 12 units x TP 2 on the prefill, 8 units x TP 1 "
                "on the decode")
    elif case == "replicated":
        rules = stp.rules(1)
        rules[1][1] = 0
        items = stp.items(1)
        items[1][1] = stp.items(2)[1][1]
        why = _mismatch(2, 1, TOTAL, {"state_slicing": stp.rules(2)}, {"state_slicing": rules},
                        decode_items=items)
        want = "state buffer [1][1]: sliced on the prefill, replicated on the decode"
    elif case == "bytes":
        items = stp.items(1)
        items[0][1] = 24 * 40  # 24 heads of 40 bytes; the prefill's are 20
        why = _mismatch(2, 1, TOTAL, {"state_slicing": stp.rules(2)},
                        {"state_slicing": stp.rules(1)}, decode_items=items)
        want = ("state buffer [0][1]: 20 bytes per unit on the prefill (item_len 240), 40 on "
                "the decode (item_len 960)")
    else:
        # 2 KV heads over TP 4 (replicated heads): the links follow the
        # heads, not the state shares.
        why = _mismatch(4, 2, 2, {"state_slicing": stp.rules(4)}, {"state_slicing": stp.rules(2)})
        want = ("state buffers move across TP sizes only when the KV heads split over the "
                "ranks: prefill TP 4, decode TP 2, 2 KV heads")
    assert why.endswith(want), why


def _args(slicing, items=None, tp=2):
    kv, aux = hp.decode_buffers(tp, TOTAL)
    items = items or stp.items(tp)
    state = [[np.zeros(stp.SLOTS * it, dtype=np.uint8) for it in c] for c in items]
    return kvrecv.KVArgs.from_buffers(
        0, kv, [hp.item_len(tp, TOTAL)] * hp.NBUF, aux, [hp.AUX_ITEM], page_size=hp.PAGE_SIZE,
        tp_size=tp, kv_head_num=TOTAL // tp, total_kv_head_num=TOTAL, state_buffers=state,
        state_item_lens=items, state_slicing=slicing)


@pytest.mark.parametrize("slicing, why", [
    ([[[4, 4, 8], 8]], r"state_slicing must give one list per state component \(2\)"),
    ([[[4, 4, 8]], [0, 4]],
     r"state_slicing\[0\] must give one rule per buffer of the component \(2\)"),
    ([[[4, 4, 8], -1], [0, 4]], r"state_slicing\[0\]\[1\]: units=-1 must be a positive integer"),
    ([[[4, 4, 8], "x"], [0, 4]], r"state_slicing\[0\]\[1\]='x' must be 0 \(replicated\)"),
    ([[[4, 4, 8], 8], [0, {"units": 4, "inner": 3}]],
     r"state_slicing\[1\]\[1\]: a dict rule has 'units' and optionally 'outer'"),
    ([[[4, 4, 8], 8], [0, {"units": 4, "outer": 0}]],
     r"state_slicing\[1\]\[1\]: outer=0 must be a positive integer"),
])
def test_state_tp_bad_slicing_raises_value_error(slicing, why):
    with pytest.raises(ValueError, match=why):
        _args(slicing)


def test_state_tp_slicing_that_does_not_divide_raises_value_error():
    """The core's checks, when the manager is made: an item that is not
    outer x units x bytes per unit, more pieces than a row may have."""
    rules = stp.rules(2)
    rules[0][1] = 7
    with pytest.raises(ValueError, match=r"^state buffer \[0\]\[1\]: item_len 240 is not outer 1 "
                       r"x 7 units x bytes per unit$"):
        KVManager(_args(rules), "decode")
    rules = stp.rules(2)
    rules[1][1] = {"units": [1] * 400, "outer": 3}
    items = stp.items(2)
    items[1][1] = 1200
    with pytest.raises(ValueError, match=r"^state_slicing of state buffer \[1\]\[1\]: outer 3 x "
                       r"400 groups must be 1 to 1024 pieces$"):
        KVManager(_args(rules, items), "decode")
