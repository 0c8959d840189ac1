"""sglang's own disaggregation scheduler code over kvrecv, in separate
processes: the driver behind tests/test_sglang_real.py's scheduler tests and
benchmarks/sglang_overhead.py.

What runs is sglang's code, as installed and unpatched:
decode ranks build sglang's DecodeTransferQueue and DecodePreallocQueue
(add, pop_preallocated, pop_transferred, resolve_deferred_releases) with
sglang's MHATokenToKVPool, DecodeReqToTokenPool, TokenToKVPoolAllocator,
radix cache and MetadataBuffers on the CPU; prefill ranks build sglang's
PrefillBootstrapQueue (add, pop_bootstrapped) and call the scheduler mixin's
own send_kv_chunk and process_disagg_prefill_inflight_queue.  The ranks of a
side form a real gloo group (torch.distributed on 127.0.0.1), which sglang's
MIN all-reduce of the polls runs over.  Requests are sglang's Req objects.

Stand-ins, named as such, replace only what sglang would take from a full
Scheduler process (a model runner, the output streamer, metrics): the
objects below whose names end in ``StandIn``.  The forward pass is a stand-in
too: it allocates the request's KV slots with sglang's allocator and writes
a known pattern into them, which the decode compares byte for byte.

Processes: the driver (``Cluster``) imports sglang once, then forks the
bootstrap server and every rank, so that a restart (a killed prefill, a
decode with other settings) costs no second import.
"""

from __future__ import annotations

import array
import dataclasses
import faulthandler
import functools
import datetime
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
import types
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = 2
KV_HEADS_ENV = "KVRECV_TEST_KV_HEADS"  # set per layout in the rank processes


def total_heads() -> int:
    """The model's KV heads (config.json's num_key_value_heads): the
    layout's kv_heads, 4 unless a layout says otherwise."""
    return int(os.environ.get(KV_HEADS_ENV, "4"))
HEAD_DIM = 16
MLA_LORA, MLA_ROPE = 16, 8  # an MLA pool: one latent cache of kv_lora_rank + qk_rope_head_dim
POOL_TOKENS = 4096
RESERVED_DECODE_TOKENS = 16  # sglang's default (512) would not fit the small pool
MAX_CONTEXT = 256
SIDE_TIMEOUT_S = 20  # one scenario on one side; the gloo timeout is the same


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_sglang() -> None:
    """sglang's plugin loader (which finds kvrecv's entry point) and the
    modules the ranks use, imported once in the driver before it forks."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401
    import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
    from sglang.srt.disaggregation.utils import TransferBackend

    if not hasattr(TransferBackend, "KVRECV"):
        raise RuntimeError("sglang's load_plugins() did not register the kvrecv backend")
    # another install of kvrecv (an editable one elsewhere) must not be what runs
    plugin = sys.modules["kvrecv.sglang_plugin"].__file__
    if not os.path.abspath(plugin).startswith(os.path.join(ROOT, "kvrecv") + os.sep):
        raise RuntimeError(f"sglang loaded kvrecv's plugin from {plugin}, not from {ROOT}")


# --- request specs and the KV pattern --------------------------------------


@dataclasses.dataclass
class ReqSpec:
    """One request of a scenario, as both sides see it."""

    rid: str
    room: int
    input_len: int
    chunk: int = 0            # prefill chunk size in tokens, 0: one chunk
    output_id: int = 7
    prefill_abort: bool = False   # every prefill rank aborts it after its first chunk
    prefill_abort_rank: int = -1  # only this prefill rank aborts it there
    prefill_die: bool = False     # every prefill rank is SIGKILLed after its first chunk
    prefill_die_rank: int = -1    # only this prefill rank is SIGKILLed there
    prefill_dp_group: int = -1    # the prefill DP group it is dispatched to (-1: room % dp)
    prefill_hold_s: float = 0.0   # the prefill waits this long before the last chunk
    decode_only: bool = False     # no prefill takes it (an unreachable bootstrap)
    decode_cached: int = 0        # tokens of the prompt the decode's radix tree holds already
    bootstrap_host: str = ""      # default: the cluster's bootstrap server
    bootstrap_port: int = 0
    fake: bool = False            # sglang's fake backend (benchmarks)


def input_ids(spec: ReqSpec) -> List[int]:
    return [(spec.room * 31 + i) % 30000 + 1 for i in range(spec.input_len)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The two instances: attention-TP sizes and the KV pool (sglang's
    MHATokenToKVPool with the rank's share of kv_heads, or with mla its
    MLATokenToKVPool, one latent cache every rank holds whole), and the
    prefill's and the decode's DP groups."""

    prefill_tp: int = 2
    decode_tp: int = 2
    mla: bool = False
    prefill_dp: int = 1  # DP attention: DP groups of prefill_tp ranks
    prefill_pp: int = 1  # PP stages of prefill_tp ranks, each holding LAYERS / prefill_pp layers
    prefill_balance: str = "follow_bootstrap_room"  # the prefill's --load-balance-method
    kv_heads: int = 4  # the model's KV heads; fewer than a TP size: replicated heads
    decode_dp: int = 1  # DP attention on the decode: room r goes to its group r % decode_dp


def rank_heads(tp: int, rank: int) -> slice:
    """The model's KV heads a rank of tp holds, as sglang splits them:
    max(1, heads // tp) a rank; with fewer heads than ranks, head
    rank // (tp // heads) on each of its replicas."""
    heads = total_heads()
    if tp <= heads:
        h = heads // tp
        return slice(rank * h, rank * h + h)
    head = rank // (tp // heads)
    return slice(head, head + 1)


def kv_pattern(room: int, n_tokens: int, tp: int, rank: int, mla: bool):
    """The bytes the prefill's forward stand-in writes for this request, as
    rank `rank` of `tp` holds them: (LAYERS, buffers, n_tokens, heads, dim)
    of int16 (buffers: K and V, or the one MLA cache), cut from the whole
    model's pattern, which depends on the room alone."""
    import torch

    seed = int.from_bytes(hashlib.blake2b(f"{room}".encode(), digest_size=6).digest(), "big")
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 1, n_tokens, 1, MLA_LORA + MLA_ROPE) if mla else \
        (LAYERS, 2, n_tokens, total_heads(), HEAD_DIM)
    full = torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16)
    return full if mla else full[:, :, :, rank_heads(tp, rank)]


def kv_buffers(pool, layer: int, mla: bool) -> list:
    """The pool's buffers of a layer, as int16 views indexed by token slot."""
    import torch

    bufs = [pool.kv_buffer[layer]] if mla else [pool.k_buffer[layer], pool.v_buffer[layer]]
    return [b.view(torch.int16) for b in bufs]


def write_kv(pool, loc, part, mla: bool) -> None:
    """part: every layer of the model; a PP stage's pool holds (and gets)
    only its layers, from pool.start_layer."""
    start = getattr(pool, "start_layer", 0) or 0
    for i in range(pool.layer_num):
        for j, buf in enumerate(kv_buffers(pool, i, mla)):
            buf[loc] = part[start + i, j]


# --- stand-ins for what sglang reads from a full Scheduler -----------------


class OutputStreamerStandIn:
    """sglang's output streamer: records what would go to the client."""

    def __init__(self):
        self.streamed: List[str] = []

    def stream_output(self, reqs, return_logprob, *args, **kwargs):
        self.streamed.extend(r.rid for r in reqs)


def _model_config_stand_in():
    return types.SimpleNamespace(
        num_hidden_layers=LAYERS,
        hf_text_config=types.SimpleNamespace(),
        hf_config=types.SimpleNamespace(),
        get_total_num_kv_heads=total_heads,
    )


def _spy_pages(log: Dict[str, list], cls, name: str, with_prefix: bool = False) -> None:
    """Records, per room, the page count of each call sglang makes to
    cls.name (init, send, send_metadata), and decode_prefix_len where the
    call carries one; the call itself is unchanged."""
    original = getattr(cls, name)

    def spy(self, kv_indices, *args, **kwargs):
        entry = [name, int(kv_indices) if isinstance(kv_indices, int) else len(kv_indices)]
        if with_prefix:
            entry.append(kwargs.get("decode_prefix_len"))
        log.setdefault(str(self.bootstrap_room), []).append(entry)
        return original(self, kv_indices, *args, **kwargs)

    setattr(cls, name, spy)


STALE_OUTPUT_ID = 7  # what a reused metadata row holds from an earlier request


def _stale_rows(meta) -> None:
    """Every metadata row as an earlier request left it: a scenario whose
    requests answer another id shows whether the row the decode reads is the
    one the prefill filled at the last chunk."""
    meta.output_ids[:] = STALE_OUTPUT_ID


def _spy_failures(log: Dict[str, list], cls) -> None:
    """Records what sglang's `except Exception as e:` receives from
    failure_exception(), and re-raises it unchanged."""
    original = cls.failure_exception

    def failure_exception(self):
        try:
            original(self)
        except Exception as e:
            log.setdefault(str(self.bootstrap_room), []).append(
                [type(e).__name__, getattr(e, "failure_reason", None),
                 getattr(e, "is_from_another_rank", None)])
            raise

    cls.failure_exception = failure_exception


# --- rank set-up ----------------------------------------------------------


def model_dir() -> str:
    """A model directory holding only a tiny Llama config.json, so that
    sglang's argument resolution reads it locally (nothing is downloaded)."""
    import json
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"kvrecv-sglang-model-{os.getuid()}-h{total_heads()}")
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": total_heads(),
           "num_hidden_layers": LAYERS, "vocab_size": 32000, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    path = os.path.join(d, "config.json")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, path)
    return d


def _server_args(mode: str, tp: int, bootstrap_port: int, page_size: int, radix: bool,
                 dp: int = 1, balance: str = "auto", pp: int = 1):
    """sglang's ServerArgs of one instance: attention TP tp, in dp DP
    attention groups when dp > 1, with that --load-balance-method, in pp
    PP stages."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=model_dir(), tp_size=tp * dp, dp_size=dp, pp_size=pp,
                      enable_dp_attention=dp > 1, load_balance_method=balance, device="cpu",
                      disaggregation_mode=mode, disaggregation_transfer_backend="kvrecv",
                      disaggregation_bootstrap_port=bootstrap_port, host="127.0.0.1",
                      page_size=page_size, skip_server_warmup=True,
                      num_reserved_decode_tokens=RESERVED_DECODE_TOKENS,
                      disaggregation_decode_enable_radix_cache=radix)


class PPGroupStandIn:
    """The PP group of a rank (sglang's GroupCoordinator of the ranks with
    its TP rank, one a stage), with GroupCoordinator's own send_object and
    recv_object over a gloo group: what pop_bootstrapped's PP poll sync
    (pp_sync_polls) calls."""

    def __init__(self, cpu_group, ranks: List[int], rank: int):
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        self.cpu_group, self.ranks = cpu_group, ranks
        self.world_size, self.rank_in_group = len(ranks), ranks.index(rank)
        self.is_first_rank = self.rank_in_group == 0
        self.is_last_rank = self.rank_in_group == len(ranks) - 1
        self.send_object = types.MethodType(GroupCoordinator.send_object, self)
        self.recv_object = types.MethodType(GroupCoordinator.recv_object, self)


def _init_rank(mode: str, rank: int, tp: int, store_port: int, bootstrap_port: int,
               page_size: int, radix: bool = False, dp: int = 1, balance: str = "auto",
               pp: int = 1):
    """sglang's global parallel state for this rank, the way its own tests
    publish it, plus the gloo groups its queues all-reduce over: the
    attention-TP group of the rank's DP group or PP stage (tp consecutive
    ranks of dp * tp * pp: sglang's world rank is tp_size * pp_rank +
    tp_rank) and, with PP, the rank's PP group."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    sa = _server_args(mode, tp, bootstrap_port, page_size, radix, dp, balance, pp)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    world, timeout = tp * dp * pp, datetime.timedelta(seconds=SIDE_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                            world_size=world, timeout=timeout)
    # each group with that timeout (a collective waiting on a rank gone fails, never hangs)
    new_group = functools.partial(dist.new_group, backend="gloo", timeout=timeout)
    width = tp * dp  # sglang's tp_size: the ranks of one stage
    tp_groups = [new_group(list(range(s * width, s * width + width))) for s in range(pp)]
    attn = [new_group(list(range(d * tp, d * tp + tp))) for d in range(dp * pp)]
    singles = [new_group([r]) for r in range(world)]
    groups = dict(
        attn_tp_group=types.SimpleNamespace(cpu_group=attn[rank // tp], world_size=tp,
                                            rank_in_group=rank % tp),
        tp_group=types.SimpleNamespace(cpu_group=tp_groups[rank // width], world_size=width,
                                       rank_in_group=rank % width))
    pp_group = None
    if pp > 1:
        members = [[t + s * width for s in range(pp)] for t in range(width)]
        made = [new_group(m) for m in members]
        pp_group = groups["pp_group"] = PPGroupStandIn(made[rank % width], members[rank % width],
                                                       rank)
    get_parallel().override_permanently(**groups)
    return sa, attn[rank // tp], singles[rank], pp_group


def _pools(sa, decode: bool, page_size: int, tp: int, mla: bool, radix: bool = False,
           layers: range = range(LAYERS)):
    import torch
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if mla:
        kv = MLATokenToKVPool(POOL_TOKENS, page_size, torch.float16, MLA_LORA, MLA_ROPE, LAYERS,
                              "cpu", False)
    else:
        heads = rank_heads(tp, 0)
        kv = MHATokenToKVPool(POOL_TOKENS, page_size, torch.float16, heads.stop - heads.start,
                              HEAD_DIM, len(layers), "cpu", False, start_layer=layers.start,
                              end_layer=layers.stop - 1, enable_alt_stream=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(POOL_TOKENS, torch.float16, "cpu", kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size, torch.float16, "cpu", kv,
                                            need_sort=False)
    if decode:
        r2t = DecodeReqToTokenPool(64, MAX_CONTEXT, "cpu", False, pre_alloc_size=64)
    else:
        r2t = ReqToTokenPool(64, MAX_CONTEXT, "cpu", False)
    # the tree a scheduler builds for a dense model (mem_cache/registry.py,
    # create_unified_radix_cache), disabled unless the decode enables it
    tree = UnifiedRadixCache(CacheInitParams(disable=not radix, req_to_token_pool=r2t,
                                             token_to_kv_pool_allocator=alloc, page_size=page_size,
                                             tree_components=(ComponentType.FULL,)))
    n_meta = 128
    meta_alloc = ReqToMetadataIdxAllocator(n_meta)
    meta = MetadataBuffers(n_meta, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=sa.sampling_mask_max_tokens)
    return types.SimpleNamespace(kv=kv, alloc=alloc, r2t=r2t, tree=tree, meta=meta,
                                 meta_alloc=meta_alloc)


def make_req(spec: ReqSpec, bootstrap_port: int):
    """sglang's own Req, as its tokenizer manager hands it to a scheduler."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    host = FAKE_BOOTSTRAP_HOST if spec.fake else (spec.bootstrap_host or "127.0.0.1")
    req = Req(spec.rid, "", array.array("q", input_ids(spec)), SamplingParams(max_new_tokens=8),
              bootstrap_host=host, bootstrap_port=spec.bootstrap_port or bootstrap_port,
              bootstrap_room=spec.room, vocab_size=32000)
    return req


class _SchedulerStandIn:
    """What sglang's queue code reads from a Scheduler, and nothing else."""

    def __init__(self, server_args, pools):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.server_args = server_args
        self.model_config = _model_config_stand_in()
        self.tp_worker = types.SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=types.SimpleNamespace(effective_logical_max_total_num_tokens=POOL_TOKENS,
                                               kv_cache_dtype_str="float16"))
        self.random_seed = 0
        self.req_to_token_pool = pools.r2t
        self.token_to_kv_pool_allocator = pools.alloc
        self.tree_cache = pools.tree
        self.req_to_metadata_buffer_idx_allocator = pools.meta_alloc
        self.disagg_metadata_buffers = pools.meta
        self.running_batch = types.SimpleNamespace(reqs=[])
        self.waiting_queue: list = []
        self.last_batch = None
        self.enable_priority_scheduling = False
        self.enable_hisparse = False
        self.enable_lora = False
        self.enable_decode_hicache = False
        self.enable_staging = False
        self.sliding_window_size = None
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.kv_shard_widening = 1
        self.rust_server = None
        self.processed_tokens_counter = 0
        self.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
        self.output_streamer = OutputStreamerStandIn()
        self.batch_result_processor = types.SimpleNamespace(
            _maybe_update_reasoning_tokens=lambda req, token: None)
        self.kv_checksum_computer = None
        self.scheduler_stage_metrics = None
        self.retired: List[str] = []

    def retire_unadmitted_request(self, req) -> None:
        self.retired.append(req.rid)

    def _release_aborted_request(self, req) -> None:
        """The scheduler's own release of an aborted request's metadata slot."""
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        maybe_release_metadata_buffer(req, self.req_to_metadata_buffer_idx_allocator)


def _prefill_scheduler_class():
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    class PrefillSchedulerStandIn(SchedulerDisaggregationPrefillMixin, _SchedulerStandIn):
        """sglang's prefill mixin (send_kv_chunk,
        process_disagg_prefill_inflight_queue, handle_bootstrap_failure, ...)
        on the stand-in's attributes."""

    return PrefillSchedulerStandIn


class _Timer:
    """Wall time spent in each sglang method the loop calls, per call."""

    def __init__(self):
        self.s: Dict[str, float] = {}
        self.n: Dict[str, int] = {}

    def call(self, name, fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
            self.n[name] = self.n.get(name, 0) + 1


def _raised(result: dict, where: str) -> None:
    result.setdefault("raised", []).append(f"{where}: {traceback.format_exc()}")


# --- decode rank ----------------------------------------------------------


class DecodeRank:
    def __init__(self, rank, tp, store_port, bootstrap_port, page_size, mla=False, radix=False,
                 dp=1):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.runtime_context import get_disagg

        from kvrecv.sglang import KVRecvReceiver

        self.bootstrap_port, self.page_size = bootstrap_port, page_size
        self.tp, self.mla, self.dp = tp, mla, dp
        self.rank, self.dp_group = rank % tp, rank // tp  # in the attention-TP group, its group
        sa, self.group, _, _ = _init_rank("decode", rank, tp, store_port, bootstrap_port, page_size,
                                       radix, dp=dp)
        self.failures: Dict[str, list] = {}
        self.pages: Dict[str, list] = {}
        _spy_failures(self.failures, KVRecvReceiver)
        _spy_pages(self.pages, KVRecvReceiver, "send_metadata", with_prefix=True)
        self.p = _pools(sa, True, page_size, tp, mla, radix)
        self.sched = _SchedulerStandIn(sa, self.p)
        self.tq = DecodeTransferQueue(self.p.meta_alloc, self.p.meta, self.sched, self.p.tree)
        self.pq = DecodePreallocQueue(
            self.p.r2t, self.p.alloc, None, self.p.meta_alloc, self.p.meta, self.sched, self.tq,
            self.p.tree, 0, bootstrap_port, POOL_TOKENS, get_disagg().num_reserved_decode_tokens,
            TransferBackend.KVRECV)
        self.sched.disagg_decode_prealloc_queue = self.pq
        # sglang retries an unreachable bootstrap 15 times, once a second;
        # the same loop, a tenth of a second apart, keeps the test short.
        self.pq._ensure_retry_interval = 0.1
        self.free_tokens = self.p.alloc.available_size()

    def _check_bytes(self, req) -> bool:
        import torch

        n = len(req.origin_input_ids)
        loc = self.p.r2t.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        want = kv_pattern(req.bootstrap_room, n, self.tp, self.rank, self.mla)
        return all(torch.equal(buf[loc], want[layer, j]) for layer in range(LAYERS)
                   for j, buf in enumerate(kv_buffers(self.p.kv, layer, self.mla)))

    def _cache_prefix(self, spec: ReqSpec) -> None:
        """An earlier request that shared the first spec.decode_cached tokens
        of the prompt, finished on this decode rank: sglang's radix tree holds
        their KV (this rank's pattern for the request) in pages of sglang's
        allocator."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        n = spec.decode_cached
        loc = self.p.alloc.alloc(n).to(torch.int64)
        pattern = kv_pattern(spec.room, spec.input_len, self.tp, self.rank, self.mla)[:, :, :n]
        write_kv(self.p.kv, loc, pattern, self.mla)
        key = RadixKey(token_ids=array.array("q", input_ids(spec)[:n]), extra_key=None)
        self.p.tree.insert(InsertParams(key=key, value=loc))

    def _empty_tree(self, result: dict) -> None:
        """The radix tree gives back every page it caches; what it still
        protects was never unlocked."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if self.p.tree.disable:
            return
        result["tree_protected"] = self.p.tree.protected_size()
        self.p.tree.evict(EvictParams(num_tokens=self.p.tree.evictable_size()))

    def run(self, specs: List[ReqSpec]) -> dict:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        timer, result, reqs = _Timer(), {"reqs": {}}, {}
        held_max, moved = 0, self.pq.kv_manager.stats()["bytes_moved"]
        self.failures.clear()
        self.pages.clear()
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        specs = [s for s in specs if s.room % self.dp == self.dp_group]  # sglang's DP dispatch
        try:
            if any(s.decode_cached for s in specs):
                _stale_rows(self.p.meta)
            for spec in specs:
                if spec.decode_cached:
                    self._cache_prefix(spec)
            for spec in specs:
                req = make_req(spec, self.bootstrap_port)
                reqs[spec.rid] = req
                timer.call("add", self.pq.add, req)
            while time.monotonic() < deadline:
                timer.call("resolve_deferred_releases", self.tq.resolve_deferred_releases)
                pre, _failed = timer.call("pop_preallocated", self.pq.pop_preallocated)
                self.tq.extend(pre)
                done = timer.call("pop_transferred", self.tq.pop_transferred)
                held_max = max(held_max, self.tq.num_pending_deferred_releases())
                for req in done:
                    out = {"status": "ok", "output_ids": list(req.output_ids),
                           "bytes_ok": self._check_bytes(req)}
                    result["reqs"][req.rid] = out
                    # the request finishes decoding: sglang's own release
                    release_kv_cache(req, self.p.tree, checkpoint=False)
                if not (self.pq.queue or self.pq.pending_reqs or self.tq.queue
                        or self.tq.has_pending_deferred_releases()):
                    break
                time.sleep(0.001)
            else:
                result["timeout"] = {
                    "pending": [d.req.rid for d in self.pq.pending_reqs],
                    "prealloc": [(d.req.rid, d.waiting_for_input, int(d.kv_receiver.poll()))
                                 for d in self.pq.queue if d.kv_receiver is not None],
                    "transfer": [d.req.rid for d in self.tq.queue],
                    "deferred": self.tq.num_pending_deferred_releases(),
                    "prefill_info": list(self.pq.kv_manager.prefill_info_table)}
        except Exception:
            _raised(result, "decode loop")
        for rid, req in reqs.items():
            if isinstance(req.finished_reason, FINISH_ABORT):
                result["reqs"][rid] = {"status": "aborted",
                                       "message": req.finished_reason.message}
        result["streamed"] = list(self.sched.output_streamer.streamed)
        self.sched.output_streamer.streamed.clear()
        result["failures"] = dict(self.failures)
        result["pages"] = dict(self.pages)
        result["held_max"] = held_max
        try:
            self._empty_tree(result)
        except Exception:
            _raised(result, "radix tree eviction")
        result["leaked_tokens"] = self.free_tokens - self.p.alloc.available_size()
        result["leaked_meta"] = self.p.meta.output_ids.shape[0] - self.p.meta_alloc.available_size()
        result["bytes_moved"] = self.pq.kv_manager.stats()["bytes_moved"] - moved
        result["aux_row_bytes"] = sum(self.pq.kv_manager.kv_args.aux_item_lens)
        result["time_s"], result["calls"] = timer.s, timer.n
        return result


# --- prefill rank ---------------------------------------------------------


class PrefillRank:
    def __init__(self, rank, tp, store_port, bootstrap_port, page_size, mla=False, dp=1,
                 balance="auto", pp=1):
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.disaggregation.utils import TransferBackend

        from kvrecv.sglang import KVRecvSender

        self.rank, self.bootstrap_port, self.page_size = rank, bootstrap_port, page_size
        self.tp, self.mla, self.dp = tp, mla, dp
        self.attn_rank, self.dp_group = rank % tp, rank // tp if pp == 1 else 0
        sa, group, single, pp_group = _init_rank("prefill", rank, tp, store_port, bootstrap_port,
                                                 page_size, dp=dp, balance=balance, pp=pp)
        n = LAYERS // pp  # this stage's layers
        layers = range(rank // tp * n, rank // tp * n + n) if pp > 1 else range(LAYERS)
        self.failures: Dict[str, list] = {}
        self.pages: Dict[str, list] = {}
        _spy_failures(self.failures, KVRecvSender)
        _spy_pages(self.pages, KVRecvSender, "init")
        _spy_pages(self.pages, KVRecvSender, "send")
        self.p = _pools(sa, False, page_size, tp, mla, layers=layers)
        self.sched = _prefill_scheduler_class()(sa, self.p)
        self.sched.pp_group = pp_group
        self.sched.attn_tp_cpu_group = group
        self.sched.attn_cp_cpu_group = single
        self.sched.disagg_prefill_inflight_queue = []
        self.sched.disagg_prefill_pending_chunk_rids = set()
        self.bq = PrefillBootstrapQueue(self.p.kv, None, self.p.meta_alloc, self.p.meta, 0,
                                        bootstrap_port, POOL_TOKENS, self.sched, None,
                                        TransferBackend.KVRECV)
        self.sched.disagg_prefill_bootstrap_queue = self.bq
        self.free_tokens = self.p.alloc.available_size()

    def _forward_stand_in(self, req, spec: ReqSpec) -> None:
        """What the prefill forward leaves behind: the request's KV slots,
        allocated by sglang's pools and filled with this rank's pattern, and
        the first output token."""
        import torch

        n = len(req.origin_input_ids)
        self.p.r2t.alloc([req])
        if self.page_size == 1:
            loc = self.p.alloc.alloc(n)
        else:
            loc = self.p.alloc.alloc_extend(
                prefix_lens=torch.tensor([0]), prefix_lens_cpu=torch.tensor([0]),
                seq_lens=torch.tensor([n]), seq_lens_cpu=torch.tensor([n]),
                last_loc=torch.tensor([-1]), extend_num_tokens=n)
        self.p.r2t.write((req.kv.req_pool_idx, slice(0, n)), loc.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = n
        write_kv(self.p.kv, loc.to(torch.int64),
                 kv_pattern(req.bootstrap_room, n, self.tp, self.attn_rank, self.mla), self.mla)
        req.output_ids.append(spec.output_id)

    def run(self, specs: List[ReqSpec]) -> dict:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        timer, result = _Timer(), {"reqs": {}}
        moved = self.bq.kv_manager.stats()["bytes_moved"]
        self.failures.clear()
        self.pages.clear()
        if any(s.decode_cached for s in specs):
            _stale_rows(self.p.meta)
        # the DP group sglang's DP controller hands each room to
        by_rid = {s.rid: s for s in specs if not s.decode_only and self.dp_group ==
                  (s.room % self.dp if s.prefill_dp_group < 0 else s.prefill_dp_group)}
        reqs = {}
        ends: Dict[str, List[int]] = {}
        concluded = set()
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        try:
            for spec in by_rid.values():
                req = make_req(spec, self.bootstrap_port)
                reqs[spec.rid] = req
                timer.call("bootstrap_add", self.bq.add, req, 1 if self.mla else self.p.kv.head_num)
            while time.monotonic() < deadline:
                for req in timer.call("pop_bootstrapped", self.bq.pop_bootstrapped):
                    spec = by_rid[req.rid]
                    self._forward_stand_in(req, spec)
                    n, c = spec.input_len, spec.chunk or spec.input_len
                    ends[req.rid] = list(range(c, n, c)) + [n]
                for rid in list(ends):
                    req, spec = reqs[rid], by_rid[rid]
                    end = ends[rid].pop(0)
                    req.extend_end = end
                    last = not ends[rid]
                    if last:
                        del ends[rid]
                        if spec.prefill_hold_s:
                            time.sleep(spec.prefill_hold_s)
                        self.sched.disagg_prefill_inflight_queue.append(req)
                        timer.call("send_kv_chunk", self.sched.send_kv_chunk, req, last_chunk=True)
                    else:
                        timer.call("send_kv_chunk", self.sched.send_kv_chunk, req)
                        if spec.prefill_die or spec.prefill_die_rank == self.rank:
                            time.sleep(0.2)  # the first chunk is on the wire
                            os.kill(os.getpid(), signal.SIGKILL)
                        if spec.prefill_abort or spec.prefill_abort_rank == self.rank:
                            # the scheduler's abort_request reaching this rank; the
                            # schedule goes on the same on every rank (the gloo
                            # all-reduces need equal queues)
                            req.disagg_kv_sender.abort()
                for req in timer.call("process_inflight",
                                      self.sched.process_disagg_prefill_inflight_queue):
                    concluded.add(req.rid)
                for rid, req in reqs.items():
                    if isinstance(req.finished_reason, FINISH_ABORT) and req not in self.bq.queue:
                        concluded.add(rid)
                if len(concluded) == len(reqs) and not self.sched.disagg_prefill_inflight_queue:
                    break
                time.sleep(0.001)
            else:
                result["timeout"] = True
        except Exception:
            _raised(result, "prefill loop")
        for rid, req in reqs.items():
            fr = req.finished_reason
            result["reqs"][rid] = {"status": "aborted" if isinstance(fr, FINISH_ABORT) else "ok",
                                   "message": getattr(fr, "message", None)}
        result["failures"] = dict(self.failures)
        result["pages"] = dict(self.pages)
        result["leaked_tokens"] = self.free_tokens - self.p.alloc.available_size()
        result["bytes_moved"] = self.bq.kv_manager.stats()["bytes_moved"] - moved
        result["time_s"], result["calls"] = timer.s, timer.n
        return result


# --- processes ------------------------------------------------------------


def _rank_main(conn, cls, env, *args) -> None:
    os.environ.update(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    faulthandler.register(signal.SIGUSR1)  # the driver asks for stacks on a timeout
    try:
        rank = cls(*args)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "close":
            return
        try:
            conn.send(("result", rank.run(arg)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _bootstrap_main(conn, port) -> None:
    from kvrecv.sglang import KVRecvBootstrapServer

    server = KVRecvBootstrapServer(host="127.0.0.1", port=port)
    conn.send(("ready", server.address))
    conn.recv()
    server.close()


class _Proc:
    def __init__(self, target, *args, name=""):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,) + args, daemon=True, name=name)
        self.proc.start()
        child.close()
        self.name = name

    def recv(self, timeout: float):
        if not self.conn.poll(timeout):
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGUSR1)  # its stacks, on stderr
                time.sleep(0.5)
            return ("timeout", f"{self.name}: no answer within {timeout:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(1)
            return ("died", self.proc.exitcode)

    def expect_ready(self, timeout: float = 60):
        kind, info = self.recv(timeout)
        if kind != "ready":
            raise RuntimeError(f"{self.name} failed to start: {info}")
        return info

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", None))
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# Faster than kvrecv's defaults, so that a killed prefill is noticed within
# the test's time: every rank (both sides) reads these KVRECV_* overrides.
KVRECV_ENV = {"KVRECV_HEARTBEAT_INTERVAL_MS": "200", "KVRECV_HEARTBEAT_TIMEOUT_MS": "2000",
              "KVRECV_BOOTSTRAP_TIMEOUT_MS": "20000"}


class Cluster:
    """A bootstrap server, the prefill ranks and the decode ranks of a
    Layout, each in its own process, forked from this one after sglang is
    imported."""

    def __init__(self, layout: Layout = Layout(), page_size: int = 1):
        import_sglang()
        self.layout, self.page_size = layout, page_size
        self.prefill: List[_Proc] = []
        self.decode: List[_Proc] = []
        self._start_bootstrap()

    def _start_bootstrap(self) -> None:
        self.bootstrap_port = free_port()
        self.bootstrap = _Proc(_bootstrap_main, self.bootstrap_port, name="bootstrap")
        self.address = self.bootstrap.expect_ready()

    def relayout(self, layout: Layout) -> None:
        """Every process again, for another layout: a new bootstrap server
        (the old one holds the old prefill's ranks), prefill and decode."""
        for p in self.decode + self.prefill + [self.bootstrap]:
            p.close()
        self.decode, self.prefill, self.layout = [], [], layout
        self._start_bootstrap()
        self.start_prefill()
        self.start_decode()

    def _start(self, cls, n, tp, env, *extra) -> List[_Proc]:
        store = free_port()
        env = dict(KVRECV_ENV, **(env or {}), **{KV_HEADS_ENV: str(self.layout.kv_heads)})
        procs = [_Proc(_rank_main, cls, env, r, tp, store,
                       self.bootstrap_port, self.page_size, self.layout.mla, *extra,
                       name=f"{cls.__name__}{r}")
                 for r in range(n)]
        for p in procs:
            p.expect_ready()
        return procs

    def start_prefill(self, env=None) -> None:
        for p in self.prefill:
            p.close()
        lay = self.layout
        self.prefill = self._start(PrefillRank, lay.prefill_tp * lay.prefill_dp * lay.prefill_pp,
                                   lay.prefill_tp, env, lay.prefill_dp, lay.prefill_balance,
                                   lay.prefill_pp)

    def start_decode(self, env=None, radix: bool = False) -> None:
        """Decode ranks; radix: with sglang's decode radix cache
        (--disaggregation-decode-enable-radix-cache)."""
        for p in self.decode:
            p.close()
        tp, dp = self.layout.decode_tp, self.layout.decode_dp
        self.decode = self._start(DecodeRank, tp * dp, tp, env, radix, dp)

    def run(self, specs: List[ReqSpec], timeout: float = SIDE_TIMEOUT_S + 15) -> dict:
        """Hands the requests to every rank; each runs sglang's queue loop
        until its side has concluded them.  Returns each rank's report."""
        procs = self.decode + self.prefill
        for p in procs:
            p.conn.send(("run", specs))
        out = {"decode": [], "prefill": []}
        deadline = time.monotonic() + timeout
        for side, group in (("decode", self.decode), ("prefill", self.prefill)):
            for p in group:
                kind, info = p.recv(max(1.0, deadline - time.monotonic()))
                out[side].append(info if kind == "result" else {kind: info})
        return out

    def close(self) -> None:
        for p in self.decode + self.prefill + [self.bootstrap]:
            p.close()


# --- the driver's command loop (tests/test_sglang_real.py, benchmarks) -----


def entry_point_dir(parent: str) -> str:
    """A dist-info holding kvrecv's entry point under `parent`, as
    `pip install kvrecv` leaves it (pyproject.toml's [project.entry-points]),
    so that sglang's own load_plugins() finds it."""
    d = os.path.join(parent, "kvrecv-0.0.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvrecv\nVersion: 0.0\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\nkvrecv = kvrecv.sglang_plugin:register\n")
    return parent


class Driver:
    """This file run as a process (main() below), spoken to line by line."""

    def __init__(self, workdir: str, tp: int = 2, start_timeout: float = 120):
        import subprocess

        self.log_path = os.path.join(workdir, "sglang_sched.log")
        self._log = open(self.log_path, "wb")
        path = os.pathsep.join([ROOT, entry_point_dir(workdir)])
        env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(tp)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env)
        self.bootstrap = self._read(start_timeout)["bootstrap"]

    def log_tail(self, n: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def _read(self, timeout: float) -> dict:
        import json
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the sglang driver gave no answer within {timeout:.0f} s "
                               f"(exit {self.proc.poll()}); its log ends:\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the sglang driver failed: {answer['error']}")
        return answer

    def call(self, cmd: str, timeout: float = SIDE_TIMEOUT_S + 30, **kw) -> dict:
        import json

        self.proc.stdin.write((json.dumps(dict(kw, cmd=cmd)) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def run(self, specs: List[ReqSpec], **kw) -> dict:
        return self.call("run", specs=[dataclasses.asdict(s) for s in specs], **kw)

    def close(self) -> None:
        try:
            self.proc.stdin.write(b'{"cmd": "close"}\n')
            self.proc.stdin.close()
            self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


def main() -> None:
    """One JSON command per line on stdin, one JSON answer per line on the
    original stdout (fd 1 is pointed at stderr, where the ranks' logs go):
    {"cmd": "start_prefill"|"start_decode", "env": {...}[, "radix": true]} -> {"ok": true};
    {"cmd": "layout", "layout": {Layout fields}} -> every process again, {"ok": true};
    {"cmd": "run", "specs": [ReqSpec fields...]} -> Cluster.run()'s report;
    {"cmd": "close"}.  Argument: the TP size (default 2)."""
    import json

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cluster = Cluster(Layout(tp, tp))
    try:
        out.write(json.dumps({"ok": True, "bootstrap": cluster.address}) + "\n")
        out.flush()
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "close":
                break
            try:
                if cmd == "start_prefill":
                    cluster.start_prefill(msg.get("env"))
                    answer = {"ok": True}
                elif cmd == "start_decode":
                    cluster.start_decode(msg.get("env"), msg.get("radix", False))
                    answer = {"ok": True}
                elif cmd == "layout":
                    cluster.relayout(Layout(**msg["layout"]))
                    answer = {"ok": True, "bootstrap": cluster.address}
                elif cmd == "run":
                    answer = cluster.run([ReqSpec(**s) for s in msg["specs"]])
                else:
                    answer = {"error": f"unknown command {cmd!r}"}
            except Exception:
                answer = {"error": traceback.format_exc()}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
