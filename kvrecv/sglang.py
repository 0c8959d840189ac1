"""An sglang transfer backend over kvrecv.

The classes here take the constructor and method signatures that sglang's
disaggregation schedulers call (``kv_manager_class(kv_args, mode,
server_args, is_mla_backend)``, ``kv_sender_class(mgr=, bootstrap_addr=,
bootstrap_room=, dest_tp_ranks=, pp_rank=)``, ``kv_receiver_class(mgr=,
bootstrap_addr=, bootstrap_room=)``, ``kv_bootstrap_server_class(host=,
port=)``) and map them onto kvrecv's KVManager / KVSender / KVReceiver /
BootstrapServer.  The scheduler's objects are read through their
attributes; sglang itself is imported only where it already runs (its
attention-TP group, its model config of the server args).  See
docs/sglang.md for how to register the backend.

Layouts (docs/sglang.md, docs/layouts.md): prefill and decode of different
attention-TP sizes (MHA/GQA head slices, MLA), a prefill of several DP
attention groups behind one bootstrap server, and a prefill of several PP
stages (each sending its layers).

A decode radix-cache prefix is supported: the decode's
``send_metadata(..., decode_prefix_len=N)`` names only the pages after the N
tokens it already holds, N travels with its request, and the prefill's
``pop_decode_prefix_len()`` returns it so the prefill scheduler sends from
token N on (``init()`` with the remaining page count).

Hybrid-model state: Mamba state buffers (``kv_args.state_types`` MAMBA,
``state_data_ptrs/lens/item_lens``) move with the room, one slot per state
type from ``state_indices`` on both sides, sliced across attention TP sizes
by sglang's state_dim_per_tensor / state_slice_outer_counts /
state_conv_shard_groups (docs/layouts.md).  Sliding-window pages (SWA) move
as a list of pages per request, equal lengths on both sides, between equal
attention TP sizes.  Other state types (DSA, ...) are refused at creation; a
manager with none registered fails a room given non-empty ``state_indices``
with a reason that says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from . import _core
from ._api import BootstrapServer, KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender
from ._core import KVAbortedError, KVBootstrapError, KVTransferError
from .sglang_http import HTTPBootstrap, fetch_json

_log = logging.getLogger("kvrecv")

__all__ = [
    "KVRecvArgs",
    "KVRecvBootstrapServer",
    "KVRecvManager",
    "KVRecvReceiver",
    "KVRecvSender",
    "KVTransferMetric",
    "KVPoll",
    "KVTransferError",
    "mode_name",
]

_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class KVRecvArgs:
    """A plain attribute bag, like sglang's KVArgs (instantiated with no
    arguments; the scheduler fills the fields)."""

    engine_rank: int = 0
    kv_data_ptrs: List[int] = []
    kv_data_lens: List[int] = []
    kv_item_lens: List[int] = []
    aux_data_ptrs: List[int] = []
    aux_data_lens: List[int] = []
    aux_item_lens: List[int] = []
    page_size: int = 1


@dataclasses.dataclass
class KVTransferMetric:
    """Same fields as sglang's KVTransferMetric."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


def mode_name(disaggregation_mode: Any) -> str:
    """"prefill" or "decode" from sglang's DisaggregationMode (an enum whose
    .value is the string), from a plain string, or from anything whose str()
    ends with PREFILL/DECODE."""
    value = getattr(disaggregation_mode, "value", disaggregation_mode)
    text = str(value).strip().lower()
    for mode in ("prefill", "decode"):
        if text == mode or text.endswith("." + mode):
            return mode
    raise ValueError(f"disaggregation_mode {disaggregation_mode!r} is neither prefill nor decode")


_WILDCARD = ("", "0.0.0.0", "::", "[::]")


def _connect_host(host: Optional[str]) -> str:
    """Where this machine reaches its own listener on `host`."""
    return "127.0.0.1" if not host or host in _WILDCARD else host


def _route_source(target: str) -> Optional[str]:
    """The local address the kernel would send from to reach target (a UDP
    connect() sends nothing), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def advertise_host(host: Optional[str], peer_host: str, server_args: Any = None) -> str:
    """The address this rank listens on and advertises to its peers.

    KVRECV_ADVERTISE_HOST (or server_args.kvrecv_advertise_host) wins; then a
    concrete ``host``; for a wildcard host (sglang's usual 0.0.0.0), the
    address of the interface that reaches peer_host (the bootstrap server),
    or, when that is loopback, the interface of the default route (another
    machine could not reach 127.0.0.1); loopback only if there is none."""
    override = os.environ.get("KVRECV_ADVERTISE_HOST") or \
        getattr(server_args, "kvrecv_advertise_host", None)
    if override:
        return str(override)
    if host and host not in _WILDCARD:
        return host
    for target in (peer_host, "192.0.2.1"):  # the second: any non-local address
        src = _route_source(target) if target else None
        if src and not src.startswith("127."):
            return src
    return "127.0.0.1"


def _seq(value) -> list:
    if value is None:
        return []
    return [int(v) for v in value]


def _has_state(state_indices) -> bool:
    """True if state_indices names any state slot.  sglang passes None, a
    list with one entry per state type (each None, a list or an array), or a
    flat list of slots."""
    if state_indices is None:
        return False
    for entry in state_indices:
        if entry is None:
            continue
        if not hasattr(entry, "__len__") or len(entry):
            return True
    return False


# Addresses whose latest try_ensure_parallel_info failed, kept with the reason
# (a bound: the addresses come from the requests).
_MAX_BOOTSTRAP_FAILURES = 1024

_NO_STATE = ("this manager registered no state buffers (kv_args.state_types is empty), so "
             "state_indices={!r} cannot be transferred")
# The state types kvrecv moves (state.c): Mamba, one slot per request;
# sliding-window pages, a list of slots per request (kvrecv's
# LIST_STATE_TYPES).  Buffers of their own item length.
_STATE_TYPES = ("mamba", "swa")


def _state_slicing(args: Any, tp: int) -> Optional[list]:
    """kvrecv's state_slicing from sglang's per-buffer TP slicing fields:
    ``state_dim_per_tensor`` (this rank's units of the sliced axis, 0:
    replicated), ``state_slice_outer_counts`` (rows before that axis, 1 if
    absent) and ``state_conv_shard_groups`` (the model's sub-blocks sliced
    independently, e.g. GDN's [key_dim, key_dim, value_dim]; sglang uses
    them only when they add up to the model's units, and so does this).
    None when sglang gives no dims, or not one per state buffer."""
    items = getattr(args, "state_item_lens", None) or []
    dims = getattr(args, "state_dim_per_tensor", None) or []
    if not dims or len(dims) != len(items) or \
            any(len(d or ()) != len(i or ()) for d, i in zip(dims, items)):
        return None

    def field(name, c, k, default):
        v = getattr(args, name, None) or []
        return v[c][k] if c < len(v) and v[c] is not None and k < len(v[c]) else default

    out = []
    for c, comp in enumerate(dims):
        rules: List[Any] = []
        for k, dim in enumerate(comp):
            dim, outer = int(dim), int(field("state_slice_outer_counts", c, k, 1) or 1)
            groups = field("state_conv_shard_groups", c, k, None)
            units: Any = dim
            if dim and groups and sum(groups) == dim * tp and all(g % tp == 0 for g in groups):
                units = [int(g) // tp for g in groups]
            rules.append(0 if dim == 0 else
                         {"units": units, "outer": outer} if outer != 1 else units)
        out.append(rules)
    return out


def _state_args(args: Any, tp: int = 1) -> dict:
    """The KVArgs state fields from sglang's KVArgs (with state_slicing
    from its slicing fields, for an attention-TP size of tp);
    NotImplementedError for a state type kvrecv does not move."""
    types = list(getattr(args, "state_types", None) or ())
    names = [str(getattr(t, "value", t)) for t in types]  # sglang's StateType is a str enum
    bad = [n for n in names if n not in _STATE_TYPES]
    if bad:
        raise NotImplementedError(
            f"kvrecv moves state types {list(_STATE_TYPES)} only (Mamba slots, sliding-window "
            f"pages); state_types {bad!r} are not supported")
    if not types:
        return {}
    out: dict = {k: [_seq(c) for c in getattr(args, k)]
                 for k in ("state_data_ptrs", "state_data_lens", "state_item_lens")}
    out["state_types"] = names
    slicing = _state_slicing(args, tp)
    if slicing is not None:
        out["state_slicing"] = slicing
    return out


@dataclasses.dataclass
class PrefillInfo:
    """What ``GET /route`` says of a prefill instance: the fields of sglang's
    PrefillServerInfo that its decode scheduler reads (dp_size,
    follow_bootstrap_room) and that kvrecv checks, plus the rendezvous."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    rendezvous: str


def _parallel(server_args: Any) -> dict:
    """This instance's parallel sizes, as sglang's server args give them."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
    balance = str(getattr(server_args, "load_balance_method", None) or "auto")
    if balance == "auto":  # a prefill's, as sglang resolves it (serving_hook.py)
        balance = "follow_bootstrap_room"
    return {"attn_tp_size": tp // dp if dp_attention else tp, "dp_size": dp,
            "dp_attention": dp_attention, "load_balance_method": balance,
            "pp_size": int(getattr(server_args, "pp_size", 1) or 1),
            "cp_size": int(getattr(server_args, "attn_cp_size", 1) or 1)}


def _attn_rank(args: Any, par: dict) -> tuple:
    """(rank in the attention-TP group, DP group) of sglang's engine_rank.
    sglang's prefill passes its TP rank; with DP attention, the ranks of DP
    group d are d * attn_tp_size ... (d + 1) * attn_tp_size - 1 (sglang's
    own attn_dp_rank and attn_tp_rank); its decode passes the rank within
    the attention-TP group already."""
    rank = int(getattr(args, "engine_rank", 0) or 0)
    if par["dp_attention"]:
        return rank % par["attn_tp_size"], rank // par["attn_tp_size"]
    return rank, 0


class KVRecvManager(KVManager):
    """sglang's ``kv_manager_class(kv_args, disaggregation_mode, server_args,
    is_mla_backend)``.

    ``kv_args`` stays sglang's own object (its schedulers read it back);
    kvrecv's KVArgs built from it is ``kvrecv_args``.  Fields read from
    server_args (each optional): ``host``, ``disaggregation_bootstrap_port``
    (default 8998: sglang's bootstrap server of the prefill instance, which
    for this backend is KVRecvBootstrapServer), ``tp_size``, ``dp_size``,
    ``pp_size``.  ``KVRECV_ADVERTISE_HOST`` (or ``kvrecv_advertise_host``)
    overrides the address this rank advertises; ``kvrecv_config`` may carry a
    KVConfig, and KVRECV_* environment variables override its fields.

    A prefill with DP attention registers each DP group's ranks under their
    group (``KVArgs.attn_dp_rank``): a decode reads the group sglang's
    decode picks, init(prefill_dp_rank).

    A prefill PP stage registers as its pp_rank and holds the layers from
    ``kv_args.prefill_start_layer``; a decode reads every stage.

    Refused at creation, with the reason: state types other than Mamba, a
    prefill with CP, or with more than one DP replica without DP attention
    (the rendezvous would need their system DP rank), a decode with PP
    stages, a PP stage whose KV buffers are not one pool's layers.

    In an sglang scheduler the manager joins the other ranks of its
    attention-TP group as siblings (set_siblings(), endpoints gathered over
    the group's gloo group; ``siblings`` lists them, [] when not joined), so
    every rank raises the origin's cause of a failed room.
    """

    supports_host_destination = False
    # A kvrecv room reports Failed only once none of its bytes can land any
    # more (its in-flight operations drained), so the decode may hold pages
    # until then: is_abort_release_safe() says when.
    enable_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False):
        mode = mode_name(disaggregation_mode)
        par = _parallel(server_args)
        state = _state_args(args, par["attn_tp_size"])
        system_dp = par["dp_size"] if not par["dp_attention"] else 1
        if mode == "prefill" and (system_dp > 1 or par["cp_size"] > 1):
            raise NotImplementedError(
                f"kvrecv serves a prefill of DP groups with DP attention, without CP "
                f"(dp_size={par['dp_size']}, enable_dp_attention={par['dp_attention']}, "
                f"attn_cp_size={par['cp_size']})")
        if mode == "decode" and par["pp_size"] > 1:
            raise NotImplementedError(
                f"kvrecv serves a decode of one PP stage, reading a prefill of any PP size "
                f"(this decode has pp_size={par['pp_size']})")
        rank, dp_group = _attn_rank(args, par)
        if isinstance(args, KVArgs):
            kv_args = args
        else:
            kv_args = KVArgs(
                rank,
                _seq(getattr(args, "kv_data_ptrs", ())),
                _seq(getattr(args, "kv_data_lens", ())),
                _seq(getattr(args, "kv_item_lens", ())),
                _seq(getattr(args, "aux_data_ptrs", ())),
                _seq(getattr(args, "aux_data_lens", ())),
                _seq(getattr(args, "aux_item_lens", ())),
                page_size=int(getattr(args, "page_size", 1) or 1),
                tp_size=par["attn_tp_size"],
                **_head_layout(rank, args, is_mla_backend, par["attn_tp_size"], server_args),
                attn_dp_rank=dp_group if mode == "prefill" else 0,
                **_pp_layout(mode, args, is_mla_backend, par["pp_size"]),
                **state,
            )
        host = getattr(server_args, "host", None)
        port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998) or 8998)
        config = getattr(server_args, "kvrecv_config", None) or KVConfig()
        self.http_bootstrap_addr = f"{_connect_host(host)}:{port}"
        rendezvous = getattr(server_args, "kvrecv_bootstrap_addr", None)
        if mode == "prefill" and not rendezvous:
            rendezvous = _wait_rendezvous(self.http_bootstrap_addr,
                                          config.resolved()["bootstrap_timeout_ms"] / 1000)
        peer_host = (rendezvous or self.http_bootstrap_addr).rpartition(":")[0]
        super().__init__(kv_args, mode, bootstrap_addr=rendezvous or None,
                         host=advertise_host(host, peer_host, server_args), config=config)
        self.kvrecv_args = kv_args
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.page_bytes = sum(kv_args.kv_item_lens)
        self.aux_row_bytes = sum(kv_args.aux_item_lens)
        self.parallel = par
        self.prefill_info_table: Dict[str, PrefillInfo] = {}
        self._bootstrap_failures: Dict[str, str] = {}
        self._aborted: Dict[int, "KVRecvReceiver"] = {}
        self._executor = None
        self.siblings: List[str] = []
        try:
            self.siblings = _attn_tp_endpoints(self.endpoint)
            if len(self.siblings) > 1:
                self.set_siblings(self.siblings)
        except _WrongSiblings:
            self.close()
            raise
        except Exception as e:  # a peer that died, a gloo timeout, a refused endpoint
            _log.warning("kvrecv: %s rank %d could not learn its sibling ranks over sglang's "
                         "attention-TP group (%s: %s); a rank whose part of a room succeeded "
                         "will raise the generic cause when another rank's part fails", mode,
                         kv_args.engine_rank, type(e).__name__, e)
            self.siblings = []
        if mode == "prefill":
            self._register_route(port)

    def _register_route(self, port: int) -> None:
        """PUT /route: this rank in sglang's rank table of the bootstrap
        server, so that sglang's GET /route and /health see the instance."""
        par, args, layers = self.parallel, self.kv_args, self.kvrecv_args.layers
        host, _, ctl_port = self.endpoint[len("tcp://"):].rpartition(":")
        body = {
            "attn_tp_size": par["attn_tp_size"], "attn_tp_rank": int(self.kvrecv_args.engine_rank),
            "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": par["dp_size"] if par["dp_attention"] else 1,
            "attn_dp_rank": int(self.kvrecv_args.attn_dp_rank),
            "pp_size": par["pp_size"], "pp_rank": layers[1] if layers else 0,
            "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": host, "rank_port": int(ctl_port),
            "page_size": int(getattr(args, "page_size", 1) or 1),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype_str", None),
            "instance_id": str(getattr(self.server_args, "kvrecv_instance_id", "") or
                               f"{getattr(self.server_args, 'host', '')}:"
                               f"{getattr(self.server_args, 'port', '')}:{port}"),
            "kvrecv_endpoint": self.endpoint,
            "load_balance_method": par["load_balance_method"],
        }
        status, text = fetch_json(self.http_bootstrap_addr, "/route", method="PUT", body=body)
        if status != 200:
            self.close()
            raise RuntimeError(f"kvrecv: the bootstrap server {self.http_bootstrap_addr} refused "
                               f"rank {body['attn_tp_rank']} of DP group "
                               f"{body['attn_dp_rank']}: {status} {text}")

    def dp_group_reason(self, room: int) -> Optional[str]:
        """A prefill of several DP groups, for a room sglang dispatched to
        this rank's group: None if the decode will find the group, else why
        not.  Following the bootstrap room (sglang's default), the decode
        takes group room % dp_size: another group fails the room, as in
        sglang's own backends.  Otherwise the room's group is registered
        (POST /register_dp_rank) for the decode's /query_dp_ranks."""
        dp, group = self.parallel["dp_size"], self.kvrecv_args.attn_dp_rank
        if not self.parallel["dp_attention"] or dp <= 1:
            return None
        if self.parallel["load_balance_method"] == "follow_bootstrap_room":
            if room % dp == group:
                return None
            return (f"follow_bootstrap_room conflict: room {room} was dispatched to prefill DP "
                    f"group {group}, but the decode reads it from group {room % dp} "
                    f"(room % dp_size {dp})")
        try:
            status, text = fetch_json(self.http_bootstrap_addr, "/register_dp_rank", method="POST",
                                      body={"bootstrap_room": room, "dp_rank": group})
            if status == 200:
                return None
            got = f"{status} {text}"
        except OSError as e:
            got = f"{type(e).__name__}: {e}"
        return (f"could not register room {room} with prefill DP group {group} at the bootstrap "
                f"server {self.http_bootstrap_addr}: {got}")

    def register_to_bootstrap(self) -> None:
        """A prefill manager registers with the bootstrap server when it is
        created; nothing left to do."""

    # --- decode: sglang's DecodePreallocQueue ---------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt (sglang retries) to learn the prefill instance at
        bootstrap_addr: its parallel info and kvrecv rendezvous.  Never
        raises; a refusal is logged with its reason and returns False, and
        the reason is kept (bootstrap_failure()) for the receivers sglang
        aborts once its retries ran out."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            status, data = fetch_json(bootstrap_addr, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                                      "&target_tp_rank=-1&target_pp_rank=-1")
            if status != 200 or not isinstance(data, dict):
                return self._not_learnt(bootstrap_addr, logging.WARNING,
                                        f"GET /route answered {status} {data!r:.200}")
            status, rv = fetch_json(bootstrap_addr, "/kvrecv")
            if status != 200 or not isinstance(rv, dict) or "rendezvous" not in rv:
                return self._not_learnt(bootstrap_addr, logging.ERROR,
                                        f"not a kvrecv bootstrap server (GET /kvrecv answered "
                                        f"{status} {rv!r:.200})")
            info = PrefillInfo(**{f.name: data.get(f.name) for f in dataclasses.fields(PrefillInfo)
                                  if f.name != "rendezvous"}, rendezvous=str(rv["rendezvous"]))
        except (OSError, ValueError, TypeError) as e:
            return self._not_learnt(bootstrap_addr, logging.WARNING, f"{type(e).__name__}: {e}")
        page_size = int(getattr(self.kv_args, "page_size", 1) or 1)
        if info.page_size is not None and info.page_size != page_size:
            return self._not_learnt(bootstrap_addr, logging.ERROR,
                                    f"the prefill has page_size={info.page_size}, this decode "
                                    f"{page_size}")
        if info.attn_tp_size != self.parallel["attn_tp_size"] and self.kvrecv_args.heads is None:
            return self._not_learnt(bootstrap_addr, logging.ERROR,
                                    f"the prefill has attention TP {info.attn_tp_size}, this "
                                    f"decode {self.parallel['attn_tp_size']}; other TP sizes "
                                    "need the KV head layout (kv_head_num, total_kv_head_num, "
                                    "or an MLA backend)")
        host = bootstrap_addr.rpartition(":")[0]
        rv_host, _, rv_port = info.rendezvous.rpartition(":")
        if rv_host in ("0.0.0.0", "::", "[::]", ""):
            info.rendezvous = f"{host}:{rv_port}"
        self.prefill_info_table[bootstrap_addr] = info
        self._bootstrap_failures.pop(bootstrap_addr, None)
        return True

    def _not_learnt(self, bootstrap_addr: str, level: int, why: str) -> bool:
        """A failed try_ensure_parallel_info: logged, and kept as the
        address's latest failure (the oldest address is forgotten beyond
        _MAX_BOOTSTRAP_FAILURES: the addresses come from requests)."""
        _log.log(level, "kvrecv: could not learn the prefill at %s: %s", bootstrap_addr, why)
        self._bootstrap_failures.pop(bootstrap_addr, None)
        self._bootstrap_failures[bootstrap_addr] = why
        while len(self._bootstrap_failures) > _MAX_BOOTSTRAP_FAILURES:
            del self._bootstrap_failures[next(iter(self._bootstrap_failures))]
        return False

    def bootstrap_failure(self, bootstrap_addr: str) -> Optional[str]:
        """Why the latest try_ensure_parallel_info(bootstrap_addr) failed;
        None if it has not failed since it last succeeded."""
        return self._bootstrap_failures.get(bootstrap_addr)

    def _ensure_prefill_recompute_executor(self):
        """The worker sglang's decode runs ``query_prefill_dp_ranks`` on."""
        if self._executor is None:
            import concurrent.futures

            self._executor = concurrent.futures.ThreadPoolExecutor(1, "kvrecv-dp-query")
        return self._executor

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return False

    # --- decode: deferred release of a failed room's pages ---------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once no byte of the room can land in the decode's pages any
        more: its kvrecv room has reached Failed (which the core reports only
        after the room's in-flight operations drained), or was never
        started here."""
        rcv = self._aborted.get(bootstrap_room)
        return rcv is None or rcv.drained()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self._aborted.pop(bootstrap_room, None)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        super().close()


class _WrongSiblings(RuntimeError):
    """The gathered sibling set is not this group's: sharing causes with it
    would put one rank's cause on rooms of unrelated ranks."""


def _pp_layout(mode: str, args: Any, is_mla: Optional[bool], pp_size: int) -> dict:
    """The layers of sglang's KV buffers for kvrecv's KVArgs: an MHA pool
    lists K of every layer, then V (num_layers = half the buffers), an MLA
    pool one buffer per layer.  A prefill PP stage adds its pp_rank and
    ``prefill_start_layer``.  Both sides give num_layers, so that a decode
    (which does not know the prefill's PP size when it is made) pairs with a
    prefill of one stage or of several.  Draft-model buffers appended to
    the list (``num_draft_entries``) or an odd MHA count leave the layers
    out: rank to rank only, and a PP prefill is refused."""
    n = len(getattr(args, "kv_data_ptrs", None) or ())
    drafts = int(getattr(args, "num_draft_entries", 0) or 0)
    layers = n if is_mla else n // 2
    if drafts or layers <= 0 or (not is_mla and n % 2):
        if mode == "prefill" and pp_size > 1:
            raise NotImplementedError(
                f"kvrecv moves a PP stage's layers only when its KV buffers are the layers "
                f"of one pool (K then V, or one MLA buffer per layer): this stage has {n} KV "
                f"buffers, {drafts} of them draft-model buffers")
        return {}
    if mode == "decode" or pp_size == 1:
        return {"num_layers": layers}
    return {"num_layers": layers, "pp_size": pp_size,
            "pp_rank": int(getattr(args, "pp_rank", 0) or 0),
            "start_layer": int(getattr(args, "prefill_start_layer", 0) or 0)}


def _head_layout(rank: int, args: Any, is_mla: Optional[bool], attn_tp: int,
                 server_args: Any = None) -> dict:
    """The KV head layout of sglang's KVArgs for kvrecv's: MLA backends hold
    one latent cache per rank; MHA/GQA pools give kv_head_num and
    total_kv_head_num.  sglang's prefill sets both; its decode sets them only
    with staging, after the manager is made, so without them the layout is
    sglang's own rule for the pool's head count, max(1, total // attn_tp),
    with the total from the model config of server_args (_model_kv_heads).
    None of these: a rank pairs with a prefill rank of its own TP size."""
    if not 0 <= rank < attn_tp:
        return {}  # not an attention-TP rank number: rank to rank only
    if is_mla:
        return {"is_mla": True}
    heads = getattr(args, "kv_head_num", None)
    total = getattr(args, "total_kv_head_num", None)
    if isinstance(heads, int) and isinstance(total, int) and heads > 0 and total > 0:
        return {"kv_head_num": heads, "total_kv_head_num": total}
    total = _model_kv_heads(server_args)
    if total is None:
        return {}
    heads = max(1, total // attn_tp)
    page = int(getattr(args, "page_size", 1) or 1)
    items = _seq(getattr(args, "kv_item_lens", ()))
    if not items or any(i % (page * heads) for i in items):
        _log.warning("kvrecv: the model has %d KV heads, %d per rank of attention TP %d, but "
                     "kv_item_lens %s are not page_size %d x %d heads x bytes per head; this "
                     "rank pairs only with a prefill of its own TP size", total, heads, attn_tp,
                     items, page, heads)
        return {}
    return {"kv_head_num": heads, "total_kv_head_num": total}


def _model_kv_heads(server_args: Any) -> Optional[int]:
    """The model's total KV heads from sglang's model config of server_args
    (built once and kept on server_args by sglang), or None outside an
    sglang process or when it cannot be read.  Nothing is imported unless
    sglang's server args are."""
    if "sglang.srt.server_args" not in sys.modules or not getattr(server_args, "model_path", None):
        return None
    try:
        from sglang.srt.arg_groups.overrides import model_config_of

        total = int(model_config_of(server_args).get_total_num_kv_heads())
    except Exception as e:  # a config sglang itself could not read: no head layout
        _log.warning("kvrecv: could not read the model's KV head count (%s: %s); this rank "
                     "pairs only with a prefill of its own TP size", type(e).__name__, e)
        return None
    return total if total > 0 else None


def _attn_tp_endpoints(endpoint: str) -> List[str]:
    """Every rank's kvrecv endpoint in sglang's attention-TP group of this
    process (the ranks whose polls sglang's queues MIN-reduce), gathered
    over the group's CPU (gloo) group, in group-rank order; [] outside an
    sglang scheduler (no process group, no attention-TP group published)
    or in a group of one.

    Every rank of the group creates its manager in the scheduler's
    init_disaggregation, in the same order, so the collective is met on
    every rank.  Nothing is imported unless torch.distributed is already in
    use: a process without a process group pays no import."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    try:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().attn_tp_group.cpu_group
    except (ImportError, AttributeError, RuntimeError):  # not an sglang scheduler process
        return []
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size <= 1:
        return []
    got: List[Any] = [None] * size
    dist.all_gather_object(got, endpoint, group=group)
    if got[rank] != endpoint or len(set(map(str, got))) != size or \
            not all(isinstance(ep, str) and ep.startswith("tcp://") for ep in got):
        raise _WrongSiblings(f"kvrecv: the attention-TP group gathered {got!r} as its ranks' "
                             f"endpoints, which is not one distinct endpoint per rank with "
                             f"{endpoint!r} at rank {rank}; refusing to share failure causes "
                             "with it")
    return got


def _wait_rendezvous(http_addr: str, timeout_s: float) -> str:
    """The kvrecv rendezvous of the bootstrap server at http_addr (GET
    /kvrecv), retried until timeout_s: sglang may start the prefill's
    schedulers before its bootstrap server listens."""
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        try:
            status, data = fetch_json(http_addr, "/kvrecv", timeout=2.0)
            if status == 200 and isinstance(data, dict) and "rendezvous" in data:
                host, _, port = str(data["rendezvous"]).rpartition(":")
                if host in ("0.0.0.0", "::", "[::]", ""):
                    host = http_addr.rpartition(":")[0]
                return f"{host}:{port}"
            why = f"GET /kvrecv answered {status} {data!r}"[:200]
        except OSError as e:
            why = str(e)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"kvrecv: no kvrecv bootstrap server at {http_addr} within "
                               f"{timeout_s:.0f} s ({why}); is the prefill started with "
                               "--disaggregation-transfer-backend kvrecv?")
        time.sleep(0.2)


class _RoomMixin:
    """poll() that latches terminal states in conclude_state; abort() and
    clear() that are safe in any state (sglang calls them freely)."""

    require_staging = False

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        state = KVPoll(super().poll())
        if state in _TERMINAL:
            self.conclude_state = state
            self._t_done = time.perf_counter()
        return state

    def abort(self) -> None:
        try:
            super().abort()
        except RuntimeError:  # already cleared, or the manager closed
            pass

    def clear(self) -> None:
        try:
            super().clear()
        except RuntimeError:
            pass

    def _fail_local(self, reason: str) -> None:
        """Fails the room for a request the backend cannot serve: the room
        is aborted (the peer sees ABORTED) and failure_exception() raises
        this reason."""
        self._local_reason = reason
        self.abort()
        self.conclude_state = KVPoll.Failed

    def failure_exception(self):
        reason = getattr(self, "_local_reason", None)
        if reason is not None:
            raise KVTransferError(self.bootstrap_room, reason)
        super().failure_exception()


class KVRecvSender(_RoomMixin, KVSender):
    """sglang's ``kv_sender_class(mgr, bootstrap_addr, bootstrap_room,
    dest_tp_ranks, pp_rank)`` (prefill side of one room).

    The aux (metadata) row leaves with the last chunk the scheduler sends,
    never earlier: sglang fills that row just before its last chunk.  The
    core sends the row once the room's pages are all posted, so a chunk that
    is not the last (should_send_kv_chunk() is told which is) keeps its
    final page back for the last one, and init(0, aux) (a full prefix hit)
    starts the room only at the 0-page last chunk."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Sequence[int] = (0,), pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, list(dest_tp_ranks or (0,)), pp_rank)
        self._local_reason = None
        why = None if req_has_disagg_prefill_dp_rank else \
            getattr(mgr, "dp_group_reason", lambda room: None)(bootstrap_room)
        if why is not None:
            self._fail_local(f"room {bootstrap_room}: {why}")
        self._t_init = None
        self._t_done = None
        self._num_kv_indices = 0
        self._aux_index = None
        self._started = False
        self._posted = 0
        self._held: list = []
        self._next_is_last = None

    @property
    def kv_mgr(self) -> KVManager:
        return self.mgr

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self._num_kv_indices = int(num_kv_indices)
        self._aux_index = aux_index
        self._t_init = time.perf_counter()
        if self._num_kv_indices > 0:
            self._start()

    def _start(self) -> None:
        self._started = True
        KVSender.init(self, self._num_kv_indices, self._aux_index)

    def send(self, kv_indices, state_indices: Optional[list] = None, num_kv_tokens=None,
             token_position_offset: int = 0, **_ignored) -> None:
        if _has_state(state_indices) and not self.mgr.kvrecv_args.state:
            self._fail_local(_NO_STATE.format(state_indices))
            return
        pages = [int(i) for i in kv_indices]
        last = self._next_is_last
        self._next_is_last = None
        if last is None:  # a caller that does not ask should_send_kv_chunk()
            last = self._posted + len(pages) >= self._num_kv_indices
        if not self._started:
            self._start()
        if last:
            pages = self._held + pages
            self._held = []
        elif pages and self._posted + len(pages) >= self._num_kv_indices:
            self._held, pages = pages[-1:], pages[:-1]
        # sglang gives the state slots with the last chunk only.
        states = state_indices if _has_state(state_indices) else None
        if pages or states:
            self._posted += len(pages)
            KVSender.send(self, pages, states)

    def poll_pp_consensus(self) -> KVPoll:
        """sglang's PP prefill polls its stage 0's senders with this (and
        passes the result to the other stages).  kvrecv's decode asks no
        stage for data before every stage answered, a stage takes pages
        before the decode's request reached it (the core posts them when
        it comes), and a stage that fails fails every stage's room through
        the decode: this stage's own poll is the consensus."""
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        """Tokens of the request the decode already holds (its radix-cache
        prefix), from the decode's request: valid once poll() has left
        Bootstrapping, 0 before.  The scheduler sends from that token on."""
        try:
            return self.decode_prefix_len
        except RuntimeError:  # cleared
            return 0

    def get_max_transfer_tokens(self) -> Optional[int]:
        """No limit: the core splits and coalesces the pages itself."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Whether the scheduler sends this chunk: any chunk with pages, and
        the last one even with none (it carries the aux row)."""
        self._next_is_last = bool(last_chunk)
        return num_pages > 0 or bool(last_chunk)

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self._t_init is not None and self._t_done is not None:
            latency = self._t_done - self._t_init
        args = self.mgr.kvrecv_args if hasattr(self.mgr, "kvrecv_args") else self.mgr.kv_args
        total = (self._num_kv_indices * sum(args.kv_item_lens)
                 + (sum(args.aux_item_lens) if self._aux_index is not None else 0))
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=total)


class KVRecvReceiver(_RoomMixin, KVReceiver):
    """sglang's ``kv_receiver_class(mgr, bootstrap_addr, bootstrap_room)``
    (decode side of one room)."""

    supports_host_destination = False

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, **_ignored):
        super().__init__(mgr, bootstrap_addr, 0 if bootstrap_room is None else bootstrap_room)
        self._local_reason = None
        self._t_done = None
        self._initialised = False
        self.abort_notified = False
        self.bootstrap_infos: list = []

    @property
    def kv_mgr(self) -> KVManager:
        return self.mgr

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Starts resolving the prefill rank of the DP group asked for (the
        manager learnt the instance in try_ensure_parallel_info)."""
        self._initialised = True
        dp = int(prefill_dp_rank or 0)
        info = getattr(self.mgr, "prefill_info_table", {}).get(self.bootstrap_addr)
        if info is None:
            self._fail_local(f"init() before the decode manager learnt the prefill at "
                             f"{self.bootstrap_addr} (try_ensure_parallel_info)")
            return
        if not 0 <= dp < info.dp_size:
            self._fail_local(f"prefill DP rank {dp} asked for, but the prefill at "
                             f"{self.bootstrap_addr} has dp_size={info.dp_size}")
            return
        self.bootstrap_infos = [info]
        tp = int(info.attn_tp_size)
        pp = int(info.pp_size or 1)
        if tp != self.mgr.parallel["attn_tp_size"] or pp > 1:
            # Other TP sizes: the heads come from the prefill ranks holding
            # them; PP stages: each stage's layers from that stage.
            same = tp == self.mgr.parallel["attn_tp_size"]
            self.recv_init(dp, info.rendezvous, 0 if same else tp, pp if pp > 1 else 0)
            return
        self.recv_init(dp, info.rendezvous)

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None,
                      state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None, **_ignored) -> None:
        """kv_indices: the decode pages after the decode_prefix_len tokens it
        already holds (sglang passes the pages of that delta)."""
        if _has_state(state_indices) and not self.mgr.kvrecv_args.state:
            self._fail_local(_NO_STATE.format(state_indices))
            return
        KVReceiver.send_metadata(self, kv_indices, aux_index, decode_prefix_len or 0,
                                 state_indices if _has_state(state_indices) else None)

    def failure_exception(self):
        """The room's failure.  A room aborted before init() (sglang's
        decode gives up on a prefill whose bootstrap server it could not
        learn, and aborts the receiver; or a sibling rank did so) raises
        KVBootstrapError naming why this rank's latest attempt failed: the
        abort alone would hide it."""
        why = None
        if not self._initialised and self._local_reason is None:
            why = getattr(self.mgr, "bootstrap_failure", lambda addr: None)(self.bootstrap_addr)
        try:
            super().failure_exception()
        except KVAbortedError as e:
            if why is None:
                raise
            raise KVBootstrapError(
                self.bootstrap_room, f"{e.failure_reason}: could not learn the prefill at "
                f"{self.bootstrap_addr}: {why}", e.is_from_another_rank, origin_rank=e.origin_rank,
                peer=e.peer) from None

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """sglang's deferred release: aborts the room (the prefill is told)
        unless it already failed, and has the manager hold its pages until
        drained() says no byte can land any more."""
        if not self.abort_notified:
            self.abort()
            self.abort_notified = True
            self.mgr._aborted[self.bootstrap_room] = self

    def drained(self) -> bool:
        """True once the core reports the room Failed (its in-flight
        operations drained) or Success (every byte landed: a room whose
        pages all came but that sglang failed because another rank's part
        failed), or has dropped it."""
        try:
            return _core.Room.poll(self) in _TERMINAL
        except RuntimeError:
            return True

    def is_abort_release_safe(self) -> bool:
        return self.drained()


class KVRecvBootstrapServer:
    """sglang's ``kv_bootstrap_server_class(host, port)``: sglang's HTTP
    routes on ``port`` (see kvrecv.sglang_http) and kvrecv's rendezvous (the
    C core's bootstrap server) on a port the OS picks, which managers learn
    from ``GET /kvrecv``."""

    def __init__(self, host: Optional[str] = None, port: int = 8998, **_ignored):
        bind = host or "0.0.0.0"
        self.rendezvous = BootstrapServer(bind, 0)
        try:
            self.http = HTTPBootstrap(bind, int(port), f"{bind}:{self.rendezvous.port}")
        except BaseException:
            self.rendezvous.close()
            raise
        self.host = bind
        self.port = self.http.port

    @property
    def address(self) -> str:
        return f"{_connect_host(self.host)}:{self.port}"

    def stats(self) -> dict:
        return self.rendezvous.stats()

    def close(self) -> None:
        self.http.close()
        self.rendezvous.close()

    # sglang's launcher may call these on its bootstrap server object
    def run(self) -> None:
        pass

    def shutdown(self) -> None:
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
