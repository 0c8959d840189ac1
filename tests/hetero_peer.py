"""Prefill ranks of one TP size and decode ranks of another, for
tests/test_hetero.py: the model's KV heads, which heads a rank holds, and
the buffers each rank derives from a seed, so that every process agrees on
every byte (tests/failure_peer.py runs a prefill rank of such a layout in a
child process, spec "heads").

A KV buffer page is [PAGE_SIZE tokens][heads of the rank][HEAD_BYTES]; the
model's page p of buffer b holds every head, and a rank's page p holds its
heads of it.
"""

from __future__ import annotations

import numpy as np

NBUF = 4
PAGES = 24
PAGE_SIZE = 2
HEAD_BYTES = 16
AUX_ROWS = 4
AUX_ITEM = 32
CANARY = 0xA5


LAYERS = NBUF // 2  # the model's KV buffers: K of each layer, then V of each layer


def stage_buffers(stage) -> list:
    """The model's KV buffers a pipeline stage {"start", "layers"} holds (all
    of them for None): its layers' K buffers, then their V buffers."""
    if stage is None:
        return list(range(NBUF))
    return [g * LAYERS + stage["start"] + j for g in range(2) for j in range(stage["layers"])]


def rank_heads(tp: int, rank: int, total: int) -> list:
    """The heads rank `rank` of `tp` holds (kvrecv's rule, docs/layouts.md)."""
    if tp <= total:
        n = total // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // total)]


def item_len(tp: int, total: int) -> int:
    return PAGE_SIZE * len(rank_heads(tp, 0, total)) * HEAD_BYTES


def model(seed: int, total: int) -> list:
    """Every KV buffer of the model, all heads: [PAGES, PAGE_SIZE, total, HEAD_BYTES]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(PAGES, PAGE_SIZE, total, HEAD_BYTES), dtype=np.uint8)
            for _ in range(NBUF)]


def stage_seed(seed: int, stage) -> int:
    """The aux rows differ per PP stage, so a test sees which stage's came."""
    return seed if stage is None else seed + 7 * stage["rank"]


def aux_rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(0, 256, size=AUX_ROWS * AUX_ITEM,
                                                    dtype=np.uint8)


def prefill_buffers(seed: int, tp: int, rank: int, total: int, stage=None):
    heads = rank_heads(tp, rank, total)
    m = model(seed, total)
    kv = [np.ascontiguousarray(m[b][:, :, heads, :]).reshape(-1) for b in stage_buffers(stage)]
    return kv, [aux_rows(stage_seed(seed, stage))]


def decode_buffers(tp: int, total: int):
    it = item_len(tp, total)
    return ([np.full(PAGES * it, CANARY, dtype=np.uint8) for _ in range(NBUF)],
            [np.full(AUX_ROWS * AUX_ITEM, CANARY, dtype=np.uint8)])


def expected_decode(seed: int, tp: int, rank: int, total: int, src_pages, dst_pages):
    """What decode rank `rank`'s KV buffers must hold after a room that moved
    prefill pages src_pages into decode pages dst_pages (CANARY elsewhere)."""
    heads = rank_heads(tp, rank, total)
    out = []
    for g in model(seed, total):
        buf = np.full((PAGES, PAGE_SIZE, len(heads), HEAD_BYTES), CANARY, dtype=np.uint8)
        for s, d in zip(src_pages, dst_pages):
            buf[d] = g[s][:, heads, :]
        out.append(buf.reshape(-1))
    return out


def kv_args(kvrecv, kv, aux, tp: int, rank: int, total: int, mla: bool = False, dp: int = 0,
            stage=None, num_layers=None):
    """stage: a prefill PP stage {"size", "rank", "start", "layers"};
    num_layers: the layers of a decode reading one (LAYERS)."""
    heads = {"is_mla": True} if mla else {"kv_head_num": len(rank_heads(tp, rank, total)),
                                          "total_kv_head_num": total}
    if stage is not None:
        heads.update(pp_size=stage["size"], pp_rank=stage["rank"], start_layer=stage["start"],
                     num_layers=stage["layers"])
    elif num_layers is not None:
        heads.update(num_layers=num_layers)
    return kvrecv.KVArgs.from_buffers(rank, kv, [item_len(tp, total)] * len(kv), aux, [AUX_ITEM],
                                      page_size=PAGE_SIZE, tp_size=tp, attn_dp_rank=dp, **heads)
