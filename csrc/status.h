/*
 * Status and failure codes of the kvrecv core.
 *
 * One X-macro table gives the enum, the stable short name (what Python sees
 * as KVTransferError.code) and a one-line description.  Codes are grouped by
 * how much breaks: KVR_OK, then failures of one room, then failures of a peer
 * (every room bound to it), then misuse.
 */
#ifndef KVR_STATUS_H
#define KVR_STATUS_H

#define KVR_STATUS_MAP(X)                                                     \
    X(OK, "OK", "success")                                                    \
    X(BOOTSTRAP, "BOOTSTRAP", "bootstrap server unreachable or peer not registered") \
    X(LAYOUT_MISMATCH, "LAYOUT_MISMATCH", "the two sides registered different KV layouts") \
    X(PEER_LOST, "PEER_LOST", "the peer process or its connection is gone")   \
    X(PEER_RESTARTED, "PEER_RESTARTED", "the peer restarted: a new instance answers at its address") \
    X(TRANSPORT, "TRANSPORT", "the transport reported an error for an operation") \
    X(TIMEOUT, "TIMEOUT", "no progress within the room's deadline")           \
    X(ABORTED, "ABORTED", "the transfer was aborted")                         \
    X(REMOTE, "REMOTE", "the peer reported a failure")                        \
    X(PROTOCOL, "PROTOCOL", "the peer sent a message that breaks the protocol") \
    X(REFUSED, "REFUSED", "the peer refused the room: its limit of rooms for this peer is reached")

typedef enum {
#define KVR_STATUS_ENUM(name, str, msg) KVR_##name,
    KVR_STATUS_MAP(KVR_STATUS_ENUM)
#undef KVR_STATUS_ENUM
    KVR_STATUS_LAST
} kvr_status_t;

/* Stable short name ("PEER_LOST"); never NULL, "UNKNOWN" for bad values. */
const char *kvr_status_name(int status);
/* One-line description; never NULL. */
const char *kvr_status_message(int status);
/* Code for a short name, or -1 if the name is unknown. */
int kvr_status_from_name(const char *name);

#endif
