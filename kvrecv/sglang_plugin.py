"""sglang plugin: ``--disaggregation-transfer-backend kvrecv``.

sglang (0.5.23 and later releases of its plugin framework) loads every entry
point of the group ``sglang.srt.plugins`` before it parses arguments and in
every scheduler process.  kvrecv's pyproject.toml registers :func:`register`
there, so installing kvrecv is all it takes; nothing in sglang is patched on
disk.  What the plugin does, through sglang's own ``HookRegistry``:

- adds ``kvrecv`` to the CLI choices of ``--disaggregation-transfer-backend``;
- replaces ``TransferBackend`` with an enum holding every member of sglang's
  own plus ``KVRECV = "kvrecv"`` (sglang compares members by identity, so
  one enum object must be seen everywhere: HookRegistry re-binds every
  ``from ... import TransferBackend`` copy);
- wraps ``get_kv_class`` so that ``TransferBackend.KVRECV`` resolves to the
  classes of :mod:`kvrecv.sglang` and every other backend to sglang's.

On an sglang release outside :data:`SUPPORTED`, the plugin refuses to
register and says so at start-up (``--disaggregation-transfer-backend
kvrecv`` is then rejected by sglang's argument parser with that choice
missing, instead of a crash at the first request).
"""

from __future__ import annotations

import enum
import logging

logger = logging.getLogger("kvrecv.sglang_plugin")

BACKEND = "kvrecv"

# sglang releases whose scheduler code kvrecv.sglang was tested against
# (tests/test_sglang_real.py runs that code).
SUPPORTED = ("0.5.23",)

_UTILS = "sglang.srt.disaggregation.utils"


def sglang_version() -> str:
    try:
        from sglang.version import __version__
    except ImportError:  # pragma: no cover - very old layouts
        return "unknown"
    return str(__version__)


def unsupported_reason(version: str) -> str:
    """Empty if `version` is supported, else the start-up message."""
    if version in SUPPORTED:
        return ""
    return (f"kvrecv: sglang {version} is not a supported release (supported: "
            f"{', '.join(SUPPORTED)}); the '{BACKEND}' transfer backend is not registered")


def _extended_backend(original: type) -> type:
    members = {m.name: m.value for m in original}
    members["KVRECV"] = BACKEND
    extended = enum.Enum(original.__name__, members)
    extended.__module__ = original.__module__
    extended.__qualname__ = original.__qualname__
    return extended


def _get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or \
            class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import sglang as backend

    return {
        KVClassType.MANAGER: backend.KVRecvManager,
        KVClassType.SENDER: backend.KVRecvSender,
        KVClassType.RECEIVER: backend.KVRecvReceiver,
        KVClassType.BOOTSTRAP_SERVER: backend.KVRecvBootstrapServer,
    }.get(class_type)


def register() -> bool:
    """The entry point sglang calls.  Returns whether kvrecv was registered."""
    version = sglang_version()
    reason = unsupported_reason(version)
    if reason:
        logger.error(reason)
        return False
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    import importlib

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    utils = importlib.import_module(_UTILS)
    if "KVRECV" not in utils.TransferBackend.__members__:
        HookRegistry.register(f"{_UTILS}.TransferBackend",
                              _extended_backend(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(f"{_UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)
    return True
