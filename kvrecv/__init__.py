"""kvrecv: KV-cache transfer for prefill/decode disaggregated serving.

The API mirrors the one sglang's schedulers call (KVManager, KVSender,
KVReceiver, KVPoll, poll(), failure_exception()); everything below it runs in
the C core (kvrecv._core): UCX for the data, ZMQ for control, and a failure
registry whose records reach Python as KVTransferError subclasses.
"""

from ._api import (
    BootstrapServer,
    KVArgs,
    KVConfig,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
)
from ._core import (
    KVAbortedError,
    KVBootstrapError,
    KVLayoutError,
    KVPeerLostError,
    KVPeerRestartedError,
    KVProtocolError,
    KVRefusedError,
    KVRemoteError,
    KVTimeoutError,
    KVTransferError,
    KVTransportError,
    failure_codes,
)

__all__ = [
    "BootstrapServer",
    "KVArgs",
    "KVConfig",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "KVAbortedError",
    "KVBootstrapError",
    "KVLayoutError",
    "KVPeerLostError",
    "KVPeerRestartedError",
    "KVProtocolError",
    "KVRefusedError",
    "KVRemoteError",
    "KVTimeoutError",
    "KVTransportError",
    "failure_codes",
]
__version__ = "0.1.0"
