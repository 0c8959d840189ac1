"""A pipeline-parallel prefill through the sglang adapter: sglang-shaped
KVArgs (pp_rank, prefill_start_layer, the K-then-V buffer list of an MHA
pool) on every stage, each stage registered in sglang's rank table of the
bootstrap server (PUT /route with its pp_rank), and a decode that learns the
prefill's PP size from GET /route (try_ensure_parallel_info) and reads every
stage.

Each prefill rank runs in its own child process (tests/failure_peer.py, spec
"heads" with "sglang"), so that a stage can be SIGKILLed.  The ranks of a
stage join as siblings, as the adapter joins sglang's attention-TP group;
the stages do not.  The layouts are tests/hetero_peer.py's (2 layers: stage
0 holds layer 0, stage 1 layer 1; the aux rows differ per stage and the
decode's must be the last stage's).

tests/test_sglang_hetero.py runs 2 stages of TP 1 through sglang's own
queues (stage 1 killed); stages of TP 2 and a killed stage 0 run only here,
through the adapter's classes.
"""

from __future__ import annotations


import numpy as np
import pytest

import hetero_peer as hp
import sglang_args
from failtest import _every_rank_fails, _wait_state
from peer_proc import PeerProcess
import kvrecv
from kvrecv import KVConfig, KVPeerLostError, KVPoll
from kvrecv.sglang import KVRecvBootstrapServer, KVRecvManager, KVRecvReceiver

TERMINAL = (KVPoll.Success, KVPoll.Failed)
SEED = 31
SRC = [3, 4, 5, 9, 11, 12, 20, 21]
DST = [0, 1, 7, 8, 9, 15, 2, 23]
SRC_AUX, DST_AUX = 2, 1
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}
TOTAL = 8
STAGES = [{"start": 0, "layers": 1}, {"start": 1, "layers": 1}]
# (prefill attention TP of each stage, decode attention TP)
LAYOUTS = {"pp2-tp1": (1, 1), "pp2-tp2-to-1": (2, 1)}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def deployment():
    """deployment(name) -> (HTTP bootstrap address, prefill ranks by stage,
    decode managers, decode buffers)."""
    made = []

    def make(name):
        ptp, dtp = LAYOUTS[name]
        server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
        made.append(server)
        prefills = []
        for s, st in enumerate(STAGES):
            stage = {"size": len(STAGES), "rank": s, **st}
            ranks = [PeerProcess("prefill", server.address, seed=SEED, config=CONFIG, rank=r,
                                 heads={"tp": ptp, "total": TOTAL, "pp": stage, "sglang": True})
                     for r in range(ptp)]
            made.extend(ranks)
            for p in ranks:
                p.stage = stage
                if ptp > 1:
                    p.set_siblings([q.endpoint for q in ranks])
            prefills += ranks
        decodes, bufs = [], []
        for r in range(dtp):
            kv, aux = hp.decode_buffers(dtp, TOTAL)
            args = hp.kv_args(kvrecv, kv, aux, dtp, r, TOTAL)
            sa = sglang_args.server_args(server.address, dtp, 1, KVConfig(**CONFIG))
            mgr = KVRecvManager(sglang_args.kv_args(args, {"tp": dtp, "total": TOTAL}),
                                "decode", sa, False)
            made.append(mgr)
            decodes.append(mgr)
            bufs.append((kv, aux))
        if dtp > 1:
            for m in decodes:
                m.set_siblings([x.endpoint for x in decodes])
        for m in decodes:  # sglang's DecodePreallocQueue learns the prefill first
            assert m.try_ensure_parallel_info(server.address), m.bootstrap_failure(server.address)
            assert m.prefill_info_table[server.address].pp_size == len(STAGES)
        return server.address, prefills, decodes, bufs

    yield make
    for obj in reversed(made):
        obj.close()


def _open(addr, prefills, decodes, room, send=True):
    recvs = [KVRecvReceiver(m, addr, room) for m in decodes]
    for r in recvs:
        r.init()
    for r in recvs:
        st, _ = _wait_state(r, (KVPoll.WaitingForInput, KVPoll.Failed), 20)
        assert st == KVPoll.WaitingForInput, st
        r.send_metadata(np.asarray(DST, dtype=np.int32), aux_index=DST_AUX)
    for p in prefills:
        p.call("open_sender", room=room, n=len(SRC), aux=SRC_AUX)
    if send:
        for part in (SRC[:3], SRC[3:]):
            for p in prefills:
                p.call("send", room=room, pages=part)
    return recvs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sglang_pp_byte_exact(deployment, name):
    """Every decode rank's KV pages hold every stage's layers byte for byte,
    its aux row is the last stage's, nothing else was touched; every stage's
    sender succeeds."""
    addr, prefills, decodes, bufs = deployment(name)
    dtp = LAYOUTS[name][1]
    recvs = _open(addr, prefills, decodes, 301)
    for rank, r in enumerate(recvs):
        st, _ = _wait_state(r, TERMINAL, 20)
        assert st == KVPoll.Success, f"decode rank {rank}: {st!r}"
    for p in prefills:
        assert p.wait_room(301) == int(KVPoll.Success), f"stage {p.stage['rank']} rank {p.rank}"
    last = hp.aux_rows(hp.stage_seed(SEED, {"rank": len(STAGES) - 1}))
    for rank, (kv, aux) in enumerate(bufs):
        want = hp.expected_decode(SEED, dtp, rank, TOTAL, SRC, DST)
        for b, (got, exp) in enumerate(zip(kv, want)):
            assert np.array_equal(got, exp), f"decode rank {rank} buffer {b} differs"
        rows = aux[0].reshape(hp.AUX_ROWS, hp.AUX_ITEM)
        assert np.array_equal(rows[DST_AUX], last.reshape(hp.AUX_ROWS, hp.AUX_ITEM)[SRC_AUX])
        assert (np.delete(rows, DST_AUX, axis=0) == hp.CANARY).all(), "other aux rows touched"


@pytest.mark.parametrize("name, dead", [("pp2-tp1", 1), ("pp2-tp1", 0), ("pp2-tp2-to-1", 2)])
def test_sglang_pp_stage_killed(deployment, name, dead):
    """A prefill rank of one stage SIGKILLed after every stage sent its first
    pages: every decode rank's request fails with KVPeerLostError naming that
    rank and its stage, and the other stage's senders fail with the same
    PEER_LOST reason (told by the decode)."""
    addr, prefills, decodes, _ = deployment(name)
    recvs = _open(addr, prefills, decodes, 401, send=False)
    for p in prefills:
        p.call("send", room=401, pages=SRC[:3])
    victim = prefills[dead]
    t0 = victim.kill()
    who = f"prefill rank {victim.rank} of PP stage {victim.stage['rank']} at 127.0.0.1"
    reasons = _every_rank_fails(recvs, KVPeerLostError, who, t0)
    assert all(r.startswith("room 401: ") for r in reasons), reasons
    assert len(reasons) == 1, reasons
    for p in prefills:
        if p.stage["rank"] == victim.stage["rank"]:
            continue
        assert p.wait_room(401, 15) == int(KVPoll.Failed)
        f = p.call("failure", room=401)
        assert f["code"] == "PEER_LOST" and f["reason"] in reasons, f
