"""The decode's checks of incoming data, proved with a prefill that breaks
them on purpose.

The prefill is a real manager whose test-only hook (Manager._test_corrupt_data,
csrc/testhook.h) rewrites the headers of the KV data messages it posts:
positions past the room, a buffer range past the registered buffers, more
bytes than the header covers, every message sent twice (rendezvous), another
instance's epoch.  Each must fail the decode's room with PROTOCOL and the
exact reason, with no byte outside the room's pages written."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvrecv import (KVPoll, KVProtocolError, KVReceiver, KVSender, KVTimeoutError,
                    KVTransportError)
from kvtest import (CANARY, TCP_NO_EAGER_FRAGMENT, Expected, Layout, Side, describe_failure,
                    terminal, wait_for, wait_until)

pytestmark = pytest.mark.timeout(60)

# 64 KiB items: a message of 4 pages of one buffer is 256 KiB, which UCX
# moves by rendezvous over tcp (the stats say so) with fragments too small
# for kvrecv's one-fragment eager messages (TCP_NO_EAGER_FRAGMENT).
BIG = Layout((65536, 65536), 32, (16,), 8)

CORRUPT = {  # mode -> (hook value, what the decode says)
    "positions_past_the_room": (1, "run outside the room"),
    "buffer_range": (2, "run outside the room"),
    "too_many_bytes": (3, "run length does not match item_len"),
    "duplicate_rendezvous": (4, "data for positions already received"),
    "stale_epoch": (5, "sender epoch is not the room's prefill's"),
}

DST_PAGES = [4, 5, 6, 7]
SRC_PAGES = [20, 21, 22, 23]


def written_outside(dst: Side, pages) -> list:
    """Buffers with a byte outside `pages` (KV) or anywhere (aux) that is not
    CANARY."""
    bad = []
    keep = np.ones(dst.layout.num_pages, dtype=bool)
    keep[list(pages)] = False
    for b in range(len(dst.kv)):
        if not (dst.pages(b)[keep] == CANARY).all():
            bad.append(f"kv buffer {b}")
    for a, buf in enumerate(dst.aux):
        if not (buf == CANARY).all():
            bad.append(f"aux buffer {a}")
    return bad


@pytest.mark.parametrize("mode", sorted(CORRUPT))
def test_bad_data_header_fails_the_room_with_protocol(res, mode, monkeypatch):
    hook, why = CORRUPT[mode]
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", TCP_NO_EAGER_FRAGMENT)
    bs = res.server()
    src, dst = Side(BIG, 0, seed=11), Side(BIG, 0)
    prefill = res.manager(src, "prefill", bs.address)
    # Before the checks existed, a refused or accepted-twice room ran into
    # its deadline (or succeeded); a short one keeps that failure quick.
    decode = res.manager(dst, "decode", deadline_base_ms=5000)
    prefill._core._test_corrupt_data(hook)
    r = KVReceiver(decode, bs.address, 5)
    s = KVSender(prefill, bs.address, 5)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    r.send_metadata(DST_PAGES)
    s.init(len(SRC_PAGES))
    s.send(SRC_PAGES)
    assert wait_for(r, terminal(), timeout=15) == KVPoll.Failed, describe_failure(r)
    with pytest.raises(KVProtocolError) as ei:
        r.failure_exception()
    name = "prefill rank 0 at " + prefill.endpoint[len("tcp://"):]
    assert ei.value.failure_reason == f"room 5: {name} sent a bad data message: {why}"
    assert wait_for(s, terminal(), timeout=15) == KVPoll.Failed
    assert written_outside(dst, DST_PAGES) == []
    if mode == "duplicate_rendezvous":
        assert decode.stats()["data_rendezvous"] >= 1  # the copy accepted
    else:
        # Nothing of a refused message lands, in the room's pages either.
        assert all((buf == CANARY).all() for buf in dst.kv)
    r.clear()
    s.clear()


def test_the_hook_is_off_by_default(res):
    """The same room with the hook never set, and set back to 0: Success."""
    bs = res.server()
    src, dst = Side(BIG, 0, seed=11), Side(BIG, 0)
    prefill = res.manager(src, "prefill", bs.address)
    decode = res.manager(dst, "decode")
    for room, hook in ((1, None), (2, 0)):
        if hook is not None:
            prefill._core._test_corrupt_data(4)
            prefill._core._test_corrupt_data(hook)
        r = KVReceiver(decode, bs.address, room)
        s = KVSender(prefill, bs.address, room)
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        r.send_metadata(DST_PAGES)
        s.init(len(SRC_PAGES))
        s.send(SRC_PAGES)
        assert wait_for(r, terminal()) == KVPoll.Success, describe_failure(r)
        r.clear()
        s.clear()
    with pytest.raises(ValueError, match="no corruption mode 12"):
        prefill._core._test_corrupt_data(12)


@pytest.mark.parametrize("how", ["rendezvous", "eager"])
def test_data_for_a_room_from_another_prefills_connection_is_foreign(res, caplog, how,
                                                                      monkeypatch):
    """Prefill B sends its room's data under room A's tag and prefill A's
    epoch (as a peer that learnt them could): it reaches the decode on the
    UCX worker of B's connection, not A's, and is refused as foreign --
    counted, logged, nothing written, room A neither failed (a stranger
    cannot fail it) nor fed.  Room A then completes with A's own data.
    B's room fails: at once where its message came by rendezvous (the
    refusal is its answer), at its deadline where it came eagerly (one
    fragment: nothing answers it, and the decode does not tell a stranger)."""
    caplog.set_level(logging.WARNING, logger="kvrecv")
    if how == "rendezvous":
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", TCP_NO_EAGER_FRAGMENT)
    bs_a, bs_b = res.server(), res.server()
    src_a, src_b, dst = Side(BIG, 0, seed=11), Side(BIG, 0, seed=12), Side(BIG, 0)
    pa = res.manager(src_a, "prefill", bs_a.address)
    pb = res.manager(src_b, "prefill", bs_b.address, deadline_base_ms=3000)
    decode = res.manager(dst, "decode")
    dst_b = [8, 9, 10, 11]
    ra, rb = KVReceiver(decode, bs_a.address, 5), KVReceiver(decode, bs_b.address, 6)
    for r, pages in ((ra, DST_PAGES), (rb, dst_b)):
        r.init()
        assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        r.send_metadata(pages)
    sa, sb = KVSender(pa, bs_a.address, 5), KVSender(pb, bs_b.address, 6)
    sa.init(len(SRC_PAGES))
    sb.init(len(SRC_PAGES))
    assert wait_until(lambda: sa.poll() == sb.poll() == KVPoll.WaitingForInput)
    tag = pa._core._test_room_tag(5)
    assert tag != 0
    pb._core._test_forge_data(tag, pa._core.epoch)
    sb.send(SRC_PAGES)
    assert wait_until(lambda: decode.stats()["data_foreign"] >= 1, 10), decode.stats()
    assert wait_for(sb, terminal(), timeout=15) == KVPoll.Failed  # refused, then no ROOM_DONE
    cls, why = ((KVTimeoutError, "no completion within its deadline") if how == "eager" else
                (KVTransportError, "Operation rejected by remote peer"))
    with pytest.raises(cls) as ei:
        sb.failure_exception()
    assert why in ei.value.failure_reason, repr(ei.value)
    assert ra.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring), describe_failure(ra)
    assert all((buf == CANARY).all() for buf in dst.kv), "a foreign message was written"
    assert wait_until(lambda: any(
        "refused a data message" in m.getMessage()
        and m.getMessage().endswith("sender is not the room's prefill")
        for m in caplog.records), 5), caplog.text
    sa.send(SRC_PAGES)
    assert wait_for(ra, terminal(), timeout=15) == KVPoll.Success, describe_failure(ra)
    want = Expected(dst)
    want.apply(src_a, SRC_PAGES, DST_PAGES)
    assert want.mismatches(dst) == []
