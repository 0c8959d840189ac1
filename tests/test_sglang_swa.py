"""Sliding-window (SWA) state through the sglang adapter, with sglang's own
pool: two SWAKVPools (full-attention and window layers, on the CPU) whose
KVArgs sglang's setup_state_kv_args fills (state_types SWA, one buffer per
window layer's K and V, a page per item), the window's pages chosen as
sglang's schedulers choose them (the last sliding_window tokens, page
aligned, kv_to_page_indices), moved by KVRecvSender / KVRecvReceiver.  The
full pool's pages and the window pages land byte for byte; every other
window page of the decode keeps its CANARY bytes.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from failtest import _wait_state
from kvrecv import KVConfig, KVLayoutError, KVPoll, KVTransferError

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

TERMINAL = (KVPoll.Success, KVPoll.Failed)
CONFIG = {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 1000}
PAGE = 4
WINDOW = 10  # tokens
CANARY = 0x5A
AUX_ITEM = 64

pytestmark = pytest.mark.timeout(120)


class Mode:
    PREFILL, DECODE = "prefill", "decode"


def _pool(fill):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=64, size_swa=32, page_size=PAGE, dtype=torch.float16, head_num=2,
                     head_dim=8, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1],
                     device="cpu")
    gen = torch.Generator().manual_seed(3)
    for sub in (pool.full_kv_pool, pool.swa_kv_pool):
        for buf in sub.k_buffer + sub.v_buffer:
            view = buf.view(torch.uint8)
            if fill is None:
                view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8))
            else:
                view.fill_(fill)
    return pool


def _kv_args(pool, aux):
    """sglang's KVArgs of a rank of this pool, filled as its schedulers do
    (kv_data from the pool, state_* by setup_state_kv_args)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = pool.get_contiguous_buf_infos()
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [aux.nbytes], [AUX_ITEM]
    a.page_size = PAGE
    setup_state_kv_args(a, pool)
    return a


def _window_pages(token_pages: list, seq_len: int) -> np.ndarray:
    """The window's pages as sglang's _swa_payload picks them (no prefix)."""
    from sglang.srt.mem_cache.common import kv_to_page_indices

    start = max(0, seq_len - WINDOW) // PAGE * PAGE
    tokens = np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in token_pages])
    return kv_to_page_indices(torch.from_numpy(tokens[start:seq_len]), PAGE)


def _swa_bufs(pool):
    sub = pool.swa_kv_pool
    return [b.view(torch.uint8).reshape(b.shape[0] // PAGE, -1) for b in sub.k_buffer + sub.v_buffer]


def _full_bufs(pool):
    sub = pool.full_kv_pool
    return [b.view(torch.uint8).reshape(b.shape[0] // PAGE, -1) for b in sub.k_buffer + sub.v_buffer]


@pytest.fixture
def swa_pair():
    from kvrecv.sglang import KVRecvBootstrapServer, KVRecvManager

    server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
    sargs = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=server.port,
                                  kvrecv_config=KVConfig(**CONFIG), tp_size=1)
    made = [server]
    src, dst = _pool(None), _pool(CANARY)
    saux, daux = np.zeros(4 * AUX_ITEM, np.uint8), np.zeros(4 * AUX_ITEM, np.uint8)
    try:
        sa, da = _kv_args(src, saux), _kv_args(dst, daux)
        assert [str(t.value) for t in sa.state_types] == ["swa"]
        pre = KVRecvManager(sa, Mode.PREFILL, sargs, False)
        made.append(pre)
        dec = KVRecvManager(da, Mode.DECODE, sargs, False)
        made.append(dec)
        addr = f"127.0.0.1:{server.port}"
        assert dec.try_ensure_parallel_info(addr)
        yield addr, pre, dec, src, dst
    finally:
        for obj in reversed(made):
            obj.close()


def _room(addr, pre, dec, rid, full, swa):
    """A room of full pages (src, dst) and window pages (src, dst); returns
    (receiver, sender) once the receiver is terminal."""
    from kvrecv.sglang import KVRecvReceiver, KVRecvSender

    recv = KVRecvReceiver(dec, addr, rid)
    send = KVRecvSender(pre, addr, rid, [0], 0)
    send.init(len(full[0]), 0)
    recv.init(0)
    _wait_state(recv, (KVPoll.WaitingForInput,), 20)
    recv.send_metadata(np.asarray(full[1], dtype=np.int32), 1, [swa[1]], decode_prefix_len=0)
    send.send(np.asarray(full[0][:1], dtype=np.int32), state_indices=None)
    send.send(np.asarray(full[0][1:], dtype=np.int32), state_indices=[swa[0]])
    _wait_state(recv, TERMINAL, 20)
    return recv, send


def test_swa_pages_through_sglangs_pool(swa_pair):
    """A 15-token request: the full pool's 4 pages and the window's pages
    (tokens 5.., page aligned from 4: 3 pages, scattered on the prefill,
    consecutive on the decode) land byte for byte; no other window page of
    the decode is touched."""
    addr, pre, dec, src, dst = swa_pair
    seq_len = 15
    full = ([2, 5, 6, 7], [1, 3, 4, 8])
    swa = (_window_pages([7, 2, 3, 6], seq_len), _window_pages([1, 2, 3, 4], seq_len))
    assert list(swa[0]) == [2, 3, 6] and list(swa[1]) == [2, 3, 4]
    recv, send = _room(addr, pre, dec, 41, full, swa)
    assert recv.poll() == KVPoll.Success
    for s, d in zip(_full_bufs(src), _full_bufs(dst)):
        for ps, pd in zip(*full):
            assert torch.equal(s[ps], d[pd])
    for s, d in zip(_swa_bufs(src), _swa_bufs(dst)):
        for ps, pd in zip(*swa):
            assert torch.equal(s[ps], d[pd])
        for page in set(range(d.shape[0])) - set(swa[1]):
            assert bool((d[page] == CANARY).all()), page
    recv.clear()
    send.clear()


def test_swa_window_of_another_length_fails_both_sides(swa_pair):
    """Window lists of different lengths (a decode whose window is a page
    longer): LAYOUT_MISMATCH on both sides naming both counts, and no
    window byte lands."""
    addr, pre, dec, src, dst = swa_pair
    full = ([2, 5, 6, 7], [1, 3, 4, 8])
    recv, send = _room(addr, pre, dec, 42, full, (np.array([2, 3, 6]), np.array([1, 2, 3, 4])))
    assert recv.poll() == KVPoll.Failed
    want = "state component 0: the decode asked for 4 slots, the prefill sender gave 3"
    for room in (recv, send):
        with pytest.raises(KVTransferError) as ei:
            room.failure_exception()
        assert type(ei.value) is KVLayoutError, ei.value.failure_reason
        assert want in ei.value.failure_reason, ei.value.failure_reason
    for d in _swa_bufs(dst):
        assert bool((d == CANARY).all())
    recv.clear()
    send.clear()
