"""The sglang adapter (kvrecv.sglang) driven the way sglang's disaggregation
schedulers drive a transfer backend: 2 prefill ranks and 2 decode ranks, every
queue polled each iteration, poll results MIN-reduced across ranks, and
failure_exception() called on every rank inside try/except KVTransferError
with the request requeued under a new bootstrap room."""

from __future__ import annotations

import enum
import time
import types

import numpy as np
import pytest

from kvtest import ROBUST_CONFIG, STD, Side

from kvrecv import KVConfig, KVPoll, KVTransferError
from kvrecv.sglang import (
    KVRecvArgs,
    KVRecvBootstrapServer,
    KVRecvManager,
    KVRecvReceiver,
    KVRecvSender,
    mode_name,
)

RANKS = 2
PAGES = 8


class DisaggregationMode(enum.Enum):
    """Shaped like sglang's enum: .value is the string."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def sglang_kv_args(side: Side) -> KVRecvArgs:
    """A KVArgs bag filled the way sglang's queues fill theirs (ints)."""
    a = KVRecvArgs()
    a.engine_rank = side.rank
    a.kv_data_ptrs = [b.ctypes.data for b in side.kv]
    a.kv_data_lens = [b.nbytes for b in side.kv]
    a.kv_item_lens = list(side.layout.kv_item_lens)
    a.aux_data_ptrs = [b.ctypes.data for b in side.aux]
    a.aux_data_lens = [b.nbytes for b in side.aux]
    a.aux_item_lens = list(side.layout.aux_item_lens)
    a.page_size = 1
    return a


class Cluster:
    def __init__(self):
        self.closers = []
        self.server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
        self.closers.append(self.server)
        cfg = KVConfig(**dict(ROBUST_CONFIG, sibling_wait_ms=3000))
        self.server_args = types.SimpleNamespace(
            host="127.0.0.1", disaggregation_bootstrap_port=self.server.port, kvrecv_config=cfg,
            tp_size=RANKS)
        self.src = [Side(STD, rank=r, seed=500 + r) for r in range(RANKS)]
        self.dst = [Side(STD, rank=r) for r in range(RANKS)]
        self.prefill = [KVRecvManager(sglang_kv_args(s), DisaggregationMode.PREFILL,
                                      self.server_args, False) for s in self.src]
        self.closers += self.prefill
        self.decode = [KVRecvManager(sglang_kv_args(s), DisaggregationMode.DECODE,
                                     self.server_args, False) for s in self.dst]
        self.closers += self.decode
        for group in (self.prefill, self.decode):
            for m in group:
                m.set_siblings([x.endpoint for x in group])
        self.addr = f"127.0.0.1:{self.server.port}"
        # sglang's DecodePreallocQueue learns the prefill before any init()
        assert all(m.try_ensure_parallel_info(self.addr) for m in self.decode)

    def close(self):
        for obj in reversed(self.closers):
            obj.close()


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def poll_and_all_reduce(pollers) -> int:
    """sglang's poll_and_all_reduce: MIN over the ranks, as a uint8."""
    return int(np.array([int(p.poll()) for p in pollers], dtype=np.uint8).min())


class Req:
    """A request of PAGES pages (page_size 1: a page is a token).  With a
    prefix, the decode's radix cache already holds the first `prefix` tokens:
    it asks only for the pages of the rest (dst_pages), and the prefill must
    learn the prefix from the backend to send src_pages[prefix:]."""

    def __init__(self, rid, room, rng, prefix=0):
        self.rid = rid
        self.room = room
        self.prefix = prefix
        self.src_pages = rng.choice(STD.num_pages, size=PAGES, replace=False).astype(np.int32)
        self.dst_pages = (rid * PAGES + np.arange(PAGES - prefix)).astype(np.int32)
        rng.shuffle(self.dst_pages)
        self.aux_src = int(rng.integers(0, STD.aux_rows))
        self.aux_dst = rid
        self.rooms = [room]
        self.seen_prefix = []  # what each prefill rank's pop_decode_prefix_len() said


def run_scheduler(c: Cluster, nreqs: int, abort_rid=None, timeout=30.0, prefixes=None):
    """Prefill and decode schedulers in one loop.  Returns (done, failures):
    failures are (side, room, rank, code, is_from_another_rank, reason).
    prefixes: {rid: tokens the decode already holds}."""
    rng = np.random.default_rng(7)
    reqs = [Req(i, 10_000 + i, rng, (prefixes or {}).get(i, 0)) for i in range(nreqs)]
    next_room = [20_000]
    p_bootstrap, p_inflight = [], []  # [req, senders, chunks_sent]
    d_prealloc, d_transfer = [], []  # [req, receivers]
    done, failures = {}, []
    aborted = [False]

    def admit(req):
        # the router hands the request (and its room) to both instances
        p_bootstrap.append([req, [KVRecvSender(mgr=m, bootstrap_addr=c.addr, bootstrap_room=req.room,
                                               dest_tp_ranks=[r], pp_rank=0)
                                  for r, m in enumerate(c.prefill)], 0])
        recvs = [KVRecvReceiver(mgr=m, bootstrap_addr=c.addr, bootstrap_room=req.room)
                 for m in c.decode]
        for rv in recvs:
            rv.init(0)
        d_prealloc.append([req, recvs])

    def collect(side, pollers):
        for rank, p in enumerate(pollers):
            room = p.bootstrap_room
            try:
                p.failure_exception()
            except KVTransferError as e:
                failures.append((side, room, rank, e.code, e.is_from_another_rank, e.failure_reason))
            else:  # pragma: no cover - failure_exception must raise
                raise AssertionError("failure_exception() returned")
            p.clear()

    for req in reqs:
        admit(req)
    deadline = time.monotonic() + timeout
    while len(done) < nreqs and time.monotonic() < deadline:
        # ---- prefill: pop_bootstrapped
        for entry in list(p_bootstrap):
            req, senders, _ = entry
            state = poll_and_all_reduce(senders)
            if state == KVPoll.WaitingForInput:
                # sglang: req.start_send_idx = sender.pop_decode_prefix_len(),
                # then init() with the pages from there on
                req.seen_prefix = [s.pop_decode_prefix_len() for s in senders]
                start = req.seen_prefix[0]
                for s in senders:
                    s.init(PAGES - start, req.aux_src)
                entry.append(start)
                p_bootstrap.remove(entry)
                p_inflight.append(entry)
            elif state == KVPoll.Failed:
                collect("prefill", senders)
                p_bootstrap.remove(entry)
        # ---- prefill: chunked prefill, then process_disagg_prefill_inflight_queue
        for entry in list(p_inflight):
            req, senders, sent, start = entry
            hold = req.rid == abort_rid and len(req.rooms) == 1 and sent == 1
            if sent < 2 and not hold:
                todo = req.src_pages[start:]
                half = len(todo) // 2
                chunk = todo[:half] if sent == 0 else todo[half:]
                for s in senders:
                    if s.should_send_kv_chunk(len(chunk), sent == 1):
                        s.send(chunk, state_indices=None)
                entry[2] = sent + 1
            state = poll_and_all_reduce(senders)
            if state == KVPoll.Success:
                for s in senders:
                    assert s.get_transfer_metric().transfer_total_bytes == \
                        STD.transfer_bytes(PAGES - start, True)
                    s.clear()
                p_inflight.remove(entry)
            elif state == KVPoll.Failed:
                collect("prefill", senders)
                p_inflight.remove(entry)
        # ---- decode: pop_preallocated
        for entry in list(d_prealloc):
            req, recvs = entry
            state = poll_and_all_reduce(recvs)
            if state == KVPoll.WaitingForInput:
                for rv in recvs:
                    rv.send_metadata(req.dst_pages, req.aux_dst, state_indices=None,
                                     decode_prefix_len=req.prefix)
                d_prealloc.remove(entry)
                d_transfer.append(entry)
            elif state == KVPoll.Failed:
                collect("decode", recvs)
                d_prealloc.remove(entry)
        # an AbortReq reaches decode rank 0 while the victim is mid-transfer
        if abort_rid is not None and not aborted[0]:
            for req, recvs in d_transfer:
                held = any(e[0] is req and e[2] == 1 for e in p_inflight)
                if req.rid == abort_rid and held and recvs[0].poll() != KVPoll.Bootstrapping:
                    recvs[0].abort()
                    aborted[0] = True
        # ---- decode: pop_transferred
        for entry in list(d_transfer):
            req, recvs = entry
            state = poll_and_all_reduce(recvs)
            if state == KVPoll.Success:
                assert all(rv.conclude_state == KVPoll.Success for rv in recvs)
                for rv in recvs:
                    rv.clear()
                d_transfer.remove(entry)
                done[req.rid] = req
            elif state == KVPoll.Failed:
                collect("decode", recvs)
                d_transfer.remove(entry)
                # requeue under a new bootstrap room
                req.room = next_room[0]
                next_room[0] += 1
                req.rooms.append(req.room)
                admit(req)
        time.sleep(0.0005)
    return done, failures, reqs


def check_bytes(c: Cluster, reqs):
    for r in range(RANKS):
        want = Side(STD, rank=r).snapshot()  # the destination started as canary
        for req in reqs:
            want.apply(c.src[r], req.src_pages[req.prefix:], req.dst_pages, req.aux_src, req.aux_dst)
        want.check(c.dst[r])


def test_abort_requeue_under_new_room_then_success(cluster):
    victim = 3
    done, failures, reqs = run_scheduler(cluster, 8, abort_rid=victim)
    assert sorted(done) == list(range(8)), f"unfinished; failures: {failures}"
    # only the victim failed, only once, and it finished under a new room
    assert len(reqs[victim].rooms) == 2
    old, new = reqs[victim].rooms
    assert new != old
    assert all(len(r.rooms) == 1 for r in reqs if r.rid != victim)
    assert {f[1] for f in failures} == {old}, failures
    dec = {f[2]: f for f in failures if f[0] == "decode"}
    assert set(dec) == {0, 1}
    # rank 0 is the origin; rank 1 raises the same root cause, marked as propagated
    assert dec[0][3] == "ABORTED" and dec[0][4] is False
    assert dec[1][3] == "ABORTED" and dec[1][4] is True, dec[1]
    pre = [f for f in failures if f[0] == "prefill"]
    assert len(pre) == RANKS and all(f[3] == "ABORTED" for f in pre), pre
    check_bytes(cluster, reqs)
    assert cluster.decode[0].stats()["failures_by_code"]["ABORTED"] >= 1


def test_mode_name():
    assert mode_name(DisaggregationMode.PREFILL) == "prefill"
    assert mode_name(DisaggregationMode.DECODE) == "decode"
    assert mode_name("decode") == "decode"
    assert mode_name("DisaggregationMode.PREFILL") == "prefill"
    with pytest.raises(ValueError):
        mode_name(DisaggregationMode.NULL)


def test_state_buffers_rejected():
    """State types other than Mamba and sliding-window pages
    (tests/test_state.py moves Mamba's, tests/test_sglang_swa.py SWA's)."""
    a = sglang_kv_args(Side(STD, rank=0))
    a.state_types = ["mamba", "swa", "dsa"]
    with pytest.raises(NotImplementedError, match=r"state_types \['dsa'\] are not supported"):
        KVRecvManager(a, DisaggregationMode.DECODE, types.SimpleNamespace(), False)


@pytest.mark.parametrize("sizes, text", [
    (dict(tp_size=2, dp_size=2), "dp_size=2, enable_dp_attention=False, attn_cp_size=1"),
    (dict(tp_size=4, dp_size=2, enable_dp_attention=True, attn_cp_size=2),
     "dp_size=2, enable_dp_attention=True, attn_cp_size=2"),
], ids=["dp-replicas", "cp"])
def test_prefill_parallel_layouts_refused(sizes, text):
    """A prefill of DP replicas without DP attention or of attention CP is
    refused when its manager is made, naming the sizes, before it registers
    anywhere."""
    sa = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=9, **sizes)
    with pytest.raises(NotImplementedError) as ei:
        KVRecvManager(sglang_kv_args(Side(STD, rank=0)), DisaggregationMode.PREFILL, sa, False)
    assert str(ei.value) == ("kvrecv serves a prefill of DP groups with DP attention, without CP "
                             f"({text})")


def test_pp_layouts_refused():
    """A decode split into PP stages, and a PP prefill stage whose KV list
    carries draft-model buffers (its layers are not one pool's), are refused
    when the manager is made, naming the numbers."""
    sa = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=9, tp_size=2,
                               pp_size=2)
    with pytest.raises(NotImplementedError) as ei:
        KVRecvManager(sglang_kv_args(Side(STD, rank=0)), DisaggregationMode.DECODE, sa, False)
    assert str(ei.value) == ("kvrecv serves a decode of one PP stage, reading a prefill of any "
                             "PP size (this decode has pp_size=2)")
    args = sglang_kv_args(Side(STD, rank=0))
    args.num_draft_entries = 2
    args.pp_rank, args.prefill_start_layer = 1, 2
    with pytest.raises(NotImplementedError) as ei:
        KVRecvManager(args, DisaggregationMode.PREFILL, sa, False)
    n = len(args.kv_data_ptrs)
    assert str(ei.value) == (
        "kvrecv moves a PP stage's layers only when its KV buffers are the layers of one pool "
        f"(K then V, or one MLA buffer per layer): this stage has {n} KV buffers, 2 of them "
        "draft-model buffers")


def _dp_group_1(balance: str):
    """A bootstrap server and the prefill manager of DP group 1's only rank
    (sglang's tp_size 2, dp_size 2 with DP attention: engine_rank 1)."""
    server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
    sa = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                               tp_size=2, dp_size=2, enable_dp_attention=True,
                               load_balance_method=balance)
    try:
        mgr = KVRecvManager(sglang_kv_args(Side(STD, rank=1)), DisaggregationMode.PREFILL, sa,
                            False)
    except BaseException:
        server.close()
        raise
    assert (mgr.kvrecv_args.engine_rank, mgr.kvrecv_args.attn_dp_rank) == (0, 1)
    return server, mgr


def _local_failure(sender) -> str:
    assert sender.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError) as ei:
        sender.failure_exception()
    return ei.value.failure_reason


def test_dp_room_dispatched_to_another_group_than_the_room_says_fails():
    """Following the bootstrap room, a room sglang hands to DP group 1 that
    the decode reads from group 0 (4 % 2) fails at once on the prefill,
    naming both groups; room 5 (5 % 2 = 1) does not."""
    server, mgr = _dp_group_1("follow_bootstrap_room")
    try:
        bad = KVRecvSender(mgr, server.address, 4)
        assert _local_failure(bad) == (
            "room 4: follow_bootstrap_room conflict: room 4 was dispatched to prefill DP group 1, "
            "but the decode reads it from group 0 (room % dp_size 2)")
        good = KVRecvSender(mgr, server.address, 5)
        assert good.poll() == KVPoll.Bootstrapping
        # a request naming its DP group: the decode reads the group it names
        named = KVRecvSender(mgr, server.address, 6, req_has_disagg_prefill_dp_rank=True)
        assert named.poll() == KVPoll.Bootstrapping
        for s in (bad, good, named):
            s.clear()
    finally:
        mgr.close()
        server.close()


def test_dp_room_registration_that_fails_fails_the_room():
    """Another load balancing: the sender registers its room's DP group with
    the bootstrap server (sglang's decode asks /query_dp_ranks); once the
    server is gone, the room fails at once, naming the room, the group and
    the refused connection."""
    server, mgr = _dp_group_1("round_robin")
    try:
        ok = KVRecvSender(mgr, server.address, 4)
        assert ok.poll() == KVPoll.Bootstrapping
        assert server.http.table.query_dp_ranks({"bootstrap_rooms": [4]}) == {"4": 1}
        ok.clear()
        addr = server.address
        server.http.close()
        bad = KVRecvSender(mgr, addr, 6)
        assert _local_failure(bad) == (
            f"room 6: could not register room 6 with prefill DP group 1 at the bootstrap server "
            f"{addr}: ConnectionRefusedError: [Errno 111] Connection refused")
        bad.clear()
    finally:
        mgr.close()
        server.close()


def test_decode_prefix_len_moves_only_the_rest(cluster):
    # the decode's radix cache holds 3, 7, all 8 (aux row only) or no tokens
    prefixes = {0: 3, 1: PAGES - 1, 2: PAGES, 4: 0}
    done, failures, reqs = run_scheduler(cluster, 5, prefixes=prefixes)
    assert failures == []
    assert sorted(done) == list(range(5))
    for req in reqs:
        # every prefill rank learnt the prefix from the decode's request
        assert req.seen_prefix == [req.prefix] * RANKS, (req.rid, req.seen_prefix)
    # the pages after the prefix landed (and nothing else: the rest of the
    # decode memory keeps its canary, the prefix pages are not overwritten)
    check_bytes(cluster, reqs)
    moved = sum(STD.transfer_bytes(PAGES - r.prefix, True) for r in reqs)
    assert cluster.decode[0].stats()["bytes_moved"] == moved
    assert cluster.prefill[1].stats()["bytes_moved"] == moved


def test_decode_prefix_len_checked():
    side = Side(STD, rank=0)
    c = Cluster()
    try:
        recv = KVRecvReceiver(c.decode[0], c.addr, 78)
        recv.init(0)
        for bad, exc in ((-1, ValueError), (2**32, ValueError), (1.5, TypeError), ("3", TypeError)):
            with pytest.raises(exc, match="decode_prefix_len"):
                recv.send_metadata(np.arange(2, dtype=np.int32), 0, None, decode_prefix_len=bad)
        recv.clear()
    finally:
        c.close()
    del side


def _open_pair(cluster, room):
    recv = KVRecvReceiver(cluster.decode[0], cluster.addr, room)
    send = KVRecvSender(cluster.prefill[0], cluster.addr, room, [0], 0)
    send.init(4, 0)
    recv.init(0)
    deadline = time.monotonic() + 10
    while recv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.001)
    assert recv.poll() == KVPoll.WaitingForInput
    return recv, send


def _wait_terminal(room, timeout=10):
    deadline = time.monotonic() + timeout
    while room.poll() not in (KVPoll.Failed, KVPoll.Success) and time.monotonic() < deadline:
        time.sleep(0.001)
    return room.poll()


@pytest.mark.parametrize("state_indices", [None, [], [None], [[]], [np.zeros(0, dtype=np.int32)]],
                         ids=["none", "empty", "none-entry", "empty-list", "empty-array"])
def test_empty_state_indices_accepted(cluster, state_indices):
    recv, send = _open_pair(cluster, 79)
    assert recv.require_staging is False
    recv.send_metadata(np.arange(4, dtype=np.int32), 0, state_indices, decode_prefix_len=0)
    send.send(np.array([9, 8, 7, 6], dtype=np.int32), state_indices=state_indices)
    assert _wait_terminal(recv) == KVPoll.Success
    assert _wait_terminal(send) == KVPoll.Success
    recv.clear()
    send.clear()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_state_indices_fail_room_cleanly(cluster, side):
    recv, send = _open_pair(cluster, 77)
    state = [[3, 4]]
    if side == "decode":
        recv.send_metadata(np.arange(4, dtype=np.int32), 0, state, decode_prefix_len=0)
        mine, peer = recv, send
    else:
        recv.send_metadata(np.arange(4, dtype=np.int32), 0, None, decode_prefix_len=0)
        send.send(np.arange(4, dtype=np.int32), state_indices=state)
        mine, peer = send, recv
    assert mine.poll() == KVPoll.Failed
    assert mine.conclude_state == KVPoll.Failed
    with pytest.raises(KVTransferError, match=r"registered no state buffers.*state_indices=\[\[3, 4\]\]") as ei:
        mine.failure_exception()
    assert ei.value.bootstrap_room == 77
    # the other side of the room is told (it would otherwise wait)
    assert _wait_terminal(peer) == KVPoll.Failed
    with pytest.raises(KVTransferError) as ei:
        peer.failure_exception()
    assert ei.value.code == "ABORTED"
    # clear/abort twice is harmless, as sglang may do
    mine.clear()
    mine.clear()
    mine.abort()
    peer.clear()
