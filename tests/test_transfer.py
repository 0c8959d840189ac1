"""Byte-exact transfers: random source pages land on the named decode pages,
every other decode byte keeps its canary, aux rows likewise; over TCP and
shared memory, with two ranks, across processes, with hundreds of rooms in
flight, and with the statistics that account for it."""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

import numpy as np
import pytest

from kvrecv import KVPoll, KVReceiver, KVSender
from kvtest import (
    SMALL,
    STD,
    TCP_EAGER_BYTES,
    TCP_NO_EAGER_FRAGMENT,
    Layout,
    TRANSPORTS,
    WIDE,
    Side,
    auto_run_bytes,
    buffer_groups,
    count_messages,
    count_runs,
    describe_failure,
    min_messages,
    position_groups,
    room_messages,
    shm_eager_room,
    split_chunks,
    terminal,
    wait_all,
    wait_for,
    wait_until,
)


pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass
class Plan:
    room: int
    src: np.ndarray            # source pages, in order
    dst: np.ndarray            # destination pages, same length
    chunks: List[np.ndarray]   # src split into the send() calls
    src_aux: Optional[int] = None
    dst_aux: Optional[int] = None

    @property
    def with_aux(self) -> bool:
        return self.dst_aux is not None


def open_receivers(decode, addr, plans):
    rs = []
    for p in plans:
        r = KVReceiver(decode, addr, p.room)
        r.init()
        rs.append(r)
    return rs


def send_metadata_all(receivers, plans):
    states = wait_all(receivers, (KVPoll.WaitingForInput, KVPoll.Failed), timeout=20)
    assert all(s == KVPoll.WaitingForInput for s in states), [
        describe_failure(r) for r in receivers
    ]
    for r, p in zip(receivers, plans):
        r.send_metadata(np.asarray(p.dst, dtype=np.int32), aux_index=p.dst_aux)


def start_senders(prefill, addr, plans, send=True):
    ss = []
    for p in plans:
        s = KVSender(prefill, addr, p.room)
        s.init(len(p.src), p.src_aux)
        if send:
            for c in p.chunks:
                s.send(c)
        ss.append(s)
    return ss


def assert_all_success(rooms, timeout=30):
    states = wait_all(rooms, terminal(), timeout)
    bad = [(r.bootstrap_room, describe_failure(r)) for r, s in zip(rooms, states)
           if s != KVPoll.Success]
    assert not bad, f"rooms that did not succeed: {bad[:5]} ({len(bad)} of {len(rooms)})"


def run_in_process(prefill, decode, addr, plans, timeout=30):
    rs = open_receivers(decode, addr, plans)
    send_metadata_all(rs, plans)
    ss = start_senders(prefill, addr, plans)
    assert_all_success(rs, timeout)
    assert_all_success(ss, timeout)
    return rs, ss


def zero_failures(stats):
    return all(v == 0 for v in stats["failures_by_code"].values())


def make_plans(rng, layout, room0=1):
    """Four rooms with disjoint destination pages: a long contiguous run (large
    messages), two scattered ones, and one without aux rows."""
    n = layout.num_pages
    block_dst = np.arange(n - 70, n - 6, dtype=np.int32)           # 64 contiguous pages
    block_src = np.arange(10, 74, dtype=np.int64)
    pool = rng.permutation(np.setdiff1d(np.arange(n), block_dst))
    sizes = [21, 27, 33]
    plans = [Plan(room0, block_src, block_dst, split_chunks(rng, block_src, 3), 5, 60)]
    at = 0
    aux_dst = [3, 41, None]
    aux_src = [17, 0, 9]  # the last room's prefill has an aux row the decode did not ask for
    for i, size in enumerate(sizes):
        dst = pool[at:at + size].astype(np.int32)
        at += size
        src = rng.choice(n, size=size, replace=False).astype(np.int64)
        plans.append(Plan(room0 + 1 + i, src, dst, split_chunks(rng, src, [1, 5, 2][i]),
                          aux_src[i], aux_dst[i]))
    return plans


def ops_bounds(plans, layout):
    """rma_ops_posted lies between one KV message (and one aux message) per
    room and one message per buffer and run of every send() chunk (posting
    races the send() calls; the exact rule is tested below)."""
    nkv, naux = len(layout.kv_item_lens), len(layout.aux_item_lens)
    lo = hi = 0
    for p in plans:
        lo += 1 + (1 if p.with_aux else 0)
        pos = 0
        for c in p.chunks:
            hi += count_runs(p.src[pos:pos + len(c)], p.dst[pos:pos + len(c)]) * nkv
            pos += len(c)
        hi += naux if p.with_aux else 0
    return lo, hi


# --------------------------------------------------------------------------


def test_byte_exact_transfer(transport, pair):
    rng = np.random.default_rng(7)
    plans = make_plans(rng, STD)
    expected = pair.dst.snapshot()

    rs = open_receivers(pair.decode, pair.addr, plans)
    send_metadata_all(rs, plans)
    ss = start_senders(pair.prefill, pair.addr, plans)

    # The states a receiver shows only ever move forward.
    seen = [rs[0].poll()]
    wait_until(lambda: seen.append(rs[0].poll()) or seen[-1] in terminal(), timeout=30,
               interval=0.0005)
    assert seen == sorted(seen), f"receiver state went backwards: {seen}"
    assert_all_success(rs)
    assert_all_success(ss)

    for p in plans:
        expected.apply(pair.src, p.src, p.dst, p.src_aux, p.dst_aux)
    expected.check(pair.dst)

    want_bytes = sum(STD.transfer_bytes(len(p.src), p.with_aux) for p in plans)
    for side, mgr in (("decode", pair.decode), ("prefill", pair.prefill)):
        st = mgr.stats()
        assert st["rooms_succeeded"] == len(plans), (side, st)
        assert st["bytes_moved"] == want_bytes, (side, st)
        assert st["rooms_by_state"]["Success"] == len(plans), (side, st)
        assert st["rooms_open"] == len(plans), (side, st)
        assert zero_failures(st), (side, st)
        assert st["ctrl_dropped"] == 0 and st["data_rejected"] == 0, (side, st)
        assert st["pending_requests"] == 0, (side, st)
    lo, hi = ops_bounds(plans, STD)
    assert lo <= pair.prefill.stats()["rma_ops_posted"] <= hi
    assert pair.decode.stats()["rma_ops_posted"] == 0


def test_two_ranks_each_decode_rank_reads_its_prefill_rank(transport, res, bootstrap):
    addr = bootstrap.address
    srcs = [Side(STD, rank=r, seed=500 + r) for r in range(2)]
    dsts = [Side(STD, rank=r) for r in range(2)]
    prefills = [res.manager(srcs[r], "prefill", addr) for r in range(2)]
    decodes = [res.manager(dsts[r], "decode") for r in range(2)]
    plans = make_plans(np.random.default_rng(11), STD, room0=900)
    expected = [d.snapshot() for d in dsts]

    # Both ranks use the same room ids and the same pages, as TP ranks do.
    rs = [open_receivers(decodes[r], addr, plans) for r in range(2)]
    for r in range(2):
        send_metadata_all(rs[r], plans)
    ss = [start_senders(prefills[r], addr, plans) for r in range(2)]
    for r in range(2):
        assert_all_success(rs[r])
        assert_all_success(ss[r])

    for r in range(2):
        for p in plans:
            expected[r].apply(srcs[r], p.src, p.dst, p.src_aux, p.dst_aux)
        expected[r].check(dsts[r])
        other = srcs[1 - r]
        for p in plans:
            for b in range(len(STD.kv_item_lens)):
                assert not np.array_equal(dsts[r].pages(b)[p.dst], other.pages(b)[p.src]), (
                    f"decode rank {r} holds prefill rank {1 - r}'s data (room {p.room}, buffer {b})"
                )
        want = sum(STD.transfer_bytes(len(p.src), p.with_aux) for p in plans)
        assert decodes[r].stats()["bytes_moved"] == want
        assert prefills[r].stats()["bytes_moved"] == want


def _transfer_from_children(children, decodes, dsts, addr, layout, plans):
    """Moves plans from prefill ranks in child processes (children[r]) to
    the decode managers of this process (decodes[r], memory dsts[r]) and
    checks states, statistics and every destination byte."""
    expected = [d.snapshot() for d in dsts]
    rs = [open_receivers(dec, addr, plans) for dec in decodes]
    for r in rs:
        send_metadata_all(r, plans)
    # The decode's requests are already on their way: the child's senders
    # are created after them (the prefill holds them as pending requests).
    work = [(p.room, len(p.src), p.src_aux, [c.tolist() for c in p.chunks]) for p in plans]
    for c in children:
        c.call("send", work)
    for r in rs:
        assert_all_success(r)
    want = sum(layout.transfer_bytes(len(p.src), p.with_aux) for p in plans)
    for r, c in enumerate(children):
        states = c.call("wait", ([p.room for p in plans], 30))
        assert all(s == int(KVPoll.Success) for s, _ in states.values()), states
        st = c.call("stats")
        assert st["rooms_succeeded"] == len(plans), st
        assert st["bytes_moved"] == want, st
        assert zero_failures(st), st
        for p in plans:
            expected[r].apply(c.side(), p.src, p.dst, p.src_aux, p.dst_aux)
        expected[r].check(dsts[r])
        assert decodes[r].stats()["bytes_moved"] == want


@pytest.mark.timeout(90)
def test_prefill_ranks_in_child_processes(transport, res, bootstrap):
    addr = bootstrap.address
    children = [res.child_prefill(STD, r, 700 + r, addr) for r in range(2)]
    assert all("UCX_TLS=" + TRANSPORTS[transport] in c.transport.split(", ") for c in children), [
        c.transport for c in children
    ]
    dsts = [Side(STD, rank=r) for r in range(2)]
    decodes = [res.manager(dsts[r], "decode") for r in range(2)]
    plans = make_plans(np.random.default_rng(13), STD, room0=40)
    _transfer_from_children(children, decodes, dsts, addr, STD, plans)


# Items up to 64 KiB: the long run is messages of about 1.3 MiB per buffer
# (several 256 KiB fragments), random 64 KiB pages go alone, the others packed.
SEG = Layout((4096, 65536), 160, (24,), 64)
TUNED = "kvrecv sets UCX_TCP_TX_SEG_SIZE=256K UCX_TCP_RX_SEG_SIZE=512K UCX_ZCOPY_THRESH=inf"
# UCX's own defaults for what kvrecv sets over tcp
UCX_DEFAULT_TCP = {"UCX_TCP_TX_SEG_SIZE": "8K", "UCX_TCP_RX_SEG_SIZE": "64K",
                   "UCX_ZCOPY_THRESH": "auto"}


@pytest.mark.timeout(90)
def test_tcp_fragment_sizes_a_decode_at_ucx_defaults_receives_from(res, bootstrap, monkeypatch):
    """kvrecv sets UCX's tcp fragment sizes (256 KiB sends into 512 KiB
    receive buffers) where the environment does not: its transport
    description says so, and a variable set in the environment wins.  A
    tuned decode receives every byte from a prefill left at UCX's defaults
    (8 KiB fragments) by its environment."""
    addr = bootstrap.address
    monkeypatch.setenv("UCX_TLS", "tcp")
    child = res.child_prefill(SEG, 0, 900, addr, env=dict(UCX_DEFAULT_TCP))
    dst = Side(SEG, rank=0)
    decode = res.manager(dst, "decode")
    assert decode.transport.endswith(", " + TUNED), decode.transport
    assert "kvrecv sets" not in child.transport, child.transport
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "16K")
    third = res.manager(Side(SEG, rank=1), "decode")
    assert third.transport.endswith(", kvrecv sets UCX_TCP_RX_SEG_SIZE=512K UCX_ZCOPY_THRESH=inf"), \
        third.transport
    plans = make_plans(np.random.default_rng(17), SEG, room0=90)
    _transfer_from_children([child], [decode], [dst], addr, SEG, plans)


@pytest.mark.timeout(90)
def test_tcp_fragment_sizes_only_where_ucx_may_use_tcp(res, bootstrap, monkeypatch, capfd):
    """Where UCX_TLS leaves tcp out, kvrecv sets no tcp setting (UCX would
    warn about settings no transport uses), and such a decode receives from
    a prefill that has tcp and its 256 KiB fragments (over shared memory)."""
    addr = bootstrap.address
    child = res.child_prefill(SEG, 0, 902, addr, env={"UCX_TLS": "posix,sysv,cma,self,tcp"})
    assert TUNED in child.transport, child.transport
    monkeypatch.setenv("UCX_TLS", "posix,sysv,cma,self")
    dst = Side(SEG, rank=0)
    decode = res.manager(dst, "decode")
    assert TUNED not in decode.transport and "TCP" not in decode.transport, decode.transport
    plans = make_plans(np.random.default_rng(23), SEG, room0=98)
    _transfer_from_children([child], [decode], [dst], addr, SEG, plans)
    err = capfd.readouterr().err
    assert "invalid configurations" not in err, err


@pytest.mark.parametrize("tls, tuned, shm", [
    ("tcp", True, False), ("all", True, True), ("^posix", True, True), ("^posix,sysv", True, False),
    ("^sm", True, False), ("sm,tcp,self", True, True), ("^tcp", False, True),
    ("posix,sysv,cma,self", False, True), ("sm,self", False, True), ("sysv,self", False, True)])
def test_tcp_fragment_sizes_follow_ucx_tls(res, monkeypatch, tls, tuned, shm):
    """kvrecv sets its tcp fragment sizes exactly where UCX_TLS lets UCX
    use tcp, its shared-memory segment sizes where it lets UCX use posix or
    sysv (a "^" list excludes what it names; sm names both)."""
    monkeypatch.setenv("UCX_TLS", tls)
    m = res.manager(Side(SMALL, rank=0), "decode")
    assert (TUNED in m.transport) is tuned, m.transport
    assert (SHM_TUNED in m.transport) is shm, m.transport


SHM_TUNED = "UCX_MM_SEG_SIZE=32K UCX_MM_FIFO_SIZE=256"


def test_shm_sizes_set_by_the_environment_win(res, monkeypatch):
    """kvrecv sets UCX's shared-memory segment and FIFO sizes (32 KiB x 256)
    only where no variable of the environment sets them: UCX_MM_* or a
    transport's own UCX_POSIX_* / UCX_SYSV_*."""
    monkeypatch.setenv("UCX_TLS", "posix,sysv,cma,self")
    monkeypatch.setenv("UCX_SYSV_FIFO_SIZE", "128")
    m = res.manager(Side(SMALL, rank=0), "decode")
    assert m.transport.endswith(", kvrecv sets UCX_MM_SEG_SIZE=32K"), m.transport
    monkeypatch.setenv("UCX_MM_SEG_SIZE", "16K")
    m = res.manager(Side(SMALL, rank=1), "decode")
    assert "kvrecv sets" not in m.transport, m.transport


@pytest.mark.timeout(90)
def test_hundreds_of_rooms_in_flight(transport, res, bootstrap):
    addr = bootstrap.address
    n_rooms, per_room = 300, 3
    src = Side(WIDE, 0, seed=31)
    dst = Side(WIDE, 0)
    prefill = res.manager(src, "prefill", addr)
    decode = res.manager(dst, "decode")
    rng = np.random.default_rng(99)
    perm = rng.permutation(WIDE.num_pages)
    plans = []
    for i in range(n_rooms):
        d = perm[per_room * i: per_room * (i + 1)].astype(np.int32)
        s = rng.choice(WIDE.num_pages, size=per_room, replace=False).astype(np.int64)
        plans.append(Plan(10_000 + i, s, d, [s[:2], s[2:]], int(rng.integers(WIDE.aux_rows)), i))

    rs = open_receivers(decode, addr, plans)
    send_metadata_all(rs, plans)
    ss = start_senders(prefill, addr, plans, send=False)
    # Every room is open and none can have completed: no page was sent yet.
    dstat, pstat = decode.stats(), prefill.stats()
    assert dstat["rooms_open"] == n_rooms and pstat["rooms_open"] == n_rooms
    assert dstat["rooms_by_state"]["Success"] == 0 and pstat["rooms_by_state"]["Success"] == 0
    assert all(r.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring) for r in rs)
    assert all(s.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) for s in ss)
    assert dstat["bytes_moved"] == 0

    for s, p in zip(ss, plans):
        s.send(p.chunks[0])
    for s, p in zip(ss, plans):
        s.send(p.chunks[1])
    assert_all_success(rs, timeout=60)
    assert_all_success(ss, timeout=60)

    expected = Side(WIDE, 0).snapshot()
    for p in plans:
        expected.apply(src, p.src, p.dst, p.src_aux, p.dst_aux)
    expected.check(dst)
    want = n_rooms * WIDE.transfer_bytes(per_room, True)
    for mgr in (decode, prefill):
        st = mgr.stats()
        assert st["rooms_succeeded"] == n_rooms, st
        assert st["bytes_moved"] == want, st
        assert zero_failures(st), st


# Page patterns and their number of runs (both sides consecutive).
PATTERNS = {
    "one_run": (list(range(20, 36)), list(range(100, 116)), 1),
    "scattered": ([5, 9, 2, 17], [40, 3, 77, 12], 4),
    "mixed": ([10, 11, 12, 13, 50, 70, 71, 3, 4, 5],
              [100, 101, 102, 103, 7, 200, 201, 30, 31, 40], 5),
    "src_consecutive_only": ([0, 1, 2, 3, 4, 5], [10, 12, 14, 16, 18, 20], 6),
    "dst_consecutive_only": ([9, 7, 5, 3], [50, 51, 52, 53], 4),
    "descending": ([30, 29, 28], [60, 59, 58], 3),
}

# Coalescing settings: off (one message per run and buffer), every run
# coalesced, runs under 3 pages of the widest item coalesced, and the
# transport's automatic choice.
COALESCE = {
    "off": dict(coalesce_bytes=0),
    "all": dict(coalesce_run_bytes=2**32 - 1),
    "under3": dict(coalesce_run_bytes=3 * max(STD.kv_item_lens)),
    "small_cap": dict(coalesce_run_bytes=2**32 - 1, coalesce_bytes=3 * max(STD.kv_item_lens)),
    "auto": dict(),
}


def coalesce_model(name, transport):
    cfg = COALESCE[name]
    cap = cfg.get("coalesce_bytes", 1 << 20)
    run_bytes = cfg.get("coalesce_run_bytes", 0) or auto_run_bytes(transport)
    return run_bytes, cap


def expect_messages(src, dst, name, transport, with_aux):
    run_bytes, cap = coalesce_model(name, transport)
    aux = STD.aux_item_lens if with_aux else ()
    return room_messages(src, dst, STD.kv_item_lens, aux, run_bytes, cap, transport=transport)


def coalesce_pair(res, bootstrap, name):
    src = Side(STD, rank=0, seed=1234)
    dst = Side(STD, rank=0)
    prefill = res.manager(src, "prefill", bootstrap.address, **COALESCE[name])
    decode = res.manager(dst, "decode")
    return src, dst, prefill, decode


def test_message_model_counts():
    """The Python model of the engine's rule, on hand-counted cases."""
    item = 4096
    src, dst, _ = PATTERNS["mixed"]  # runs of 4, 1, 2, 2, 1 pages
    assert count_messages(src, dst, item, 1 << 62) == 1
    assert count_messages(src, dst, item, 1 << 62, cap=3 * item) == 3  # 4 | 1+2 | 2+1
    assert count_messages(src, dst, item, 3 * item) == 2              # 4 alone | 1+2+2+1
    assert count_messages(src, dst, item, 2 * item) == 5              # 4 | 1 | 2 | 2 | 1
    assert count_messages(src, dst, item, 1 << 62, cap=0) == 5
    assert min_messages(src, dst, item, cap=3 * item) == 3
    assert count_messages(list(range(2000)), list(range(2000)), item, 1 << 62) == 1
    scattered = list(range(0, 4000, 2))
    assert count_messages(scattered, scattered, 8, 1 << 62) == 2      # 1024 pieces, then 976
    assert min_messages(scattered, scattered, 8) == 2
    # buffers sharing messages: [64, 96, 128, 256] x 2 pages within 400 bytes
    assert buffer_groups([64, 96, 128, 256], 2, 1, 400) == 3          # 64+96 | 128 | 256
    assert buffer_groups([64, 96, 128, 256], 2, 1, 0) == 4
    assert buffer_groups([64, 96, 128, 256], 2, 1, 1 << 20) == 1
    assert buffer_groups([8] * 10, 1, 300, 1 << 20) == 4              # 3 x 300 pieces <= 1024
    # a whole small room: 8 KV buffers and 2 aux in 2 messages
    assert room_messages([1, 2], [5, 6], STD.kv_item_lens, STD.aux_item_lens, 1 << 62) == 2
    assert room_messages([1, 2], [5, 6], STD.kv_item_lens, STD.aux_item_lens, 1 << 62, cap=0) == 10
    # runs cut at max_pages, ranges within it (small rooms over shared memory)
    assert [g[0] for g in position_groups(src, dst, item, 1 << 62, 2 * item, 2)] == [2, 2, 1, 2, 2, 1]
    # over shared memory that room is small: messages of at most 8 KiB, the
    # 2-page run in 3 (buffers of 64..1024 B | 2048 B | 4096 B), aux in 1
    assert shm_eager_room(STD.kv_item_lens, STD.aux_item_lens, 2)
    assert room_messages([1, 2], [5, 6], STD.kv_item_lens, STD.aux_item_lens, 1 << 62,
                         transport="shm") == 4
    assert not shm_eager_room([16 << 10], (), 1)  # an item over 8 KiB
    assert not shm_eager_room([4096], (), 129)    # over 512 KiB


@pytest.mark.parametrize("with_aux", [True, False], ids=["aux", "noaux"])
@pytest.mark.parametrize("mode", sorted(COALESCE))
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_runs_are_coalesced(transport, res, bootstrap, name, mode, with_aux):
    src, dst, runs = PATTERNS[name]
    assert count_runs(src, dst) == runs  # the pattern is what it claims
    side_src, side_dst, prefill, decode = coalesce_pair(res, bootstrap, mode)
    plan = Plan(77, np.array(src), np.array(dst, dtype=np.int32), [np.array(src)],
                3 if with_aux else None, 9 if with_aux else None)
    run_in_process(prefill, decode, bootstrap.address, [plan])
    want = expect_messages(src, dst, mode, transport, with_aux)
    assert prefill.stats()["rma_ops_posted"] == want
    expected = Side(STD, 0).snapshot()
    expected.apply(side_src, plan.src, plan.dst, plan.src_aux, plan.dst_aux)
    expected.check(side_dst)


def test_small_rooms_over_shared_memory_go_as_eager_messages(transport, res, bootstrap):
    """Over shared memory a room of at most 512 KiB (items of at most 8 KiB)
    goes as eager messages of at most 8 KiB, each one fragment of UCX's
    segment: none waits for a rendezvous round trip.  A room one page
    bigger goes as before: its pages coalesced into one big message, by
    rendezvous.  Over tcp the rule does not apply."""
    rng = np.random.default_rng(5)
    dst = rng.permutation(STD.num_pages).astype(np.int32)
    src = rng.permutation(STD.num_pages)
    # either side of the line
    assert STD.transfer_bytes(63, True) <= 512 << 10 < STD.transfer_bytes(64, True)
    side_src, side_dst, prefill, decode = coalesce_pair(res, bootstrap, "auto")
    expected = side_dst.snapshot()
    at = 0
    for room, npages in ((1, 63), (2, 64)):
        plan = Plan(room, src[at:at + npages], dst[at:at + npages], [src[at:at + npages]], 3, 9)
        at += npages
        ops0 = prefill.stats()["rma_ops_posted"]
        rndv0 = decode.stats()["data_rendezvous"]
        run_in_process(prefill, decode, bootstrap.address, [plan])
        expected.apply(side_src, plan.src, plan.dst, plan.src_aux, plan.dst_aux)
        ops = prefill.stats()["rma_ops_posted"] - ops0
        rndv = decode.stats()["data_rendezvous"] - rndv0
        assert ops == room_messages(plan.src, plan.dst, STD.kv_item_lens, STD.aux_item_lens,
                                    auto_run_bytes(transport), transport=transport)
        if transport == "shm" and npages == 63:
            # 31 ranges of 2 pages in 3 messages (buffers of 64..1024 B,
            # 2048 B, 4096 B), one of 1 page in 2, the aux row in 1.
            assert ops == 96 and rndv == 0, (ops, rndv)
        elif transport == "shm":
            assert ops == 2 and rndv == 1, (ops, rndv)  # every page in one message
    expected.check(side_dst)
    assert zero_failures(prefill.stats()) and zero_failures(decode.stats())


@pytest.mark.parametrize("fragment", ["lane", "default", TCP_NO_EAGER_FRAGMENT])
def test_tcp_messages_fit_one_fragment(transport, res, bootstrap, fragment, monkeypatch):
    """Over tcp through UCX (tcp_lane off) every message of KV pages fits one
    of UCX's fragments, sent eagerly: a 1.2 MiB run of 4 KiB pages goes as 5
    messages of at most 63 pages, none by rendezvous.  With fragments too
    small for a page (UCX_TCP_TX_SEG_SIZE=TCP_NO_EAGER_FRAGMENT; no lane
    then either) the run goes whole, by rendezvous; over kvrecv's tcp lane
    (the default) whole, as a frame; over shared memory whole, whatever the
    tcp fragment."""
    if fragment == TCP_NO_EAGER_FRAGMENT:
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", fragment)
    layout = Layout((4096,) * 4, 400)
    side_src, side_dst = Side(layout, rank=0, seed=9), Side(layout, rank=0)
    prefill = res.manager(side_src, "prefill", bootstrap.address)
    decode = res.manager(side_dst, "decode", tcp_lane=fragment == "lane")
    expected = side_dst.snapshot()
    plan = Plan(1, np.arange(50, 350), np.arange(0, 300, dtype=np.int32), [np.arange(50, 350)],
                None, None)
    run_in_process(prefill, decode, bootstrap.address, [plan])
    expected.apply(side_src, plan.src, plan.dst, plan.src_aux, plan.dst_aux)
    expected.check(side_dst)
    ops, rndv = prefill.stats()["rma_ops_posted"], decode.stats()["data_rendezvous"]
    lane = transport == "tcp" and fragment == "lane"
    eager = transport == "tcp" and fragment == "default"
    assert TCP_EAGER_BYTES // 4096 == 63
    # (Over shared memory the decode reads each run whole: no rendezvous.)
    whole = (4, 4 if transport == "tcp" and not lane else 0)
    assert (ops, rndv) == ((4 * 5, 0) if eager else whole), (ops, rndv)
    assert decode.stats()["lane_messages"] == (4 if lane else 0)
    model = ("tcp-ucx" if eager else "tcp") if transport == "tcp" else transport
    assert ops == room_messages(plan.src, plan.dst, layout.kv_item_lens, (),
                                auto_run_bytes(model, 4096),
                                transport=model if fragment != TCP_NO_EAGER_FRAGMENT else "")


def test_eager_pieces_of_odd_lengths_at_odd_addresses(transport, res, bootstrap):
    """The decode copies the pieces of 1 KiB or more of an eager message of
    at most 8 KiB (every message of a small room over shared memory, the
    short ones over tcp) with streaming stores, 64 bytes at a time once the
    destination is 16-byte aligned, and larger messages with memcpy: pieces
    whose lengths are no multiple of 64, into buffers at odd addresses,
    land byte-exact either way and leave every other byte alone."""
    layout = Layout((1027, 4099, 1000, 2053), 64, (1031,), 8)
    side_src = Side(layout, rank=0, seed=21)
    side_dst = Side(layout, rank=0)
    for group in (side_dst.kv, side_dst.aux):
        for i, b in enumerate(group):
            shifted = np.full(b.size + 5, 0xA5, dtype=np.uint8)[5:]  # base + 5
            shifted[:] = b
            group[i] = shifted
    assert all(b.ctypes.data % 16 == 5 % 16 for b in side_dst.kv)
    prefill = res.manager(side_src, "prefill", bootstrap.address)
    decode = res.manager(side_dst, "decode")
    expected = side_dst.snapshot()
    rng = np.random.default_rng(8)
    plans = []
    for room, (lo, n) in enumerate(((0, 7), (7, 20), (27, 30)), start=1):
        src = rng.permutation(layout.num_pages)[:n]
        dst = np.arange(lo, lo + n, dtype=np.int32)[rng.permutation(n)]
        plans.append(Plan(room, src, dst, [src], room % layout.aux_rows, room))
    run_in_process(prefill, decode, bootstrap.address, plans)
    for p in plans:
        expected.apply(side_src, p.src, p.dst, p.src_aux, p.dst_aux)
    expected.check(side_dst)
    assert decode.stats()["data_rendezvous"] == 0  # every piece came eagerly


@pytest.mark.parametrize("pack_bytes,zcopy", [(0, "auto"), (3000, "auto"), (1 << 28, "auto"),
                                              (1 << 28, None)],
                         ids=["never", "some", "default", "default-zcopy-off"])
def test_packed_and_scattered_messages_are_byte_exact(transport, res, bootstrap, pack_bytes, zcopy,
                                                      monkeypatch):
    """Over tcp with UCX's zero-copy sends on (UCX_ZCOPY_THRESH set), a
    scattered message is packed into a contiguous copy while fewer than
    pack_bytes of copies are in flight, and sent scattered otherwise; with
    kvrecv's setting (zero-copy off) and over shared memory never.  Every
    mix lands the same bytes.  (tcp fragments of TCP_NO_EAGER_FRAGMENT here,
    too small for kvrecv's eager messages: a message that fits one fragment
    goes eagerly, unpacked, and with the default fragment every message of
    these rooms would.)"""
    if zcopy is not None:
        monkeypatch.setenv("UCX_ZCOPY_THRESH", zcopy)
    if transport == "tcp":
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", TCP_NO_EAGER_FRAGMENT)
    rng = np.random.default_rng(11)
    plans = make_plans(rng, STD)
    src = Side(STD, rank=0, seed=77)
    dst = Side(STD, rank=0)
    prefill = res.manager(src, "prefill", bootstrap.address, pack_bytes=pack_bytes,
                          coalesce_run_bytes=2**32 - 1)
    decode = res.manager(dst, "decode")
    expected = dst.snapshot()
    run_in_process(prefill, decode, bootstrap.address, plans)
    for p in plans:
        expected.apply(src, p.src, p.dst, p.src_aux, p.dst_aux)
    expected.check(dst)
    st = prefill.stats()
    assert zero_failures(st) and zero_failures(decode.stats())
    assert st["bytes_moved"] == sum(STD.transfer_bytes(len(p.src), p.with_aux) for p in plans)
    # Scattered messages: the three scattered rooms' runs share messages.
    if transport == "shm" or pack_bytes == 0 or zcopy is None:
        assert st["data_packed"] == 0, st
    elif pack_bytes == 3000:
        assert 0 < st["data_packed"] < st["rma_ops_posted"], st
    else:
        assert 0 < st["data_packed"] <= st["rma_ops_posted"], st
    if st["data_packed"] == 0:
        assert st["pack_cached_bytes"] == 0, st
    else:
        # The packing buffers are kept for the next messages (never more than
        # pack_bytes), then freed after a second without packed messages (a
        # slow, instrumented run may already have freed them here).
        assert st["pack_cached_bytes"] <= pack_bytes, st
        deadline = time.monotonic() + 5
        while prefill.stats()["pack_cached_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.stats()["pack_cached_bytes"] == 0


@pytest.mark.parametrize("poll_progress", [True, False], ids=["on", "off"])
def test_poll_progresses_rooms_waiting_for_data(transport, res, bootstrap, poll_progress):
    """A decode room waiting for data is progressed by poll() on the
    caller's thread (KVConfig.poll_progress, default on): a scheduler
    spinning on poll() takes its rooms' bytes itself, and the completion
    notices it leaves to the engine thread still reach the prefill (its
    senders succeed).  Off, poll() only reads the state."""
    src = Side(STD, rank=0, seed=79)
    dst = Side(STD, rank=0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode", poll_progress=poll_progress)
    expected = dst.snapshot()
    rng = np.random.default_rng(12)
    # The engine thread races poll() for every event: rounds until poll()
    # won some (each round is a few milliseconds; on a loaded 2-core machine
    # the engine thread wins the first 5 rounds now and then).
    for round_no in range(60):
        plans = make_plans(rng, STD, room0=100 + 10 * round_no)
        rs = open_receivers(decode, bootstrap.address, plans)
        send_metadata_all(rs, plans)
        ss = start_senders(prefill, bootstrap.address, plans)
        deadline = time.monotonic() + 30
        while any(r.poll() not in terminal() for r in rs) and time.monotonic() < deadline:
            pass  # a scheduler spinning on poll()
        assert_all_success(rs)
        assert_all_success(ss)  # ROOM_DONE reached the prefill
        for p in plans:
            expected.apply(src, p.src, p.dst, p.src_aux, p.dst_aux)
        expected.check(dst)
        for r in rs + ss:
            r.clear()
        if not poll_progress or decode.stats()["poll_progressed"] > 0:
            break
    st = decode.stats()
    assert zero_failures(st) and zero_failures(prefill.stats())
    if poll_progress:
        assert st["poll_progressed"] > 0, st
    else:
        assert st["poll_progressed"] == 0, st
    assert prefill.stats()["poll_progressed"] == 0  # only the decode's poll() progresses


def test_chunks_split_at_run_boundaries_keep_the_run_count(res, bootstrap):
    """With coalescing off, chunks that end where runs end cost no extra
    message."""
    src, dst, runs = PATTERNS["mixed"]
    # Chunks that end where runs end: [10..13] [50] [70, 71, 3, 4] [5]
    chunks = [src[0:4], src[4:5], src[5:9], src[9:]]
    plan = Plan(78, np.array(src), np.array(dst, dtype=np.int32), [np.array(c) for c in chunks],
                1, 2)
    side_src, side_dst, prefill, decode = coalesce_pair(res, bootstrap, "off")
    run_in_process(prefill, decode, bootstrap.address, [plan])
    assert prefill.stats()["rma_ops_posted"] == runs * len(STD.kv_item_lens) + 2
    expected = Side(STD, 0).snapshot()
    expected.apply(side_src, plan.src, plan.dst, plan.src_aux, plan.dst_aux)
    expected.check(side_dst)


def test_room_id_reused_after_clear(pair):
    expected = pair.dst.snapshot()
    first = Plan(5, np.array([1, 2, 3]), np.array([10, 11, 12], dtype=np.int32),
                 [np.array([1, 2]), np.array([3])], 4, 6)
    rs, ss = run_in_process(pair.prefill, pair.decode, pair.addr, [first])
    expected.apply(pair.src, first.src, first.dst, first.src_aux, first.dst_aux)
    expected.check(pair.dst)
    for room in rs + ss:
        room.clear()
    assert pair.decode.stats()["rooms_open"] == 0
    assert pair.prefill.stats()["rooms_open"] == 0

    # Same id, other pages and rows: only the new pages change.
    second = Plan(5, np.array([150, 40]), np.array([90, 17], dtype=np.int32),
                  [np.array([150, 40])], 33, 7)
    run_in_process(pair.prefill, pair.decode, pair.addr, [second])
    expected.apply(pair.src, second.src, second.dst, second.src_aux, second.dst_aux)
    expected.check(pair.dst)
    for mgr in (pair.decode, pair.prefill):
        st = mgr.stats()
        assert st["rooms_succeeded"] == 2, st
        assert st["bytes_moved"] == STD.transfer_bytes(3, True) + STD.transfer_bytes(2, True), st


def test_room_id_reused_after_a_failed_room(pair):
    r = KVReceiver(pair.decode, pair.addr, 6)
    s = KVSender(pair.prefill, pair.addr, 6)
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.send_metadata([1, 2], aux_index=None)
    assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.abort()
    assert wait_for(r, terminal()) == KVPoll.Failed
    assert wait_for(s, terminal()) == KVPoll.Failed
    r.clear()
    s.clear()

    plan = Plan(6, np.array([60, 61]), np.array([1, 2], dtype=np.int32), [np.array([60, 61])],
                0, 0)
    run_in_process(pair.prefill, pair.decode, pair.addr, [plan])
    expected = Side(STD, 0).snapshot()
    expected.apply(pair.src, plan.src, plan.dst, 0, 0)
    expected.check(pair.dst)


def test_request_arriving_before_the_sender_is_held_and_served(pair):
    plan = Plan(12, np.array([7, 8, 9, 100]), np.array([3, 4, 5, 50], dtype=np.int32),
                [np.array([7, 8]), np.array([9, 100])], 2, 8)
    (r,) = open_receivers(pair.decode, pair.addr, [plan])
    send_metadata_all([r], [plan])
    assert wait_until(lambda: pair.prefill.stats()["pending_requests"] == 1), \
        pair.prefill.stats()
    (s,) = start_senders(pair.prefill, pair.addr, [plan])
    assert_all_success([r, s])
    assert pair.prefill.stats()["pending_requests"] == 0
    expected = Side(STD, 0).snapshot()
    expected.apply(pair.src, plan.src, plan.dst, plan.src_aux, plan.dst_aux)
    expected.check(pair.dst)


def test_transfer_without_registered_memory(res, bootstrap):
    src, dst = Side(STD, 0, seed=3), Side(STD, 0)
    prefill = res.manager(src, "prefill", bootstrap.address, register_memory=False)
    decode = res.manager(dst, "decode", register_memory=False)
    plans = make_plans(np.random.default_rng(5), STD)
    run_in_process(prefill, decode, bootstrap.address, plans)
    expected = Side(STD, 0).snapshot()
    for p in plans:
        expected.apply(src, p.src, p.dst, p.src_aux, p.dst_aux)
    expected.check(dst)


def test_aux_only_room(pair):
    empty = np.array([], dtype=np.int64)
    plan = Plan(21, empty, empty.astype(np.int32), [empty], 11, 12)
    run_in_process(pair.prefill, pair.decode, pair.addr, [plan])
    expected = Side(STD, 0).snapshot()
    expected.apply(pair.src, plan.src, plan.dst, 11, 12)
    expected.check(pair.dst)
    assert pair.decode.stats()["bytes_moved"] == STD.aux_bytes


def test_aux_only_room_completes_after_init_without_send(pair):
    r = KVReceiver(pair.decode, pair.addr, 22)
    s = KVSender(pair.prefill, pair.addr, 22)
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.send_metadata([], aux_index=12)
    assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput  # request bound
    s.init(0, aux_index=11)  # nothing left to hand over: no send() needed
    assert wait_for(r, terminal(), timeout=3) == KVPoll.Success


def test_decode_prefix_len_travels_with_the_request(pair):
    """The decode's radix-cache prefix (tokens it already holds) reaches the
    prefill with the request, whether the sender existed before the request
    (bound at once) or was created after it (the request waited)."""
    # room 31: the sender first; room 32: the decode's request first
    send31 = KVSender(pair.prefill, pair.addr, 31)
    assert send31.decode_prefix_len == 0
    recvs = {}
    for room, prefix, dst in ((31, 4096, [0, 1]), (32, 7, [2, 3, 4])):
        r = KVReceiver(pair.decode, pair.addr, room)
        r.init()
        assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        r.send_metadata(np.array(dst, dtype=np.int32), aux_index=None, decode_prefix_len=prefix)
        assert r.decode_prefix_len == prefix
        recvs[room] = (r, dst)
    assert wait_for(send31, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert send31.decode_prefix_len == 4096
    assert wait_until(lambda: pair.prefill.stats()["pending_requests"] == 1)
    send32 = KVSender(pair.prefill, pair.addr, 32)
    assert wait_for(send32, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert send32.decode_prefix_len == 7
    want = pair.dst.snapshot()
    for s, (r, dst), src in ((send31, recvs[31], [5, 6]), (send32, recvs[32], [7, 8, 9])):
        s.init(len(src))
        s.send(np.array(src, dtype=np.int32))
        assert wait_for(r, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        want.apply(pair.src, src, dst)
    want.check(pair.dst)
    for s in (send31, send32):
        s.clear()
    for r, _ in recvs.values():
        r.clear()
