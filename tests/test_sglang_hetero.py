"""Heterogeneous deployments through sglang's own scheduler code: prefill
and decode of different attention-TP sizes, with sglang's MHATokenToKVPool
(each rank holding its share of the model's KV heads) and with its
MLATokenToKVPool (one latent cache every rank holds whole).

tests/sglang_sched.py runs sglang's DecodePreallocQueue, DecodeTransferQueue,
PrefillBootstrapQueue, send_kv_chunk and process_disagg_prefill_inflight_queue,
unpatched, in separate processes; the forward stand-in writes the whole
model's pattern of a request cut to each prefill rank's heads, and each
decode rank compares its own heads' cut byte for byte."""

from __future__ import annotations

import dataclasses

import pytest

# test_sglang_real's marks: skipped without sglang, a failure with
# KVRECV_REQUIRE_SGLANG=1 (set by CI)
from test_sglang_real import _check_causes, _check_clean, _ok, _run_ok, pytestmark  # noqa: F401
from sglang_sched import HEAD_DIM, LAYERS, MLA_LORA, MLA_ROPE, Driver, Layout, ReqSpec

# Ordered so that the kill test, which follows the byte-exact test, finds
# its layout (the last) up.
LAYOUTS = {
    # 2 KV heads over 4 prefill ranks: each head on 2 of them
    "gqa2-tp4-to-2": Layout(prefill_tp=4, decode_tp=2, kv_heads=2),
    "mla-tp2-to-4": Layout(prefill_tp=2, decode_tp=4, mla=True),
    "mla-tp2-to-1": Layout(prefill_tp=2, decode_tp=1, mla=True),
    "mla-tp1-to-2": Layout(prefill_tp=1, decode_tp=2, mla=True),
    "tp1-to-2": Layout(prefill_tp=1, decode_tp=2),
    "tp2-to-1": Layout(prefill_tp=2, decode_tp=1),
}
# A prefill of 2 DP attention groups behind one bootstrap server.
DP_LAYOUTS = {
    "dp2-tp1-to-1": Layout(prefill_tp=1, decode_tp=1, prefill_dp=2),
    "dp2-tp1-to-2": Layout(prefill_tp=1, decode_tp=2, prefill_dp=2),
    "dp2-tp1-to-2-round-robin": Layout(prefill_tp=1, decode_tp=2, prefill_dp=2,
                                       prefill_balance="round_robin"),
}
# A decode of 2 DP attention groups (each one attention-TP rank), reading a
# prefill of TP 2 or of 2 DP groups.
DECODE_DP_LAYOUTS = {
    "tp2-to-dp2-tp1": Layout(prefill_tp=2, decode_tp=1, decode_dp=2),
    "dp2-tp1-to-dp2-tp1": Layout(prefill_tp=1, decode_tp=1, prefill_dp=2, decode_dp=2),
}
# A prefill of 2 PP stages (sglang's pp_size 2), each holding one of the 2 layers.
PP_LAYOUTS = {
    "pp2-tp1-to-2": Layout(prefill_tp=1, decode_tp=2, prefill_pp=2),
    "pp2-tp1-to-1": Layout(prefill_tp=1, decode_tp=1, prefill_pp=2),
}


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    """One driver (one sglang import) for every layout; use(name) restarts
    the bootstrap server and both instances when the layout changes."""
    d = Driver(str(tmp_path_factory.mktemp("sglang_hetero")), tp=1)
    current = []

    def use(name: str) -> Driver:
        if current != [name]:
            lay = {**LAYOUTS, **DP_LAYOUTS, **PP_LAYOUTS, **DECODE_DP_LAYOUTS}[name]
            d.call("layout", layout=dataclasses.asdict(lay))
            current[:] = [name]
        return d

    try:
        yield use
    finally:
        d.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sglang_hetero_byte_exact(hetero, name):
    """Requests of 20 tokens, 130 in chunks of 13, and 1 through sglang's
    queues: each decode rank's pool holds, byte for byte, its heads (MHA) or
    the latent cache (MLA) of every token, gathered from the prefill ranks
    holding them; the first token arrives through sglang's MetadataBuffers;
    nothing failed on either side (an MLA prefill rank no decode rank reads
    from ends its request too)."""
    d = hetero(name)
    lay = LAYOUTS[name]
    base = 2000 + 10 * list(LAYOUTS).index(name)
    specs = [ReqSpec("x1", base + 1, 20), ReqSpec("x2", base + 2, 130, chunk=13),
             ReqSpec("x3", base + 3, 1)]
    out = _run_ok(d, specs)
    assert (len(out["prefill"]), len(out["decode"])) == (lay.prefill_tp, lay.decode_tp)
    _check_bytes_moved(lay, specs, out)


def _check_bytes_moved(lay, specs, out):
    """Each decode rank received its pages' bytes and the metadata rows
    exactly once (one writer a page, never a replica twice), and the
    prefill ranks sent exactly that; with MLA fan-out every prefill rank
    took a share."""
    if lay.mla:
        token = (MLA_LORA + MLA_ROPE) * 2
    else:
        token = 2 * max(1, lay.kv_heads // lay.decode_tp) * HEAD_DIM * 2  # K and V
    tokens = sum(s.input_len for s in specs)
    got = [r["bytes_moved"] for r in out["decode"]]
    assert got == [tokens * LAYERS * token + len(specs) * r["aux_row_bytes"]
                   for r in out["decode"]], got
    sent = [r["bytes_moved"] for r in out["prefill"]]
    assert sum(sent) == sum(got), (sent, got)
    if lay.mla and lay.decode_tp >= lay.prefill_tp:
        assert min(sent) > 0, sent


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, dead, origin", [("tp2-to-1", 1, 0), ("gqa2-tp4-to-2", 3, 1)])
def test_sglang_hetero_killed_prefill_rank_fails_the_request(hetero, name, dead, origin):
    """Prefill TP 2 -> decode TP 1, prefill rank 1 SIGKILLed after its first
    chunk (the decode rank reads heads 2-3 from it); prefill TP 4 -> decode
    TP 2 with 2 KV heads, prefill rank 3 killed (decode rank 1 reads head 1
    from it, decode rank 0 reads head 0 from prefill rank 0).  sglang's
    pop_transferred gets KVPeerLostError naming the dead rank on every
    decode rank (its own cause on the rank reading from it, the sibling's
    on the other) and aborts the request with it; the pages are held until
    the room drained, then released.  The other prefill ranks fail in
    sglang's gloo all-reduce with their dead peer, as a real instance
    would.  A restarted prefill serves the next request."""
    d = hetero(name)
    room = 2101 + 10 * dead
    out = d.run([ReqSpec("k1", room, 64, chunk=8, prefill_die_rank=dead)])
    assert out["prefill"][dead] == {"died": -9}
    # the others lost their peer in sglang's MIN all-reduce: that instance is gone
    for rank, r in enumerate(out["prefill"]):
        if rank != dead:
            assert "raised" in r, (rank, {k: r[k] for k in r if k not in ("pages", "calls")})
            [raised] = r["raised"]
            assert "all_reduce" in raised and "gloo" in raised, (rank, raised)
    out["prefill"] = []
    _check_clean(d, out)

    def lost(o, text):
        return o == origin and " lost: " in text and \
            text.startswith(f"room {room}: prefill rank {dead} at 127.0.0.1:")
    got = _check_causes(out, "decode", "k1", room, "KVPeerLostError", lost)
    assert [o for o, _ in got] == [origin] * len(out["decode"]), got
    assert all(r["held_max"] == 1 for r in out["decode"]), got
    d.call("start_prefill")
    out = d.run([ReqSpec("k2", room + 1, 30, chunk=8)])
    _check_clean(d, out)
    _ok(out, "k2")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(DP_LAYOUTS))
def test_sglang_prefill_dp_groups_byte_exact(hetero, name):
    """A prefill of 2 DP attention groups (sglang's tp_size 2, dp_size 2,
    enable_dp_attention; each group one attention-TP rank) registered with
    one bootstrap server.  Following the bootstrap room (sglang's default),
    room r goes to group r % 2 and sglang's decode picks the same group
    (_resolve_prefill_dp_rank); with round_robin, room r goes to group
    (r + 1) % 2 here, the sender registers it (POST /register_dp_rank) and
    sglang's decode asks (query_prefill_dp_ranks).  Every decode rank reads
    its heads from that group alone, byte for byte."""
    d = hetero(name)
    shift = DP_LAYOUTS[name].prefill_balance != "follow_bootstrap_room"
    specs = [ReqSpec(f"g{i}", 2200 + i, n, chunk=c, prefill_dp_group=(2200 + i + shift) % 2)
             for i, (n, c) in enumerate(((20, 0), (37, 8), (1, 0), (130, 13)))]
    out = d.run(specs)
    assert (len(out["prefill"]), len(out["decode"])) == (2, DP_LAYOUTS[name].decode_tp)
    _all_ok(d, out, specs, lambda group, s: s.prefill_dp_group == group)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(DECODE_DP_LAYOUTS))
def test_sglang_decode_dp_groups_byte_exact(hetero, name):
    """A decode of 2 DP attention groups (sglang's tp_size 2, dp_size 2,
    enable_dp_attention; sglang's decode passes engine_rank tp_rank %
    attn_tp_size): room r goes to decode group r % 2, whose rank reads it
    from the prefill (its TP ranks, or the prefill DP group sglang's decode
    picks) byte for byte; the other group never sees it."""
    d = hetero(name)
    lay = DECODE_DP_LAYOUTS[name]
    specs = [ReqSpec(f"e{i}", 2500 + i, n, chunk=c)
             for i, (n, c) in enumerate(((20, 0), (37, 8), (1, 0), (130, 13)))]
    out = d.run(specs)
    assert len(out["decode"]) == lay.decode_tp * lay.decode_dp
    _all_ok(d, out, specs, lambda i, s: s.room % lay.prefill_dp == i // lay.prefill_tp,
            lambda i, s: s.room % lay.decode_dp == i // lay.decode_tp)


def _all_ok(d, out, specs, serves, reads=lambda rank, s: True):
    """Every request succeeded byte for byte on every decode rank that
    reads(rank, spec) and on every prefill rank i that serves(i, spec); no
    other rank saw it; nothing failed anywhere."""
    _check_clean(d, out)
    for rank, r in enumerate(out["decode"]):
        assert set(r["reqs"]) == {s.rid for s in specs if reads(rank, s)}, rank
        for s in specs:
            if reads(rank, s):
                assert r["reqs"][s.rid] == {"status": "ok", "output_ids": [7],
                                            "bytes_ok": True}, (rank, s.rid)
        assert r["failures"] == {}
    for i, r in enumerate(out["prefill"]):
        assert r["reqs"] == {s.rid: {"status": "ok", "message": None}
                             for s in specs if serves(i, s)}, i
        assert r["failures"] == {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(PP_LAYOUTS))
def test_sglang_pp_prefill_byte_exact(hetero, name):
    """A prefill of 2 PP stages (sglang's pp_size 2: each stage's pool
    holds its layer from start_layer, sglang's _init_kv_manager sets
    pp_rank and prefill_start_layer; pop_bootstrapped syncs stage 0's polls
    to stage 1 over the PP group): sglang's decode learns the PP size from
    GET /route and each decode rank's pool holds every layer of every
    token, byte for byte, with the first token from the last stage."""
    d = hetero(name)
    specs = [ReqSpec(f"p{i}", 2300 + i, n, chunk=c)
             for i, (n, c) in enumerate(((20, 0), (37, 8), (1, 0), (130, 13)))]
    out = d.run(specs)
    assert (len(out["prefill"]), len(out["decode"])) == (2, PP_LAYOUTS[name].decode_tp)
    _all_ok(d, out, specs, lambda stage, s: True)


@pytest.mark.timeout(180)
def test_sglang_pp_stage_killed_fails_the_request(hetero):
    """2 PP stages -> decode TP 1: stage 1 SIGKILLed after its first chunk,
    stage 0 holding its last chunk back.  sglang's pop_transferred gets
    KVPeerLostError naming prefill rank 0 of PP stage 1 and aborts the
    request with it; stage 0's sender fails with the same PEER_LOST reason
    (told by the decode) and sglang's prefill aborts the request there.  A
    restarted prefill serves the next request."""
    d = hetero("pp2-tp1-to-1")
    room = 2401
    # stage 0 holds its last chunk back long enough for the decode to notice
    out = d.run([ReqSpec("q1", room, 64, chunk=8, prefill_die_rank=1, prefill_hold_s=2.5)])
    assert out["prefill"][1] == {"died": -9}
    stage0 = out["prefill"][0]
    out["prefill"] = []
    _check_clean(d, out)

    def lost(o, text):
        return text.startswith(f"room {room}: prefill rank 0 of PP stage 1 at 127.0.0.1:") \
            and " lost: " in text
    [(origin, text)] = _check_causes(out, "decode", "q1", room, "KVPeerLostError", lost)
    assert origin == 0, text
    assert "raised" not in stage0, stage0
    assert stage0["reqs"]["q1"]["status"] == "aborted", stage0
    [[kind, reason, _]] = stage0["failures"][str(room)]
    assert kind == "KVPeerLostError" and reason == text, stage0["failures"]
    d.call("start_prefill")
    out = d.run([ReqSpec("q2", room + 1, 30, chunk=8)])
    _check_clean(d, out)
    _ok(out, "q2")

# --- the decode's head layout, from sglang's model config ------------------

def _decode_manager(server_args, layout):
    """A decode manager made as sglang's DecodePreallocQueue makes it: its
    KVArgs carry no kv_head_num (sglang sets it only with staging)."""
    import logging

    from kvtest import Side
    from test_sglang import DisaggregationMode, sglang_kv_args

    from kvrecv.sglang import KVRecvManager

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("kvrecv").addHandler(handler)
    try:
        args = sglang_kv_args(Side(layout))
        assert getattr(args, "kv_head_num", None) is None
        mgr = KVRecvManager(args, DisaggregationMode.DECODE, server_args, False)
    finally:
        logging.getLogger("kvrecv").removeHandler(handler)
    heads = mgr.kvrecv_args.heads
    mgr.close()
    return heads, warnings


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_head_layout_from_sglangs_model_config(tp):
    """sglang's ServerArgs of the tiny model (4 KV heads): the decode's rank 0
    of attention TP tp holds 4 // tp heads of 4, sglang's own rule."""
    from kvtest import STD
    from sglang_sched import _server_args

    heads, warnings = _decode_manager(_server_args("decode", tp, 9, 1, False), STD)
    assert heads == (tp, 0, 4 // tp, 4) and warnings == []


def test_decode_head_layout_that_does_not_fit_the_pool_is_rank_to_rank():
    """The model's 4 heads do not divide a buffer's item length (66 bytes):
    no head layout (the rank pairs only with a prefill of its TP size), and
    a warning naming the numbers."""
    from kvtest import Layout as Mem
    from sglang_sched import _server_args

    heads, warnings = _decode_manager(_server_args("decode", 1, 9, 1, False),
                                      Mem((64, 66), 32, (16,), 8))
    assert heads is None
    assert warnings == ["kvrecv: the model has 4 KV heads, 4 per rank of attention TP 1, but "
                        "kv_item_lens [64, 66] are not page_size 1 x 4 heads x bytes per head; "
                        "this rank pairs only with a prefill of its own TP size"]


def test_decode_head_layout_of_an_unreadable_model_config_is_rank_to_rank(tmp_path):
    """A model path sglang's model config cannot read: no head layout, and a
    warning with sglang's error."""
    import types

    from kvtest import STD

    sa = types.SimpleNamespace(model_path=str(tmp_path / "no-model"), tp_size=1,
                               host="127.0.0.1")
    heads, warnings = _decode_manager(sa, STD)
    assert heads is None and len(warnings) == 1, warnings
    assert warnings[0].startswith("kvrecv: could not read the model's KV head count (")
    assert warnings[0].endswith("); this rank pairs only with a prefill of its own TP size")
