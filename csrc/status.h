/*
 * Status and failure codes of the kvrecv core.
 *
 * One X-macro table gives the enum, the stable short name (what Python sees
 * as KVTransferError.code), the name of the KVTransferError subclass the
 * binding raises for it (NULL for OK; the core itself never uses it) and a
 * one-line description.  Codes are grouped by how much breaks: KVR_OK, then
 * failures of one room, then failures of a peer (every room bound to it),
 * then misuse.
 */
#ifndef KVR_STATUS_H
#define KVR_STATUS_H

#define KVR_STATUS_MAP(X)                                                      \
    X(OK, "OK", NULL,                                                          \
      "success")                                                               \
    X(BOOTSTRAP, "BOOTSTRAP", "KVBootstrapError",                              \
      "bootstrap server unreachable or peer not registered")                   \
    X(LAYOUT_MISMATCH, "LAYOUT_MISMATCH", "KVLayoutError",                     \
      "the two sides registered different KV layouts")                         \
    X(PEER_LOST, "PEER_LOST", "KVPeerLostError",                               \
      "the peer process or its connection is gone")                            \
    X(PEER_RESTARTED, "PEER_RESTARTED", "KVPeerRestartedError",                \
      "the peer restarted: a new instance answers at its address")             \
    X(TRANSPORT, "TRANSPORT", "KVTransportError",                              \
      "the transport reported an error for an operation")                      \
    X(TIMEOUT, "TIMEOUT", "KVTimeoutError",                                    \
      "no progress within the room's deadline")                                \
    X(ABORTED, "ABORTED", "KVAbortedError",                                    \
      "the transfer was aborted")                                              \
    X(REMOTE, "REMOTE", "KVRemoteError",                                       \
      "the peer reported a failure")                                           \
    X(PROTOCOL, "PROTOCOL", "KVProtocolError",                                 \
      "the peer sent a message that breaks the protocol")                      \
    X(REFUSED, "REFUSED", "KVRefusedError",                                    \
      "the peer refused the room: its limit of rooms for this peer is reached")

typedef enum {
#define KVR_STATUS_ENUM(name, str, pyclass, msg) KVR_##name,
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
