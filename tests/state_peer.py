"""Per-request state buffers (hybrid models, docs/layouts.md) for
tests/test_state.py: two state components of buffers of different item
lengths, next to failure_peer's KV and aux buffers, derived from a seed so
that the prefill child (tests/failure_peer.py, spec "state") and the test
agree on every byte.  Decode state buffers start as CANARY.
"""

from __future__ import annotations

import numpy as np

import failure_peer as fp

SLOTS = 5
# Component 0 (a Mamba layer: conv state, ssm state), component 1 (one buffer).
ITEMS = [[48, 200], [72]]


def source(seed: int) -> list:
    rng = np.random.default_rng(seed + 7)
    return [[rng.integers(0, 256, size=SLOTS * it, dtype=np.uint8) for it in comp]
            for comp in ITEMS]


def canary(items=ITEMS) -> list:
    return [[np.full(SLOTS * it, fp.CANARY, dtype=np.uint8) for it in comp] for comp in items]


def kv_args(KVArgs, rank: int, kv, aux, state, items=ITEMS):
    return KVArgs.from_buffers(rank, kv, fp.item_lens(), aux, [fp.AUX_ITEM],
                               state_buffers=state, state_item_lens=items)


def row(buf, slot: int) -> np.ndarray:
    it = len(buf) // SLOTS
    return buf[slot * it:(slot + 1) * it]
