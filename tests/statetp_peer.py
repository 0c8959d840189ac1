"""State buffers sliced over TP ranks (docs/layouts.md, state_slicing) for
tests/test_state_tp.py, next to tests/hetero_peer.py's KV heads: the
model's state rows, each rank's share of them and its slicing rules,
derived from a seed so that the prefill children (tests/failure_peer.py,
spec "heads" with "state") and the test agree on every byte.

Component 0 is a Mamba layer: a conv state of three groups sliced
independently ([q | k | v], 12, 12 and 24 channels of 6 bytes) and an ssm
state of 24 heads of 20 bytes.  Component 1: a replicated buffer of 72
bytes, and a buffer of 3 outer rows of 12 sliced units of 2 bytes (a conv
state laid out [kernel - 1][channels]).  The units split over 1, 2, 3, 4
and 6 ranks.
"""

from __future__ import annotations

import numpy as np

import hetero_peer as hp

SLOTS = 5
CANARY = 0xA5
# Per buffer: (outer, model units per group, bytes per unit); None: replicated.
BUFFERS = [[(1, [12, 12, 24], 6), (1, [24], 20)], [None, (3, [12], 2)]]
REPLICATED_ITEM = 72


def rules(tp: int) -> list:
    """The state_slicing of a rank of tp ranks."""
    out = []
    for comp in BUFFERS:
        rs = []
        for b in comp:
            if b is None:
                rs.append(0)
            else:
                outer, groups, _ = b
                units = [g // tp for g in groups]
                rs.append({"units": units, "outer": outer} if outer > 1 else
                          (units[0] if len(units) == 1 else units))
        out.append(rs)
    return out


def items(tp: int) -> list:
    return [[REPLICATED_ITEM if b is None else b[0] * sum(b[1]) // tp * b[2] for b in comp]
            for comp in BUFFERS]


def model(seed: int) -> list:
    """Every state buffer of the model, all units: per buffer
    [SLOTS, outer, sum of units, unit bytes] (replicated: [SLOTS, item])."""
    rng = np.random.default_rng(seed + 13)
    out = []
    for comp in BUFFERS:
        out.append([rng.integers(0, 256, size=(SLOTS, REPLICATED_ITEM) if b is None else
                                 (SLOTS, b[0], sum(b[1]), b[2]), dtype=np.uint8)
                    for b in comp])
    return out


def rank_rows(full: np.ndarray, b, tp: int, rank: int) -> np.ndarray:
    """A rank's rows of one buffer: [SLOTS, item]."""
    if b is None:
        return full.copy()
    _, groups, _ = b
    parts, start = [], 0
    for g in groups:
        u = g // tp
        parts.append(full[:, :, start + rank * u:start + (rank + 1) * u, :])
        start += g
    return np.concatenate(parts, axis=2).reshape(SLOTS, -1)


def prefill_state(seed: int, tp: int, rank: int) -> list:
    return [[np.ascontiguousarray(rank_rows(f, b, tp, rank)).reshape(-1)
             for f, b in zip(fs, comp)] for fs, comp in zip(model(seed), BUFFERS)]


def decode_state(tp: int) -> list:
    return [[np.full(SLOTS * it, CANARY, dtype=np.uint8) for it in comp] for comp in items(tp)]


def expected_rows(seed: int, tp: int, rank: int) -> list:
    """Per buffer [SLOTS, item]: rank `rank`'s rows of every slot."""
    return [[rank_rows(f, b, tp, rank) for f, b in zip(fs, comp)]
            for fs, comp in zip(model(seed), BUFFERS)]


def kv_args(kvrecv, kv, aux, tp: int, rank: int, total: int, state, slicing=True):
    return kvrecv.KVArgs.from_buffers(
        rank, kv, [hp.item_len(tp, total)] * hp.NBUF, aux, [hp.AUX_ITEM],
        page_size=hp.PAGE_SIZE, tp_size=tp, kv_head_num=len(hp.rank_heads(tp, rank, total)),
        total_kv_head_num=total, state_buffers=state, state_item_lens=items(tp),
        state_slicing=rules(tp) if slicing else None)
