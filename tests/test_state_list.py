"""State components that take a list of slots per request (sliding-window
pages, docs/layouts.md): a Mamba component of one slot next to a window
component of two buffers indexed by a list of slots on both sides, moved
with the room's last chunk, consecutive slots coalesced as pages are.

The prefill runs in a child process (tests/failure_peer.py, spec state
"list") where a test kills it; the decode's state buffers start as CANARY:
the rows named must hold the prefill's rows byte for byte and every other
byte must still be CANARY.  Then a killed prefill, an abort, and the input
that is refused (slots outside the buffers, a list for a one-slot
component, lists of different lengths, components that take a list on
one side only, a list component across TP sizes, a row message for a list
the room did not ask for).
"""

from __future__ import annotations

import numpy as np
import pytest

import failure_peer as fp
import statelist_peer as sp
from failtest import _wait_state
from peer_proc import PeerProcess
from test_state import (CONFIG, DST, SRC, TERMINAL, _failure, _receiver, check_abort,
                        check_prefill_killed)
from kvrecv import (BootstrapServer, KVArgs, KVConfig, KVLayoutError, KVManager, KVPoll,
                    KVProtocolError, KVReceiver, KVSender)

SEED = 9
# Window pages: scattered (runs of 1 and 3 on both sides), and consecutive.
SCATTERED = ([3, 17, 9, 30, 31, 32, 0], [10, 2, 39, 5, 6, 7, 1])
CONSECUTIVE = (list(range(4, 36)), list(range(8, 40)))

pytestmark = pytest.mark.timeout(120)


class Decode:
    def __init__(self, items=sp.ITEMS, types=sp.TYPES):
        self.kv, self.aux = fp.canary_buffers()
        self.state = sp.canary(items)
        self.mgr = KVManager(sp.kv_args(KVArgs, 0, self.kv, self.aux, self.state, items, types),
                             "decode", config=KVConfig(**CONFIG))

    def state_canary_except(self, slots) -> str:
        """'' if every state byte outside the rows of `slots` (per
        component, the slots written) is CANARY, else where it is not."""
        for c, bufs in enumerate(self.state):
            for b, buf in enumerate(bufs):
                for s in range(sp.ROWS[c]):
                    if s not in slots[c] and not (sp.row(buf, c, s) == fp.CANARY).all():
                        return f"component {c} buffer {b} slot {s} was written"
        return ""


@pytest.fixture
def pair():
    made = []

    def make(child=True, pre_types=sp.TYPES):
        bs = BootstrapServer(port=0)
        made.append(bs)
        if child:
            pre = PeerProcess("prefill", bs.address, seed=SEED, config=CONFIG, state="list")
        else:
            kv, aux = fp.source_buffers(SEED)
            pre = KVManager(sp.kv_args(KVArgs, 0, kv, aux, sp.source(SEED), types=pre_types),
                            "prefill", bootstrap_addr=bs.address, config=KVConfig(**CONFIG))
        made.append(pre)
        dec = Decode()
        made.append(dec.mgr)
        return bs.address, pre, dec

    yield make
    for obj in reversed(made):
        obj.close()


def _ops(pre) -> int:
    return pre.call("stats")["rma_ops_posted"]


def test_state_lists_byte_exact_and_coalesced(pair):
    """Pages, the aux row, the Mamba row and the window pages of a list of
    7 scattered slots and of 32 consecutive ones land byte for byte (the
    lists given with the last chunk, as sglang does); every other state
    byte stays CANARY.  A room posts as many data operations for 4
    consecutive window slots as for 32, and as for 7 scattered ones (runs
    are pieces of one message, as pages)."""
    addr, pre, dec = pair()
    src_kv, src_aux = fp.source_buffers(SEED)
    src_state = sp.source(SEED)
    short = (CONSECUTIVE[0][:4], CONSECUTIVE[1][:4])
    cases = [(11, SCATTERED, 3, 2), (12, CONSECUTIVE, 1, 4), (13, short, 0, 0)]
    ops = {}
    written = [set(), set()]
    for rid, (dst, src), mdst, msrc in cases:
        r = _receiver(addr, dec, rid, [[mdst], dst])
        pre.call("open_sender", room=rid, n=len(SRC), aux=2)
        # Bound to the decode's request: each send() posts its messages.
        assert pre.call("wait", room=rid, states=[int(KVPoll.WaitingForInput)])["state"] == \
            KVPoll.WaitingForInput
        before = _ops(pre)
        pre.call("send", room=rid, pages=SRC[:3])
        pre.call("send", room=rid, pages=SRC[3:], state=[[msrc], src])
        st, el = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"room {rid}: {st!r} after {el:.2f} s"
        assert pre.call("wait", room=rid, states=[int(KVPoll.Success)])["state"] == \
            KVPoll.Success
        ops[rid] = _ops(pre) - before
        assert fp.pages_equal(src_kv, dec.kv, SRC, DST)
        for b in range(len(sp.ITEMS[0])):
            assert np.array_equal(sp.row(dec.state[0][b], 0, mdst),
                                  sp.row(src_state[0][b], 0, msrc)), (rid, b)
        for b in range(len(sp.ITEMS[1])):
            for d, s in zip(dst, src):
                assert np.array_equal(sp.row(dec.state[1][b], 1, d),
                                      sp.row(src_state[1][b], 1, s)), (rid, b, d, s)
        written[0].add(mdst)
        written[1].update(dst)
        r.clear()
    assert dec.state_canary_except(written) == ""
    assert ops[11] == ops[12] == ops[13] > 0, ops


@pytest.mark.parametrize("part", [False, True])
def test_state_lists_prefill_killed(pair, part):
    """The prefill SIGKILLed before it sent (part: after the first pages,
    before the last chunk that carries the window pages): the decode
    raises PEER_LOST naming it, and no state byte landed
    (test_state.check_prefill_killed)."""
    check_prefill_killed(*pair(), [[3], SCATTERED[0]], part)


def test_state_lists_abort(pair):
    """abort() on the decode before the last chunk: both sides fail with
    ABORTED, and no window page lands, also once the prefill sends it
    (test_state.check_abort)."""
    check_abort(*pair(), [[3], SCATTERED[0]], [[2], SCATTERED[1]])


def test_state_lists_bad_input(pair):
    """A window slot outside the registered rows, a negative one, a list
    for the one-slot component, a decode slot named twice: ValueError naming
    them, on both sides, before any byte moves."""
    addr, pre, dec = pair(child=False)
    r = KVReceiver(dec.mgr, addr, 41)
    r.init()
    _wait_state(r, (KVPoll.WaitingForInput,), 20)
    pages = np.asarray(DST, dtype=np.int32)
    with pytest.raises(ValueError, match=r"^state_indices\[1\]\[2\]=40 is outside the "
                                         r"registered state slots \[0, 40\)$"):
        r.send_metadata(pages, state_indices=[[0], [1, 2, 40]])
    with pytest.raises(ValueError, match=r"^state_indices\[1\]\[1\] must be a non-negative "
                                         r"slot below 2\*\*31$"):
        r.send_metadata(pages, state_indices=[None, np.array([4, -1])])
    with pytest.raises(ValueError, match=r"^state_indices\[0\] has 2 slots: state component 0 "
                                         r"takes one slot per request \(a list of slots is for "
                                         r"a component registered as a list"):
        r.send_metadata(pages, state_indices=[[0, 1], [2]])
    with pytest.raises(ValueError, match=r"^state_indices\[1\]\[0\] and state_indices\[1\]\[2\] "
                                         r"are both slot 5: a decode slot can receive one slot"):
        r.send_metadata(pages, state_indices=[[0], [5, 6, 5]])
    s = KVSender(pre, addr, 41)
    s.init(len(SRC))
    with pytest.raises(ValueError, match=r"^state_indices\[1\]\[0\]=41 is outside the "
                                         r"registered state slots \[0, 40\)$"):
        s.send(np.asarray(SRC, dtype=np.int32), state_indices=[[1], [41]])
    assert dec.state_canary_except([(), ()]) == ""
    s.clear()
    r.clear()


def test_state_lists_of_different_lengths(pair):
    """The decode asks for 3 window pages, the prefill's last chunk names
    2: LAYOUT_MISMATCH naming both counts on both sides, no state byte
    lands."""
    addr, pre, dec = pair(child=False)
    r = _receiver(addr, dec, 51, [[3], [5, 6, 7]])
    s = KVSender(pre, addr, 51)
    s.init(len(SRC), aux_index=2)
    s.send(np.asarray(SRC, dtype=np.int32), state_indices=[[1], [8, 9]])
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    want = "state component 1: the decode asked for 3 slots, the prefill sender gave 2"
    for room in (r, s):
        e = _failure(room)
        assert type(e) is KVLayoutError, e.failure_reason
        assert want in e.failure_reason, e.failure_reason
    assert dec.state_canary_except([(), ()]) == ""
    s.clear()
    r.clear()


def test_state_lists_on_one_side_only(pair):
    """A prefill that registered the window buffers as a one-slot type:
    the room fails with LAYOUT_MISMATCH naming both sides, no byte moved."""
    addr, pre, dec = pair(child=False, pre_types=["mamba", "mamba"])
    r = KVReceiver(dec.mgr, addr, 61)
    r.init()
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    e = _failure(r)
    assert type(e) is KVLayoutError, e.failure_reason
    # The prefill checks the decode's HELLO: "here" is the prefill.
    assert e.failure_reason.endswith(
        ": state component 1 takes one slot here, a list of slots there"), e.failure_reason
    assert dec.state_canary_except([(), ()]) == ""
    r.clear()


def test_state_list_row_not_asked_is_protocol(pair):
    """A row message that names the window's last buffer while the room
    asked for the Mamba slot only: PROTOCOL, and no window byte lands."""
    addr, pre, dec = pair(child=False)
    pre._core._test_corrupt_data(6)
    r = _receiver(addr, dec, 71, [[3], None], aux=None)
    s = KVSender(pre, addr, 71)
    s.init(len(SRC))
    s.send(np.asarray(SRC, dtype=np.int32), state_indices=[[2], [4, 5]])
    st, _ = _wait_state(r, TERMINAL, 20)
    assert st == KVPoll.Failed
    e = _failure(r)
    assert type(e) is KVProtocolError, e.failure_reason
    assert "state list positions outside the room's list" in e.failure_reason, e.failure_reason
    assert dec.state_canary_except([(), ()]) == ""
    s.clear()
    r.clear()


def test_state_list_across_tp_sizes_is_refused():
    """A list component between prefill TP 2 and decode TP 1: LAYOUT_MISMATCH
    naming both TP sizes, before any byte (window pages are not sliced by
    head)."""
    import statetp_peer as stp
    from test_state_tp import TOTAL, _mismatch

    types = {"state_types": ["mamba", "swa"]}
    why = _mismatch(2, 1, TOTAL, {"state_slicing": stp.rules(2), **types},
                    {"state_slicing": stp.rules(1), **types})
    assert why.endswith("state component 1 takes a list of slots (sliding-window pages), "
                        "which moves between equal TP sizes only: prefill TP 2, decode TP 1"), why
