/*
 * peer: one remote rank we exchange rooms with, and its connections.
 *
 *   decode's view of a prefill (KVR_PEER_IS_PREFILL):
 *
 *     FAILED --kvr_peer_resolve--> RESOLVING --bootstrap names it--> CONNECTING
 *       ^                              |                                 |
 *       |                   bootstrap timeout             HELLO_OK: endpoint made
 *       |                              v                                 v
 *       +------------------------- FAILED <--- heartbeat, BYE, error --- READY
 *
 *   prefill's view of a decode (KVR_PEER_IS_DECODE): READY on its HELLO,
 *   FAILED when the HELLO is refused, on BYE, silence or an endpoint error.
 *
 * A failed peer's sockets, endpoint and worker are retired to the engine's
 * dead lists and closed by kvr_reap_locked outside any callback.  Engine
 * thread, lock held, unless a prototype says otherwise.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Fails every open room bound to peer p. */
static void kvr_peer_fail_rooms_locked(kvr_engine_t *e, kvr_peer_t *p, int code, int notify,
                                       const char *what)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r == NULL || r->peer != p || kvr_room_terminal(r)) {
            continue;
        }
        kvr_room_failf_locked(e, r, code, notify, "%s %s", p->name, what);
    }
}

void kvr_send_ctrl_to_peer(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m_in)
{
    kvr_msg_t m = *m_in;
    m.epoch = e->epoch;
    if (kvr_wire_encode(&e->wbuf, &m) != 0) {
        return;
    }
    int rc = -1;
    if (p->kind == KVR_PEER_IS_PREFILL && p->conn != NULL) {
        rc = kvr_ctl_send_conn(p->conn, e->wbuf.data, e->wbuf.len);
    } else if (p->kind == KVR_PEER_IS_DECODE) {
        rc = kvr_ctl_send_router(e->ctl, p->ident, p->ident_len, e->wbuf.data, e->wbuf.len);
    }
    (void)rc; /* a lost notice is covered by heartbeats and deadlines */
}

/* Encodes m with our epoch and sends it on a connection we opened (the
 * bootstrap server's; a lost message is asked again by the timers). */
void kvr_send_conn_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, const kvr_msg_t *m_in)
{
    KVR_ASSERT_LOCKED(e);
    kvr_msg_t m = *m_in;
    m.epoch = e->epoch;
    if (kvr_wire_encode(&e->wbuf, &m) == 0) {
        kvr_ctl_send_conn(conn, e->wbuf.data, e->wbuf.len);
    }
}

void kvr_fill_layout(kvr_engine_t *e, kvr_wire_layout_t *l)
{
    l->page_size = e->page_size;
    l->tp_size = e->heads.tp_size;
    l->tp_rank = e->heads.tp_rank;
    l->heads = e->heads.heads;
    l->total_heads = e->heads.total_heads;
    l->nkv = e->nkv;
    l->kv_item_lens = e->layout_kv;
    l->naux = e->naux;
    l->aux_item_lens = e->layout_aux;
    const kvr_layers_t *y = &e->layers;
    int given = y->pp_size > 1 || y->start > 0 || y->layers != y->nkv;
    l->pp_size = given ? y->pp_size : 0;
    l->pp_rank = given ? y->pp_rank : 0;
    l->start_layer = given ? y->start : 0;
    l->layers = given ? y->layers : 0;
    l->nrules = e->nstate_rules;
    l->rules = (const unsigned char *)e->state_rules; /* little-endian host */
    l->state_lists = e->state_list;
}

/* Compares one kind of buffers' item lengths (ours against the wire's). */
static int kvr_items_diff(const char *what, uint32_t n, const uint64_t *ours,
                          const unsigned char *theirs, char *why, size_t len)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = kvr_wire_u64_at(theirs, i);
        if (v != ours[i]) {
            snprintf(why, len, "%s buffer %u item_len %" PRIu64 " here, %" PRIu64 " there", what,
                     i, ours[i], v);
            return -1;
        }
    }
    return 0;
}

/* Compares a peer's layout with ours; returns 0 or writes the first
 * difference into why. */
int kvr_layout_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n)
{
    if (l->page_size != e->page_size) {
        snprintf(why, n, "page_size %u here, %u there", e->page_size, l->page_size);
        return -1;
    }
    kvr_layers_t theirs = kvr_wire_layers(l);
    int pre = e->mode == KVR_MODE_PREFILL;
    const kvr_layers_t *pl = pre ? &e->layers : &theirs, *dl = pre ? &theirs : &e->layers;
    if (l->nkv != e->nkv && pl->pp_size == 1) {
        snprintf(why, n, "%u KV buffers here, %u there", e->nkv, l->nkv);
        return -1;
    }
    if (kvr_layers_compat(pl, dl, why, n) != 0 || kvr_layout_kv_diff(e, l, why, n) != 0) {
        return -1;
    }
    if (l->naux != e->naux) {
        snprintf(why, n, "%u aux and state buffers here, %u there", e->naux, l->naux);
        return -1;
    }
    if (l->state_lists != e->state_list) {
        uint32_t c = (uint32_t)__builtin_ctz(l->state_lists ^ e->state_list);
        snprintf(why, n, "state component %u takes %s here, %s there", c,
                 e->state_list >> c & 1u ? "a list of slots" : "one slot",
                 l->state_lists >> c & 1u ? "a list of slots" : "one slot");
        return -1;
    }
    /* The state buffers (state.c) follow the aux buffers; across TP sizes
     * their rows are slices (kvr_state_link_set checks them). */
    uint32_t plain = e->naux - e->nstate;
    int across = e->heads.heads && l->heads && e->heads.tp_size != l->tp_size;
    return kvr_items_diff("aux", plain, e->aux_item, l->aux_item_lens, why, n) != 0 ||
                   (!across && kvr_items_diff("state", e->nstate, e->aux_item + plain,
                                              l->aux_item_lens + (size_t)plain * 8, why, n) != 0)
               ? -1
               : 0;
}

/* FNV-1a over the kind and the key: the index's 64-bit key.  Peers whose
 * hashes collide share a chain (hnext). */
static uint64_t kvr_peer_hash(int kind, const char *key)
{
    uint64_t h = 0xcbf29ce484222325ull;
    h = (h ^ (uint64_t)(unsigned char)kind) * 0x100000001b3ull;
    for (const unsigned char *c = (const unsigned char *)key; *c; c++) {
        h = (h ^ *c) * 0x100000001b3ull;
    }
    return h;
}

static int kvr_peer_index_add(kvr_engine_t *e, kvr_peer_t *p)
{
    uint64_t h = kvr_peer_hash(p->kind, p->key);
    kvr_peer_t *head = kvr_table_get(&e->peer_index, h);
    p->hnext = head;
    if (kvr_table_put(&e->peer_index, h, p) != 0) {
        p->hnext = NULL;
        return -1;
    }
    return 0;
}

static void kvr_peer_index_remove(kvr_engine_t *e, kvr_peer_t *p)
{
    uint64_t h = kvr_peer_hash(p->kind, p->key);
    kvr_peer_t *head = kvr_table_get(&e->peer_index, h);
    if (head == p) {
        if (p->hnext != NULL) {
            kvr_table_put(&e->peer_index, h, p->hnext); /* replaces: no memory needed */
        } else {
            kvr_table_remove(&e->peer_index, h);
        }
    } else {
        for (kvr_peer_t *q = head; q != NULL; q = q->hnext) {
            if (q->hnext == p) {
                q->hnext = p->hnext;
                break;
            }
        }
    }
    p->hnext = NULL;
}

kvr_peer_t *kvr_peer_find(kvr_engine_t *e, int kind, const char *key)
{
    kvr_peer_t *p = kvr_table_get(&e->peer_index, kvr_peer_hash(kind, key));
    for (; p; p = p->hnext) {
        if (p->kind == kind && strcmp(p->key, key) == 0) {
            return p;
        }
    }
    return NULL;
}

kvr_peer_t *kvr_peer_new(kvr_engine_t *e, int kind, const char *key)
{
    kvr_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return NULL;
    }
    p->kind = kind;
    p->remote_rank = -1;
    p->query_rank = -1;
    p->query_pp = -1;
    snprintf(p->key, sizeof(p->key), "%s", key);
    snprintf(p->name, sizeof(p->name), "%s", key);
    if (kvr_peer_index_add(e, p) != 0) {
        free(p);
        return NULL;
    }
    p->next = e->peers;
    e->peers = p;
    e->stats.peers++;
    return p;
}

/* The key: the server's "host:port", then "#rank" for a rank not ours and
 * "#dpN" for a DP group other than 0 (kvr_peer_bs_endpoint reads the
 * server back from it). */
kvr_peer_t *kvr_prefill_peer_get(kvr_engine_t *e, const char *addr, uint32_t dp, int rank,
                                 int pp)
{
    char key[sizeof(((kvr_peer_t *)0)->key)], r[16] = "", d[16] = "", s[16] = "";
    if (rank >= 0) {
        snprintf(r, sizeof(r), "#%d", rank);
    }
    if (dp > 0) {
        snprintf(d, sizeof(d), "#dp%u", dp);
    }
    if (pp >= 0) {
        snprintf(s, sizeof(s), "#pp%d", pp);
    }
    snprintf(key, sizeof(key), "%.128s%s%s%s", addr, r, d, s);
    kvr_peer_t *p = kvr_peer_find(e, KVR_PEER_IS_PREFILL, key);
    if (p == NULL && (p = kvr_peer_new(e, KVR_PEER_IS_PREFILL, key)) != NULL) {
        p->query_rank = rank;
        p->query_dp = dp;
        p->query_pp = pp;
        kvr_peer_set_state(p, KVR_PEER_FAILED); /* the engine thread resolves it */
    }
    return p;
}

/* Puts x on a dead list; 0, or -1 if out of memory. */
static int kvr_dead_push(kvr_deadlist_t *d, void *x)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 16;
        void **v = realloc(d->v, cap * sizeof(*v));
        if (v == NULL) {
            return -1;
        }
        d->v = v;
        d->cap = cap;
    }
    d->v[d->n++] = x;
    return 0;
}

/* Retires a control connection (closed at once only if memory ran out). */
static void kvr_dead_conn(kvr_engine_t *e, kvr_ctl_conn_t *c)
{
    if (c != NULL && kvr_dead_push(&e->dead_conns, c) != 0) {
        kvr_ctl_conn_close(e->ctl, c);
    }
}

int kvr_peer_rekey(kvr_engine_t *e, kvr_peer_t *p, const char *key)
{
    kvr_peer_index_remove(e, p);
    snprintf(p->key, sizeof(p->key), "%s", key);
    snprintf(p->name, sizeof(p->name), "%s", key);
    if (kvr_peer_index_add(e, p) != 0) {
        p->key[0] = '\0';
        return -1;
    }
    return 0;
}

/* Queues the peer's sockets and endpoint for closing.  They are closed by
 * kvr_reap_locked, outside UCX progress and outside the socket poll, since
 * this may run inside a callback of either. */
void kvr_peer_disconnect(kvr_engine_t *e, kvr_peer_t *p)
{
    kvr_dead_conn(e, p->bs_conn);
    kvr_dead_conn(e, p->conn);
    kvr_dead_conn(e, p->vconn);
    p->vconn = NULL;
    p->verifying = 0;
    p->bs_conn = NULL;
    p->conn = NULL;
    if (p->ep) {
        if (kvr_dead_push(&e->dead_eps, p->ep) != 0) {
            kvr_tp_ep_close(p->ep, 1); /* out of memory: now rather than never */
        }
        p->ep = NULL;
    }
    p->ep_err = 0; /* an error of the endpoint just retired */
    p->lane_wait = 0;
    if (p->worker) {
        /* A connection to a peer never reuses a worker (a dead peer may
         * have left its shared-memory FIFO stopped).  From now on it is
         * not progressed: nothing the peer left in flight lands after its
         * rooms failed.  (Out of memory, it stays until the manager
         * closes.) */
        kvr_tp_worker_retire(p->worker);
        (void)kvr_dead_push(&e->dead_workers, p->worker);
        p->worker = NULL;
    }
}

void kvr_peer_retire_conn(kvr_engine_t *e, kvr_peer_t *p)
{
    kvr_dead_conn(e, p->conn);
    p->conn = NULL;
}

/* The peer's UCX worker, created for a new connection.  0, or -1 with err. */
int kvr_peer_worker(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen)
{
    if (p->worker != NULL) {
        return 0;
    }
    return kvr_tp_worker_create(e->tp, &p->worker, err, errlen);
}

void kvr_reap_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    while (e->dead_conns.n > 0) {
        kvr_ctl_conn_close(e->ctl, e->dead_conns.v[--e->dead_conns.n]);
    }
    while (e->dead_eps.n > 0) {
        kvr_tp_ep_close(e->dead_eps.v[--e->dead_eps.n], 1);
    }
    while (e->dead_workers.n > 0) {
        kvr_tp_worker_destroy(e->dead_workers.v[--e->dead_workers.n]);
    }
}

void kvr_dead_free(kvr_engine_t *e)
{
    free(e->dead_conns.v);
    free(e->dead_eps.v);
    free(e->dead_workers.v);
}

/* Decode: tells the prefill, over the control channel that still works,
 * that a room failed before it could ask for anything (the prefill's
 * sender would otherwise wait for its bootstrap timeout). */
void kvr_tell_room_failed(kvr_engine_t *e, kvr_peer_t *p, kvr_room_t *r, int code)
{
    kvr_failure_t f;
    if (p->conn == NULL || !kvr_registry_peek(&e->registry, r->id, &f)) {
        return;
    }
    kvr_msg_t n = kvr_msg_fail(KVR_MSG_ROOM_FAIL, r->id, r->tag, code, e->rank, f.reason, NULL);
    kvr_send_ctrl_to_peer(e, p, &n);
}

/*
 * Declares the peer failed: every room bound to it fails with code.  On the
 * decode side, rooms still bootstrapping have sent nothing to that instance:
 * when the instance is lost or replaced they wait for the next one (within
 * the bootstrap timeout) instead of failing.
 */
void kvr_peer_fail_locked(kvr_engine_t *e, kvr_peer_t *p, int code, const char *what)
{
    KVR_ASSERT_LOCKED(e);
    if (p->state == KVR_PEER_FAILED) {
        return;
    }
    int spare = p->kind == KVR_PEER_IS_PREFILL && (code == KVR_PEER_LOST || code == KVR_PEER_RESTARTED);
    int waiting = 0, failed = 0;
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r == NULL || r->peer != p || kvr_room_terminal(r)) {
            continue;
        }
        if (spare && atomic_load(&r->visible) == KVR_POLL_BOOTSTRAPPING && !r->failing) {
            waiting = 1;
            continue;
        }
        kvr_room_failf_locked(e, r, code, 0, "%s %s", p->name, what);
        failed++;
        if (p->kind == KVR_PEER_IS_PREFILL && (code == KVR_TRANSPORT || code == KVR_LAYOUT_MISMATCH)) {
            kvr_tell_room_failed(e, p, r, code);
        }
    }
    /* A peer that goes away with no room of ours in flight is news, not a
     * failure (a graceful shutdown of the other side). */
    kvr_log_write(&e->log, failed ? KVR_LOG_WARNING : KVR_LOG_INFO,
                  "%s rank %d: %s: %s %s (%d room(s) failed)", kvr_side(e), e->rank,
                  kvr_status_name(code), p->name, what, failed);
    if (e->mode == KVR_MODE_PREFILL) {
        kvr_pending_peer_failed_locked(e, p, code, what);
    }
    kvr_peer_set_state(p, KVR_PEER_FAILED);
    kvr_peer_disconnect(e, p);
    if (waiting) {
        char err[256];
        if (kvr_peer_resolve(e, p, err, sizeof(err)) != 0) {
            kvr_peer_fail_rooms_locked(e, p, KVR_BOOTSTRAP, 0, err);
        }
    }
}

/* Decode: start (or restart) resolving a prefill peer through bootstrap. */
/*
 * The silence after which a ready peer is lost.  A prefill declares a
 * decode lost when more than heartbeat_timeout_ms passed since the decode's
 * last PING reached it; the decode last heard the prefill at the PONG to
 * that PING, up to a round trip (and a loaded scheduler) later.  So the
 * decode gives up on a prefill a margin earlier than the prefill gives up
 * on it: it never takes data from a prefill that may already have failed
 * the room (a decode frozen, then resumed with data still queued).
 */
uint64_t kvr_peer_silence_limit_ns(const kvr_engine_t *e, const kvr_peer_t *p)
{
    uint64_t t = e->cfg.heartbeat_timeout_ms;
    if (p->kind == KVR_PEER_IS_PREFILL) {
        uint64_t margin = e->cfg.heartbeat_interval_ms < t / 4 ? e->cfg.heartbeat_interval_ms
                                                               : t / 4;
        t -= margin;
    }
    return t * KVR_MS;
}

int kvr_peer_silent(const kvr_engine_t *e, const kvr_peer_t *p, uint64_t now)
{
    return p->state == KVR_PEER_READY && now > p->last_heard_ns &&
           now - p->last_heard_ns > kvr_peer_silence_limit_ns(e, p);
}

/* Whether a ready peer is silent past its limit (not yet declared lost). */
int kvr_peers_silent_locked(const kvr_engine_t *e, uint64_t now)
{
    for (const kvr_peer_t *p = e->peers; p; p = p->next) {
        if (kvr_peer_silent(e, p, now)) {
            return 1;
        }
    }
    return 0;
}

/* The bootstrap server of a decode's prefill peer: its key is the server's
 * "host:port", with "#rank" after it when it names a rank not ours. */
static void kvr_peer_bs_endpoint(const kvr_peer_t *p, char *ep, size_t n)
{
    snprintf(ep, n, "tcp://%.*s", (int)strcspn(p->key, "#"), p->key);
}

int kvr_peer_resolve(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen)
{
    char ep[192];
    kvr_peer_disconnect(e, p);
    kvr_peer_set_state(p, KVR_PEER_RESOLVING);
    p->epoch = 0;
    if (p->query_dp > 0 || p->query_pp >= 0) {
        char dp[32] = "", pp[32] = "";
        if (p->query_dp > 0) {
            snprintf(dp, sizeof(dp), "DP group %u, ", p->query_dp);
        }
        if (p->query_pp >= 0) {
            snprintf(pp, sizeof(pp), ", PP stage %d", p->query_pp);
        }
        snprintf(p->name, sizeof(p->name), "%.*s (prefill %srank %d%s)",
                 (int)strcspn(p->key, "#"), p->key, dp,
                 p->query_rank >= 0 ? p->query_rank : e->rank, pp);
    } else {
        snprintf(p->name, sizeof(p->name), "%.159s", p->key); /* a routing id: short */
    }
    kvr_peer_bs_endpoint(p, ep, sizeof(ep));
    if (kvr_ctl_connect(e->ctl, ep, NULL, 0, p, &p->bs_conn, err, errlen) != 0) {
        kvr_peer_set_state(p, KVR_PEER_FAILED);
        return -1;
    }
    p->resolve_deadline_ns = kvr_now_ns() + e->cfg.bootstrap_timeout_ms * KVR_MS;
    p->next_try_ns = 0; /* query at once */
    return 0;
}

/* Asks the bootstrap server (on conn) which prefill instance serves peer
 * p's rank (ours, unless the peer names another) in p's DP group. */
void kvr_bs_query(kvr_engine_t *e, const kvr_peer_t *p, kvr_ctl_conn_t *conn)
{
    int rank = p->query_rank >= 0 ? p->query_rank : e->rank;
    kvr_msg_t m = kvr_msg_bs(KVR_MSG_BS_QUERY, p->query_dp, (uint32_t)rank,
                             p->query_pp > 0 ? (uint32_t)p->query_pp : 0, NULL);
    kvr_send_conn_locked(e, conn, &m);
}

void kvr_peer_hello(kvr_engine_t *e, kvr_peer_t *p)
{
    const void *addr;
    size_t alen;
    kvr_wire_layout_t layout;
    kvr_fill_layout(e, &layout);
    kvr_tp_address(p->worker, &addr, &alen);
    kvr_msg_t m = kvr_msg_hello(KVR_MSG_HELLO, (uint32_t)e->rank, &layout, addr, (uint32_t)alen);
    size_t rx = kvr_tp_tcp_rx_seg(e->tp);
    m.tcp_rx_seg = rx > UINT32_MAX ? UINT32_MAX : (uint32_t)rx;
    kvr_tp_shm_sizes(e->tp, &m.shm_seg, &m.shm_fifo);
    m.has_shm = 1;
    kvr_cma_offer(e, p, &m);
    m.has_lane = e->cfg.tcp_lane && e->ndev == 0; /* lane.h */
    kvr_send_ctrl_to_peer(e, p, &m);
}

/*
 * Decode: before a new room binds to a ready prefill peer, ask the bootstrap
 * server (at most every 100 ms) whether the same instance is still the one
 * registered for our rank.  A prefill that restarted is then noticed by the
 * first new room after it registered, not by the heartbeat of the dead one.
 */
#define KVR_VERIFY_EVERY_MS 100
#define KVR_VERIFY_TIMEOUT_MS 500

void kvr_peer_verify_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    KVR_ASSERT_LOCKED(e);
    uint64_t now = kvr_now_ns();
    if (p->verifying || now - p->verified_ns < KVR_VERIFY_EVERY_MS * KVR_MS) {
        return;
    }
    char ep[192], err[256];
    kvr_peer_bs_endpoint(p, ep, sizeof(ep));
    if (kvr_ctl_connect(e->ctl, ep, NULL, 0, p, &p->vconn, err, sizeof(err)) != 0) {
        p->verified_ns = now; /* keep the peer we have */
        return;
    }
    p->verifying = 1;
    p->verify_deadline_ns = now + KVR_VERIFY_TIMEOUT_MS * KVR_MS;
    kvr_bs_query(e, p, p->vconn);
}

/* Ends a verification: the registration is the same (or unknown), or a new
 * instance replaced the one our rooms are bound to. */
void kvr_peer_verified_locked(kvr_engine_t *e, kvr_peer_t *p, int found, uint64_t epoch)
{
    KVR_ASSERT_LOCKED(e);
    kvr_dead_conn(e, p->vconn);
    p->vconn = NULL;
    p->verifying = 0;
    p->verified_ns = kvr_now_ns();
    if (found && epoch != p->epoch) {
        char what[200];
        snprintf(what, sizeof(what),
                 "restarted: the bootstrap server lists a new instance (epoch %016" PRIx64
                 ", was %016" PRIx64 ")",
                 epoch, p->epoch);
        kvr_log_write(&e->log, KVR_LOG_WARNING, "decode rank %d: PEER_RESTARTED: %s %s", e->rank,
                      p->name, what);
        /* Rooms bound to the old instance fail; rooms still bootstrapping
         * go to the new one. */
        kvr_room_t *r;
        for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
            if (r && r->peer == p && !kvr_room_terminal(r) &&
                atomic_load(&r->visible) > KVR_POLL_BOOTSTRAPPING) {
                kvr_room_failf_locked(e, r, KVR_PEER_RESTARTED, 0, "%s %s", p->name, what);
            }
        }
        char err[256];
        if (kvr_peer_resolve(e, p, err, sizeof(err)) != 0) {
            kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, err);
        }
        return;
    }
    kvr_service_peer_rooms_locked(e, p);
}

/* Endpoint ep of peer p failed.  Recorded for kvr_ep_errors_locked (on
 * the engine thread: failing a peer touches its sockets, and this may run
 * in poll()'s progress).  Only the peer's current endpoint speaks for it:
 * one it replaced or retired (closed by the next reap) may still report
 * the failure of the connection it had before. */
void kvr_on_ep_error(void *arg, void *ep_ctx, kvr_tp_ep_t *ep, const char *status_text)
{
    kvr_engine_t *e = arg;
    kvr_peer_t *p = ep_ctx;
    if (ep != p->ep) {
        kvr_log_write(&e->log, KVR_LOG_DEBUG, "%s rank %d: %s: error of an endpoint no longer in "
                      "use ignored: %s", kvr_side(e), e->rank, p->name, status_text);
        return;
    }
    if (p->ep_err) {
        return; /* the first error names the cause */
    }
    p->ep_err = 1;
    p->ep_err_ep = ep;
    p->ep_err_ns = kvr_now_ns();
    snprintf(p->ep_err_text, sizeof(p->ep_err_text), "%s", status_text);
    e->ep_err_pending = 1;
}

/*
 * Engine thread: fails the peers whose current endpoint failed.  Not at
 * once: a peer that closes its manager says BYE on the control channel,
 * then closes its endpoints, and over tcp the endpoint error can overtake
 * the BYE.  For KVR_EP_ERR_GRACE_NS the BYE may still come and fail the
 * peer with its reason (the rooms then say the peer closed its manager,
 * not "lost: Endpoint timeout"); a peer that died says nothing and fails
 * with the endpoint's error after that.  Operations on the failed endpoint
 * fail at once regardless (op.c).
 */
void kvr_ep_errors_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    uint64_t now = kvr_now_ns();
    e->ep_err_pending = 0;
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (!p->ep_err) {
            continue;
        }
        if (p->ep == NULL || p->ep != p->ep_err_ep) {
            p->ep_err = 0; /* the peer failed or reconnected meanwhile */
        } else if (now - p->ep_err_ns < KVR_EP_ERR_GRACE_NS) {
            e->ep_err_pending = 1;
        } else {
            p->ep_err = 0;
            char what[256];
            snprintf(what, sizeof(what), "lost: %s", p->ep_err_text);
            kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
        }
    }
}
