"""State components that take a list of slots per request (sliding-window
pages, docs/layouts.md) for tests/test_state_list.py: a Mamba component of
one slot per request next to a sliding-window component of two buffers
(K and V of one window layer) indexed by a list of slots, beside
failure_peer's KV and aux buffers, derived from a seed so that the prefill
child (tests/failure_peer.py, spec state "list") and the test agree on
every byte.  Decode state buffers start as CANARY.
"""

from __future__ import annotations

import numpy as np

import failure_peer as fp

# Rows per component: Mamba slots, window pages.
ROWS = [5, 40]
ITEMS = [[48, 200], [64, 96]]
TYPES = ["mamba", "swa"]


def source(seed: int, items=ITEMS) -> list:
    rng = np.random.default_rng(seed + 11)
    return [[rng.integers(0, 256, size=ROWS[c] * it, dtype=np.uint8) for it in comp]
            for c, comp in enumerate(items)]


def canary(items=ITEMS) -> list:
    return [[np.full(ROWS[c] * it, fp.CANARY, dtype=np.uint8) for it in comp]
            for c, comp in enumerate(items)]


def kv_args(KVArgs, rank: int, kv, aux, state, items=ITEMS, types=TYPES):
    return KVArgs.from_buffers(rank, kv, fp.item_lens(), aux, [fp.AUX_ITEM],
                               state_buffers=state, state_item_lens=items, state_types=types)


def row(buf, c: int, slot: int) -> np.ndarray:
    it = len(buf) // ROWS[c]
    return buf[slot * it:(slot + 1) * it]
