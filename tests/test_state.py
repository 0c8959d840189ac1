"""Per-request state buffers of hybrid models (docs/layouts.md): two state
components whose buffers have different item lengths, named by
state_indices on both sides, moved with the room's last chunk.

The prefill runs in a child process (tests/failure_peer.py, spec "state")
so that it can be SIGKILLed; the decode is a manager in this process whose
state buffers start as CANARY: the rows named must hold the prefill's rows
byte for byte and every other byte must still be CANARY.  Then a killed
prefill, an abort, and the input that is refused (a slot outside the
buffers, two slots for one component, different item lengths, a data
message that writes a state row the room did not ask for).
"""

from __future__ import annotations

import numpy as np
import pytest

import failure_peer as fp
import state_peer as sp
from failtest import _wait_state
from peer_proc import PeerProcess
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVArgs,
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
SEED = 5
SRC = [3, 4, 5, 9, 11, 12]
DST = [0, 1, 7, 8, 20, 2]
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}

pytestmark = pytest.mark.timeout(120)


class Decode:
    def __init__(self, items=sp.ITEMS):
        self.kv, self.aux = fp.canary_buffers()
        self.state = sp.canary(items)
        self.mgr = KVManager(sp.kv_args(KVArgs, 0, self.kv, self.aux, self.state, items),
                             "decode", config=KVConfig(**CONFIG))

    def state_canary_except(self, slots) -> str:
        """'' if every state byte outside the rows of `slots` (per
        component, the slots written) is CANARY, else where it is not."""
        for c, bufs in enumerate(self.state):
            for b, buf in enumerate(bufs):
                for s in range(sp.SLOTS):
                    if s in slots[c]:
                        continue
                    if not (sp.row(buf, s) == fp.CANARY).all():
                        return f"component {c} buffer {b} slot {s} was written"
        return ""


@pytest.fixture
def pair():
    made = []

    def make(items=sp.ITEMS, child=True):
        bs = BootstrapServer(port=0)
        made.append(bs)
        if child:
            pre = PeerProcess("prefill", bs.address, seed=SEED, config=CONFIG, state=True)
        else:
            kv, aux = fp.source_buffers(SEED)
            pre = KVManager(sp.kv_args(KVArgs, 0, kv, aux, sp.source(SEED)), "prefill",
                            bootstrap_addr=bs.address, config=KVConfig(**CONFIG))
        made.append(pre)
        dec = Decode(items)
        made.append(dec.mgr)
        return bs.address, pre, dec

    yield make
    for obj in reversed(made):
        obj.close()


def _receiver(addr, dec, rid, states, aux=1):
    r = KVReceiver(dec.mgr, addr, rid)
    r.init()
    st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
    assert st == KVPoll.WaitingForInput, st
    r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=aux, state_indices=states)
    return r


def _failure(room) -> KVTransferError:
    with pytest.raises(KVTransferError) as ei:
        room.failure_exception()
    return ei.value


def test_state_rows_byte_exact(pair):
    """Pages, the aux row and the state rows of both components land byte
    for byte (the prefill's slots 2 and 4 into the decode's 3 and 1, given
    with the last chunk, as sglang does); a second room asks for component
    0 only, whose other component's buffers keep every CANARY byte."""
    addr, pre, dec = pair()
    src_kv, src_aux = fp.source_buffers(SEED)
    src_state = sp.source(SEED)
    cases = [(11, [[3], [1]], [[2], [4]]), (12, [np.array([0]), None], [[1], [0]])]
    for rid, dst_slots, src_slots in cases:
        r = _receiver(addr, dec, rid, dst_slots)
        pre.call("open_sender", room=rid, n=len(SRC), aux=2)
        pre.call("send", room=rid, pages=SRC[:3])
        pre.call("send", room=rid, pages=SRC[3:], state=src_slots)
        st, el = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"room {rid}: {st!r} after {el:.2f} s"
        assert pre.call("wait", room=rid, states=[int(KVPoll.Success)])["state"] == KVPoll.Success
        assert fp.pages_equal(src_kv, dec.kv, SRC, DST)
        assert np.array_equal(src_aux[0][2 * fp.AUX_ITEM:3 * fp.AUX_ITEM],
                              dec.aux[0][fp.AUX_ITEM:2 * fp.AUX_ITEM])
        for c, (d, s) in enumerate(zip(dst_slots, src_slots)):
            if d is None:
                continue
            for b in range(len(sp.ITEMS[c])):
                assert np.array_equal(sp.row(dec.state[c][b], int(d[0])),
                                      sp.row(src_state[c][b], s[0])), (rid, c, b)
    # Every state byte outside slots 3 and 1 (room 11) and 0 of component 0
    # (room 12) is CANARY.
    assert dec.state_canary_except([{3, 0}, {1}]) == ""
    assert dec.state_canary_except([{3}, {1}]) == "component 0 buffer 0 slot 0 was written"
    r.clear()


def check_prefill_killed(addr, pre, dec, dst_states, part):
    """The prefill child SIGKILLed before it sent (part: after the first
    pages, before the last chunk that carries the state rows): the decode
    raises PEER_LOST naming it, and no state or aux byte landed."""
    rid = 21
    r = _receiver(addr, dec, rid, dst_states)
    pre.call("open_sender", room=rid, n=len(SRC), aux=2)
    if part:
        pre.call("send", room=rid, pages=SRC[:3])
    pre.kill()
    st, el = _wait_state(r, TERMINAL, 15)
    assert st == KVPoll.Failed, f"{st!r} after {el:.2f} s"
    e = _failure(r)
    assert type(e) is KVPeerLostError, e.failure_reason
    assert "prefill rank 0 at 127.0.0.1" in e.failure_reason, e.failure_reason
    assert e.bootstrap_room == rid
    assert dec.state_canary_except([(), ()]) == ""
    assert (dec.aux[0] == fp.CANARY).all()
    r.clear()


def check_abort(addr, pre, dec, dst_states, src_states):
    """abort() on the decode before the last chunk: both sides fail with
    ABORTED, and no state byte lands, also once the prefill sends it."""
    rid = 31
    r = _receiver(addr, dec, rid, dst_states)
    pre.call("open_sender", room=rid, n=len(SRC), aux=2)
    pre.call("send", room=rid, pages=SRC[:3])
    r.abort()
    e = _failure(r)
    assert type(e) is KVAbortedError, e.failure_reason
    got = pre.call("wait", room=rid, states=[int(KVPoll.Failed)])
    assert got["state"] == KVPoll.Failed
    f = pre.call("failure", room=rid)
    assert f["cls"] == "KVAbortedError" and "aborted by decode rank 0" in f["reason"], f
    pre.call("send", room=rid, pages=SRC[3:], state=src_states)
    assert dec.state_canary_except([(), ()]) == ""
    r.clear()


@pytest.mark.parametrize("part", [False, True])
def test_state_prefill_killed(pair, part):
    """check_prefill_killed, for Mamba slots."""
    check_prefill_killed(*pair(), [[3], [1]], part)


def test_state_abort(pair):
    """check_abort, for Mamba slots."""
    check_abort(*pair(), [[3], [1]], [[2], [4]])


def test_state_bad_input(pair):
    """A slot outside the registered state buffers, two slots for one
    component, more components than registered: ValueError naming them, on
    both sides, before any byte moves."""
    addr, pre, dec = pair(child=False)
    r = KVReceiver(dec.mgr, addr, 41)
    r.init()
    _wait_state(r, (KVPoll.WaitingForInput,), 20)
    pages = np.asarray(DST, dtype=np.int32)
    with pytest.raises(ValueError, match=r"^state_indices\[1\]=5 is outside the registered "
                                         r"state slots \[0, 5\)$"):
        r.send_metadata(pages, state_indices=[[0], [5]])
    with pytest.raises(ValueError, match=r"^state_indices\[0\] has 2 slots: state component 0 "
                                         r"takes one slot per request"):
        r.send_metadata(pages, state_indices=[[0, 1], None])
    with pytest.raises(ValueError, match=r"^state_indices names 3 state components, 2 are "
                                         r"registered$"):
        r.send_metadata(pages, state_indices=[0, 0, 0])
    with pytest.raises(ValueError, match=r"^state_indices\[0\] must be a non-negative slot$"):
        r.send_metadata(pages, state_indices=[-1])
    s = KVSender(pre, addr, 41)
    s.init(len(SRC))
    with pytest.raises(ValueError, match=r"^state_indices\[0\]=9 is outside the registered "
                                         r"state slots \[0, 5\)$"):
        s.send(np.asarray(SRC, dtype=np.int32), state_indices=[[9], [0]])
    assert dec.state_canary_except([(), ()]) == ""
    s.clear()
    r.clear()


def test_state_item_len_mismatch(pair):
    """A decode whose ssm state buffer has another item length: the room
    fails with LAYOUT_MISMATCH naming both numbers, no byte moved."""
    items = [[48, 208], [72]]
    addr, pre, dec = pair(items=items, child=False)
    r = KVReceiver(dec.mgr, addr, 51)
    r.init()
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    e = _failure(r)
    assert type(e) is KVLayoutError, e.failure_reason
    # The prefill checks the decode's HELLO: "here" is the prefill.
    assert e.failure_reason.endswith(": state buffer 1 item_len 200 here, 208 there"), \
        e.failure_reason
    assert dec.state_canary_except([(), ()]) == ""
    r.clear()


def test_state_prefill_without_slots(pair):
    """The decode asked for state rows, the prefill's last chunk named
    none: LAYOUT_MISMATCH on both sides, no state byte lands."""
    addr, pre, dec = pair(child=False)
    r = _receiver(addr, dec, 61, [[3], None])
    s = KVSender(pre, addr, 61)
    s.init(len(SRC), aux_index=2)
    s.send(np.asarray(SRC, dtype=np.int32))
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    e = _failure(r)
    assert type(e) is KVLayoutError, e.failure_reason
    assert ("decode asked for slot 3 of state component 0 but the prefill sender gave no "
            "state_indices for it") in e.failure_reason, e.failure_reason
    assert dec.state_canary_except([(), ()]) == ""
    s.clear()
    r.clear()


def test_state_row_not_asked_is_protocol(pair):
    """A data message that writes a state row the room did not ask for (a
    prefill whose row messages name the last state buffer, component 1,
    while the decode asked for component 0 only): PROTOCOL, and nothing of
    component 1 lands."""
    addr, pre, dec = pair(child=False)
    pre._core._test_corrupt_data(6)
    r = _receiver(addr, dec, 71, [[3], None], aux=None)
    s = KVSender(pre, addr, 71)
    s.init(len(SRC))
    s.send(np.asarray(SRC, dtype=np.int32), state_indices=[[2], [4]])
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    e = _failure(r)
    assert type(e) is KVProtocolError, e.failure_reason
    assert e.failure_reason.endswith("sent a bad data message: state row the room did not "
                                     "ask for"), e.failure_reason
    assert all((buf == fp.CANARY).all() for buf in dec.state[1])
    s.clear()
    r.clear()


def test_state_through_the_sglang_adapter():
    """sglang's KVArgs (state_types MAMBA, state_data_ptrs/lens/item_lens per
    state type) and its state_indices (one array of one slot per state
    type, given with the last chunk on the prefill): the rows land."""
    import types

    from kvrecv.sglang import (KVRecvArgs, KVRecvBootstrapServer, KVRecvManager,
                               KVRecvReceiver, KVRecvSender)

    class Mode:
        PREFILL, DECODE = "prefill", "decode"

    def sg_args(kv, aux, state):
        a = KVRecvArgs()
        a.engine_rank = 0
        a.kv_data_ptrs = [b.ctypes.data for b in kv]
        a.kv_data_lens = [b.nbytes for b in kv]
        a.kv_item_lens = fp.item_lens()
        a.aux_data_ptrs = [b.ctypes.data for b in aux]
        a.aux_data_lens = [b.nbytes for b in aux]
        a.aux_item_lens = [fp.AUX_ITEM]
        a.page_size = 1
        a.state_types = ["mamba", "mamba"]
        a.state_data_ptrs = [[b.ctypes.data for b in c] for c in state]
        a.state_data_lens = [[b.nbytes for b in c] for c in state]
        a.state_item_lens = sp.ITEMS
        return a

    server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
    sargs = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                                  kvrecv_config=KVConfig(**CONFIG), tp_size=1)
    kv, aux = fp.source_buffers(SEED)
    src_state = sp.source(SEED)
    dkv, daux = fp.canary_buffers()
    dstate = sp.canary()
    made = [server]
    try:
        pre = KVRecvManager(sg_args(kv, aux, src_state), Mode.PREFILL, sargs, False)
        made.append(pre)
        dec = KVRecvManager(sg_args(dkv, daux, dstate), Mode.DECODE, sargs, False)
        made.append(dec)
        addr = f"127.0.0.1:{server.port}"
        assert dec.try_ensure_parallel_info(addr)
        recv = KVRecvReceiver(dec, addr, 81)
        send = KVRecvSender(pre, addr, 81, [0], 0)
        send.init(len(SRC), 0)
        recv.init(0)
        _wait_state(recv, (KVPoll.WaitingForInput,), 20)
        recv.send_metadata(np.asarray(DST, dtype=np.int32), 1,
                           [np.array([4]), np.array([0])], decode_prefix_len=0)
        send.send(np.asarray(SRC[:3], dtype=np.int32), state_indices=None)
        send.send(np.asarray(SRC[3:], dtype=np.int32),
                  state_indices=[np.array([1]), np.array([3])])
        st, el = _wait_state(recv, TERMINAL, 20)
        assert st == KVPoll.Success, f"{st!r} after {el:.2f} s"
        assert fp.pages_equal(kv, dkv, SRC, DST)
        for c, (d, s) in enumerate(((4, 1), (0, 3))):
            for b in range(len(sp.ITEMS[c])):
                assert np.array_equal(sp.row(dstate[c][b], d), sp.row(src_state[c][b], s))
        for c, keep in enumerate(({4}, {0})):
            for buf in dstate[c]:
                for slot in set(range(sp.SLOTS)) - keep:
                    assert (sp.row(buf, slot) == fp.CANARY).all(), (c, slot)
        recv.clear()
        send.clear()
    finally:
        for obj in reversed(made):
            obj.close()


@pytest.mark.parametrize("dtp", [1, 2])
def test_state_with_head_layouts(dtp):
    """Head layouts and init(prefill_tp_size=1): with decode TP 1 the room
    is read over one link and the state rows land byte for byte; with
    decode TP 2 and no state_slicing it fails with LAYOUT_MISMATCH saying
    state moves between equal TP sizes only, naming both, before any byte
    moves (tests/test_state_tp.py moves it with state_slicing)."""
    import hetero_peer as hp
    import kvrecv

    def args(kv, aux, state, tp, rank):
        return kvrecv.KVArgs.from_buffers(
            rank, kv, [hp.item_len(tp, 8)] * hp.NBUF, aux, [hp.AUX_ITEM],
            page_size=hp.PAGE_SIZE, tp_size=tp, kv_head_num=len(hp.rank_heads(tp, rank, 8)),
            total_kv_head_num=8, state_buffers=state, state_item_lens=sp.ITEMS)

    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        kv, aux = hp.prefill_buffers(SEED, 1, 0, 8)
        pre = KVManager(args(kv, aux, sp.source(SEED), 1, 0), "prefill",
                        bootstrap_addr=bs.address, config=KVConfig(**CONFIG))
        made.append(pre)
        dkv, daux = hp.decode_buffers(dtp, 8)
        dstate = sp.canary()
        dec = KVManager(args(dkv, daux, dstate, dtp, 0), "decode", config=KVConfig(**CONFIG))
        made.append(dec)
        r = KVReceiver(dec, bs.address, 91)
        r.init(prefill_tp_size=1)
        if dtp == 1:
            _wait_state(r, (KVPoll.WaitingForInput,), 20)
            r.send_metadata(np.asarray(DST, dtype=np.int32), state_indices=[[3], [1]])
            s = KVSender(pre, bs.address, 91)
            s.init(len(SRC))
            s.send(np.asarray(SRC[:2], dtype=np.int32))
            s.send(np.asarray(SRC[2:], dtype=np.int32), state_indices=[2, 4])
            st, el = _wait_state(r, TERMINAL, 20)
            assert st == KVPoll.Success, f"{st!r} after {el:.2f} s"
            want = hp.expected_decode(SEED, 1, 0, 8, SRC, DST)
            assert all(np.array_equal(a, b) for a, b in zip(want, dkv))
            src_state = sp.source(SEED)
            for c, (d, s_) in enumerate(((3, 2), (1, 4))):
                for b in range(len(sp.ITEMS[c])):
                    assert np.array_equal(sp.row(dstate[c][b], d), sp.row(src_state[c][b], s_))
            r.clear()
            s.clear()
            return
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Failed
        e = _failure(r)
        assert type(e) is KVLayoutError, e.failure_reason
        assert e.failure_reason.endswith(
            "state buffers move between equal TP sizes only, unless both sides give "
            "state_slicing: prefill TP 1 (not given), decode TP 2 (not given)"), e.failure_reason
        assert all((b == fp.CANARY).all() for c in dstate for b in c)
        assert all((b == hp.CANARY).all() for b in dkv)
        r.clear()
    finally:
        for obj in reversed(made):
            obj.close()
