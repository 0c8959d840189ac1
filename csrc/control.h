/*
 * control: everything that touches ZMQ.
 *
 * A kvr_ctl_t is one manager's control plane: a ROUTER socket bound on the
 * manager's host (peers connect to it) and any number of DEALER connections
 * to other ROUTERs (the bootstrap server, prefill peers).  All sockets belong
 * to the engine thread; nothing here is thread safe, except that
 * kvr_bootstrap_* run their own thread.  Sends never block: a message that
 * cannot be queued is dropped and the call says so.
 */
#ifndef KVR_CONTROL_H
#define KVR_CONTROL_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvr_ctl kvr_ctl_t;
typedef struct kvr_ctl_conn kvr_ctl_conn_t;

#define KVR_IDENT_MAX 32

/* Messages refused by the control layer before any decoding (see
 * on_refused).  Every refused message is also a dropped one. */
enum {
    KVR_CTL_REFUSED_AUTH = 1,  /* unauthenticated, bad tag, or sealed without our secret */
    KVR_CTL_REFUSED_REPLAY,    /* authentic, but seen before, too old or reflected */
    KVR_CTL_REFUSED_OVERSIZED, /* longer than the socket's limit */
};

/* Limit on messages received on DEALER connections (the largest legitimate
 * one, a HELLO_OK with 2 x 4096 buffers and a 64 KiB worker address, is
 * about 128 KiB). */
#define KVR_CTL_CONN_MAX_MSG (256 * 1024)
/* Only a room request may be longer than this (its page list); anything
 * else longer is refused before authentication spends work on it. */
#define KVR_CTL_SMALL_MAX_MSG (64 * 1024)
/* Messages taken from one socket per kvr_ctl_poll: the engine's timers and
 * UCX progress run between batches however fast a sender sends. */
#define KVR_CTL_DRAIN_MAX 256

typedef struct {
    void *arg;
    /* A message on the ROUTER from the peer with routing id ident. */
    void (*on_router_msg)(void *arg, const void *ident, size_t ident_len, const void *data,
                          size_t len);
    /* A message on a DEALER connection. */
    void (*on_conn_msg)(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx, const void *data,
                        size_t len);
    /* A message refused before decoding: kind is KVR_CTL_REFUSED_*.  From
     * the ROUTER: conn is NULL, ident and from (the sender's address, "" if
     * unknown) say who sent it.  From a DEALER: conn and conn_ctx do. */
    void (*on_refused)(void *arg, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
                       const void *ident, size_t ident_len, const char *from, size_t len,
                       const char *why);
} kvr_ctl_callbacks_t;

/*
 * Creates the context and binds the ROUTER on tcp://host:port (port 0: any).
 * max_msg bounds messages received on the ROUTER: longer ones are refused
 * (KVR_CTL_REFUSED_OVERSIZED) unread, and ZMQ cuts the connection of a
 * sender of more than twice that.  With secret_len > 0 every message sent is
 * sealed and every message received must verify (auth.h); self_epoch is the
 * epoch our own messages carry.  A routing id belongs to the connection
 * that holds it as long as that lives: another one naming it is not heard
 * meanwhile.  The ROUTER sends ZMTP heartbeats every hb_ivl_ms and closes a
 * connection silent for hb_timeout_ms, so that one whose link died without
 * a FIN lets go of its id.  What ZMQ queues for the engine from one
 * connection (ROUTER or DEALER) stays under queue_bytes: past it ZMQ stops
 * reading that connection (its sender's queue fills, and a non-blocking
 * send there fails).  Returns 0, or -1 with err filled.
 */
int kvr_ctl_create(const char *host, int port, int64_t max_msg, const void *secret,
                   size_t secret_len, uint64_t self_epoch, uint32_t hb_ivl_ms,
                   uint32_t hb_timeout_ms, uint64_t queue_bytes, const kvr_ctl_callbacks_t *cb,
                   kvr_ctl_t **ctl_p, char *err, size_t errlen);
void kvr_ctl_destroy(kvr_ctl_t *ctl);
/* "tcp://host:port" of the bound ROUTER. */
const char *kvr_ctl_endpoint(kvr_ctl_t *ctl);

/* Opens a DEALER to endpoint ("tcp://..."), with our routing id. */
int kvr_ctl_connect(kvr_ctl_t *ctl, const char *endpoint, const void *ident, size_t ident_len,
                    void *conn_ctx, kvr_ctl_conn_t **conn_p, char *err, size_t errlen);
/* Must not be called from inside a callback of kvr_ctl_poll. */
void kvr_ctl_conn_close(kvr_ctl_t *ctl, kvr_ctl_conn_t *conn);

/* Non-blocking sends; 0 on success, -1 if the message was dropped (the peer
 * is unknown to the ROUTER, or its queue is full). */
int kvr_ctl_send_conn(kvr_ctl_conn_t *conn, const void *data, size_t len);
int kvr_ctl_send_router(kvr_ctl_t *ctl, const void *ident, size_t ident_len, const void *data,
                        size_t len);

/*
 * Waits up to timeout_ms (-1: forever) for a message on any socket or for
 * one of the extra fds to become readable, then dispatches every pending
 * message to the callbacks.  fd_ready[i] is set for each readable extra fd.
 * Returns the number of messages dispatched, or -1 if interrupted.
 */
int kvr_ctl_poll(kvr_ctl_t *ctl, const int *fds, int nfds, int *fd_ready, long timeout_ms);

/* Bootstrap service: a ROUTER on its own thread where prefill ranks register
 * (rank -> epoch, endpoint) and decode ranks look them up.  With
 * secret_len > 0 it authenticates every message as the managers do;
 * queue_bytes bounds its queues as kvr_ctl_create's. */
typedef struct kvr_bootstrap kvr_bootstrap_t;
int kvr_bootstrap_start(const char *host, int port, const void *secret, size_t secret_len,
                        uint64_t queue_bytes, kvr_bootstrap_t **bs_p, char *err, size_t errlen);
int kvr_bootstrap_port(kvr_bootstrap_t *bs);
typedef struct {
    uint64_t registered;   /* prefill instances registered */
    uint64_t dropped;      /* messages dropped: malformed, unexpected or refused */
    uint64_t auth_rejected; /* of those, refused by authentication */
    char last_rejected[160]; /* the sender of the last one refused ("" if none) */
} kvr_bootstrap_counts_t;
void kvr_bootstrap_counts(kvr_bootstrap_t *bs, kvr_bootstrap_counts_t *out);
/* Stops the thread (blocks until it has exited) and frees everything. */
void kvr_bootstrap_stop(kvr_bootstrap_t *bs);

#endif
