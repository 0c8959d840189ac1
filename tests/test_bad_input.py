"""Bad input raises the right built-in exception with a message naming the
argument, and no byte moves because of it: the destination keeps its canary
until a valid call, after which exactly the valid pages land."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvrecv import (
    BootstrapServer,
    KVAbortedError,
    KVBootstrapError,
    KVArgs,
    KVConfig,
    KVLayoutError,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
)
from kvtest import (
    SMALL,
    STD,
    Layout,
    Side,
    assert_all_canary,
    describe_failure,
    terminal,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

N = STD.num_pages


@pytest.fixture
def ready(pair):
    """A decode room in WaitingForInput and its prefill sender, not inited."""
    r = KVReceiver(pair.decode, pair.addr, 1)
    s = KVSender(pair.prefill, pair.addr, 1)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r)
    pair.r, pair.s = r, s
    return pair


def finish_and_check(p, src_pages, dst_pages, src_aux=None, dst_aux=None, fresh=True):
    """Completes the room of `ready` with valid calls and checks that exactly
    the valid pages (and nothing from the rejected calls) landed.  fresh:
    nothing was handed over yet, so the destination is still all canary."""
    expected = Side(STD, 0).snapshot()
    if fresh:
        assert_all_canary(p.dst)
    if not p.r_meta:
        p.r.send_metadata(dst_pages, aux_index=dst_aux)
    if not p.s_init:
        p.s.init(len(src_pages), src_aux)
    p.s.send(src_pages[p.s_sent:])
    assert wait_for(p.r, terminal()) == KVPoll.Success, describe_failure(p.r)
    assert wait_for(p.s, terminal()) == KVPoll.Success, describe_failure(p.s)
    expected.apply(p.src, src_pages, dst_pages, src_aux, dst_aux)
    expected.check(p.dst)
    want = STD.transfer_bytes(len(src_pages), dst_aux is not None)
    assert p.decode.stats()["bytes_moved"] == want
    assert p.prefill.stats()["bytes_moved"] == want


@pytest.fixture
def prog(ready):
    ready.r_meta = ready.s_init = False
    ready.s_sent = 0
    return ready


NOT_INTEGERS = {
    "float_list": ([1.0, 2.0], TypeError),
    "float_array": (np.array([1.0, 2.0]), TypeError),
    "float32_array": (np.array([1, 2], dtype=np.float32), TypeError),
    "str_items": (["1", "2"], TypeError),
    "str": ("12", TypeError),
    "bool_items": ([True, False], TypeError),
    "bool_array": (np.array([True, False]), TypeError),
    "none": (None, TypeError),
    "object": (object(), TypeError),
    "mixed": ([1, 2.5], TypeError),
}

OUT_OF_RANGE = {
    "negative": [3, -1],
    "negative_array": np.array([-5], dtype=np.int64),
    "just_past_end": [N],
    "far_past_end": [0, 1, 10 * N],
    "past_int32": [2**31],
    "huge": [2**70],
    "int64_array_past_int32": np.array([2**40], dtype=np.int64),
    "uint8_array_past_end": np.array([N - 1, 255], dtype=np.uint8) if N <= 255 else
    np.array([N], dtype=np.uint16),
}


@pytest.mark.parametrize("name", sorted(NOT_INTEGERS))
def test_send_metadata_rejects_non_integer_indices(prog, name):
    bad, exc = NOT_INTEGERS[name]
    with pytest.raises(exc, match="kv_indices"):
        prog.r.send_metadata(bad)
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [4, 5, 6], [7, 8, 9])


@pytest.mark.parametrize("name", sorted(NOT_INTEGERS))
def test_send_rejects_non_integer_indices(prog, name):
    bad, exc = NOT_INTEGERS[name]
    prog.r.send_metadata([10, 20])
    prog.r_meta = True
    prog.s.init(2)
    prog.s_init = True
    with pytest.raises(exc, match="kv_indices"):
        prog.s.send(bad)
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [30, 31], [10, 20])


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_send_metadata_rejects_pages_outside_the_registered_range(prog, name):
    with pytest.raises(ValueError, match="kv_indices"):
        prog.r.send_metadata(OUT_OF_RANGE[name], aux_index=0)
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [N - 1, 0], [N - 1, 0], 1, 2)


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_send_rejects_pages_outside_the_registered_range(prog, name):
    bad = OUT_OF_RANGE[name]
    prog.r.send_metadata(np.arange(len(bad), dtype=np.int32) + 100)
    prog.r_meta = True
    prog.s.init(len(bad))
    prog.s_init = True
    with pytest.raises(ValueError, match="kv_indices"):
        prog.s.send(bad)
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, list(range(len(bad))), list(range(100, 100 + len(bad))))


def test_out_of_range_message_names_the_position_and_the_limit(prog):
    with pytest.raises(ValueError) as ei:
        prog.r.send_metadata([0, 1, N + 3])
    msg = str(ei.value)
    assert "kv_indices[2]" in msg and str(N + 3) in msg and str(N) in msg


def test_send_metadata_rejects_a_page_named_twice(prog):
    # Two pages of the room written into one decode page: which lands last
    # is not defined, so the room is refused before any byte moves.
    with pytest.raises(ValueError, match=r"^kv_indices\[1\] and kv_indices\[3\] are both page 7: "):
        prog.r.send_metadata(np.array([3, 7, 9, 7, 2], dtype=np.int32))
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [1, 2, 3, 1], [3, 7, 9, 2])  # a repeated source page is fine


def test_two_dimensional_index_array_is_rejected(prog):
    with pytest.raises(ValueError, match="kv_indices"):
        prog.r.send_metadata(np.array([[1, 2], [3, 4]], dtype=np.int32))
    finish_and_check(prog, [1, 2], [3, 4])


@pytest.mark.parametrize("call", ["send", "send_metadata"])
def test_empty_string_is_not_an_index_list(prog, call):
    if call == "send":
        prog.r.send_metadata([1])
        prog.s.init(1)
        with pytest.raises(TypeError, match="kv_indices"):
            prog.s.send("")
    else:
        with pytest.raises(TypeError, match="kv_indices"):
            prog.r.send_metadata("", aux_index=0)


def test_strided_index_array_is_accepted_or_rejected_by_name(prog):
    dst = np.arange(40, dtype=np.int64)[::4]  # 0, 4, ..., 36: non-contiguous view
    assert not dst.flags.contiguous
    try:
        prog.r.send_metadata(dst)
    except (TypeError, ValueError) as e:
        assert "kv_indices" in str(e), f"message does not name the argument: {e}"
        return
    prog.r_meta = True
    finish_and_check(prog, list(range(10)), dst.tolist())


def test_send_overrunning_num_kv_indices(prog):
    prog.r.send_metadata([1, 2, 3])
    prog.r_meta = True
    prog.s.init(3)
    prog.s_init = True
    prog.s.send([5, 6])
    prog.s_sent = 2
    with pytest.raises(ValueError, match="num_kv_indices"):
        prog.s.send([7, 8])
    with pytest.raises(ValueError, match="num_kv_indices"):
        prog.s.send(np.arange(10, dtype=np.int32))
    # The valid pages sent so far may already be in flight; the rejected ones
    # must not be: complete with page 7 and check every byte.
    finish_and_check(prog, [5, 6, 7], [1, 2, 3], fresh=False)


def test_send_of_more_pages_than_announced_in_one_call(prog):
    prog.r.send_metadata([1, 2])
    prog.r_meta = True
    prog.s.init(2)
    prog.s_init = True
    with pytest.raises(ValueError, match="num_kv_indices"):
        prog.s.send([5, 6, 7])
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [5, 6], [1, 2])


@pytest.mark.parametrize("num", [-1, 2**24 + 1, 2**63])
def test_num_kv_indices_out_of_range(prog, num):
    with pytest.raises(ValueError, match="num_kv_indices"):
        prog.s.init(num)
    finish_and_check(prog, [1], [2])


@pytest.mark.parametrize("num", [1.0, "3", None, [1]])
def test_num_kv_indices_not_an_integer(prog, num):
    with pytest.raises(TypeError, match="num_kv_indices"):
        prog.s.init(num)
    finish_and_check(prog, [1], [2])


@pytest.mark.parametrize("decode_pages,prefill_pages", [(3, 2), (2, 3), (1, 0)],
                         ids=["decode_asks_more", "decode_asks_fewer", "prefill_announces_0"])
@pytest.mark.parametrize("order", ["request_first", "init_first"])
def test_page_count_mismatch_fails_both_sides(ready, decode_pages, prefill_pages, order):
    p = ready
    if order == "init_first":
        p.s.init(prefill_pages)
    p.r.send_metadata(list(range(decode_pages)))
    if order == "request_first":
        assert wait_for(p.s, (KVPoll.WaitingForInput, KVPoll.Failed)) != KVPoll.Bootstrapping
        p.s.init(prefill_pages)
    if prefill_pages:
        p.s.send(list(range(100, 100 + prefill_pages)))
    assert wait_for(p.r, terminal()) == KVPoll.Failed
    assert wait_for(p.s, terminal()) == KVPoll.Failed
    for room in (p.r, p.s):
        with pytest.raises(KVLayoutError) as ei:
            room.failure_exception()
        e = ei.value
        assert e.code == "LAYOUT_MISMATCH"
        assert e.bootstrap_room == 1
        assert e.failure_reason == (
            f"room 1: decode asked for {decode_pages} pages, prefill announced {prefill_pages}")
    assert p.decode.stats()["failures_by_code"]["LAYOUT_MISMATCH"] == 1
    assert p.prefill.stats()["failures_by_code"]["LAYOUT_MISMATCH"] == 1
    time.sleep(0.05)
    assert_all_canary(p.dst)
    assert p.decode.stats()["bytes_moved"] == 0
    assert p.prefill.stats()["rma_ops_posted"] == 0


def test_decode_asks_for_an_aux_row_the_prefill_does_not_send(ready):
    p = ready
    p.r.send_metadata([1, 2], aux_index=3)
    p.s.init(2, aux_index=None)
    p.s.send([5, 6])
    assert wait_for(p.r, terminal()) == KVPoll.Failed
    assert wait_for(p.s, terminal()) == KVPoll.Failed
    with pytest.raises(KVLayoutError, match="aux"):
        p.s.failure_exception()
    with pytest.raises(KVLayoutError):
        p.r.failure_exception()
    # Aux rows are never written.
    for a in p.dst.aux:
        assert (a == 0xA5).all()


def test_room_id_already_in_use_on_the_same_manager(res, pair):
    r = KVReceiver(pair.decode, pair.addr, 55)
    s = KVSender(pair.prefill, pair.addr, 55)
    with pytest.raises(ValueError, match="55"):
        KVReceiver(pair.decode, pair.addr, 55)
    with pytest.raises(ValueError, match="55"):
        KVSender(pair.prefill, pair.addr, 55)
    # The original rooms are unharmed and still work.
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.send_metadata([3])
    s.init(1)
    s.send([4])
    assert wait_for(r, terminal()) == KVPoll.Success
    assert wait_for(s, terminal()) == KVPoll.Success
    # The same id on another manager is a different room.
    d2 = res.manager(Side(SMALL, 0), "decode")
    assert KVReceiver(d2, pair.addr, 55).bootstrap_room == 55


@pytest.mark.parametrize("room", [-1, 2**64])
def test_room_id_out_of_range(pair, room):
    with pytest.raises(ValueError, match="bootstrap_room"):
        KVReceiver(pair.decode, pair.addr, room)
    with pytest.raises(ValueError, match="bootstrap_room"):
        KVSender(pair.prefill, pair.addr, room)


@pytest.mark.parametrize("room", [1.0, "1", None])
def test_room_id_not_an_integer(pair, room):
    with pytest.raises(TypeError, match="bootstrap_room"):
        KVReceiver(pair.decode, pair.addr, room)


def test_room_id_messages(pair):
    with pytest.raises(TypeError) as ei:
        KVSender(pair.prefill, pair.addr, True)
    assert str(ei.value) == "bootstrap_room must be an integer, not bool"
    with pytest.raises(ValueError) as ei:
        KVReceiver(pair.decode, pair.addr, np.int64(-3))
    assert str(ei.value) == "bootstrap_room=-3 must be in [0, 2**64)"
    assert KVReceiver(pair.decode, pair.addr, np.uint64(2**64 - 1)).bootstrap_room == 2**64 - 1


# ---- KVArgs --------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(kv_data_ptrs=[1, 2], kv_data_lens=[64], kv_item_lens=[64]), "kv_data_ptrs"),
        (dict(kv_data_ptrs=[1], kv_data_lens=[64, 64], kv_item_lens=[64]), "kv_data_lens"),
        (dict(kv_data_ptrs=[1], kv_data_lens=[64], kv_item_lens=[64, 8]), "kv_item_lens"),
        (dict(kv_data_ptrs=[1], kv_data_lens=[64], kv_item_lens=[64],
              aux_data_ptrs=[1, 2], aux_data_lens=[8], aux_item_lens=[8]), "aux_data_ptrs"),
        (dict(kv_data_ptrs=[1], kv_data_lens=[64], kv_item_lens=[64],
              aux_data_ptrs=[1], aux_data_lens=[8], aux_item_lens=[]), "aux_item_lens"),
    ],
)
def test_kvargs_mismatched_list_lengths(kw, words):
    with pytest.raises(ValueError, match=words):
        KVArgs(0, **kw)


@pytest.mark.parametrize(
    "kind,lens,items,words",
    [
        ("kv", [1000], [64], r"kv_item_lens\[0\]=64 does not divide kv_data_lens\[0\]=1000"),
        ("kv", [128, 100], [64, 64], r"kv_item_lens\[1\]"),
        ("kv", [128], [0], r"kv_item_lens\[0\]"),
        ("kv", [128], [-64], r"kv_item_lens\[0\]"),
        ("aux", [30], [16], r"aux_item_lens\[0\]=16 does not divide aux_data_lens\[0\]=30"),
    ],
)
def test_kvargs_item_len_must_divide_the_buffer(kind, lens, items, words):
    kv = dict(kv_data_ptrs=[4096], kv_data_lens=[128], kv_item_lens=[64])
    if kind == "kv":
        kv = dict(kv_data_ptrs=[4096] * len(lens), kv_data_lens=lens, kv_item_lens=items)
        aux = {}
    else:
        aux = dict(aux_data_ptrs=[4096], aux_data_lens=lens, aux_item_lens=items)
    with pytest.raises(ValueError, match=words):
        KVArgs(0, **kv, **aux)


def test_kvargs_from_buffers_checks():
    good = np.zeros(256, np.uint8)
    with pytest.raises(ValueError, match="kv_item_lens"):
        KVArgs.from_buffers(0, [good], [100])
    with pytest.raises(ValueError, match=r"kv_buffers\[0\]"):
        ro = np.zeros(256, np.uint8)
        ro.flags.writeable = False
        KVArgs.from_buffers(0, [ro], [64])
    with pytest.raises(ValueError, match=r"kv_buffers\[1\]"):
        KVArgs.from_buffers(0, [good, np.zeros(512, np.uint8)[::2]], [64, 64])
    with pytest.raises(ValueError, match=r"aux_buffers\[0\]"):
        KVArgs.from_buffers(0, [good], [64], [np.zeros(0, np.uint8)], [8])
    with pytest.raises(TypeError, match=r"kv_buffers\[0\]"):
        KVArgs.from_buffers(0, [12345], [64])
    with pytest.raises(TypeError, match=r"kv_item_lens\[0\]"):
        KVArgs.from_buffers(0, [good], [64.0])


def test_manager_rejects_bad_config_and_args(bootstrap):
    side = Side(SMALL, 0)
    with pytest.raises(ValueError, match="mode"):
        KVManager(side.args(), "both")
    with pytest.raises(ValueError, match="bootstrap_addr"):
        KVManager(side.args(), "prefill")
    with pytest.raises(TypeError, match="args"):
        KVManager("not args", "decode")
    with pytest.raises(ValueError, match="heartbeat_interval_ms"):
        KVManager(side.args(), "decode", config=KVConfig(heartbeat_interval_ms=-5))
    with pytest.raises(TypeError, match="config"):
        KVManager(side.args(), "decode", config={"max_rooms": 4})
    with pytest.raises(ValueError, match="kv_data_ptrs"):
        KVManager(KVArgs(0, [], [], []), "decode")


# ---- modes and addresses -------------------------------------------------


def test_wrong_mode_manager(pair):
    with pytest.raises(ValueError, match="prefill manager"):
        KVSender(pair.decode, pair.addr, 3)
    with pytest.raises(ValueError, match="decode manager"):
        KVReceiver(pair.prefill, pair.addr, 3)
    with pytest.raises(TypeError, match="mgr"):
        KVReceiver(object(), pair.addr, 3)
    # Nothing was opened by the failed constructors.
    assert pair.decode.stats()["rooms_open"] == 0
    assert pair.prefill.stats()["rooms_open"] == 0


BAD_ADDRS = ["localhost", "127.0.0.1:", ":8998", "127.0.0.1:0", "127.0.0.1:65536",
             "127.0.0.1:http", "127.0.0.1:-1", ""]


@pytest.mark.parametrize("addr", BAD_ADDRS)
def test_bad_bootstrap_addr(pair, addr):
    with pytest.raises(ValueError, match="bootstrap_addr"):
        KVReceiver(pair.decode, addr, 3)
    with pytest.raises(ValueError, match="bootstrap_addr"):
        KVManager(Side(SMALL, 0).args(), "prefill", bootstrap_addr=addr)
    assert pair.decode.stats()["rooms_open"] == 0


def test_bootstrap_addr_not_a_string(pair):
    with pytest.raises(TypeError, match="bootstrap_addr"):
        KVReceiver(pair.decode, ("127.0.0.1", 8998), 3)


def test_bootstrap_port_in_use(bootstrap):
    with pytest.raises(OSError):
        BootstrapServer("127.0.0.1", bootstrap.port)
    with pytest.raises(ValueError, match="port"):
        BootstrapServer("127.0.0.1", 70000)


def test_secret_checks(res):
    for make, what in [(lambda s: BootstrapServer("127.0.0.1", 0, secret=s), "secret"),
                       (lambda s: res.manager(Side(SMALL, 0), "decode", secret=s),
                        "KVConfig.secret")]:
        with pytest.raises(TypeError) as ei:
            make(5)
        assert str(ei.value) == f"{what} must be a str or bytes, not int"
        with pytest.raises(ValueError) as ei:
            make("x" * 257)
        assert str(ei.value) == f"{what} is 257 bytes long, more than 256"
    BootstrapServer("127.0.0.1", 0, secret=bytearray(b"k" * 256)).close()


# ---- aux_index -----------------------------------------------------------


@pytest.mark.parametrize("aux", [STD.aux_rows, STD.aux_rows + 100, 2**40, -1])
def test_aux_index_out_of_range(prog, aux):
    with pytest.raises(ValueError, match="aux_index"):
        prog.r.send_metadata([1, 2], aux_index=aux)
    with pytest.raises(ValueError, match="aux_index"):
        prog.s.init(2, aux_index=aux)
    time.sleep(0.05)
    assert_all_canary(prog.dst)
    finish_and_check(prog, [3, 4], [1, 2], STD.aux_rows - 1, STD.aux_rows - 1)


@pytest.mark.parametrize("aux", [1.0, "0", True])
def test_aux_index_not_an_integer(prog, aux):
    with pytest.raises(TypeError, match="aux_index"):
        prog.r.send_metadata([1, 2], aux_index=aux)
    with pytest.raises(TypeError, match="aux_index"):
        prog.s.init(2, aux_index=aux)
    finish_and_check(prog, [3, 4], [1, 2], 0, 0)


def test_aux_index_without_aux_buffers(res, bootstrap):
    layout = Layout((64,), 16)
    src, dst = Side(layout, 0, seed=1), Side(layout, 0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode")
    r = KVReceiver(decode, bootstrap.address, 1)
    s = KVSender(prefill, bootstrap.address, 1)
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    with pytest.raises(ValueError, match="aux_index"):
        r.send_metadata([1], aux_index=0)
    with pytest.raises(ValueError, match="aux_index"):
        s.init(1, aux_index=0)
    with pytest.raises(ValueError, match="kv_indices"):
        r.send_metadata([], aux_index=None)  # nothing to transfer


# ---- closed managers and cleared rooms -----------------------------------


def test_calls_on_a_closed_manager(pair):
    r = KVReceiver(pair.decode, pair.addr, 8)
    s = KVSender(pair.prefill, pair.addr, 8)
    r.init()
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    pair.decode.close()
    pair.prefill.close()
    assert pair.decode.closed and pair.prefill.closed
    pair.decode.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        KVReceiver(pair.decode, pair.addr, 9)
    with pytest.raises(RuntimeError, match="closed"):
        KVSender(pair.prefill, pair.addr, 9)
    with pytest.raises(RuntimeError, match="closed"):
        r.send_metadata([1])
    with pytest.raises(RuntimeError, match="closed"):
        s.init(1)
    with pytest.raises(RuntimeError, match="closed"):
        s.send([1])
    # poll never raises; rooms open at close failed with ABORTED.
    assert r.poll() == KVPoll.Failed
    assert s.poll() == KVPoll.Failed
    with pytest.raises(KVAbortedError) as ei:
        r.failure_exception()
    assert ei.value.code == "ABORTED"
    r.abort()
    r.clear()
    assert_all_canary(pair.dst)


def test_endpoint_and_transport_readable_while_close_runs(res, bootstrap):
    """Reader threads racing close(): the same text before, during and after
    (close() frees the control layer and the transport with the GIL
    released; the properties are copies made at creation)."""
    side = Side(SMALL, 0)
    mgr = res.manager(side, "prefill", bootstrap.address)
    endpoint, transport = mgr.endpoint, mgr.transport
    assert endpoint.startswith("tcp://127.0.0.1:") and transport
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            seen.add((mgr.endpoint, mgr.transport, mgr.closed in (True, False)))

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    mgr.close()
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert mgr.closed
    assert seen == {(endpoint, transport, True)}
    assert (mgr.endpoint, mgr.transport) == (endpoint, transport)


def test_manager_as_context_manager_closes(bootstrap):
    side = Side(SMALL, 0)
    with KVManager(side.args(), "decode") as mgr:
        assert not mgr.closed
    assert mgr.closed
    with pytest.raises(RuntimeError):
        KVReceiver(mgr, bootstrap.address, 1)


def test_calls_on_a_cleared_room(ready):
    p = ready
    p.r.clear()
    p.s.clear()
    with pytest.raises(RuntimeError, match="cleared"):
        p.r.send_metadata([1])
    with pytest.raises(RuntimeError, match="cleared"):
        p.r.init()
    with pytest.raises(RuntimeError, match="cleared"):
        p.s.init(1)
    with pytest.raises(RuntimeError, match="cleared"):
        p.s.send([1])
    # poll, abort and clear stay callable.
    assert p.r.poll() in (KVPoll.Failed, KVPoll.WaitingForInput)
    p.r.abort()
    p.r.clear()
    p.s.abort()
    p.s.clear()
    with pytest.raises(KVTransferError):
        p.r.failure_exception()
    assert p.decode.stats()["rooms_open"] == 0
    assert p.prefill.stats()["rooms_open"] == 0
    assert_all_canary(p.dst)


def test_call_order_errors(pair):
    r = KVReceiver(pair.decode, pair.addr, 4)
    s = KVSender(pair.prefill, pair.addr, 4)
    with pytest.raises(RuntimeError, match="init"):
        r.send_metadata([1])
    with pytest.raises(RuntimeError, match="init"):
        s.send([1])
    r.init()
    with pytest.raises(RuntimeError, match="init"):
        r.init()
    s.init(1)
    with pytest.raises(RuntimeError, match="init"):
        s.init(1)
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    r.send_metadata([2])
    with pytest.raises(RuntimeError, match="send_metadata"):
        r.send_metadata([3])
    s.send([9])
    assert wait_for(r, terminal()) == KVPoll.Success
    expected = Side(STD, 0).snapshot()
    expected.apply(pair.src, [9], [2])
    expected.check(pair.dst)


# ---- well-formed but wrong ------------------------------------------------


def test_layout_mismatch_between_ranks_fails_the_decode_room(res, bootstrap):
    src = Side(SMALL, 0, seed=1)
    dst = Side(Layout((64, 256), SMALL.num_pages, SMALL.aux_item_lens, SMALL.aux_rows), 0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode")
    r = KVReceiver(decode, bootstrap.address, 1)
    s = KVSender(prefill, bootstrap.address, 1)
    r.init()
    r.send_metadata([1, 2], aux_index=0)
    s.init(2, aux_index=0)
    s.send([3, 4])
    assert wait_for(r, terminal()) == KVPoll.Failed
    with pytest.raises(KVLayoutError) as ei:
        r.failure_exception()
    assert ei.value.code == "LAYOUT_MISMATCH"
    assert "KV buffer 1 item_len 128 here, 256 there" in ei.value.failure_reason
    time.sleep(0.05)
    assert_all_canary(dst)
    assert prefill.stats()["rma_ops_posted"] == 0
    # No request ever reached the prefill; the rejected decode names the room,
    # so the sender fails with the same cause instead of waiting for its
    # bootstrap timeout.
    assert wait_for(s, terminal()) == KVPoll.Failed
    with pytest.raises(KVLayoutError) as ei:
        s.failure_exception()
    assert ei.value.code == "LAYOUT_MISMATCH"
    assert "KV buffer 1 item_len" in ei.value.failure_reason
    assert prefill.stats()["rma_ops_posted"] == 0


def test_unregistered_prefill_fails_with_bootstrap_then_recovers(res, bootstrap):
    src, dst = Side(SMALL, 0, seed=2), Side(SMALL, 0)
    decode = res.manager(dst, "decode", bootstrap_timeout_ms=300)
    r = KVReceiver(decode, bootstrap.address, 1)
    r.init()
    r.send_metadata([1])
    assert wait_for(r, terminal()) == KVPoll.Failed
    with pytest.raises(KVBootstrapError) as ei:
        r.failure_exception()
    assert ei.value.code == "BOOTSTRAP"
    assert "300 ms" in ei.value.failure_reason
    assert decode.stats()["failures_by_code"]["BOOTSTRAP"] == 1

    # Once the prefill rank registers, a new room on the same manager resolves it.
    prefill = res.manager(src, "prefill", bootstrap.address)
    assert wait_until(lambda: bootstrap.stats()["registrations"] == 1)
    r2 = KVReceiver(decode, bootstrap.address, 2)
    s2 = KVSender(prefill, bootstrap.address, 2)
    r2.init()
    assert wait_for(r2, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput, \
        describe_failure(r2)
    r2.send_metadata([5])
    s2.init(1)
    s2.send([6])
    assert wait_for(r2, terminal()) == KVPoll.Success, describe_failure(r2)
    expected = Side(SMALL, 0).snapshot()
    expected.apply(src, [6], [5])
    expected.check(dst)


def test_max_rooms_from_the_environment(res, pair, monkeypatch):
    monkeypatch.setenv("KVRECV_MAX_ROOMS", "2")
    decode = res.manager(Side(SMALL, 0), "decode")
    a = KVReceiver(decode, pair.addr, 1)
    b = KVReceiver(decode, pair.addr, 2)  # noqa: F841  (a live handle keeps the room open)
    with pytest.raises(RuntimeError, match="max_rooms=2"):
        KVReceiver(decode, pair.addr, 3)
    a.clear()
    assert KVReceiver(decode, pair.addr, 3).bootstrap_room == 3
    monkeypatch.setenv("KVRECV_MAX_ROOMS", "many")
    with pytest.raises(ValueError, match="KVRECV_MAX_ROOMS"):
        res.manager(Side(SMALL, 0), "decode")


def test_calls_of_the_other_side_are_refused(pair):
    r = KVReceiver(pair.decode, pair.addr, 31)
    s = KVSender(pair.prefill, pair.addr, 31)
    with pytest.raises(RuntimeError, match="send_init.. on a decode room"):
        r.send_init(1)
    with pytest.raises(RuntimeError, match="send.. on a decode room"):
        r.send([1])
    with pytest.raises(RuntimeError, match="send_metadata.. on a prefill room"):
        s.send_metadata([1])
    with pytest.raises(RuntimeError, match="recv_init.. on a prefill room"):
        s.recv_init()
    assert r.poll() == KVPoll.Bootstrapping and s.poll() == KVPoll.Bootstrapping
    r.clear()
    s.clear()
    assert_all_canary(pair.dst)


# --------------------------------------------------------------------------
# UCX settings kvrecv cannot work with
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name,value", [("UCX_POSIX_SEG_SIZE", "65600"),
                                        ("UCX_SYSV_SEG_SIZE", "65536"),
                                        ("UCX_MM_SEG_SIZE", "64K")])
def test_shared_memory_segments_of_64k_or_more_are_refused(monkeypatch, name, value):
    """UCX 1.13's shared-memory transports hang (65600) or crash the process
    (65536) on kvrecv's messages with segments of 64 KiB or more: the
    manager refuses to start instead, naming the variable."""
    monkeypatch.setenv(name, value)
    bufs = [np.zeros(4 * 1024, dtype=np.uint8)]
    for mode in ("decode", "prefill"):
        with pytest.raises(ValueError) as ei:
            KVManager(KVArgs.from_buffers(0, bufs, [1024]), mode,
                      bootstrap_addr="127.0.0.1:1" if mode == "prefill" else None)
        msg = str(ei.value)
        assert msg.startswith(f"{name}={value}: UCX ") and "below 65536" in msg, msg


@pytest.fixture
def shm_65535(monkeypatch):
    """The largest shared-memory segments kvrecv accepts (before `prog`
    creates the managers)."""
    monkeypatch.setenv("UCX_TLS", "posix,sysv,cma,self")
    monkeypatch.setenv("UCX_MM_SEG_SIZE", "65535")


def test_shared_memory_segments_below_64k_move_every_byte(shm_65535, prog):
    """A room of 64 pages (526 KB: one scattered message per buffer, moved
    through the segments) lands byte for byte with 65535-byte segments."""
    pages = np.arange(64, dtype=np.int32)
    finish_and_check(prog, pages, pages[::-1].copy())
