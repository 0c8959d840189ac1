"""sglang-shaped KVArgs and server args for a rank of tests/hetero_peer.py's
layouts: the attributes sglang 0.5.23's PrefillBootstrapQueue and
DecodePreallocQueue set on their KVArgs (``_init_kv_manager``), filled from
kvrecv's KVArgs of the same buffers, so that the sglang adapter maps them
itself."""

from __future__ import annotations

import types


def kv_args(args, heads: dict, stage=None):
    """sglang's KVArgs of a rank: engine_rank, the KV and aux buffers,
    page_size, kv_head_num / total_kv_head_num, and for a prefill PP stage
    {"size", "rank", "start", "layers"} its pp_rank, prefill_start_layer and
    prefill_end_layer."""
    import hetero_peer as hp

    a = types.SimpleNamespace(
        engine_rank=args.engine_rank, kv_data_ptrs=list(args.kv_data_ptrs),
        kv_data_lens=list(args.kv_data_lens), kv_item_lens=list(args.kv_item_lens),
        aux_data_ptrs=list(args.aux_data_ptrs), aux_data_lens=list(args.aux_data_lens),
        aux_item_lens=list(args.aux_item_lens), page_size=args.page_size,
        kv_head_num=len(hp.rank_heads(heads["tp"], args.engine_rank, heads["total"])),
        total_kv_head_num=heads["total"], kv_cache_dtype_str="float16", pp_rank=0,
        prefill_start_layer=0, prefill_end_layer=None, num_draft_entries=0)
    a.keep = args  # the buffers stay alive with it
    if args.state_data_ptrs:  # tests/statetp_peer.py's components, as sglang describes them
        a.state_types = ["mamba"] * len(args.state_data_ptrs)
        a.state_data_ptrs, a.state_data_lens, a.state_item_lens = (
            [list(c) for c in getattr(args, name)]
            for name in ("state_data_ptrs", "state_data_lens", "state_item_lens"))
        a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_conv_shard_groups = \
            state_slicing_fields(heads["tp"])
    if stage is not None:
        a.pp_rank, a.prefill_start_layer = stage["rank"], stage["start"]
        a.prefill_end_layer = stage["start"] + stage["layers"]
    return a


def state_slicing_fields(tp: int):
    """sglang's state_dim_per_tensor, state_slice_outer_counts and
    state_conv_shard_groups of tests/statetp_peer.py's buffers on a rank of
    tp: this rank's units of the sliced axis (0: replicated), the rows
    before it, and the model's sub-blocks of a buffer of several groups."""
    import statetp_peer as stp

    dims = [[0 if b is None else sum(b[1]) // tp for b in comp] for comp in stp.BUFFERS]
    outer = [[1 if b is None else b[0] for b in comp] for comp in stp.BUFFERS]
    groups = [[list(b[1]) if b is not None and len(b[1]) > 1 else None for b in comp]
              for comp in stp.BUFFERS]
    return dims, outer, groups


def server_args(http_addr: str, tp: int, pp: int, config):
    """The fields of sglang's ServerArgs the adapter reads."""
    return types.SimpleNamespace(host="127.0.0.1",
                                 disaggregation_bootstrap_port=int(http_addr.rpartition(":")[2]),
                                 tp_size=tp, pp_size=pp, kvrecv_config=config)


def prefill(args, heads: dict, http_addr: str, config):
    """(sglang's KVArgs, server args) of a prefill rank of tests/failure_peer.py's
    spec "heads" (with "pp": the stage)."""
    stage = heads.get("pp")
    return (kv_args(args, heads, stage),
            server_args(http_addr, heads["tp"], stage["size"] if stage else 1, config))
