"""The Python surface: enums, argument checks and docs over kvrecv._core."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import weakref
from typing import Any, Optional, Sequence

from . import _core


class KVPoll(enum.IntEnum):
    """Room states, with sglang's values: schedulers MIN-reduce them across
    ranks, so Failed (0) dominates."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_core._set_poll_values([KVPoll(i) for i in range(5)])


# The defaults are the C core's (kvr_config_default), read once.
_DEFAULT = _core.config_defaults()


@dataclasses.dataclass
class KVConfig:
    """Timeouts, bounds and the shared secret of a manager; the defaults are
    the C core's, and the README's Configuration table says what each field
    means.  Every field may be overridden by an environment variable
    KVRECV_<FIELD> (upper case).

    secret: when set (a str, or bytes), every control message is
    authenticated with HMAC-SHA256 under it, and messages that do not verify
    are refused.  Every decode, prefill and bootstrap server of a deployment
    needs the same one.  It is not shown by repr()."""

    bootstrap_timeout_ms: int = _DEFAULT["bootstrap_timeout_ms"]
    heartbeat_interval_ms: int = _DEFAULT["heartbeat_interval_ms"]
    heartbeat_timeout_ms: int = _DEFAULT["heartbeat_timeout_ms"]
    deadline_base_ms: int = _DEFAULT["deadline_base_ms"]
    deadline_floor_bps: int = _DEFAULT["deadline_floor_bps"]
    max_rooms: int = _DEFAULT["max_rooms"]
    max_pending: int = _DEFAULT["max_pending"]
    ctrl_port: int = _DEFAULT["ctrl_port"]
    sibling_wait_ms: int = _DEFAULT["sibling_wait_ms"]
    register_memory: bool = _DEFAULT["register_memory"]
    coalesce_bytes: int = _DEFAULT["coalesce_bytes"]
    coalesce_run_bytes: int = _DEFAULT["coalesce_run_bytes"]
    pack_bytes: int = _DEFAULT["pack_bytes"]
    max_rooms_per_peer: int = _DEFAULT["max_rooms_per_peer"]
    max_peers: int = _DEFAULT["max_peers"]
    ctrl_queue_bytes: int = _DEFAULT["ctrl_queue_bytes"]
    secret: Any = dataclasses.field(default="", repr=False)
    staging_slots: int = _DEFAULT["staging_slots"]
    staging_slot_bytes: int = _DEFAULT["staging_slot_bytes"]
    force_staging: bool = _DEFAULT["force_staging"]
    poll_progress: bool = _DEFAULT["poll_progress"]
    cross_memory_bytes: int = _DEFAULT["cross_memory_bytes"]
    cross_memory_readers: int = _DEFAULT["cross_memory_readers"]
    tcp_lane: bool = _DEFAULT["tcp_lane"]
    lane_congestion: str = _DEFAULT["lane_congestion"]

    def resolved(self) -> dict:
        """The fields with the environment applied, as the core reads them
        (the secret and lane_congestion are checked there)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            env = os.environ.get("KVRECV_" + f.name.upper())
            if f.name in ("secret", "lane_congestion"):
                out[f.name] = value if env is None else env
                continue
            if env is not None:
                try:
                    value = type(f.default)(int(env)) if f.type != "bool" else env not in ("0", "false", "")
                except ValueError:
                    raise ValueError(f"KVRECV_{f.name.upper()}={env!r} is not an integer") from None
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"KVConfig.{f.name} must be a non-negative integer, got {value!r}")
            out[f.name] = value
        return out


def _int_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a sequence of integers")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] must be an integer, not {type(v).__name__}")
        out.append(int(v))
    return out


class KVArgs:
    """The registered memory of one rank: KV buffers (page-indexed) and aux
    buffers (row-indexed).  Pointers are ints, as sglang passes them.

    Head layout (optional; lets prefill and decode run different TP sizes,
    docs/layouts.md): kv_head_num KV heads in this rank's pages out of
    total_kv_head_num, engine_rank being the rank among tp_size ranks; a
    page of a KV buffer is [page_size tokens][kv_head_num][bytes per head].
    is_mla: one latent cache every rank holds whole (one "head" of one).

    attn_dp_rank (prefill): the DP group this rank belongs to.  Several
    prefill DP groups may register with one bootstrap server (each rank by
    its DP group and engine_rank); a decode room picks one with
    KVReceiver.init(prefill_dp_rank).

    Pipeline-parallel prefill: a stage registers as pp_rank of pp_size and
    holds layers [start_layer, start_layer + num_layers); its KV buffers are
    groups (K, then V; one for MLA) of num_layers buffers in layer order.
    num_layers (both sides) defaults to one buffer per layer; a decode
    reading a PP prefill gives its own (all layers) and
    KVReceiver.init(prefill_pp_size=).

    State buffers (hybrid models, sglang's state_* fields): per component
    (state_types, e.g. Mamba), a list of buffers, each of its own item length,
    indexed by the request's slot of that component (docs/layouts.md); a
    component whose state_types entry is "swa" (LIST_STATE_TYPES: sliding-
    window pages) is indexed by a list of slots per request, equal lengths
    on both sides, moved like pages (equal TP sizes only).
    state_slicing (optional, parallel to state_item_lens): how each state
    buffer's row splits over the TP ranks, so that prefill and decode of
    different TP sizes move state: 0 (replicated: every rank holds the whole
    row), n (the row holds this rank's n units -- heads, channels -- of the
    model's n x tp_size), a list of such counts (groups sliced independently,
    e.g. a conv state [q | k | v]), or {"units": n or [...], "outer": k} (the
    row is k repetitions of those)."""

    def __init__(
        self,
        engine_rank: int,
        kv_data_ptrs: Sequence[int],
        kv_data_lens: Sequence[int],
        kv_item_lens: Sequence[int],
        aux_data_ptrs: Sequence[int] = (),
        aux_data_lens: Sequence[int] = (),
        aux_item_lens: Sequence[int] = (),
        page_size: int = 1,
        tp_size: int = 1,
        mem_kinds: Any = "auto",
        kv_head_num: Optional[int] = None,
        total_kv_head_num: Optional[int] = None,
        is_mla: bool = False,
        attn_dp_rank: int = 0,
        state_data_ptrs: Sequence[Sequence[int]] = (),
        state_data_lens: Sequence[Sequence[int]] = (),
        state_item_lens: Sequence[Sequence[int]] = (),
        state_types: Sequence[Any] = (),
        pp_rank: int = 0,
        pp_size: int = 1,
        start_layer: int = 0,
        num_layers: Optional[int] = None,
        state_slicing: Optional[Sequence[Sequence[Any]]] = None,
    ):
        self.engine_rank = int(engine_rank)
        self.attn_dp_rank = _dp_rank("attn_dp_rank", attn_dp_rank)
        self.kv_data_ptrs = _int_list("kv_data_ptrs", kv_data_ptrs)
        self.kv_data_lens = _int_list("kv_data_lens", kv_data_lens)
        self.kv_item_lens = _int_list("kv_item_lens", kv_item_lens)
        self.aux_data_ptrs = _int_list("aux_data_ptrs", aux_data_ptrs)
        self.aux_data_lens = _int_list("aux_data_lens", aux_data_lens)
        self.aux_item_lens = _int_list("aux_item_lens", aux_item_lens)
        self.page_size = int(page_size)
        self.tp_size = int(tp_size)
        self._keepalive: list = []
        if not (len(self.kv_data_ptrs) == len(self.kv_data_lens) == len(self.kv_item_lens)):
            raise ValueError(
                "kv_data_ptrs, kv_data_lens and kv_item_lens have different lengths "
                f"({len(self.kv_data_ptrs)}, {len(self.kv_data_lens)}, {len(self.kv_item_lens)})"
            )
        if not (len(self.aux_data_ptrs) == len(self.aux_data_lens) == len(self.aux_item_lens)):
            raise ValueError(
                "aux_data_ptrs, aux_data_lens and aux_item_lens have different lengths "
                f"({len(self.aux_data_ptrs)}, {len(self.aux_data_lens)}, {len(self.aux_item_lens)})"
            )
        self.state_types = list(state_types)
        self.state_data_ptrs, self.state_data_lens, self.state_item_lens = (
            [_int_list(f"{name}[{i}]", c) for i, c in enumerate(v)]
            for name, v in (("state_data_ptrs", state_data_ptrs),
                            ("state_data_lens", state_data_lens),
                            ("state_item_lens", state_item_lens))
        )
        self.state = _state(self.state_data_ptrs, self.state_data_lens, self.state_item_lens,
                            self.state_types)
        self.state_slicing = state_slicing
        self.state_rules = _state_rules(state_slicing, self.state_item_lens)
        nstate = len(self.state[0]) if self.state else 0
        self.mem_kinds = _mem_kinds(
            mem_kinds, len(self.kv_data_ptrs) + len(self.aux_data_ptrs) + nstate
        )
        self.heads = _heads(self.tp_size, self.engine_rank, kv_head_num, total_kv_head_num, is_mla)
        self.layers = _layers(pp_size, pp_rank, start_layer, num_layers)
        for kind in ("kv", "aux"):
            lens = getattr(self, f"{kind}_data_lens")
            items = getattr(self, f"{kind}_item_lens")
            for i, (n, item) in enumerate(zip(lens, items)):
                if item <= 0:
                    raise ValueError(f"{kind}_item_lens[{i}]={item} must be > 0")
                if n % item:
                    raise ValueError(
                        f"{kind}_item_lens[{i}]={item} does not divide {kind}_data_lens[{i}]={n}"
                    )

    @classmethod
    def from_buffers(
        cls,
        engine_rank: int,
        kv_buffers: Sequence[Any],
        kv_item_lens: Sequence[int],
        aux_buffers: Sequence[Any] = (),
        aux_item_lens: Sequence[int] = (),
        page_size: int = 1,
        tp_size: int = 1,
        state_buffers: Sequence[Sequence[Any]] = (),
        state_item_lens: Sequence[Sequence[int]] = (),
        **heads: Any,
    ) -> "KVArgs":
        """Builds KVArgs from writable buffers (numpy arrays, bytearrays,
        anything with the buffer protocol).  The KVArgs, and every manager
        made from it, keeps the buffers alive."""
        keep = []

        def describe(name, bufs):
            ptrs, lens = [], []
            for i, b in enumerate(bufs):
                try:
                    mv = memoryview(b)
                except TypeError:
                    raise TypeError(f"{name}[{i}] does not support the buffer protocol") from None
                if mv.readonly:
                    raise ValueError(f"{name}[{i}] is read-only")
                if not mv.c_contiguous:
                    raise ValueError(f"{name}[{i}] is not contiguous")
                import ctypes

                if mv.nbytes == 0:
                    raise ValueError(f"{name}[{i}] is empty")
                raw = mv.cast("B")
                addr = ctypes.addressof(ctypes.c_char.from_buffer(raw))
                keep.append(b)
                keep.append(raw)
                ptrs.append(addr)
                lens.append(mv.nbytes)
            return ptrs, lens

        kp, kl = describe("kv_buffers", kv_buffers)
        ap, al = describe("aux_buffers", aux_buffers)
        state = [describe(f"state_buffers[{i}]", c) for i, c in enumerate(state_buffers)]
        args = cls(engine_rank, kp, kl, kv_item_lens, ap, al, aux_item_lens, page_size, tp_size,
                   state_data_ptrs=[p for p, _ in state], state_data_lens=[n for _, n in state],
                   state_item_lens=state_item_lens, **heads)
        args._keepalive = keep
        return args


MEM_KINDS = {"auto": 0, "host": 1, "cuda": 2}

# The largest DP group number the bootstrap registration carries.
MAX_DP_RANK = _core.MAX_DP_RANK


def _dp_rank(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DP_RANK:
        raise ValueError(f"{name}={value!r} must be an integer in [0, {MAX_DP_RANK}]")
    return value


# State types whose components take a list of slots per request (a
# sliding window's pages), moved like pages; the others take one slot.
LIST_STATE_TYPES = ("swa",)


def _state_type_name(t: Any) -> str:
    return str(getattr(t, "value", t)).lower()


def _state(ptrs: list, lens: list, items: list, types: Sequence[Any] = ()):
    """The state buffers for the core, flat: (ptrs, lens, item lens,
    component of each[, mask of the list components]), or None when there
    are none."""
    if not (len(ptrs) == len(lens) == len(items)):
        raise ValueError(
            "state_data_ptrs, state_data_lens and state_item_lens have different numbers of "
            f"components ({len(ptrs)}, {len(lens)}, {len(items)})"
        )
    flat: tuple = ([], [], [], [])
    for c, (p, n, i) in enumerate(zip(ptrs, lens, items)):
        if not (len(p) == len(n) == len(i)) or not p:
            raise ValueError(
                f"state component {c}: state_data_ptrs, state_data_lens and state_item_lens "
                f"have {len(p)}, {len(n)} and {len(i)} buffers (equal, at least one)"
            )
        for k, v in enumerate((p, n, i, [c] * len(p))):
            flat[k].extend(v)
    mask = sum(1 << c for c, t in enumerate(types) if _state_type_name(t) in LIST_STATE_TYPES)
    if not flat[0]:
        return None
    return (*flat, mask) if mask else flat


def _state_rule(where: str, rule: Any) -> list:
    """One buffer's slicing rule as the core's flat numbers: outer,
    groups, units per group (replicated: 1, 0)."""
    def count(name, v):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**32:
            raise ValueError(f"{where}: {name}={v!r} must be a positive integer")
        return v

    outer, units = 1, rule
    if isinstance(rule, dict):
        unknown = set(rule) - {"units", "outer"}
        if unknown or "units" not in rule:
            raise ValueError(f"{where}: a dict rule has 'units' and optionally 'outer', "
                             f"not {sorted(rule)}")
        outer, units = count("outer", rule.get("outer", 1)), rule["units"]
    if isinstance(units, int) and not isinstance(units, bool) and units == 0 and outer == 1:
        return [1, 0]
    groups = [units] if isinstance(units, int) and not isinstance(units, bool) else units
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"{where}={rule!r} must be 0 (replicated), a unit count, a list of "
                         "them or a dict with 'units' and 'outer'")
    return [outer, len(groups)] + [count("units", g) for g in groups]


def _state_rules(slicing: Any, items: list) -> Optional[list]:
    """state_slicing, flat for the core (None when not given)."""
    if slicing is None:
        return None
    if isinstance(slicing, (str, bytes)) or not isinstance(slicing, Sequence) or \
            len(slicing) != len(items):
        raise ValueError(f"state_slicing must give one list per state component "
                         f"({len(items)}), not {slicing!r}")
    flat: list = []
    for c, (rules, comp) in enumerate(zip(slicing, items)):
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence) or \
                len(rules) != len(comp):
            raise ValueError(f"state_slicing[{c}] must give one rule per buffer of the "
                             f"component ({len(comp)}), not {rules!r}")
        for k, rule in enumerate(rules):
            flat.extend(_state_rule(f"state_slicing[{c}][{k}]", rule))
    return flat or None


def _heads(tp_size: int, rank: int, heads: Optional[int], total: Optional[int], mla: bool):
    """(tp_size, tp_rank, heads, total heads) for the core, or None.  The
    core checks that the numbers make a layout (ValueError naming them)."""
    if mla:
        if heads not in (None, 1) or total not in (None, 1):
            raise ValueError(f"is_mla: one latent cache per rank, not kv_head_num={heads} of "
                             f"total_kv_head_num={total}")
        heads = total = 1
    if heads is None and total is None:
        return None
    if heads is None or total is None:
        raise ValueError("kv_head_num and total_kv_head_num go together")
    for name, v in (("kv_head_num", heads), ("total_kv_head_num", total), ("tp_size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not 0 <= rank < tp_size:
        raise ValueError(f"engine_rank={rank} is not a rank of tp_size={tp_size}")
    return (tp_size, rank, heads, total)


def _layers(pp_size: Any, pp_rank: Any, start: Any, layers: Any):
    """(pp_size, pp_rank, start_layer, num_layers) for the core, or None.
    The core checks them against the buffers (ValueError naming them)."""
    if layers is None and (pp_size, pp_rank, start) == (1, 0, 0):
        return None
    if layers is None:
        raise ValueError("num_layers is needed with pp_size, pp_rank or start_layer: the layers "
                         "this rank's KV buffers hold")
    for name, v, low in (("pp_size", pp_size, 1), ("pp_rank", pp_rank, 0),
                         ("start_layer", start, 0), ("num_layers", layers, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 2**32:
            raise ValueError(f"{name}={v!r} must be an integer >= {low}")
    return (pp_size, pp_rank, start, layers)


def _mem_kinds(value: Any, n: int) -> list:
    """One kind for every buffer, or one per buffer (KV buffers first, then
    aux, then state): "host", "cuda" (device memory; needs the CUDA runtime) or "auto"
    (asks CUDA where it can, else host)."""
    if isinstance(value, str):
        value = [value] * n
    elif value is None:
        value = ["auto"] * n
    elif isinstance(value, bytes) or not isinstance(value, Sequence):
        raise TypeError("mem_kinds must be 'host', 'cuda', 'auto' or a sequence of them")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"mem_kinds has {len(value)} entries for {n} buffers (KV buffers first, "
                         "then aux, then state)")
    for i, k in enumerate(value):
        if not isinstance(k, str):
            raise TypeError(f"mem_kinds[{i}] must be a str, not {type(k).__name__}")
        if k not in MEM_KINDS:
            raise ValueError(f"mem_kinds[{i}]={k!r} is not one of 'host', 'cuda', 'auto'")
    return value


class BootstrapServer:
    """The rendezvous where prefill ranks register and decode ranks look
    them up.  port=0 picks a free port; .port says which.  secret (default:
    the KVRECV_SECRET environment variable) authenticates every message, as
    KVConfig.secret does for the managers: all must use the same one."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, secret: Any = None):
        self.host = host
        if secret is None:
            secret = os.environ.get("KVRECV_SECRET", "")
        self._core = _core.BootstrapServer(host, port, secret)
        self.port = self._core.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stats(self) -> dict:
        return self._core.stats()

    def close(self) -> None:
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class KVManager:
    """One rank's transfer engine, in mode "prefill" or "decode".  A prefill
    manager registers its rank with the bootstrap server at bootstrap_addr."""

    def __init__(
        self,
        args: KVArgs,
        mode: str,
        *,
        bootstrap_addr: Optional[str] = None,
        host: str = "127.0.0.1",
        config: Optional[KVConfig] = None,
    ):
        if not isinstance(args, KVArgs):
            raise TypeError(f"args must be a KVArgs, not {type(args).__name__}")
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', not {mode!r}")
        if mode == "prefill" and not bootstrap_addr:
            raise ValueError("bootstrap_addr is required for a prefill manager")
        if bootstrap_addr is not None:
            _check_addr(bootstrap_addr)
        if config is not None and not isinstance(config, KVConfig):
            raise TypeError(f"config must be a KVConfig, not {type(config).__name__}")
        self.kv_args = args
        self.mode = mode
        self.bootstrap_addr = bootstrap_addr
        self.config = config or KVConfig()
        self._core = _core.Manager(
            _core.MODE_PREFILL if mode == "prefill" else _core.MODE_DECODE,
            args.engine_rank,
            args.kv_data_ptrs,
            args.kv_data_lens,
            args.kv_item_lens,
            args.aux_data_ptrs,
            args.aux_data_lens,
            args.aux_item_lens,
            args.page_size,
            host,
            bootstrap_addr or "",
            self.config.resolved(),
            [MEM_KINDS[k] for k in args.mem_kinds],
            args.heads,
            args.attn_dp_rank,
            args.state,
            args.layers,
            args.state_rules,
        )
        # The core's events reach logging.getLogger("kvrecv") through one
        # thread per manager that waits (without the GIL) for them.  It holds
        # only the core, so dropping the manager closes it.
        self._log_thread = threading.Thread(
            target=_pump_logs, args=(self._core,), name=f"kvrecv-log-{mode}-{args.engine_rank}",
            daemon=True)
        self._log_thread.start()
        self._finalizer = weakref.finalize(self, _close_core, self._core, self._log_thread)

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def transport(self) -> str:
        return self._core.transport

    def stats(self) -> dict:
        """Rooms by state, bytes moved, RMA operations posted, control
        messages dropped, failures by code, ...; gpu_path ("host",
        "ucx-cuda" or "staged") and gpu_path_why; staging counters."""
        return self._core.stats()

    @property
    def mem_kinds(self) -> list:
        """The memory kind in use per buffer, "host" or "cuda" (KV buffers
        first, then aux), after "auto" was resolved."""
        n = len(self.kv_args.kv_data_ptrs) + len(self.kv_args.aux_data_ptrs)
        return ["cuda" if self._core.is_device(i) else "host" for i in range(n)]

    def set_siblings(self, endpoints: Sequence[str]) -> None:
        """Joins this rank with the other ranks of its instance: pass every
        rank's ``endpoint`` (this one's is ignored).  Each root cause recorded
        on one rank is then published to the others, so that every rank's
        failure_exception() raises the originating rank's code and reason
        (with is_from_another_rank=True and origin_rank set on the others).
        Call it once, after all ranks of the instance are created."""
        if isinstance(endpoints, str):
            raise TypeError("endpoints must be a sequence of str, not a str")
        own = self.endpoint
        self._core.set_siblings([ep for ep in endpoints if ep != own])

    def close(self) -> None:
        """Stops the engine; open rooms fail with ABORTED.  Idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_log = logging.getLogger("kvrecv")


def _pump_logs(core) -> None:
    while True:
        try:
            records = core.read_logs(200)
            if records is None:
                return
            for level, text in records:
                _log.log(level, text)
        except Exception:  # a handler that raises must not end the pump
            if core.closed:
                return


def _close_core(core, thread) -> None:
    core.close()
    if thread is not threading.current_thread():
        thread.join(5)


def _check_addr(addr: str) -> None:
    if not isinstance(addr, str):
        raise TypeError(f"bootstrap_addr must be a str 'host:port', not {type(addr).__name__}")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bootstrap_addr {addr!r} is not 'host:port'")


class _Room(_core.Room):
    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int, mode: str):
        if not isinstance(mgr, KVManager):
            raise TypeError(f"mgr must be a KVManager, not {type(mgr).__name__}")
        if mgr.mode != mode:
            raise ValueError(
                f"a {type(self).__name__} needs a {mode} manager, this one is {mgr.mode}"
            )
        if mode == "decode":
            _check_addr(bootstrap_addr)
        super().__init__(mgr._core, bootstrap_addr or "", bootstrap_room)
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.conclude_state: Optional[KVPoll] = None

    # poll() is _core.Room.poll itself (no Python wrapper: it is called for
    # every receiver on every scheduler iteration): an atomic load that
    # returns a KVPoll member, never blocks and never raises (a decode room
    # waiting for data may also progress UCX, see KVConfig.poll_progress).


class KVReceiver(_Room):
    """Decode side of one room."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, "decode")

    def init(self, prefill_dp_rank: int = 0, prefill_tp_size: Optional[int] = None,
             prefill_pp_size: Optional[int] = None) -> None:
        """Starts resolving the prefill peer without blocking: the ranks of
        prefill DP group prefill_dp_rank (KVArgs.attn_dp_rank) registered
        with the bootstrap server.  With prefill_tp_size (and a head layout
        in the manager's KVArgs), the room reads this rank's heads from the
        prefill ranks of that group that hold them, whatever the two TP
        sizes; with prefill_pp_size, each of the prefill's pipeline stages'
        layers from that stage (docs/layouts.md)."""
        prefill_dp_rank = _dp_rank("prefill_dp_rank", prefill_dp_rank)
        sizes = []
        for name, v in (("prefill_tp_size", prefill_tp_size), ("prefill_pp_size", prefill_pp_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name}={v!r} must be a positive integer")
            sizes.append(v or 0)
        if sizes == [0, 0]:
            self.recv_init(prefill_dp_rank)
            return
        self.recv_init(prefill_dp_rank, None, *sizes)

    def failure_exception(self):
        """Raises the room's KVTransferError (always raises)."""
        self._raise_failure("KVReceiver Exception")


class KVSender(_Room):
    """Prefill side of one room."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: Sequence[int] = (0,),
        pp_rank: int = 0,
    ):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, "prefill")
        self.dest_tp_ranks = list(dest_tp_ranks)
        self.pp_rank = pp_rank

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.send_init(num_kv_indices, aux_index)

    def failure_exception(self):
        """Raises the room's KVTransferError (always raises)."""
        self._raise_failure("KVSender Exception")
