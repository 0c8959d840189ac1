"""A pipeline-parallel prefill: each PP stage holds a range of the model's
layers (docs/layouts.md) and sends only those; the decode reads every
stage's part and succeeds once all of them landed.

The model of tests/hetero_peer.py has 2 layers (KV buffers K0 K1 V0 V1);
stage 0 holds layer 0 (K0, V0), stage 1 layer 1 (K1, V1), each prefill rank
in its own child process (tests/failure_peer.py), so that it can be
SIGKILLed, all ranks of the prefill joined as siblings.  The aux row comes
from the last stage: each stage's aux rows differ, and the decode's must be
the last stage's.  Layouts: 2 stages of TP 1 -> decode TP 1, and 2 stages
of TP 2 -> decode TP 1 (each stage's heads from both of its ranks).  Each
with a room served byte for byte, a stage killed in the middle of a room
(the decode and the other stage raise PEER_LOST naming the dead stage) and
an abort on a stage (every rank gets its reason).  Then layer ranges that
leave a gap, overlap or go past the decode's layers (LAYOUT_MISMATCH, on
the decode and on every stage), and bad input (ValueError).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import hetero_peer as hp
from failtest import _every_rank_fails, _wait_state
from peer_proc import PeerProcess
import kvrecv
from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVBootstrapError,
    KVConfig,
    KVLayoutError,
    KVManager,
    KVPeerLostError,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
)

TERMINAL = (KVPoll.Success, KVPoll.Failed)
SEED = 23
SRC = [3, 4, 5, 9, 11, 12, 20, 21]
DST = [0, 1, 7, 8, 9, 15, 2, 23]
SRC_AUX, DST_AUX = 2, 1
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}
TOTAL = 8  # KV heads
STAGES = [{"start": 0, "layers": 1}, {"start": 1, "layers": 1}]

# (prefill TP of each stage, decode TP)
LAYOUTS = {"pp2-tp1": (1, 1), "pp2-tp2-to-1": (2, 1), "pp2-tp1-to-2": (1, 2)}

pytestmark = pytest.mark.timeout(120)


class Prefill:
    """One prefill rank of one PP stage, in a child process."""

    def __init__(self, bootstrap, tp, rank, stage):
        self.stage = stage
        self.proc = PeerProcess("prefill", bootstrap, seed=SEED, config=CONFIG, rank=rank,
                                heads={"tp": tp, "total": TOTAL, "pp": stage})
        self.rank = rank

    def __getattr__(self, name):
        return getattr(self.proc, name)


class Decode:
    def __init__(self, tp, rank, **config):
        self.tp, self.rank = tp, rank
        self.kv, self.aux = hp.decode_buffers(tp, TOTAL)
        args = hp.kv_args(kvrecv, self.kv, self.aux, tp, rank, TOTAL, num_layers=hp.LAYERS)
        self.mgr = KVManager(args, "decode", config=KVConfig(**{**CONFIG, **config}))


@pytest.fixture
def deployment():
    """deployment(name, stages=2) -> (bootstrap address, prefill ranks,
    decode ranks); the prefill ranks stage after stage."""
    made = []

    def make(name, **config):
        ptp, dtp = LAYOUTS[name]
        bs = BootstrapServer(port=0)
        made.append(bs)
        prefills = []
        for s, st in enumerate(STAGES):
            stage = {"size": len(STAGES), "rank": s, **st}
            prefills += [Prefill(bs.address, ptp, r, stage) for r in range(ptp)]
        made.extend(prefills)
        for p in prefills:
            p.call("set_siblings", endpoints=[q.endpoint for q in prefills])
        decodes = [Decode(dtp, r, **config) for r in range(dtp)]
        made.extend(d.mgr for d in decodes)
        for d in decodes:
            d.mgr.set_siblings([x.mgr.endpoint for x in decodes])
        return bs.address, prefills, decodes

    yield make
    for obj in reversed(made):
        obj.close()


def _open(addr, prefills, decodes, rid, name, send=True, stages=len(STAGES)):
    ptp, dtp = LAYOUTS[name]
    recvs = [KVReceiver(d.mgr, addr, rid) for d in decodes]
    for r in recvs:
        r.init(prefill_tp_size=ptp if ptp != dtp else None, prefill_pp_size=stages)
    for r in recvs:
        st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, st
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


def _check_bytes(d):
    want = hp.expected_decode(SEED, d.tp, d.rank, TOTAL, SRC, DST)
    for b, (got, exp) in enumerate(zip(d.kv, want)):
        bad = np.flatnonzero(got != exp)
        assert bad.size == 0, (f"decode rank {d.rank} buffer {b}: {bad.size} bytes differ, "
                               f"first at {bad[0]}")
    last = {"rank": len(STAGES) - 1}
    aux = hp.aux_rows(hp.stage_seed(SEED, last)).reshape(hp.AUX_ROWS, hp.AUX_ITEM)
    a = d.aux[0].reshape(hp.AUX_ROWS, hp.AUX_ITEM)
    assert np.array_equal(a[DST_AUX], aux[SRC_AUX]), "the aux row is not the last stage's"
    others = [i for i in range(hp.AUX_ROWS) if i != DST_AUX]
    assert (a[others] == hp.CANARY).all(), "other aux rows touched"


def _who(p):
    return f"stage {p.stage['rank']} rank {p.rank}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pp_byte_exact(deployment, name):
    addr, prefills, decodes = deployment(name)
    for rid in (101, 102):  # twice: the second room reuses the connections
        for d in decodes:
            for buf in d.kv + d.aux:
                buf[:] = hp.CANARY
        recvs = _open(addr, prefills, decodes, rid, name)
        for rank, r in enumerate(recvs):
            st, _ = _wait_state(r, TERMINAL, 20)
            assert st == KVPoll.Success, f"{name} room {rid}: decode rank {rank} {st!r}"
        for p in prefills:
            assert p.wait_room(rid) == int(KVPoll.Success), _who(p)
        for d in decodes:
            _check_bytes(d)
        for r in recvs:
            r.clear()
        for p in prefills:
            p.call("clear", room=rid)
    for d in decodes:
        st = d.mgr.stats()
        assert st["rooms_open"] == 0 and st["rooms_draining"] == 0, st


@pytest.mark.parametrize("name, dead, part", [("pp2-tp1", 0, False), ("pp2-tp1", 0, True),
                                              ("pp2-tp2-to-1", 3, False),
                                              ("pp2-tp1-to-2", 1, True)])
def test_pp_stage_killed(deployment, name, dead, part):
    """A prefill rank SIGKILLed once every rank opened the room (part:
    after every rank sent the first pages): every decode rank fails with
    PEER_LOST naming that rank and its stage, and so does every rank of the
    other stage (told by the decode)."""
    addr, prefills, decodes = deployment(name)
    rid = 201
    recvs = _open(addr, prefills, decodes, rid, name, send=False)
    if part:
        for p in prefills:
            p.call("send", room=rid, pages=SRC[:3])
    victim = prefills[dead]
    t0 = victim.kill()
    name_of = f"prefill rank {victim.rank} of PP stage {victim.stage['rank']} at 127.0.0.1"
    reasons = _every_rank_fails(recvs, KVPeerLostError, name_of, t0)
    # The ranks share the root cause, the rank that died.  What follows
    # "lost:" says which of its connections noticed first on that rank:
    # UCX's endpoint ("Endpoint timeout") or the tcp lane ("tcp data
    # connection: ..."), both at its death.
    assert len({r.split(" lost: ")[0] for r in reasons}) == 1, reasons
    for p in prefills:
        if p.stage["rank"] == victim.stage["rank"]:
            continue
        assert p.wait_room(rid, 15) == int(KVPoll.Failed), _who(p)
        f = p.call("failure", room=rid)
        assert f["code"] == "PEER_LOST" and f["reason"] in reasons, f
    if not part:
        for d in decodes:
            assert all((buf == hp.CANARY).all() for buf in d.kv), "bytes landed"
    for r in recvs:
        r.clear()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pp_stage_aborts(deployment, name):
    """abort() on the last stage's last rank before any byte moved: every
    decode rank and every prefill rank of both stages fail with ABORTED and
    its reason."""
    addr, prefills, decodes = deployment(name)
    rid = 301
    recvs = _open(addr, prefills, decodes, rid, name, send=False)
    prefills[-1].call("abort", room=rid)
    who = f"aborted by prefill rank {prefills[-1].rank} of PP stage 1"
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, f"decode rank {rank}: {st!r}"
        with pytest.raises(KVAbortedError) as ei:
            r.failure_exception()
        assert who in ei.value.failure_reason, ei.value.failure_reason
    for p in prefills:
        assert p.wait_room(rid, 15) == int(KVPoll.Failed), _who(p)
        f = p.call("failure", room=rid)
        assert f["code"] == "ABORTED" and who in f["reason"], f
        p.call("send", room=rid, pages=SRC)  # accepted, moves nothing
    time.sleep(0.2)
    for d in decodes:
        assert all((buf == hp.CANARY).all() for buf in d.kv), "bytes landed"
    for r in recvs:
        r.clear()


def test_pp_size_differs(deployment):
    """The room asks for 3 stages of a prefill of 2: LAYOUT_MISMATCH naming
    both sizes, on the decode and on both stages' senders."""
    addr, prefills, decodes = deployment("pp2-tp1")
    r = KVReceiver(decodes[0].mgr, addr, 401)
    r.init(prefill_pp_size=3)
    for p in prefills:
        p.call("open_sender", room=401, n=len(SRC), aux=SRC_AUX)
    st, _ = _wait_state(r, TERMINAL, 15)
    assert st == KVPoll.Failed, st
    with pytest.raises(KVLayoutError) as ei:
        r.failure_exception()
    want = "has a different layout: the room asks for prefill PP 3, the prefill has PP 2"
    assert want in ei.value.failure_reason, ei.value.failure_reason
    for p in prefills:
        assert p.wait_room(401, 15) == int(KVPoll.Failed), _who(p)
        f = p.call("failure", room=401)
        assert f["code"] == "LAYOUT_MISMATCH" and want in f["reason"], f
    r.clear()


ITEM = 64
PAGES = 8


def _stage_mgr(addr, size, rank, start, layers):
    kv = [np.full(PAGES * ITEM, 10 + rank, dtype=np.uint8) for _ in range(2 * layers)]
    args = kvrecv.KVArgs.from_buffers(0, kv, [ITEM] * len(kv), pp_size=size, pp_rank=rank,
                                      start_layer=start, num_layers=layers)
    return KVManager(args, "prefill", bootstrap_addr=addr, config=KVConfig(**CONFIG))


def _decode_mgr(layers=4, **config):
    kv = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(2 * layers)]
    args = kvrecv.KVArgs.from_buffers(0, kv, [ITEM] * len(kv), num_layers=layers)
    return KVManager(args, "decode", config=KVConfig(**{**CONFIG, **config})), kv


def _metadata_and_senders(r, stages, addr, rid):
    """Receiver r's pages [0, 1] once it waits for them, then a sender of 2
    pages on every stage's manager."""
    st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 15)
    assert st == KVPoll.WaitingForInput, st
    r.send_metadata(np.asarray([0, 1], dtype=np.int32))
    senders = [KVSender(m, addr, rid) for m in stages]
    for s in senders:
        s.init(2)
    return senders


def test_pp_stage_never_registered():
    """Stage 1 of 2 never registered: the room fails at the bootstrap
    timeout with BOOTSTRAP naming the missing stage, and stage 0's sender
    fails with that cause too."""
    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        stage0 = _stage_mgr(bs.address, 2, 0, 0, 2)
        made.append(stage0)
        dec, _ = _decode_mgr(bootstrap_timeout_ms=1500)
        made.append(dec)
        r = KVReceiver(dec, bs.address, 401)
        r.init(prefill_pp_size=2)
        s = KVSender(stage0, bs.address, 401)
        s.init(2)
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVBootstrapError) as ei:
            r.failure_exception()
        want = (f"{bs.address} (prefill rank 0, PP stage 1) was not found at the bootstrap "
                "server (unreachable, or the prefill rank is not registered) within the "
                "bootstrap timeout (1500 ms)")
        assert want in ei.value.failure_reason, ei.value.failure_reason
        st, _ = _wait_state(s, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVBootstrapError) as ei:
            s.failure_exception()
        assert want in ei.value.failure_reason, ei.value.failure_reason
        r.clear()
    finally:
        for m in reversed(made):
            m.close()


@pytest.mark.parametrize("case", ["gap", "overlap", "past_the_end", "pp_not_asked"])
def test_pp_layer_ranges_mismatch(case):
    """Stage layer ranges that do not cover the decode's 4 layers exactly
    (or a PP prefill read by a room that names no PP size) fail the room
    with LAYOUT_MISMATCH naming both sides' numbers, on the decode and on
    every stage's sender, before any byte moves."""
    ranges = {"gap": [(0, 2), (3, 1)], "overlap": [(0, 3), (2, 2)],
              "past_the_end": [(0, 2), (2, 3)], "pp_not_asked": [(0, 2), (2, 2)]}[case]
    want = {
        "gap": "room 9: the prefill's PP stages hold layers 0-1 (stage 0), 3-3 (stage 1): "
               "layers 2-2 of the decode's 4 are in none",
        "overlap": "room 9: the prefill's PP stages hold layers 0-2 (stage 0), 2-3 (stage 1): "
                   "layer 2 is in stage 0 and stage 1",
        # the stage refuses the decode's HELLO: its reason
        "past_the_end": "layout mismatch between prefill rank 0 of PP stage 1 (tcp://127.0.0.1:",

        "pp_not_asked": "has a different layout: the prefill has PP 2 (stage 0 holds layers "
                        "0-1); give the receiver's init() prefill_pp_size",
    }[case]
    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        stages = [_stage_mgr(bs.address, 2, s, a, n) for s, (a, n) in enumerate(ranges)]
        made += stages
        dec, dec_kv = _decode_mgr()
        made.append(dec)
        r = KVReceiver(dec, bs.address, 9)
        r.init(prefill_pp_size=None if case == "pp_not_asked" else 2)
        senders = []
        if case in ("gap", "overlap"):
            # Every stage is reachable: the room waits for metadata, then
            # fails when its stages' layers are compared.
            senders = _metadata_and_senders(r, stages, bs.address, 9)
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVLayoutError) as ei:
            r.failure_exception()
        assert want in ei.value.failure_reason, ei.value.failure_reason
        if case == "past_the_end":
            assert ei.value.failure_reason.endswith(
                "prefill PP stage 1 of 2 holds layers 2-4, the decode has 4 layers")
        for i, s in enumerate(senders):
            st, _ = _wait_state(s, TERMINAL, 15)
            assert st == KVPoll.Failed, f"stage {i}: {st!r}"
            with pytest.raises(KVLayoutError) as ei:
                s.failure_exception()
            assert want in ei.value.failure_reason, ei.value.failure_reason
        assert all((b == 0).all() for b in dec_kv), "bytes landed"
        r.clear()
    finally:
        for m in reversed(made):
            m.close()


def test_pp_data_outside_the_stage_refused():
    """A stage whose data messages name the decode's buffers of the next
    stage's layers (the test hook of csrc/testhook.h): the decode fails the
    room with PROTOCOL naming the stage, and none of its bytes land."""
    bs = BootstrapServer(port=0)
    made = [bs]
    try:
        stages = [_stage_mgr(bs.address, 2, s, 2 * s, 2) for s in range(2)]
        made += stages
        stages[0]._core._test_corrupt_data(10)
        dec, dec_kv = _decode_mgr()
        made.append(dec)
        r = KVReceiver(dec, bs.address, 12)
        r.init(prefill_pp_size=2)
        senders = _metadata_and_senders(r, stages, bs.address, 12)  # alive to the end
        for s in senders:
            s.send(np.asarray([3, 4], dtype=np.int32))
        st, _ = _wait_state(r, TERMINAL, 15)
        assert st == KVPoll.Failed, st
        with pytest.raises(KVTransferError) as ei:
            r.failure_exception()
        e = ei.value
        assert e.code == "PROTOCOL", e.failure_reason
        assert re.fullmatch(r"room 12: prefill rank 0 of PP stage 0 at 127\.0\.0\.1:\d+ sent a "
                            r"bad data message: buffers outside the sender's PP stage",
                            e.failure_reason), e.failure_reason
        assert not any((b == 10).any() for b in dec_kv), "stage 0's bytes landed"
        r.clear()
    finally:
        for m in reversed(made):
            m.close()


def test_pp_bad_input_raises_value_error():
    def args(**kw):
        kv = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(4)]
        return kvrecv.KVArgs.from_buffers(0, kv, [ITEM] * 4, **kw)

    with pytest.raises(ValueError, match=r"prefill: 4 KV buffers do not hold num_layers=3 "
                                         r"layers"):
        KVManager(args(pp_size=2, pp_rank=0, num_layers=3), "prefill",
                  bootstrap_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"prefill: 4 KV buffers do not hold num_layers=5"):
        KVManager(args(pp_size=2, pp_rank=1, start_layer=3, num_layers=5), "prefill",
                  bootstrap_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="prefill: pp_rank 2 is not a stage of pp_size 2"):
        KVManager(args(pp_size=2, pp_rank=2, num_layers=2), "prefill",
                  bootstrap_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="num_layers is needed with pp_size, pp_rank or "
                                         "start_layer"):
        args(pp_size=2, pp_rank=1)
    with pytest.raises(ValueError, match="start_layer=-1 must be an integer >= 0"):
        args(pp_size=2, start_layer=-1, num_layers=2)
    with pytest.raises(ValueError, match="pp_size=2, start_layer=0 on a decode: a decode split "
                                         "into pipeline stages is not supported"):
        KVManager(args(pp_size=2, num_layers=2), "decode")
    dec, _ = _decode_mgr(layers=2)
    try:
        r = KVReceiver(dec, "127.0.0.1:1", 5)
        with pytest.raises(ValueError, match="prefill_pp_size=0 must be a positive integer"):
            r.init(prefill_pp_size=0)
        with pytest.raises(ValueError, match="prefill_pp_size=65 is above 64"):
            r.init(prefill_pp_size=65)
    finally:
        dec.close()
