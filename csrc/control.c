#include "control.h"
#include "registry.h" /* kvr_now_ns */

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <zmq.h>

#include "auth.h"
#include "table.h"
#include "wire.h"

/* Seals outgoing messages (when a secret is configured) into its buffer. */
typedef struct {
    kvr_auth_t *auth;
    unsigned char *buf;
    size_t cap;
    uint64_t epoch;      /* of our messages (AUTH_REJECT replies) */
    uint64_t reject_ns;  /* start of the current one-second window of replies */
    int rejects;         /* AUTH_REJECT replies sent in it */
    char who[200];       /* "bootstrap server tcp://..." for reasons */
} kvr_sealer_t;

/* AUTH_REJECT replies per second, all senders together. */
#define KVR_REJECT_REPLIES_PER_S 20

struct kvr_ctl_conn {
    void *sock;
    void *ctx;
    kvr_ctl_t *ctl;
    kvr_ctl_conn_t *next;
};

struct kvr_ctl {
    void *zctx;
    void *router;
    char endpoint[128];
    kvr_ctl_callbacks_t cb;
    kvr_ctl_conn_t *conns;
    zmq_pollitem_t *items;
    int nitems_cap;
    zmq_msg_t frames[2];
    int64_t max_msg;
    uint64_t queue_bytes;
    kvr_sealer_t sealer;
};

static int kvr_sealer_init(kvr_sealer_t *s, const void *secret, size_t secret_len,
                           uint64_t epoch, char *err, size_t errlen)
{
    memset(s, 0, sizeof(*s));
    s->epoch = epoch;
    if (secret_len == 0) {
        return 0;
    }
    if (secret_len > KVR_AUTH_SECRET_MAX) {
        snprintf(err, errlen, "the secret is longer than %d bytes", KVR_AUTH_SECRET_MAX);
        return -1;
    }
    if (kvr_auth_create(secret, secret_len, epoch, &s->auth) != 0) {
        snprintf(err, errlen, "cannot set up HMAC-SHA256 (libcrypto)");
        return -1;
    }
    return 0;
}

static void kvr_sealer_destroy(kvr_sealer_t *s)
{
    kvr_auth_destroy(s->auth);
    free(s->buf);
    s->auth = NULL;
    s->buf = NULL;
}

/* Points (*data, *len) at the sealed form of the message (unchanged without a
 * secret).  Returns 0, or -1 if it cannot be sealed (dropped). */
static int kvr_sealer_out(kvr_sealer_t *s, const void **data, size_t *len)
{
    if (s->auth == NULL) {
        return 0;
    }
    size_t need = *len + KVR_AUTH_TRAILER_LEN;
    if (need > s->cap) {
        unsigned char *nb = realloc(s->buf, need * 2);
        if (nb == NULL) {
            return -1;
        }
        s->buf = nb;
        s->cap = need * 2;
    }
    if (kvr_auth_seal(s->auth, *data, *len, s->buf) != 0) {
        return -1;
    }
    *data = s->buf;
    *len = need;
    return 0;
}

/*
 * Admission of one received message, before anything decodes it: the size
 * limit, then authentication.  inbound: it came to our ROUTER (a connection
 * someone else opened).  Returns 1 to dispatch buf[0..*len), or 0 with
 * *kind and *why set; *reply says whether the sender should get an
 * AUTH_REJECT.
 */
static int kvr_admit(kvr_sealer_t *s, int64_t max_msg, int inbound, unsigned char *buf,
                     size_t *len, int *kind, const char **why, int *reply)
{
    *reply = 0;
    if (max_msg > 0 && *len > (size_t)max_msg) {
        *kind = KVR_CTL_REFUSED_OVERSIZED;
        *why = "message longer than this socket accepts";
        return 0;
    }
    int type = kvr_auth_peek_type(buf, *len);
    int sealed = kvr_auth_is_sealed(buf, *len);
    if (type != KVR_MSG_ROOM_REQ &&
        *len > (size_t)KVR_CTL_SMALL_MAX_MSG + (sealed ? KVR_AUTH_TRAILER_LEN : 0)) {
        *kind = KVR_CTL_REFUSED_OVERSIZED;
        *why = "only a room request may be longer than 64 KiB";
        return 0;
    }
    if (!inbound && !sealed && type == KVR_MSG_AUTH_REJECT) {
        /* The server we connected to cannot authenticate us: it cannot
         * seal its answer either.  Only accepted from servers we chose. */
        return 1;
    }
    if (s->auth == NULL) {
        if (sealed) {
            *kind = KVR_CTL_REFUSED_AUTH;
            *why = "authenticated message, but no secret is configured here";
            *reply = inbound && *len >= KVR_WIRE_HEADER_LEN + KVR_AUTH_TRAILER_LEN;
            return 0;
        }
        return 1;
    }
    size_t body = 0;
    int rc = kvr_auth_open(s->auth, buf, *len, &body, why);
    if (rc == KVR_AUTH_OK) {
        *len = body;
        return 1;
    }
    *kind = rc == KVR_AUTH_REPLAY ? KVR_CTL_REFUSED_REPLAY : KVR_CTL_REFUSED_AUTH;
    *reply = inbound && rc != KVR_AUTH_REPLAY && type != KVR_MSG_AUTH_REJECT;
    return 0;
}

/* Answers a sender we could not authenticate (rate limited), unsealed. */
static void kvr_reject_reply(kvr_sealer_t *s, void *router, const void *ident, size_t ident_len,
                             const char *why)
{
    uint64_t now = kvr_now_ns();
    if (now - s->reject_ns >= 1000000000u) {
        s->reject_ns = now;
        s->rejects = 0;
    }
    if (s->rejects >= KVR_REJECT_REPLIES_PER_S) {
        return;
    }
    s->rejects++;
    char reason[KVR_WIRE_MAX_STR];
    snprintf(reason, sizeof(reason),
             "authentication failed at the %s: %s; the secret (KVRECV_SECRET, KVConfig.secret, "
             "BootstrapServer(secret=)) must be the same on every decode, prefill and bootstrap "
             "server",
             s->who, why);
    kvr_msg_t m = kvr_msg_text(KVR_MSG_AUTH_REJECT, 0, 0, reason);
    m.epoch = s->epoch;
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    if (kvr_wire_encode(&b, &m) == 0 &&
        zmq_send(router, ident, ident_len, ZMQ_DONTWAIT | ZMQ_SNDMORE) >= 0) {
        zmq_send(router, b.data, b.len, ZMQ_DONTWAIT);
    }
    kvr_wbuf_free(&b);
}

/* The sender's address of a received frame, "" if ZMQ does not say. */
static const char *kvr_peer_address(zmq_msg_t *msg)
{
    const char *a = zmq_msg_gets(msg, "Peer-Address");
    return a ? a : "";
}

/* ZMQ counts its queues in messages: the most messages of up to cap bytes
 * that stay within queue_bytes (at least one). */
static int kvr_ctl_hwm(uint64_t queue_bytes, int64_t cap)
{
    uint64_t n = queue_bytes / (uint64_t)cap;
    return n < 1 ? 1 : n > 1000000 ? 1000000 : (int)n;
}

/* rcvhwm: messages received and not yet read, per connection. */
static void kvr_ctl_common_opts(void *sock, int rcvhwm)
{
    int linger = 0, hwm = 1000000, ivl = 100, ivl_max = 1000;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(sock, ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
    zmq_setsockopt(sock, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(sock, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof(ivl_max));
}

static int kvr_ctl_bind(void *sock, const char *host, int port, char *endpoint, size_t eplen,
                        char *err, size_t errlen)
{
    char ep[160];
    if (port > 0) {
        snprintf(ep, sizeof(ep), "tcp://%s:%d", host, port);
    } else {
        snprintf(ep, sizeof(ep), "tcp://%s:*", host);
    }
    if (zmq_bind(sock, ep) != 0) {
        snprintf(err, errlen, "cannot bind %s: %s", ep, zmq_strerror(zmq_errno()));
        return -1;
    }
    size_t len = eplen;
    zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, endpoint, &len);
    return 0;
}

/* ZMQ cuts a connection whose message exceeds this; between max_msg and it,
 * messages are read and refused (counted). */
static int64_t kvr_zmq_cap(int64_t max_msg)
{
    return 2 * max_msg + (2 << 20) + KVR_AUTH_TRAILER_LEN;
}

int kvr_ctl_create(const char *host, int port, int64_t max_msg, const void *secret,
                   size_t secret_len, uint64_t self_epoch, uint32_t hb_ivl_ms,
                   uint32_t hb_timeout_ms, uint64_t queue_bytes, const kvr_ctl_callbacks_t *cb,
                   kvr_ctl_t **ctl_p, char *err, size_t errlen)
{
    kvr_ctl_t *ctl = calloc(1, sizeof(*ctl));
    if (ctl == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    ctl->cb = *cb;
    ctl->max_msg = max_msg;
    ctl->queue_bytes = queue_bytes;
    if (kvr_sealer_init(&ctl->sealer, secret, secret_len, self_epoch, err, errlen) != 0) {
        free(ctl);
        return -1;
    }
    ctl->zctx = zmq_ctx_new();
    if (ctl->zctx == NULL) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        goto err_free;
    }
    ctl->router = zmq_socket(ctl->zctx, ZMQ_ROUTER);
    if (ctl->router == NULL) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto err_term;
    }
    kvr_ctl_common_opts(ctl->router, kvr_ctl_hwm(queue_bytes, kvr_zmq_cap(max_msg)));
    int one = 1;
    zmq_setsockopt(ctl->router, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    /* No ZMQ_ROUTER_HANDOVER: with it any connection that names a live
     * peer's routing id takes the id over, and libzmq (4.3) renames the
     * peer's own connection, whose messages then come from an id nobody
     * knows.  Without it a connection naming an id already held is not
     * heard (libzmq takes its first message for its routing id) until the
     * holder is gone: a peer whose link died without a FIN reaching us
     * reconnects with the same id (its epoch and rank), so the ZMTP
     * heartbeat closes a connection silent for hb_timeout_ms, and the
     * decode says HELLO again on a fresh connection until it is answered. */
    int hb[2] = {hb_ivl_ms > INT_MAX ? INT_MAX : (int)hb_ivl_ms,
                 hb_timeout_ms > INT_MAX ? INT_MAX : (int)hb_timeout_ms};
    zmq_setsockopt(ctl->router, ZMQ_HEARTBEAT_IVL, &hb[0], sizeof(hb[0]));
    zmq_setsockopt(ctl->router, ZMQ_HEARTBEAT_TIMEOUT, &hb[1], sizeof(hb[1]));
    int64_t cap = kvr_zmq_cap(max_msg);
    zmq_setsockopt(ctl->router, ZMQ_MAXMSGSIZE, &cap, sizeof(cap));
    if (kvr_ctl_bind(ctl->router, host, port, ctl->endpoint, sizeof(ctl->endpoint), err,
                     errlen) != 0) {
        goto err_close;
    }
    snprintf(ctl->sealer.who, sizeof(ctl->sealer.who), "kvrecv manager %s", ctl->endpoint);
    zmq_msg_init(&ctl->frames[0]);
    zmq_msg_init(&ctl->frames[1]);
    *ctl_p = ctl;
    return 0;

err_close:
    zmq_close(ctl->router);
err_term:
    zmq_ctx_term(ctl->zctx);
err_free:
    kvr_sealer_destroy(&ctl->sealer);
    free(ctl);
    return -1;
}

void kvr_ctl_destroy(kvr_ctl_t *ctl)
{
    if (ctl == NULL) {
        return;
    }
    while (ctl->conns) {
        kvr_ctl_conn_close(ctl, ctl->conns);
    }
    zmq_msg_close(&ctl->frames[0]);
    zmq_msg_close(&ctl->frames[1]);
    zmq_close(ctl->router);
    zmq_ctx_term(ctl->zctx);
    free(ctl->items);
    kvr_sealer_destroy(&ctl->sealer);
    free(ctl);
}

const char *kvr_ctl_endpoint(kvr_ctl_t *ctl)
{
    return ctl->endpoint;
}

int kvr_ctl_connect(kvr_ctl_t *ctl, const char *endpoint, const void *ident, size_t ident_len,
                    void *conn_ctx, kvr_ctl_conn_t **conn_p, char *err, size_t errlen)
{
    kvr_ctl_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    c->sock = zmq_socket(ctl->zctx, ZMQ_DEALER);
    if (c->sock == NULL) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        free(c);
        return -1;
    }
    int64_t cap = kvr_zmq_cap(KVR_CTL_CONN_MAX_MSG);
    kvr_ctl_common_opts(c->sock, kvr_ctl_hwm(ctl->queue_bytes, cap));
    zmq_setsockopt(c->sock, ZMQ_MAXMSGSIZE, &cap, sizeof(cap));
    if (ident_len > 0) {
        zmq_setsockopt(c->sock, ZMQ_ROUTING_ID, ident, ident_len);
    }
    if (zmq_connect(c->sock, endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        zmq_close(c->sock);
        free(c);
        return -1;
    }
    c->ctx = conn_ctx;
    c->ctl = ctl;
    c->next = ctl->conns;
    ctl->conns = c;
    *conn_p = c;
    return 0;
}

void kvr_ctl_conn_close(kvr_ctl_t *ctl, kvr_ctl_conn_t *conn)
{
    for (kvr_ctl_conn_t **pp = &ctl->conns; *pp; pp = &(*pp)->next) {
        if (*pp == conn) {
            *pp = conn->next;
            break;
        }
    }
    zmq_close(conn->sock);
    free(conn);
}

int kvr_ctl_send_conn(kvr_ctl_conn_t *conn, const void *data, size_t len)
{
    if (kvr_sealer_out(&conn->ctl->sealer, &data, &len) != 0) {
        return -1;
    }
    return zmq_send(conn->sock, data, len, ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

int kvr_ctl_send_router(kvr_ctl_t *ctl, const void *ident, size_t ident_len, const void *data,
                        size_t len)
{
    if (kvr_sealer_out(&ctl->sealer, &data, &len) != 0) {
        return -1;
    }
    if (zmq_send(ctl->router, ident, ident_len, ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0) {
        return -1;
    }
    return zmq_send(ctl->router, data, len, ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

/* Receives one whole multipart message into frames[0..1]; returns the number
 * of frames (extra frames are discarded and make the count 3), 0 if none. */
static int kvr_ctl_recv(void *sock, zmq_msg_t frames[2])
{
    int n = 0;
    for (;;) {
        zmq_msg_t tmp;
        zmq_msg_t *m = n < 2 ? &frames[n] : &tmp;
        if (n >= 2) {
            zmq_msg_init(&tmp);
        }
        if (zmq_msg_recv(m, sock, ZMQ_DONTWAIT) < 0) {
            if (n >= 2) {
                zmq_msg_close(&tmp);
            }
            return n; /* EAGAIN before the first frame: nothing pending */
        }
        int more = zmq_msg_more(m);
        if (n >= 2) {
            zmq_msg_close(&tmp);
            n = 3;
        } else {
            n++;
        }
        if (!more) {
            return n;
        }
    }
}

int kvr_ctl_poll(kvr_ctl_t *ctl, const int *fds, int nfds, int *fd_ready, long timeout_ms)
{
    int nconn = 0;
    for (kvr_ctl_conn_t *c = ctl->conns; c; c = c->next) {
        nconn++;
    }
    int n = 1 + nconn + nfds;
    if (n > ctl->nitems_cap) {
        zmq_pollitem_t *ni = realloc(ctl->items, (size_t)n * 2 * sizeof(*ni));
        if (ni == NULL) {
            return -1;
        }
        ctl->items = ni;
        ctl->nitems_cap = n * 2;
    }
    zmq_pollitem_t *it = ctl->items;
    memset(it, 0, (size_t)n * sizeof(*it));
    it[0].socket = ctl->router;
    it[0].events = ZMQ_POLLIN;
    int k = 1;
    for (kvr_ctl_conn_t *c = ctl->conns; c; c = c->next, k++) {
        it[k].socket = c->sock;
        it[k].events = ZMQ_POLLIN;
    }
    for (int i = 0; i < nfds; i++, k++) {
        it[k].fd = fds[i];
        it[k].events = ZMQ_POLLIN;
    }
    if (zmq_poll(it, n, timeout_ms) < 0) {
        return -1;
    }
    for (int i = 0; i < nfds; i++) {
        fd_ready[i] = (it[1 + nconn + i].revents & ZMQ_POLLIN) != 0;
    }
    int dispatched = 0;
    /* Drain every socket regardless of revents: cheap, and ZMQ's readiness
     * is edge-like, so a missed message would otherwise wait a whole poll.
     * At most KVR_CTL_DRAIN_MAX from each: what is left makes the next
     * zmq_poll return at once. */
    for (int taken = 0; taken < KVR_CTL_DRAIN_MAX; taken++) {
        int nf = kvr_ctl_recv(ctl->router, ctl->frames);
        if (nf == 0) {
            break;
        }
        dispatched++;
        if (nf == 2) {
            size_t len = zmq_msg_size(&ctl->frames[1]);
            int kind, reply;
            const char *why;
            if (!kvr_admit(&ctl->sealer, ctl->max_msg, 1, zmq_msg_data(&ctl->frames[1]), &len,
                           &kind, &why, &reply)) {
                if (reply) {
                    kvr_reject_reply(&ctl->sealer, ctl->router, zmq_msg_data(&ctl->frames[0]),
                                     zmq_msg_size(&ctl->frames[0]), why);
                }
                ctl->cb.on_refused(ctl->cb.arg, kind, NULL, NULL, zmq_msg_data(&ctl->frames[0]),
                                   zmq_msg_size(&ctl->frames[0]),
                                   kvr_peer_address(&ctl->frames[1]),
                                   zmq_msg_size(&ctl->frames[1]), why);
                continue;
            }
            ctl->cb.on_router_msg(ctl->cb.arg, zmq_msg_data(&ctl->frames[0]),
                                  zmq_msg_size(&ctl->frames[0]), zmq_msg_data(&ctl->frames[1]),
                                  len);
        } else {
            /* A frame count the protocol never sends: let the engine count
             * it as malformed through an empty message. */
            ctl->cb.on_router_msg(ctl->cb.arg, zmq_msg_data(&ctl->frames[0]),
                                  zmq_msg_size(&ctl->frames[0]), "", 0);
        }
    }
    /* Callbacks may open connections (added at the head) but never close
     * one: the engine closes them between polls. */
    for (kvr_ctl_conn_t *c = ctl->conns; c; c = c->next) {
        int nf;
        for (int taken = 0;
             taken < KVR_CTL_DRAIN_MAX && (nf = kvr_ctl_recv(c->sock, ctl->frames)) > 0;
             taken++) {
            dispatched++;
            size_t len = nf == 1 ? zmq_msg_size(&ctl->frames[0]) : 0;
            int kind, reply;
            const char *why;
            if (nf == 1 && !kvr_admit(&ctl->sealer, KVR_CTL_CONN_MAX_MSG, 0,
                                      zmq_msg_data(&ctl->frames[0]), &len, &kind, &why, &reply)) {
                ctl->cb.on_refused(ctl->cb.arg, kind, c, c->ctx, NULL, 0,
                                   kvr_peer_address(&ctl->frames[0]),
                                   zmq_msg_size(&ctl->frames[0]), why);
                continue;
            }
            ctl->cb.on_conn_msg(ctl->cb.arg, c, c->ctx, zmq_msg_data(&ctl->frames[0]), len);
        }
    }
    return dispatched;
}

/* ---- bootstrap service ---- */

typedef struct {
    uint64_t epoch;
    char endpoint[KVR_WIRE_MAX_STR + 1];
} kvr_bs_entry_t;

struct kvr_bootstrap {
    void *zctx;
    void *router;
    int stop_fd;
    int port;
    pthread_t thread;
    kvr_table_t ranks; /* kvr_bs_key (DP, TP, PP rank) -> kvr_bs_entry_t* */
    atomic_ullong registered;
    atomic_ullong dropped;
    atomic_ullong auth_rejected;
    pthread_mutex_t last_lock;
    char last_rejected[160];
    kvr_sealer_t sealer;
};

static void kvr_bs_reply(kvr_bootstrap_t *bs, zmq_msg_t *ident, kvr_msg_t *reply)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    reply->epoch = bs->sealer.epoch;
    if (kvr_wire_encode(&b, reply) == 0) {
        const void *data = b.data;
        size_t len = b.len;
        if (kvr_sealer_out(&bs->sealer, &data, &len) == 0) {
            zmq_send(bs->router, zmq_msg_data(ident), zmq_msg_size(ident),
                     ZMQ_DONTWAIT | ZMQ_SNDMORE);
            zmq_send(bs->router, data, len, ZMQ_DONTWAIT);
        }
    }
    kvr_wbuf_free(&b);
}

/* A registration's key: prefill ranks are (DP group, TP rank, PP stage);
 * the wire keeps DP and PP within 16 bits. */
static uint64_t kvr_bs_key(const kvr_msg_t *m)
{
    return (uint64_t)m->dp_rank << 48 | (uint64_t)m->pp_rank << 32 | m->rank;
}

static void kvr_bs_handle(kvr_bootstrap_t *bs, zmq_msg_t frames[2], int nf)
{
    kvr_msg_t m, reply;
    const char *why = NULL;
    if (nf != 2) {
        bs->dropped++;
        return;
    }
    size_t len = zmq_msg_size(&frames[1]);
    int kind, answer;
    if (!kvr_admit(&bs->sealer, 0, 1, zmq_msg_data(&frames[1]), &len, &kind, &why, &answer)) {
        bs->dropped++;
        bs->auth_rejected++;
        /* Recorded before the answer, so whoever reads the answer finds it. */
        pthread_mutex_lock(&bs->last_lock);
        snprintf(bs->last_rejected, sizeof(bs->last_rejected), "%s (%s)",
                 kvr_peer_address(&frames[1]), why);
        pthread_mutex_unlock(&bs->last_lock);
        if (answer) {
            kvr_reject_reply(&bs->sealer, bs->router, zmq_msg_data(&frames[0]),
                             zmq_msg_size(&frames[0]), why);
        }
        return;
    }
    if (kvr_wire_decode(zmq_msg_data(&frames[1]), len, &m, &why) != 0) {
        bs->dropped++;
        return;
    }
    if (m.type == KVR_MSG_BS_REGISTER) {
        kvr_bs_entry_t *e = kvr_table_get(&bs->ranks, kvr_bs_key(&m));
        if (e == NULL) {
            e = calloc(1, sizeof(*e));
            if (e == NULL || kvr_table_put(&bs->ranks, kvr_bs_key(&m), e) != 0) {
                free(e);
                return;
            }
        }
        if (e->epoch != m.epoch) {
            bs->registered++;
        }
        e->epoch = m.epoch;
        memcpy(e->endpoint, m.str, m.str_len);
        e->endpoint[m.str_len] = '\0';
        reply = kvr_msg_rank(KVR_MSG_BS_REGISTER_OK, m.rank);
        kvr_bs_reply(bs, &frames[0], &reply);
    } else if (m.type == KVR_MSG_BS_QUERY) {
        kvr_bs_entry_t *e = kvr_table_get(&bs->ranks, kvr_bs_key(&m));
        reply = e != NULL ? kvr_msg_bs_reply(m.rank, 1, e->epoch, e->endpoint)
                          : kvr_msg_bs_reply(m.rank, 0, 0, NULL);
        kvr_bs_reply(bs, &frames[0], &reply);
    } else {
        bs->dropped++;
    }
}

static void *kvr_bs_main(void *arg)
{
    kvr_bootstrap_t *bs = arg;
    zmq_msg_t frames[2];
    zmq_msg_init(&frames[0]);
    zmq_msg_init(&frames[1]);
    for (;;) {
        zmq_pollitem_t it[2];
        memset(it, 0, sizeof(it));
        it[0].socket = bs->router;
        it[0].events = ZMQ_POLLIN;
        it[1].fd = bs->stop_fd;
        it[1].events = ZMQ_POLLIN;
        if (zmq_poll(it, 2, -1) < 0 && zmq_errno() != EINTR) {
            break;
        }
        if (it[1].revents & ZMQ_POLLIN) {
            break;
        }
        int nf;
        while ((nf = kvr_ctl_recv(bs->router, frames)) > 0) {
            kvr_bs_handle(bs, frames, nf);
        }
    }
    zmq_msg_close(&frames[0]);
    zmq_msg_close(&frames[1]);
    return NULL;
}

int kvr_bootstrap_start(const char *host, int port, const void *secret, size_t secret_len,
                        uint64_t queue_bytes, kvr_bootstrap_t **bs_p, char *err, size_t errlen)
{
    char endpoint[128];
    kvr_bootstrap_t *bs = calloc(1, sizeof(*bs));
    if (bs == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    uint64_t epoch = 0;
    while (epoch == 0) {
        if (getrandom(&epoch, sizeof(epoch), 0) != sizeof(epoch)) {
            epoch = kvr_now_ns() ^ ((uint64_t)getpid() << 32);
        }
    }
    if (kvr_sealer_init(&bs->sealer, secret, secret_len, epoch, err, errlen) != 0) {
        free(bs);
        return -1;
    }
    pthread_mutex_init(&bs->last_lock, NULL);
    kvr_table_init(&bs->ranks);
    bs->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (bs->stop_fd < 0) {
        snprintf(err, errlen, "eventfd: %s", strerror(errno));
        goto err_free;
    }
    bs->zctx = zmq_ctx_new();
    if (bs->zctx == NULL) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        goto err_close_fd;
    }
    bs->router = zmq_socket(bs->zctx, ZMQ_ROUTER);
    if (bs->router == NULL) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto err_term;
    }
    int64_t max_msg = (1 << 16) + KVR_AUTH_TRAILER_LEN;
    kvr_ctl_common_opts(bs->router, kvr_ctl_hwm(queue_bytes, max_msg));
    zmq_setsockopt(bs->router, ZMQ_MAXMSGSIZE, &max_msg, sizeof(max_msg));
    if (kvr_ctl_bind(bs->router, host, port, endpoint, sizeof(endpoint), err, errlen) != 0) {
        goto err_close_sock;
    }
    const char *colon = strrchr(endpoint, ':');
    bs->port = colon ? atoi(colon + 1) : port;
    snprintf(bs->sealer.who, sizeof(bs->sealer.who), "bootstrap server %s", endpoint);
    if (pthread_create(&bs->thread, NULL, kvr_bs_main, bs) != 0) {
        snprintf(err, errlen, "pthread_create failed");
        goto err_close_sock;
    }
    *bs_p = bs;
    return 0;

err_close_sock:
    zmq_close(bs->router);
err_term:
    zmq_ctx_term(bs->zctx);
err_close_fd:
    close(bs->stop_fd);
err_free:
    kvr_sealer_destroy(&bs->sealer);
    pthread_mutex_destroy(&bs->last_lock);
    free(bs);
    return -1;
}

int kvr_bootstrap_port(kvr_bootstrap_t *bs)
{
    return bs->port;
}

void kvr_bootstrap_counts(kvr_bootstrap_t *bs, kvr_bootstrap_counts_t *out)
{
    out->registered = bs->registered;
    out->dropped = bs->dropped;
    out->auth_rejected = bs->auth_rejected;
    pthread_mutex_lock(&bs->last_lock);
    memcpy(out->last_rejected, bs->last_rejected, sizeof(out->last_rejected));
    pthread_mutex_unlock(&bs->last_lock);
}

void kvr_bootstrap_stop(kvr_bootstrap_t *bs)
{
    uint64_t one = 1;
    if (write(bs->stop_fd, &one, sizeof(one)) != sizeof(one)) {
        /* eventfd writes of 8 bytes only fail on overflow; the thread
         * still sees the fd readable. */
    }
    pthread_join(bs->thread, NULL);
    zmq_close(bs->router);
    zmq_ctx_term(bs->zctx);
    close(bs->stop_fd);
    void *v;
    for (kvr_table_iter_t it = {0}; (v = kvr_table_next(&bs->ranks, &it, NULL)) != NULL;) {
        free(v);
    }
    kvr_table_destroy(&bs->ranks);
    kvr_sealer_destroy(&bs->sealer);
    pthread_mutex_destroy(&bs->last_lock);
    free(bs);
}
