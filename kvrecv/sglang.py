"""An sglang transfer backend over kvrecv.

The classes here take the constructor and method signatures that sglang's
disaggregation schedulers call (``kv_manager_class(kv_args, mode,
server_args, is_mla_backend)``, ``kv_sender_class(mgr=, bootstrap_addr=,
bootstrap_room=, dest_tp_ranks=, pp_rank=)``, ``kv_receiver_class(mgr=,
bootstrap_addr=, bootstrap_room=)``, ``kv_bootstrap_server_class(host=,
port=)``) and map them onto kvrecv's KVManager / KVSender / KVReceiver /
BootstrapServer.  Nothing from sglang is imported: the scheduler's objects
are read through their attributes only.  See docs/sglang.md for how to
register the backend.

A decode radix-cache prefix is supported: the decode's
``send_metadata(..., decode_prefix_len=N)`` names only the pages after the N
tokens it already holds, N travels with its request, and the prefill's
``pop_decode_prefix_len()`` returns it so the prefill scheduler sends from
token N on (``init()`` with the remaining page count).

What is not supported (rejected cleanly rather than moving wrong bytes):
hybrid-model state buffers.  A manager whose ``kv_args.state_types`` is
non-empty is refused; with none registered, ``state_indices`` may be None or
empty, and a room given non-empty ``state_indices`` fails with a reason that
says so.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional, Sequence

from ._api import BootstrapServer, KVArgs, KVManager, KVPoll, KVReceiver, KVSender
from ._core import KVTransferError

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


def _connect_host(host: Optional[str]) -> str:
    if not host or host in ("0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return host


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


_NO_STATE = ("kvrecv registered no state buffers (it moves dense KV caches only; a manager "
             "with state_types is refused), so state_indices={!r} cannot be transferred")


class KVRecvManager(KVManager):
    """sglang's ``kv_manager_class(kv_args, disaggregation_mode, server_args,
    is_mla_backend)``.

    Fields read from server_args (each optional): ``host`` (this rank's
    control host; 0.0.0.0 means loopback), ``disaggregation_bootstrap_port``
    (default 8998) and, for a prefill rank, the bootstrap server it registers
    with: ``kvrecv_bootstrap_addr`` if set, else ``host:disaggregation_bootstrap_port``
    (sglang starts the bootstrap server next to the prefill instance).
    ``kvrecv_config`` may carry a KVConfig; KVRECV_* environment variables
    override its fields as usual.
    """

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False):
        mode = mode_name(disaggregation_mode)
        state_types = getattr(args, "state_types", None)
        if state_types:
            raise NotImplementedError(
                f"kvrecv moves dense KV caches only; state buffers {list(state_types)!r} are not supported")
        if isinstance(args, KVArgs):
            kv_args = args
        else:
            kv_args = KVArgs(
                getattr(args, "engine_rank", 0),
                _seq(getattr(args, "kv_data_ptrs", ())),
                _seq(getattr(args, "kv_data_lens", ())),
                _seq(getattr(args, "kv_item_lens", ())),
                _seq(getattr(args, "aux_data_ptrs", ())),
                _seq(getattr(args, "aux_data_lens", ())),
                _seq(getattr(args, "aux_item_lens", ())),
                page_size=int(getattr(args, "page_size", 1) or 1),
            )
        host = getattr(server_args, "host", None)
        port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998) or 8998)
        bootstrap_addr = getattr(server_args, "kvrecv_bootstrap_addr", None)
        if mode == "prefill" and not bootstrap_addr:
            bootstrap_addr = f"{_connect_host(host)}:{port}"
        config = getattr(server_args, "kvrecv_config", None)
        super().__init__(kv_args, mode, bootstrap_addr=bootstrap_addr or None,
                         host=_connect_host(host), config=config)
        self.sglang_kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.page_bytes = sum(kv_args.kv_item_lens)
        self.aux_row_bytes = sum(kv_args.aux_item_lens)

    def register_to_bootstrap(self) -> None:
        """A prefill manager registers with the bootstrap server when it is
        created; nothing left to do."""


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
    dest_tp_ranks, pp_rank)`` (prefill side of one room)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Sequence[int] = (0,), pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, list(dest_tp_ranks or (0,)), pp_rank)
        self._local_reason = None
        self._t_init = None
        self._t_done = None
        self._num_kv_indices = 0
        self._with_aux = False

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self._num_kv_indices = int(num_kv_indices)
        self._with_aux = aux_index is not None
        self._t_init = time.perf_counter()
        super().init(num_kv_indices, aux_index)

    def send(self, kv_indices, state_indices: Optional[list] = None, num_kv_tokens=None,
             token_position_offset: int = 0) -> None:
        if _has_state(state_indices):
            self._fail_local(_NO_STATE.format(state_indices))
            return
        super().send(kv_indices)

    def pop_decode_prefix_len(self) -> int:
        """Tokens of the request the decode already holds (its radix-cache
        prefix), from the decode's request: valid once poll() has left
        Bootstrapping, 0 before.  The scheduler sends from that token on."""
        try:
            return self.decode_prefix_len
        except RuntimeError:  # cleared
            return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self._t_init is not None and self._t_done is not None:
            latency = self._t_done - self._t_init
        args = self.mgr.kv_args
        total = (self._num_kv_indices * sum(args.kv_item_lens)
                 + (sum(args.aux_item_lens) if self._with_aux else 0))
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=total)


class KVRecvReceiver(_RoomMixin, KVReceiver):
    """sglang's ``kv_receiver_class(mgr, bootstrap_addr, bootstrap_room)``
    (decode side of one room)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, **_ignored):
        super().__init__(mgr, bootstrap_addr, 0 if bootstrap_room is None else bootstrap_room)
        self._local_reason = None
        self._t_done = None

    def init(self, prefill_dp_rank: int = 0) -> None:
        super().init(int(prefill_dp_rank or 0))

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None,
                      state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None, **_ignored) -> None:
        """kv_indices: the decode pages after the decode_prefix_len tokens it
        already holds (sglang passes the pages of that delta)."""
        if _has_state(state_indices):
            self._fail_local(_NO_STATE.format(state_indices))
            return
        KVReceiver.send_metadata(self, kv_indices, aux_index, decode_prefix_len or 0)


class KVRecvBootstrapServer(BootstrapServer):
    """sglang's ``kv_bootstrap_server_class(host, port)``."""

    def __init__(self, host: Optional[str] = None, port: int = 8998, **_ignored):
        super().__init__(host or "0.0.0.0", int(port))

    def close(self) -> None:
        super().close()

    # sglang's launcher may call these on its bootstrap server object
    def run(self) -> None:
        pass

    def shutdown(self) -> None:
        self.close()
