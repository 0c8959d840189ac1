"""Metrics: KVManager.stats(), its histograms kept by the C core, the
Prometheus text exposition and the prometheus_client collector."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest

from kvtest import STD, auto_run_bytes, count_runs, room_messages, wait_for, wait_until

from kvrecv import KVPoll, KVReceiver, KVSender
from kvrecv.metrics import histogram_buckets, prometheus_text

NKV, NAUX = len(STD.kv_item_lens), len(STD.aux_item_lens)

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\} '
                  r'(-?[0-9.e+-]+|\+Inf)$')
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def parse_prometheus(text):
    """A strict reader of the text format: every sample after its family's
    TYPE line, no duplicates.  Returns ({(name, labels): value}, {family: type})."""
    samples, types = {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert typ in ("counter", "gauge", "histogram")
            assert name not in types, f"{name} has two TYPE lines"
            types[name] = typ
            continue
        m = LINE.match(line)
        assert m, f"malformed line: {line!r}"
        name, labels, value = m.groups()
        family = name
        for suffix in HIST_SUFFIXES:
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                family = name[: -len(suffix)]
        assert family in types, f"{name} has no TYPE line before it"
        lab = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels)))
        key = (name, lab)
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(value) if any(c in value for c in ".eI") else int(value)
    return samples, types


def transfer(pair, room, src_pages, dst_pages, aux=None, hold_s=0.0):
    """One room from request to Success; the prefill calls send() hold_s
    after the decode's request went out."""
    recv = KVReceiver(pair.decode, pair.addr, room)
    send = KVSender(pair.prefill, pair.addr, room)
    send.init(len(src_pages), None if aux is None else aux[0])
    recv.init()
    assert wait_for(recv, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    recv.send_metadata(np.asarray(dst_pages, dtype=np.int32), aux_index=None if aux is None else aux[1])
    assert wait_for(send, KVPoll.WaitingForInput) == KVPoll.WaitingForInput  # request bound
    if hold_s:
        time.sleep(hold_s)
    send.send(np.asarray(src_pages, dtype=np.int32))
    assert wait_for(recv, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert wait_for(send, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    recv.clear()
    send.clear()


def bucket_of(hist, value):
    """Index of the bucket (le semantics) that value belongs to."""
    for i, b in enumerate(hist["bounds"]):
        if value <= b:
            return i
    return len(hist["bounds"])


def test_histograms_in_stats(pair):
    lat0 = pair.decode.stats()["transfer_latency"]
    assert lat0["count"] == 0 and lat0["sum"] == 0.0 and sum(lat0["counts"]) == 0
    # fixed log-spaced bounds, 10 us .. 100 s, one +Inf bucket after them
    b = lat0["bounds"]
    assert b[0] == pytest.approx(1e-5) and b[-1] == pytest.approx(100.0)
    assert len(lat0["counts"]) == len(b) + 1
    assert all(2.0 <= hi / lo <= 2.5 + 1e-9 for lo, hi in zip(b, b[1:]))

    # room A: one run (contiguous on both sides), with aux
    transfer(pair, 1, [10, 11, 12, 13], [20, 21, 22, 23], aux=(0, 1))
    # room B: 3 runs, no aux; the prefill holds its send() 300 ms
    src_b, dst_b = [5, 6, 40, 7], [30, 31, 32, 33]
    assert count_runs(src_b, dst_b) == 3
    # data messages (tcp, auto: runs and buffers share messages up to one fragment)
    tcp = auto_run_bytes("tcp")
    ops_a = room_messages([10, 11, 12, 13], [20, 21, 22, 23], STD.kv_item_lens,
                          STD.aux_item_lens, tcp, transport="tcp")
    ops_b = room_messages(src_b, dst_b, STD.kv_item_lens, (), tcp, transport="tcp")
    assert ops_a == 2 and ops_b == 1  # all 8 buffers' pages in one message (+ aux)
    hold = 0.3
    transfer(pair, 2, src_b, dst_b, hold_s=hold)
    # room C: aborted before anything moved: not observed
    bad = KVReceiver(pair.decode, pair.addr, 3)
    bad.init()
    bad.abort()
    assert wait_for(bad, KVPoll.Failed) == KVPoll.Failed
    bad.clear()

    dec, pre = pair.decode.stats(), pair.prefill.stats()
    for st in (dec, pre):
        ops = st["room_ops"]
        assert ops["count"] == 2 == st["rooms_succeeded"]
        assert ops["sum"] == ops_a + ops_b
        want = [0] * len(ops["counts"])
        want[bucket_of(ops, ops_a)] += 1
        want[bucket_of(ops, ops_b)] += 1
        assert ops["counts"] == want
        assert st["transfer_latency"]["count"] == 2
        assert sum(st["transfer_latency"]["counts"]) == 2
    assert pre["room_ops"]["sum"] == pre["rma_ops_posted"]

    # The decode's clock runs from its request: room B's held send() is in it.
    dlat = dec["transfer_latency"]
    assert dlat["sum"] >= hold
    assert sum(dlat["counts"][bucket_of(dlat, hold):]) >= 1
    assert dlat["sum"] < 60
    # The prefill's clock starts at the last send(): the hold is not in it.
    # Measured against the decode's clocks of the same two rooms (which hold
    # it), not against a wall bound a loaded machine could overrun.
    plat = pre["transfer_latency"]
    assert 0 < plat["sum"] < dlat["sum"] - hold / 2, (plat, dlat)


def test_prometheus_text_matches_stats(pair):
    # one successful room and one aborted one, so counters are not all zero
    transfer(pair, 5, [9, 8, 7, 6], [0, 1, 2, 3], aux=(1, 2))
    bad = KVReceiver(pair.decode, pair.addr, 6)
    bad.init()
    bad.abort()
    assert wait_for(bad, KVPoll.Failed) == KVPoll.Failed

    mgrs = [pair.prefill, pair.decode]
    stats = {m.mode: m.stats() for m in mgrs}
    samples, types = parse_prometheus(prometheus_text(mgrs))
    assert types["kvrecv_bytes_total"] == "counter" and types["kvrecv_rooms"] == "gauge"
    assert types["kvrecv_transfer_latency_seconds"] == "histogram"
    assert types["kvrecv_rma_ops_per_room"] == "histogram"
    for mode, st in stats.items():
        base = (("mode", mode), ("rank", "0"))

        def get(name, *extra):
            return samples[(name, tuple(sorted(base + extra)))]

        assert get("kvrecv_bytes_total") == st["bytes_moved"]
        assert get("kvrecv_rma_ops_total") == st["rma_ops_posted"]
        assert get("kvrecv_heartbeats_missed_total") == st["heartbeats_missed"]
        assert get("kvrecv_ctrl_dropped_total") == st["ctrl_dropped"]
        assert get("kvrecv_data_rendezvous_total") == st["data_rendezvous"]
        # One connected peer each: one worker for it.
        assert get("kvrecv_ucx_workers") == st["ucx_workers"] == 1
        assert get("kvrecv_ucx_workers_created_total") == st["ucx_workers_created"] == 1
        assert get("kvrecv_rooms_succeeded_total") == st["rooms_succeeded"] == 1
        for state, n in st["rooms_by_state"].items():
            assert get("kvrecv_rooms", ("state", state)) == n
        for code, n in st["failures_by_code"].items():
            assert get("kvrecv_failures_total", ("code", code)) == n
        for fam, key in (("kvrecv_transfer_latency_seconds", "transfer_latency"),
                         ("kvrecv_rma_ops_per_room", "room_ops")):
            h = st[key]
            assert h["count"] == 1
            cum = [get(fam + "_bucket", ("le", le)) for le, _ in histogram_buckets(h)]
            assert cum == list(np.cumsum(h["counts"]))  # cumulative, ending in +Inf
            assert get(fam + "_bucket", ("le", "+Inf")) == get(fam + "_count") == h["count"]
            assert get(fam + "_sum") == pytest.approx(h["sum"])
            les = sorted(float(dict(lab)["le"]) for name, lab in samples
                         if name == fam + "_bucket" and dict(lab)["mode"] == mode)
            assert les == sorted(list(h["bounds"]) + [math.inf])
    assert stats["decode"]["bytes_moved"] == STD.transfer_bytes(4, True)
    assert samples[("kvrecv_bytes_total", (("mode", "decode"), ("rank", "0")))] == STD.transfer_bytes(4, True)
    assert samples[("kvrecv_failures_total", (("code", "ABORTED"), ("mode", "decode"), ("rank", "0")))] >= 1
    # [9, 8, 7, 6] -> [0, 1, 2, 3] is 4 runs of one page, coalesced (tcp, auto)
    ops = room_messages([9, 8, 7, 6], [0, 1, 2, 3], STD.kv_item_lens, STD.aux_item_lens,
                        auto_run_bytes("tcp"), transport="tcp")
    assert ops == 2  # the 8 buffers' 4 pages in one message, and the aux row
    assert samples[("kvrecv_rma_ops_per_room_sum", (("mode", "prefill"), ("rank", "0")))] == ops
    # a closed manager is left out
    pair.prefill.close()
    samples, _ = parse_prometheus(prometheus_text(mgrs))
    assert all(dict(lab)["mode"] == "decode" for _, lab in samples)


def _families(text):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                    for s in fam.samples})
    return out


def test_prometheus_client_collector(pair):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from kvrecv.metrics import KVRecvCollector

    assert KVRecvCollector is not None
    transfer(pair, 8, [1, 2, 3], [4, 5, 6], aux=(0, 0))
    bad = KVReceiver(pair.decode, pair.addr, 9)
    bad.init()
    bad.abort()
    assert wait_for(bad, KVPoll.Failed) == KVPoll.Failed
    bad.clear()

    mgrs = [pair.prefill]
    registry = CollectorRegistry()
    KVRecvCollector(mgrs).register(registry)
    mgrs.append(pair.decode)  # the list is read at every scrape
    scraped = generate_latest(registry).decode()
    stats = {m.mode: m.stats() for m in mgrs}
    ours = prometheus_text(mgrs)
    fams = _families(scraped)

    # prometheus_client's parser reads our own exposition to the same families
    assert _families(ours) == fams

    def value(fam, name, mode, **extra):
        labels = dict(mode=mode, rank="0", **extra)
        return fams[fam][1][(name, tuple(sorted(labels.items())))]

    for mode, st in stats.items():
        assert fams["kvrecv_bytes"][0] == "counter"
        assert value("kvrecv_bytes", "kvrecv_bytes_total", mode) == st["bytes_moved"]
        assert value("kvrecv_rma_ops", "kvrecv_rma_ops_total", mode) == st["rma_ops_posted"]
        assert value("kvrecv_heartbeats_missed", "kvrecv_heartbeats_missed_total", mode) == \
            st["heartbeats_missed"]
        assert value("kvrecv_ctrl_dropped", "kvrecv_ctrl_dropped_total", mode) == st["ctrl_dropped"]
        for state, n in st["rooms_by_state"].items():
            assert value("kvrecv_rooms", "kvrecv_rooms", mode, state=state) == n
        for code, n in st["failures_by_code"].items():
            assert value("kvrecv_failures", "kvrecv_failures_total", mode, code=code) == n
        for fam, key in (("kvrecv_transfer_latency_seconds", "transfer_latency"),
                         ("kvrecv_rma_ops_per_room", "room_ops")):
            h = st[key]
            assert fams[fam][0] == "histogram"
            assert h["count"] == 1
            for le, cum in histogram_buckets(h):
                assert value(fam, fam + "_bucket", mode, le=le) == cum
            assert value(fam, fam + "_count", mode) == 1
            assert value(fam, fam + "_sum", mode) == pytest.approx(h["sum"])
    assert value("kvrecv_failures", "kvrecv_failures_total", "decode", code="ABORTED") >= 1
    ops = room_messages([1, 2, 3], [4, 5, 6], STD.kv_item_lens, STD.aux_item_lens,
                        auto_run_bytes("tcp"), transport="tcp")
    assert ops == 2  # one run of 3 pages: the 8 buffers in one message | aux (tcp, auto)
    assert value("kvrecv_rma_ops_per_room", "kvrecv_rma_ops_per_room_sum", "prefill") == ops


def test_a_decode_that_leaves_takes_its_worker_with_it(pair):
    """Each connection has its own UCX worker (one per side here); when the
    decode closes its manager the prefill destroys the worker it had for
    it at once."""
    transfer(pair, 5, [1, 2], [3, 4])
    for mgr in (pair.prefill, pair.decode):
        assert mgr.stats()["ucx_workers"] == mgr.stats()["ucx_workers_created"] == 1
    pair.decode.close()
    assert wait_until(lambda: pair.prefill.stats()["ucx_workers"] == 0, 5), pair.prefill.stats()
    assert pair.prefill.stats()["ucx_workers_created"] == 1
