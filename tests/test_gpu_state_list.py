"""Sliding-window pages (a state component that takes a list of slots,
docs/layouts.md) in device memory, through the staging path on the fake
CUDA runtime (tests/fakecuda): a window list longer than a staging slot
moves in messages that each fit one slot, byte for byte, with the slots
consecutive (one run) and scattered."""

from __future__ import annotations

import numpy as np
import pytest

from gpumem import Cudart, MemSide
from kvrecv import KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender, _core
from kvtest import ROBUST_CONFIG, Layout, describe_failure, terminal, wait_for
from test_gpu import fake_path  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)

L = Layout((64, 512), 96, (24,), 8)
ITEM, ROWS = 4096, 64  # window pages: a list of 40 is 160 KiB, ten 16 KiB slots


@pytest.fixture
def cu(fake_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVRECV_CUDART", fake_path)
    info = _core.cuda_info()
    if info["loaded"] and info["path"] != fake_path:
        pytest.skip(f"another CUDA runtime ({info['path']}) is already loaded in this process")
    c = Cudart(fake_path)
    yield c
    c.free_all()


def _args(side: MemSide, state, kind):
    a = side.args()
    ptr = state if isinstance(state, int) else state.ctypes.data
    return KVArgs(0, a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, a.aux_data_ptrs,
                  a.aux_data_lens, a.aux_item_lens, state_data_ptrs=[[ptr]],
                  state_data_lens=[[ITEM * ROWS]], state_item_lens=[[ITEM]],
                  state_types=["swa"], mem_kinds=side.kinds + [kind])


@pytest.mark.parametrize("order", ["consecutive", "scattered"])
def test_staged_window_list_fits_the_slots(cu, res, bootstrap, order):
    rng = np.random.default_rng(5)
    src_state = rng.integers(0, 256, size=ITEM * ROWS, dtype=np.uint8)
    dev = cu.malloc(len(src_state))
    cu.upload(dev, src_state)
    dst_state = np.full(ITEM * ROWS, MemSide.CANARY, dtype=np.uint8)
    src, dst = MemSide(cu, L, ["host"] * 3, seed=7), MemSide(cu, L, ["host"] * 3)
    conf = KVConfig(**dict(ROBUST_CONFIG, staging_slots=2, staging_slot_bytes=16 << 10))
    pre = KVManager(_args(src, dev, "cuda"), "prefill", bootstrap_addr=bootstrap.address,
                    config=conf)
    res._managers.append(pre)
    dec = KVManager(_args(dst, dst_state, "host"), "decode", config=conf)
    res._managers.append(dec)
    if order == "consecutive":
        sl, dl = list(range(20, 60)), list(range(0, 40))
    else:
        sl, dl = list(rng.permutation(ROWS)[:40]), list(rng.permutation(ROWS)[:40])
    recv = KVReceiver(dec, bootstrap.address, 1)
    recv.init()
    assert wait_for(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
    recv.send_metadata(np.arange(4, dtype=np.int32), state_indices=[dl])
    send = KVSender(pre, bootstrap.address, 1)
    send.init(4)
    send.send(np.arange(4, 8, dtype=np.int32), state_indices=[sl])
    for r in (recv, send):
        assert wait_for(r, terminal(), 30) == KVPoll.Success, describe_failure(r)
    for s, d in zip(sl, dl):
        assert np.array_equal(dst_state[d * ITEM:(d + 1) * ITEM], src_state[s * ITEM:(s + 1) * ITEM])
    for d in set(range(ROWS)) - set(dl):
        assert (dst_state[d * ITEM:(d + 1) * ITEM] == MemSide.CANARY).all(), d
    ps = pre.stats()
    assert ps["gpu_path"] == "staged", ps["gpu_path_why"]
    # 160 KiB of window pages in 16 KiB slots: at least ten staged messages.
    assert ps["staged_ops"] >= 10 and ps["staged_bytes"] >= 40 * ITEM, ps
    recv.clear()
    send.clear()
