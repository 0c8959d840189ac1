#include "peerstate.h"

int kvr_peer_state_legal(int kind, int from, int to)
{
    if (from < KVR_PEER_RESOLVING || from > KVR_PEER_FAILED || to < KVR_PEER_RESOLVING ||
        to > KVR_PEER_FAILED || (kind != KVR_PEER_IS_PREFILL && kind != KVR_PEER_IS_DECODE)) {
        return 0;
    }
    if (to == from || to == KVR_PEER_FAILED) {
        return 1;
    }
    if (kind == KVR_PEER_IS_DECODE) {
        /* We never resolve or dial a decode: it comes to us. */
        return to == KVR_PEER_READY;
    }
    switch (to) {
    case KVR_PEER_RESOLVING:
        /* again after a failure, or a restarted instance re-verified */
        return from == KVR_PEER_FAILED || from == KVR_PEER_READY;
    case KVR_PEER_CONNECTING:
        return from == KVR_PEER_RESOLVING;
    default: /* READY */
        return from == KVR_PEER_CONNECTING;
    }
}
