#define _GNU_SOURCE /* pthread_setname_np */
#include "engine.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "control.h"
#include "cuda.h"
#include "log.h"
#include "room.h"
#include "table.h"
#include "testhook.h"
#include "transport.h"
#include "wire.h"

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

enum { KVR_PEER_RESOLVING, KVR_PEER_CONNECTING, KVR_PEER_READY, KVR_PEER_FAILED };
enum { KVR_PEER_IS_PREFILL, KVR_PEER_IS_DECODE };

#define KVR_MS ((uint64_t)1000000)
#define KVR_MAX_DEAD 1024
#define KVR_MAX_PENDING_PAGES (16u << 20) /* held by pending requests: 64 MiB */
#define KVR_SCAN_NS (5 * KVR_MS) /* period of the timer scans over all rooms */
#define KVR_BUSY_POLL_NS (100 * 1000) /* socket polls of a busy engine loop */
#define KVR_TCP_RUN_BYTES (64u << 10)  /* auto coalesce_run_bytes over tcp */
#define KVR_SHM_EAGER_ROOM_BYTES (512u << 10) /* rooms sent as eager messages over shm */
#define KVR_POLL_PROGRESS_NS (10 * 1000) /* poll(): at most one UCX progress per */
#define KVR_STAGE_NAP_NS (10 * 1000)  /* between polls of staging copies */

typedef struct kvr_peer {
    int kind;
    int state;
    uint64_t epoch;             /* remote instance epoch; 0 before known */
    int remote_rank;
    char key[160];              /* decode: bootstrap addr; prefill: routing id */
    char name[160];             /* "host:port" for reasons and logs */
    kvr_ctl_conn_t *bs_conn;    /* decode: to the bootstrap server */
    kvr_ctl_conn_t *conn;       /* decode: to the prefill's ROUTER */
    unsigned char ident[KVR_IDENT_MAX];
    size_t ident_len;           /* prefill: the decode's routing id */
    kvr_tp_worker_t *worker;    /* our UCX worker for this peer (see transport.h) */
    kvr_tp_ep_t *ep;            /* endpoint from it to the peer's worker */
    kvr_ctl_conn_t *vconn;      /* decode: re-checking the bootstrap registration */
    int verifying;
    uint64_t verified_ns;
    uint64_t verify_deadline_ns;
    void *worker_addr;          /* prefill: the decode's worker address */
    size_t worker_addr_len;
    uint64_t last_heard_ns;
    uint64_t last_data_ns;      /* a data operation with this peer completed */
    uint64_t next_ping_ns;
    uint64_t next_try_ns;
    uint64_t resolve_deadline_ns;
    uint32_t nrooms;            /* prefill: requests of this decode pending or bound */
    int ep_err;                 /* an endpoint error seen off the engine thread */
    kvr_tp_ep_t *ep_err_ep;     /* on this endpoint */
    char ep_err_text[128];
    struct kvr_peer *next;
} kvr_peer_t;

/* A pinned host buffer that device memory is staged through. */
typedef struct kvr_slot {
    char *buf;
    struct kvr_slot *next;
} kvr_slot_t;

/* Where a staged operation is (kvr_op_t.stage). */
enum {
    KVR_STAGE_NONE = 0, /* not staged: UCX reads/writes the pieces themselves */
    KVR_STAGE_D2H = 1,  /* prefill: device pieces -> slot copy in flight */
    KVR_STAGE_XFER = 2, /* the slot is with UCX (send or receive) */
    KVR_STAGE_H2D = 3,  /* decode: slot -> device pieces copy in flight */
};

typedef struct kvr_op {
    kvr_tp_op_t base; /* first: the transport hands this pointer back */
    kvr_room_t *room;
    uint64_t len;
    struct kvr_op *prev, *next; /* the room's operations in flight */
    /* staging (device memory without UCX support for it) */
    int stage;                  /* KVR_STAGE_* */
    int mixed;                  /* decode: pieces of several buffers, host or device */
    kvr_slot_t *slot;           /* the pinned slot, or */
    void *bounce;               /* a heap buffer (decode, no slot fit) */
    void *event;                /* recorded after the copy */
    struct kvr_op *stage_next;  /* the engine's FIFO of copies in flight */
    kvr_tp_iov_t siov;          /* the contiguous staging piece UCX sees */
    /* UCX 1.13 reads an AM header until the send completes: it lives here. */
    unsigned char hdr[KVR_AM_HEADER_LEN];
    uint32_t niov;
    /* The pieces of the message: the sender's source runs, or the
     * receiver's destination runs (UCX reads them until completion). */
    kvr_tp_iov_t iov[];
} kvr_op_t;

/* Most pieces in one coalesced data message. */
#define KVR_MAX_IOV 1024

/* A decode request that reached the prefill before its KVSender. */
typedef struct {
    kvr_peer_t *peer;
    uint64_t tag;
    int64_t aux_index;
    uint32_t npages;
    int32_t *pages;
    uint32_t prefix_len;
    uint64_t arrived_ns;
} kvr_pending_t;

/* A root cause waiting to be published to the siblings. */
/* Rate limit of one kind of WARNING. */
typedef struct {
    uint64_t last_ns;
    uint64_t held;
} kvr_ratelog_t;

typedef struct kvr_sib_out {
    uint64_t room;
    kvr_failure_t f;
    struct kvr_sib_out *next;
} kvr_sib_out_t;

struct kvr_engine {
    int mode;
    int rank;
    uint64_t epoch;
    kvr_config_t cfg;
    char host[128];
    char bootstrap_addr[128];
    uint32_t page_size;
    uint32_t nkv, naux;
    uint64_t *kv_ptrs, *kv_lens, *kv_item;
    uint64_t kv_item_max; /* the widest KV item */
    uint64_t *aux_ptrs, *aux_lens, *aux_item;
    uint64_t aux_item_max; /* the widest aux item */
    int64_t min_pages;   /* pages every KV buffer has */
    int64_t aux_rows;    /* rows every aux buffer has */
    uint64_t page_bytes; /* sum of kv item lengths */
    uint64_t aux_bytes;  /* sum of aux item lengths */
    unsigned char *layout_kv; /* little-endian copies for the wire */
    unsigned char *layout_aux;

    pthread_mutex_t lock;
    pthread_t thread;
    int thread_started;
    int wake_fd;
    int stopping;
    int closed;

    kvr_registry_t registry;
    kvr_transport_t *tp;
    kvr_ctl_t *ctl;
    kvr_table_t rooms;   /* id -> room (open rooms) */
    kvr_table_t tags;    /* tag -> room (rooms alive, for data lookup) */
    kvr_table_t pending; /* room id -> kvr_pending_t* (prefill) */
    uint64_t pending_pages; /* pages the pending requests hold */
    kvr_room_t *work_head;
    kvr_peer_t *peers;
    /* decode: poll() progressing UCX from the caller's thread */
    int off_thread;               /* set while it does (under the lock) */
    int ep_err_pending;           /* a peer has ep_err set */
    _Atomic uint64_t poll_progress_ns; /* when it last did */

    /* prefill registration with the bootstrap server */
    kvr_ctl_conn_t *bs_conn;
    int registered;
    uint64_t next_register_ns;

    /* sibling ranks of this instance */
    char **sib_eps;
    int nsib;
    int sib_dirty;
    kvr_ctl_conn_t **sib_conns;
    int nsib_conns;
    kvr_sib_out_t *sib_out; /* failures to publish */
    int sib_pending;

    /* closed outside callbacks by kvr_reap_locked */
    kvr_ctl_conn_t *dead_conns[KVR_MAX_DEAD];
    int ndead_conns;
    kvr_tp_ep_t *dead_eps[KVR_MAX_DEAD];
    int ndead_eps;
    kvr_tp_worker_t *dead_workers[KVR_MAX_DEAD]; /* destroyed after dead_eps are closed */
    int ndead_workers;

    kvr_log_t log;
    uint64_t next_scan_ns; /* next timer scan over the rooms */
    uint64_t drop_log_ns;  /* last time dropped messages were logged */
    uint64_t drop_log_n;   /* dropped since then */
    kvr_ratelog_t auth_log;    /* refused by authentication */
    kvr_ratelog_t size_log;    /* oversized */
    kvr_ratelog_t data_log;    /* foreign data messages */
    kvr_ratelog_t refuse_log;  /* refused requests */
    char reg_auth_error[KVR_WIRE_MAX_STR + 1]; /* prefill: why the bootstrap server refused us */

    uint64_t tag_pool[64]; /* random room tags, drawn in batches */
    int tag_pool_n;

    kvr_wbuf_t wbuf;
    kvr_stats_t stats; /* counters (room gauges are computed on demand) */

    /* device memory */
    uint8_t *kv_dev, *aux_dev; /* 1: the buffer is device memory */
    uint32_t ndev;             /* how many are */
    int cuda_device;           /* the device they live on */
    int gpu_path;              /* KVR_GPU_* */
    char gpu_why[320];
    void *stream;              /* staging copies, in order */
    char *pool;                /* pinned slots, staging_slot_bytes each */
    uint32_t nslots;
    kvr_slot_t *slots, *slot_free;
    void **events;             /* free events */
    uint32_t nevents, events_cap;
    kvr_op_t *stage_head, *stage_tail; /* copies in flight, in stream order */
    kvr_room_t *slot_waiters;  /* prefill rooms waiting for a free slot */

    int test_corrupt;          /* KVR_TEST_CORRUPT_*: tests only (testhook.h) */

    /* Copied at creation: readable without the lock while close() frees
     * the transport and the control layer. */
    char endpoint[128];
    char transport[256];
};


/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

/*
 * Logs a WARNING at most once a second per kind; the lines held back in
 * between are counted and reported with the next one.
 */
static void kvr_warn_limited(kvr_engine_t *e, kvr_ratelog_t *rl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void kvr_warn_limited(kvr_engine_t *e, kvr_ratelog_t *rl, const char *fmt, ...)
{
    uint64_t now = kvr_now_ns();
    if (rl->last_ns != 0 && now - rl->last_ns < 1000 * KVR_MS) {
        rl->held++;
        return;
    }
    char text[KVR_LOG_TEXT];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (rl->held) {
        kvr_log_write(&e->log, KVR_LOG_WARNING, "%s (and %" PRIu64 " more like it in the last %" PRIu64 " ms)",
                      text, rl->held, (now - rl->last_ns) / KVR_MS);
    } else {
        kvr_log_write(&e->log, KVR_LOG_WARNING, "%s", text);
    }
    rl->last_ns = now;
    rl->held = 0;
}

/* A fresh room tag: random, non-zero, not in use here.  Tags name rooms on
 * the data path, so a peer must not be able to guess another room's tag. */
static uint64_t kvr_new_tag_locked(kvr_engine_t *e)
{
    for (;;) {
        if (e->tag_pool_n == 0) {
            if (getrandom(e->tag_pool, sizeof(e->tag_pool), 0) != (ssize_t)sizeof(e->tag_pool)) {
                /* getrandom on Linux >= 3.17 does not fail for 512 bytes; a
                 * counter mixed with the epoch keeps tags unique regardless. */
                for (int i = 0; i < 64; i++) {
                    e->tag_pool[i] = (e->epoch * 0x9E3779B97F4A7C15ULL) ^ kvr_now_ns() ^ (uint64_t)i;
                }
            }
            e->tag_pool_n = 64;
        }
        uint64_t t = e->tag_pool[--e->tag_pool_n];
        if (t != 0 && kvr_table_get(&e->tags, t) == NULL) {
            return t;
        }
    }
}

void kvr_config_default(kvr_config_t *cfg)
{
    cfg->bootstrap_timeout_ms = 30000;
    cfg->heartbeat_interval_ms = 100;
    cfg->heartbeat_timeout_ms = 600;
    cfg->deadline_base_ms = 60000;
    cfg->deadline_floor_bps = 100ULL * 1000 * 1000;
    cfg->max_rooms = 65536;
    cfg->max_pending = 65536;
    cfg->ctrl_port = 0;
    cfg->sibling_wait_ms = 50;
    cfg->register_memory = 1;
    cfg->coalesce_bytes = 1u << 20;
    cfg->coalesce_run_bytes = 0; /* auto */
    cfg->pack_bytes = (uint64_t)256 << 20;
    cfg->max_rooms_per_peer = 16384;
    cfg->max_peers = 64;
    cfg->poll_progress = 1;
    cfg->secret_len = 0;
    cfg->staging_slots = 8;
    cfg->staging_slot_bytes = 4u << 20;
    cfg->force_staging = 0;
}

static int kvr_err(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int kvr_err(char *err, size_t errlen, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

static void kvr_wake(kvr_engine_t *e)
{
    uint64_t one = 1;
    ssize_t n = write(e->wake_fd, &one, sizeof(one));
    (void)n; /* an eventfd at its limit is already readable */
}

static const char *kvr_side(const kvr_engine_t *e)
{
    return e->mode == KVR_MODE_PREFILL ? "prefill" : "decode";
}

static void kvr_room_ref(kvr_room_t *r)
{
    r->refs++;
}

static void kvr_room_unref_locked(kvr_engine_t *e, kvr_room_t *r)
{
    if (--r->refs > 0) {
        return;
    }
    if (kvr_table_get(&e->tags, r->tag) == r) {
        kvr_table_remove(&e->tags, r->tag);
    }
    kvr_room_free(r);
}

static void kvr_work_push_locked(kvr_engine_t *e, kvr_room_t *r)
{
    if (r->on_work) {
        return;
    }
    r->on_work = 1;
    kvr_room_ref(r);
    r->work_next = e->work_head;
    e->work_head = r;
}

/* ------------------------------------------------------------------ */
/* Failures                                                            */
/* ------------------------------------------------------------------ */

static void kvr_send_ctrl_to_peer(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m);

/*
 * Records the root cause for room r (first wins) and starts failing it.
 * notify: tell the peer.  Returns 1 if this was the first failure.
 */
static int kvr_room_fail_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_failure_t *f,
                                int notify)
{
    if (!kvr_room_fail(r, f->code)) {
        return 0;
    }
    r->failing_since_ns = kvr_now_ns();
    if (r->in_table && kvr_registry_record(&e->registry, r->id, f) == 1 && !f->from_sibling &&
        e->nsib > 0) {
        /* Our root cause: the siblings learn it from the engine thread. */
        kvr_sib_out_t *o = malloc(sizeof(*o));
        if (o != NULL) {
            o->room = r->id;
            o->f = *f;
            o->next = e->sib_out;
            e->sib_out = o;
            e->sib_pending = 1;
        }
    }
    e->stats.failures_by_code[f->code < KVR_STATUS_LAST ? f->code : 0]++;
    /* Logged once, where it happened; echoes only at debug level. */
    kvr_log_write(&e->log, f->from_remote || f->from_sibling ? KVR_LOG_DEBUG : KVR_LOG_WARNING,
                  "%s rank %d: %s: %s%s", kvr_side(e), e->rank, kvr_status_name(f->code),
                  f->reason, f->from_sibling ? " (from another rank)"
                                             : f->from_remote ? " (reported by the peer)" : "");
    if (notify && r->peer != NULL && r->notice == NULL) {
        /* Sockets belong to the engine thread: it sends the notice. */
        r->notice = malloc(sizeof(kvr_failure_t));
        if (r->notice != NULL) {
            memcpy(r->notice, f, sizeof(*f));
            kvr_work_push_locked(e, r);
        }
    }
    kvr_room_settle(r);
    return 1;
}

/* Engine thread: tells the room's peer about the room's failure. */
static void kvr_send_notice_locked(kvr_engine_t *e, kvr_room_t *r)
{
    kvr_failure_t *f = r->notice;
    r->notice = NULL;
    if (r->peer != NULL && r->peer->state == KVR_PEER_READY) {
        kvr_msg_t m;
        memset(&m, 0, sizeof(m));
        m.type = KVR_MSG_ROOM_FAIL;
        m.room = r->id;
        m.tag = e->mode == KVR_MODE_DECODE ? r->tag : r->dst_tag;
        m.code = (uint16_t)f->code;
        m.origin_rank = f->origin_rank;
        m.str = f->reason;
        m.str_len = (uint16_t)strlen(f->reason);
        m.peer = f->peer;
        m.peer_len = (uint16_t)strlen(f->peer);
        kvr_send_ctrl_to_peer(e, r->peer, &m);
    }
    free(f);
}

static int kvr_room_failf_locked(kvr_engine_t *e, kvr_room_t *r, int code, int notify,
                                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int kvr_room_failf_locked(kvr_engine_t *e, kvr_room_t *r, int code, int notify,
                                 const char *fmt, ...)
{
    kvr_failure_t f;
    char text[KVR_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    kvr_failure_fill(&f, code, e->rank, r->peer ? r->peer->name : "", "room %" PRIu64 ": %s",
                     r->id, text);
    return kvr_room_fail_locked(e, r, &f, notify);
}

/* Fails every open room bound to peer p. */
static void kvr_peer_fail_rooms_locked(kvr_engine_t *e, kvr_peer_t *p, int code, int notify,
                                       const char *what)
{
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r == NULL || r->peer != p || kvr_room_terminal(r)) {
            continue;
        }
        kvr_room_failf_locked(e, r, code, notify, "%s %s", p->name, what);
    }
}

/* ------------------------------------------------------------------ */
/* Control messages out                                                */
/* ------------------------------------------------------------------ */

static void kvr_send_ctrl_to_peer(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m_in)
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

static void kvr_fill_layout(kvr_engine_t *e, kvr_wire_layout_t *l)
{
    l->page_size = e->page_size;
    l->nkv = e->nkv;
    l->kv_item_lens = e->layout_kv;
    l->naux = e->naux;
    l->aux_item_lens = e->layout_aux;
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
static int kvr_layout_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n)
{
    if (l->page_size != e->page_size) {
        snprintf(why, n, "page_size %u here, %u there", e->page_size, l->page_size);
        return -1;
    }
    if (l->nkv != e->nkv) {
        snprintf(why, n, "%u KV buffers here, %u there", e->nkv, l->nkv);
        return -1;
    }
    if (kvr_items_diff("KV", e->nkv, e->kv_item, l->kv_item_lens, why, n) != 0) {
        return -1;
    }
    if (l->naux != e->naux) {
        snprintf(why, n, "%u aux buffers here, %u there", e->naux, l->naux);
        return -1;
    }
    return kvr_items_diff("aux", e->naux, e->aux_item, l->aux_item_lens, why, n);
}

/* ------------------------------------------------------------------ */
/* Peers                                                               */
/* ------------------------------------------------------------------ */

static kvr_peer_t *kvr_peer_find(kvr_engine_t *e, int kind, const char *key)
{
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->kind == kind && strcmp(p->key, key) == 0) {
            return p;
        }
    }
    return NULL;
}

static kvr_peer_t *kvr_peer_new(kvr_engine_t *e, int kind, const char *key)
{
    kvr_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return NULL;
    }
    p->kind = kind;
    p->remote_rank = -1;
    snprintf(p->key, sizeof(p->key), "%s", key);
    snprintf(p->name, sizeof(p->name), "%s", key);
    p->next = e->peers;
    e->peers = p;
    e->stats.peers++;
    return p;
}

/* Queues the peer's sockets and endpoint for closing.  They are closed by
 * kvr_reap_locked, outside UCX progress and outside the socket poll, since
 * this may run inside a callback of either. */
static void kvr_peer_disconnect(kvr_engine_t *e, kvr_peer_t *p)
{
    kvr_ctl_conn_t *conns[3] = {p->bs_conn, p->conn, p->vconn};
    p->vconn = NULL;
    p->verifying = 0;
    for (int i = 0; i < 3; i++) {
        if (conns[i] && e->ndead_conns < KVR_MAX_DEAD) {
            e->dead_conns[e->ndead_conns++] = conns[i];
        } else if (conns[i]) {
            kvr_ctl_conn_close(e->ctl, conns[i]); /* never in practice */
        }
    }
    p->bs_conn = NULL;
    p->conn = NULL;
    if (p->ep) {
        if (e->ndead_eps < KVR_MAX_DEAD) {
            e->dead_eps[e->ndead_eps++] = p->ep;
        }
        p->ep = NULL;
    }
    if (p->worker) {
        /* A connection to a peer never reuses a worker (a dead peer may
         * have left its shared-memory FIFO stopped).  Past the list's end
         * it stays until the manager closes. */
        if (e->ndead_workers < KVR_MAX_DEAD) {
            e->dead_workers[e->ndead_workers++] = p->worker;
        }
        p->worker = NULL;
    }
}

/* The peer's UCX worker, created for a new connection.  0, or -1 with err. */
static int kvr_peer_worker(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen)
{
    if (p->worker != NULL) {
        return 0;
    }
    return kvr_tp_worker_create(e->tp, &p->worker, err, errlen);
}

/* Engine thread: (re)connects to the siblings and publishes root causes. */
static void kvr_siblings_locked(kvr_engine_t *e)
{
    if (e->sib_dirty) {
        e->sib_dirty = 0;
        for (int i = 0; i < e->nsib_conns; i++) {
            kvr_ctl_conn_close(e->ctl, e->sib_conns[i]);
        }
        free(e->sib_conns);
        e->nsib_conns = 0;
        e->sib_conns = calloc(e->nsib ? (size_t)e->nsib : 1, sizeof(*e->sib_conns));
        unsigned char ident[12];
        memcpy(ident, &e->epoch, 8);
        memcpy(ident + 8, &e->rank, 4);
        for (int i = 0; e->sib_conns && i < e->nsib; i++) {
            char err[256];
            if (kvr_ctl_connect(e->ctl, e->sib_eps[i], ident, sizeof(ident), NULL,
                                &e->sib_conns[e->nsib_conns], err, sizeof(err)) == 0) {
                e->nsib_conns++;
            } else {
                kvr_log_write(&e->log, KVR_LOG_WARNING, "%s rank %d: sibling %s: %s",
                              kvr_side(e), e->rank, e->sib_eps[i], err);
            }
        }
    }
    while (e->sib_out) {
        kvr_sib_out_t *o = e->sib_out;
        e->sib_out = o->next;
        kvr_msg_t m;
        memset(&m, 0, sizeof(m));
        m.type = KVR_MSG_SIB_FAIL;
        m.epoch = e->epoch;
        m.room = o->room;
        m.code = (uint16_t)o->f.code;
        m.origin_rank = o->f.origin_rank >= 0 ? o->f.origin_rank : e->rank;
        m.str = o->f.reason;
        m.str_len = (uint16_t)strlen(o->f.reason);
        m.peer = o->f.peer;
        m.peer_len = (uint16_t)strlen(o->f.peer);
        if (kvr_wire_encode(&e->wbuf, &m) == 0) {
            for (int i = 0; i < e->nsib_conns; i++) {
                kvr_ctl_send_conn(e->sib_conns[i], e->wbuf.data, e->wbuf.len);
            }
        }
        free(o);
    }
    e->sib_pending = 0;
}

/* A sibling's root cause for a room: it becomes this rank's record too, and
 * the room here fails with it (telling our own peer to stop). */
static void kvr_handle_sib_fail_locked(kvr_engine_t *e, const kvr_msg_t *m)
{
    kvr_failure_t f;
    memset(&f, 0, sizeof(f));
    f.code = m->code > KVR_OK && m->code < KVR_STATUS_LAST ? m->code : KVR_REMOTE;
    f.origin_rank = m->origin_rank;
    f.from_sibling = 1;
    f.time_ns = kvr_now_ns();
    snprintf(f.reason, sizeof(f.reason), "%.*s", (int)m->str_len, m->str);
    snprintf(f.peer, sizeof(f.peer), "%.*s", (int)m->peer_len, m->peer);
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    if (r != NULL && !kvr_room_terminal(r) && !r->failing) {
        kvr_room_fail_locked(e, r, &f, 1);
    } else if (r == NULL) {
        /* Kept for a room this rank has not opened yet (see kvr_handle_open). */
        kvr_registry_record_early(&e->registry, m->room, &f);
    } else {
        /* A room already terminal or failing here: a room whose part
         * succeeded on this rank still fails as a whole (the schedulers
         * MIN-reduce their ranks' polls), and failure_exception() must raise
         * the origin's cause.  A record of this rank's own stays first;
         * clearing the room drops the record. */
        kvr_registry_record(&e->registry, m->room, &f);
    }
}

static void kvr_reap_locked(kvr_engine_t *e)
{
    while (e->ndead_conns > 0) {
        kvr_ctl_conn_close(e->ctl, e->dead_conns[--e->ndead_conns]);
    }
    while (e->ndead_eps > 0) {
        kvr_tp_ep_close(e->dead_eps[--e->ndead_eps], 1);
    }
    while (e->ndead_workers > 0) {
        kvr_tp_worker_destroy(e->dead_workers[--e->ndead_workers]);
    }
}

static int kvr_peer_resolve(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen);

static void kvr_send_ctrl_to_peer(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m);

/* Decode: tells the prefill, over the control channel that still works,
 * that a room failed before it could ask for anything (the prefill's
 * sender would otherwise wait for its bootstrap timeout). */
static void kvr_tell_room_failed(kvr_engine_t *e, kvr_peer_t *p, kvr_room_t *r, int code)
{
    kvr_failure_t f;
    if (p->conn == NULL || !kvr_registry_peek(&e->registry, r->id, &f)) {
        return;
    }
    kvr_msg_t n;
    memset(&n, 0, sizeof(n));
    n.type = KVR_MSG_ROOM_FAIL;
    n.room = r->id;
    n.tag = r->tag;
    n.code = (uint16_t)code;
    n.origin_rank = e->rank;
    n.str = f.reason;
    n.str_len = (uint16_t)strlen(f.reason);
    kvr_send_ctrl_to_peer(e, p, &n);
}

/*
 * Declares the peer failed: every room bound to it fails with code.  On the
 * decode side, rooms still bootstrapping have sent nothing to that instance:
 * when the instance is lost or replaced they wait for the next one (within
 * the bootstrap timeout) instead of failing.
 */
static void kvr_peer_fail_locked(kvr_engine_t *e, kvr_peer_t *p, int code, const char *what)
{
    if (p->state == KVR_PEER_FAILED) {
        return;
    }
    int spare = p->kind == KVR_PEER_IS_PREFILL && (code == KVR_PEER_LOST || code == KVR_PEER_RESTARTED);
    int waiting = 0, failed = 0;
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
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
    p->state = KVR_PEER_FAILED;
    kvr_peer_disconnect(e, p);
    if (waiting) {
        char err[256];
        if (kvr_peer_resolve(e, p, err, sizeof(err)) != 0) {
            kvr_peer_fail_rooms_locked(e, p, KVR_BOOTSTRAP, 0, err);
        }
    }
}

/* Decode: start (or restart) resolving a prefill peer through bootstrap. */
static int kvr_peer_resolve(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen)
{
    char ep[192];
    unsigned char ident[12];
    kvr_peer_disconnect(e, p);
    p->state = KVR_PEER_RESOLVING;
    p->epoch = 0;
    snprintf(p->name, sizeof(p->name), "%s", p->key);
    snprintf(ep, sizeof(ep), "tcp://%s", p->key);
    memcpy(ident, &e->epoch, 8);
    memcpy(ident + 8, &e->rank, 4);
    if (kvr_ctl_connect(e->ctl, ep, NULL, 0, p, &p->bs_conn, err, errlen) != 0) {
        p->state = KVR_PEER_FAILED;
        return -1;
    }
    p->resolve_deadline_ns = kvr_now_ns() + e->cfg.bootstrap_timeout_ms * KVR_MS;
    p->next_try_ns = 0; /* query at once */
    return 0;
}

/* Asks the bootstrap server (on conn) which prefill instance serves our rank. */
static void kvr_bs_query(kvr_engine_t *e, kvr_ctl_conn_t *conn)
{
    kvr_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVR_MSG_BS_QUERY;
    m.epoch = e->epoch;
    m.rank = (uint32_t)e->rank;
    if (kvr_wire_encode(&e->wbuf, &m) == 0) {
        kvr_ctl_send_conn(conn, e->wbuf.data, e->wbuf.len);
    }
}

static void kvr_peer_hello(kvr_engine_t *e, kvr_peer_t *p)
{
    kvr_msg_t m;
    const void *addr;
    size_t alen;
    memset(&m, 0, sizeof(m));
    m.type = KVR_MSG_HELLO;
    m.rank = (uint32_t)e->rank;
    kvr_fill_layout(e, &m.layout);
    kvr_tp_address(p->worker, &addr, &alen);
    m.addr = addr;
    m.addr_len = (uint32_t)alen;
    size_t rx = kvr_tp_tcp_rx_seg(e->tp);
    m.tcp_rx_seg = rx > UINT32_MAX ? UINT32_MAX : (uint32_t)rx;
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

static void kvr_peer_verify_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    uint64_t now = kvr_now_ns();
    if (p->verifying || now - p->verified_ns < KVR_VERIFY_EVERY_MS * KVR_MS) {
        return;
    }
    char ep[192], err[256];
    snprintf(ep, sizeof(ep), "tcp://%s", p->key);
    if (kvr_ctl_connect(e->ctl, ep, NULL, 0, p, &p->vconn, err, sizeof(err)) != 0) {
        p->verified_ns = now; /* keep the peer we have */
        return;
    }
    p->verifying = 1;
    p->verify_deadline_ns = now + KVR_VERIFY_TIMEOUT_MS * KVR_MS;
    kvr_bs_query(e, p->vconn);
}

static void kvr_service_peer_rooms_locked(kvr_engine_t *e, kvr_peer_t *p);

/* Ends a verification: the registration is the same (or unknown), or a new
 * instance replaced the one our rooms are bound to. */
static void kvr_peer_verified_locked(kvr_engine_t *e, kvr_peer_t *p, int found, uint64_t epoch)
{
    if (p->vconn && e->ndead_conns < KVR_MAX_DEAD) {
        e->dead_conns[e->ndead_conns++] = p->vconn;
        p->vconn = NULL;
    }
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
        for (size_t i = 0; i < e->rooms.capacity; i++) {
            kvr_room_t *r = e->rooms.slots[i].value;
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

/* ------------------------------------------------------------------ */
/* Data path                                                           */
/* ------------------------------------------------------------------ */

static kvr_op_t *kvr_op_new(kvr_room_t *r, uint64_t len, uint32_t niov)
{
    kvr_op_t *op = calloc(1, sizeof(*op) + (size_t)niov * sizeof(kvr_tp_iov_t));
    if (op == NULL) {
        return NULL;
    }
    op->base.req = NULL;
    op->niov = niov;
    op->room = r;
    op->len = len;
    op->prev = NULL;
    op->next = r->ops;
    if (r->ops) {
        ((kvr_op_t *)r->ops)->prev = op;
    }
    r->ops = op;
    kvr_room_ref(r);
    r->inflight++;
    r->ops_posted++;
    return op;
}

static void kvr_op_unlink(kvr_room_t *r, kvr_op_t *op)
{
    if (op->prev) {
        op->prev->next = op->next;
    } else {
        r->ops = op->next;
    }
    if (op->next) {
        op->next->prev = op->prev;
    }
}

/* A room just became Success: the counter and the per-room histograms
 * (what they measure is documented at kvr_stats_t). */
static void kvr_room_succeeded_locked(kvr_engine_t *e, kvr_room_t *r)
{
    uint64_t now = kvr_now_ns();
    uint64_t from = r->started_ns; /* decode: request sent; prefill: request bound */
    if (e->mode == KVR_MODE_PREFILL && r->ready_ns > from) {
        from = r->ready_ns;
    }
    e->stats.rooms_succeeded++;
    kvr_hist_observe(&e->stats.transfer_latency, KVR_HIST_LATENCY, now > from ? now - from : 0);
    kvr_hist_observe(&e->stats.room_ops, KVR_HIST_OPS, r->ops_posted);
}

/* ---- staging of device memory ---------------------------------------
 *
 * Where UCX cannot move device memory, each message of a device buffer goes
 * through one pinned host slot of a bounded pool:
 *   prefill: cudaMemcpyAsync of the message's source pieces into the slot
 *            (one stream), an event; when the engine sees the event done it
 *            sends the slot as one contiguous message (KVR_STAGE_D2H ->
 *            XFER); the slot is free again when the send completes.  Messages
 *            are cut to at most staging_slot_bytes; with no slot free the
 *            room waits (post_end/post_buf keep its place) and resumes when
 *            one is released, so copies of later messages overlap the
 *            transfers of earlier ones.
 *   decode:  the message is received into a slot (a heap buffer if none is
 *            free or it is larger than a slot), then cudaMemcpyAsync into the
 *            destination pieces and an event (XFER -> H2D); its bytes count
 *            as landed when the event is done.  A room that is failing when
 *            the receive completes gets no copy; a room with copies in flight
 *            is never declared drained before they finish, so after poll()
 *            says Failed nothing lands in its device pages.
 * The copies are queued on one stream, so they finish in order and the
 * engine polls only the head of its FIFO (cudaEventQuery, never blocking).
 */

static kvr_slot_t *kvr_slot_get(kvr_engine_t *e)
{
    kvr_slot_t *s = e->slot_free;
    if (s != NULL) {
        e->slot_free = s->next;
        s->next = NULL;
    }
    return s;
}

static void kvr_slot_put(kvr_engine_t *e, kvr_slot_t *s)
{
    s->next = e->slot_free;
    e->slot_free = s;
    if (e->slot_waiters == NULL) {
        return;
    }
    /* Rooms that stopped for want of a slot go round again. */
    while (e->slot_waiters != NULL) {
        kvr_room_t *r = e->slot_waiters;
        e->slot_waiters = r->slot_next;
        r->slot_next = NULL;
        r->slot_waiting = 0;
        kvr_work_push_locked(e, r);
        kvr_room_unref_locked(e, r);
    }
    kvr_wake(e);
}

static void kvr_slot_wait(kvr_engine_t *e, kvr_room_t *r)
{
    e->stats.staging_waits++;
    if (r->slot_waiting) {
        return;
    }
    r->slot_waiting = 1;
    kvr_room_ref(r);
    r->slot_next = e->slot_waiters;
    e->slot_waiters = r;
}

static void *kvr_event_get(kvr_engine_t *e, char *err, size_t errlen)
{
    if (e->nevents > 0) {
        return e->events[--e->nevents];
    }
    void *ev = NULL;
    return kvr_cuda_event_create(&ev, err, errlen) == 0 ? ev : NULL;
}

static void kvr_event_put(kvr_engine_t *e, void *ev)
{
    if (e->nevents == e->events_cap) {
        uint32_t cap = e->events_cap ? e->events_cap * 2 : 32;
        void **n = realloc(e->events, cap * sizeof(void *));
        if (n == NULL) {
            kvr_cuda_event_destroy(ev);
            return;
        }
        e->events = n;
        e->events_cap = cap;
    }
    e->events[e->nevents++] = ev;
}

/* Releases what a staged operation holds.  Its copy, if any, is done. */
static void kvr_op_unstage(kvr_engine_t *e, kvr_op_t *op)
{
    if (op->event != NULL) {
        kvr_event_put(e, op->event);
        op->event = NULL;
    }
    free(op->bounce);
    op->bounce = NULL;
    if (op->slot != NULL) {
        kvr_slot_t *s = op->slot;
        op->slot = NULL;
        kvr_slot_put(e, s);
    }
}

/*
 * Queues the copies between op's device pieces and its staging piece
 * (d2h: into the staging piece) and an event after them.  Returns 0, or -1
 * with err (the stream is then synchronized, so nothing is left running on
 * the staging memory).
 */
static int kvr_stage_copy_locked(kvr_engine_t *e, kvr_op_t *op, int d2h, char *err,
                                 size_t errlen)
{
    char *stage = op->siov.buf;
    size_t off = 0;
    for (uint32_t i = 0; i < op->niov; i++) {
        char *dev = op->iov[i].buf;
        size_t n = op->iov[i].len;
        /* A message of several buffers may mix host and device pieces: the
         * runtime tells them apart (unified addressing). */
        int h2d = op->mixed ? KVR_CUDA_DEFAULT : KVR_CUDA_H2D;
        int rc = d2h ? kvr_cuda_memcpy_async(stage + off, dev, n, KVR_CUDA_D2H, e->stream, err,
                                             errlen)
                     : kvr_cuda_memcpy_async(dev, stage + off, n, h2d, e->stream, err, errlen);
        if (rc != 0) {
            goto fail;
        }
        off += n;
    }
    op->event = kvr_event_get(e, err, errlen);
    if (op->event == NULL || kvr_cuda_event_record(op->event, e->stream, err, errlen) != 0) {
        goto fail;
    }
    op->stage = d2h ? KVR_STAGE_D2H : KVR_STAGE_H2D;
    op->stage_next = NULL;
    if (e->stage_tail) {
        e->stage_tail->stage_next = op;
    } else {
        e->stage_head = op;
    }
    e->stage_tail = op;
    op->room->stage_copies++;
    e->stats.staged_ops++;
    e->stats.staged_bytes += off;
    return 0;
fail:
    kvr_cuda_stream_sync(e->stream, NULL, 0);
    return -1;
}

/* Prefill: room r's decode refused its data and then said it had every
 * byte (done_received), or said nothing since: the data path failed. */
static void kvr_rejected_fail_locked(kvr_engine_t *e, kvr_room_t *r)
{
    char why[96];
    if (r->done_received) {
        snprintf(why, sizeof(why), "then reported every byte landed");
    } else {
        snprintf(why, sizeof(why), "sent no reason within %" PRIu64 " ms",
                 (kvr_now_ns() - r->rejected_ns) / KVR_MS);
    }
    kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "data operation with %s failed: %s (the decode %s)",
                          r->peer ? r->peer->name : "peer", r->rejected_why, why);
}

static void kvr_check_prefill_done_locked(kvr_engine_t *e, kvr_room_t *r)
{
    if (r->failing || kvr_room_terminal(r) || !r->done_received) {
        return;
    }
    if (r->rejected_ns) {
        kvr_rejected_fail_locked(e, r);
        return;
    }
    if (r->inflight > 0) {
        return;
    }
    if (kvr_room_advance(r, KVR_POLL_SUCCESS)) {
        kvr_room_succeeded_locked(e, r);
    }
}

/* Decode: tells the room's prefill that every byte landed. */
static void kvr_send_done_locked(kvr_engine_t *e, kvr_room_t *r)
{
    r->done_pending = 0;
    if (r->peer != NULL) {
        kvr_msg_t m;
        memset(&m, 0, sizeof(m));
        m.type = KVR_MSG_ROOM_DONE;
        m.room = r->id;
        m.tag = r->tag;
        kvr_send_ctrl_to_peer(e, r->peer, &m);
    }
}

/* Ends one operation of a room: accounting, then settle or succeed. */
static void kvr_op_end_locked(kvr_engine_t *e, kvr_op_t *op, int failed, const char *status_text)
{
    kvr_room_t *r = op->room;
    kvr_op_unlink(r, op);
    kvr_op_unstage(e, op);
    if (!r->drained_by_force) {
        r->inflight--;
    }
    if (r->peer != NULL) {
        r->peer->last_data_ns = kvr_now_ns();
    }
    if (failed == KVR_TP_PEER_GONE && !r->failing) {
        /* The same cause as the endpoint error or the heartbeat: the peer. */
        kvr_room_failf_locked(e, r, KVR_PEER_LOST, 1, "%s lost: %s",
                              r->peer ? r->peer->name : "peer", status_text);
    } else if (failed == KVR_TP_REJECTED) {
        /*
         * Prefill: the decode refused the data: it failed or dropped the
         * room (an abort, a deadline, a sibling's failure), and its
         * ROOM_FAIL naming the cause travels on the control channel, which
         * may deliver it after this.  Post nothing more and wait for it;
         * without it (kvr_timers_locked) the room fails with TRANSPORT.
         */
        e->stats.data_rejected++;
        if (r->rejected_ns == 0) {
            r->rejected_ns = kvr_now_ns();
            r->rejected_why = status_text ? status_text : "rejected";
        }
    } else if (failed) {
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "data operation with %s failed: %s",
                              r->peer ? r->peer->name : "peer", status_text);
    } else {
        e->stats.bytes_moved += op->len;
        if (e->mode == KVR_MODE_DECODE) {
            r->received += op->len;
        }
    }
    if (r->failing) {
        kvr_room_settle(r);
    } else if (e->mode == KVR_MODE_DECODE) {
        if (kvr_room_complete(r) && kvr_room_advance(r, KVR_POLL_SUCCESS)) {
            kvr_room_succeeded_locked(e, r);
            if (r->peer) {
                /* Sockets belong to the engine thread: from poll()'s
                 * progress it sends the notice. */
                r->done_pending = 1;
                if (e->off_thread) {
                    kvr_work_push_locked(e, r);
                } else {
                    kvr_send_done_locked(e, r);
                }
            }
        }
    } else {
        kvr_check_prefill_done_locked(e, r);
    }
    kvr_room_unref_locked(e, r);
    free(op);
}

static void kvr_on_recv_done(void *arg, kvr_tp_op_t *tp_op, size_t len, int failed,
                             const char *status_text)
{
    kvr_engine_t *e = arg;
    kvr_op_t *op = (kvr_op_t *)tp_op;
    (void)len;
    if (op->stage == KVR_STAGE_XFER && !failed && !op->room->failing) {
        /* Staged: the bytes are in the slot; copy them to the device pages.
         * A failing room gets no copy (its pages stay as they are). */
        char err[256];
        if (kvr_stage_copy_locked(e, op, 0, err, sizeof(err)) == 0) {
            return; /* ends when its event is done (kvr_stage_poll_locked) */
        }
        kvr_op_end_locked(e, op, KVR_TP_ERROR, err);
        return;
    }
    kvr_op_end_locked(e, op, failed, status_text);
}

static void kvr_on_send_done(void *arg, kvr_tp_op_t *op, int failed, const char *status_text)
{
    kvr_op_end_locked(arg, (kvr_op_t *)op, failed, status_text);
}

/*
 * The pieces of the data message h, in order: for each buffer of
 * [h->buf, h->buf + h->nbuf) of its kind, the runs of consecutive pages of
 * `pages` over positions [h->pos, h->pos + h->npages) (KV), or row `row`
 * (aux).  The prefill passes its source pages and row, the decode its own
 * destination pages and row.  With out == NULL only counts.  Returns the
 * number of pieces; *bytes gets their total length.  h was checked against
 * the layout and the room.
 */
static uint32_t kvr_msg_pieces(const kvr_engine_t *e, const kvr_am_header_t *h,
                               const int32_t *pages, int64_t row, kvr_tp_iov_t *out,
                               uint64_t *bytes)
{
    uint32_t n = 0, end = h->pos + h->npages;
    uint64_t total = 0;
    for (uint32_t b = h->buf; b < (uint32_t)h->buf + h->nbuf; b++) {
        if (h->kind == KVR_AM_KIND_AUX) {
            if (out != NULL) {
                out[n].buf = (char *)(uintptr_t)e->aux_ptrs[b] + (uint64_t)row * e->aux_item[b];
                out[n].len = e->aux_item[b];
            }
            total += e->aux_item[b];
            n++;
            continue;
        }
        char *base = (char *)(uintptr_t)e->kv_ptrs[b];
        uint64_t item = e->kv_item[b];
        for (uint32_t at = h->pos; at < end; n++) {
            uint32_t run = kvr_run_length(NULL, pages, at, end);
            if (out != NULL) {
                out[n].buf = base + (uint64_t)pages[at] * item;
                out[n].len = (size_t)run * item;
            }
            at += run;
        }
        total += (uint64_t)h->npages * item;
    }
    *bytes = total;
    return n;
}

/* Decode: a data message arrived; decide where (if anywhere) it lands. */
static void kvr_on_data(void *arg, const void *hdr, size_t hdr_len, size_t len, int rndv,
                        kvr_tp_accept_t *acc)
{
    kvr_engine_t *e = arg;
    kvr_am_header_t h;
    const char *why = NULL;
    if (kvr_am_header_decode(hdr, hdr_len, &h, &why) != 0) {
        goto reject;
    }
    kvr_room_t *r = kvr_table_get(&e->tags, h.tag);
    if (r == NULL || r->role != KVR_ROLE_DECODE) {
        why = "no such room";
        goto foreign;
    }
    if (r->peer == NULL) {
        why = "sender is not the room's prefill";
        goto foreign;
    }
    if (r->failing || kvr_room_terminal(r) || !r->meta_set) {
        why = "room is not receiving";
        goto reject;
    }
    if (r->peer->epoch != h.epoch) {
        /* Only the instance the request went to knows the room's tag. */
        why = "sender epoch is not the room's prefill's";
        goto protocol;
    }
    /* The message covers positions [pos, pos + npages) of buffers
     * [buf, buf + nbuf); the destination is what this room asked for there,
     * never an address the sender names: one piece per buffer and run of
     * consecutive destination pages. */
    if (h.kind == KVR_AM_KIND_KV) {
        if ((uint32_t)h.buf + h.nbuf > e->nkv || h.npages == 0 || h.pos >= r->npages ||
            h.npages > r->npages - h.pos) {
            why = "run outside the room";
            goto protocol;
        }
    } else if ((uint32_t)h.buf + h.nbuf > e->naux || r->aux_index < 0 || h.npages != 1) {
        why = "aux row does not match the room";
        goto protocol;
    }
    uint64_t want = 0;
    uint32_t niov = kvr_msg_pieces(e, &h, r->pages, r->aux_index, NULL, &want);
    if ((uint64_t)len != want) {
        why = h.kind == KVR_AM_KIND_KV ? "run length does not match item_len"
                                       : "aux row does not match the room";
        goto protocol;
    }
    /* Counted when accepted, not when landed: a repeated rendezvous would
     * otherwise be accepted again while the first copy is in flight. */
    int claim = kvr_room_claim(r, h.kind == KVR_AM_KIND_AUX, e->nkv, e->naux, h.buf, h.nbuf, h.pos,
                               h.npages);
    if (claim == -1) {
        why = "data for positions already received";
        goto protocol;
    }
    kvr_op_t *op = claim == 0 ? kvr_op_new(r, len, niov) : NULL;
    if (op == NULL) {
        why = "out of memory";
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory receiving data");
        goto reject;
    }
    kvr_msg_pieces(e, &h, r->pages, r->aux_index, op->iov, &want);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING); /* first byte */
    r->peer->last_data_ns = kvr_now_ns();
    e->stats.data_rendezvous += rndv != 0;
    int dev = 0;
    for (uint32_t b = h.buf; b < (uint32_t)h.buf + h.nbuf; b++) {
        dev |= h.kind == KVR_AM_KIND_KV ? e->kv_dev[b] : e->aux_dev[b];
    }
    op->mixed = h.nbuf > 1;
    /* Device pages are staged unless UCX moves device memory itself; even
     * then eager data (copied here with memcpy) and scattered pieces (UCX's
     * iov datatype is for host memory) go through a staging buffer. */
    if (dev && (e->gpu_path == KVR_GPU_STAGED || !rndv || niov > 1)) {
        if (len <= e->cfg.staging_slot_bytes && (op->slot = kvr_slot_get(e)) != NULL) {
            op->siov.buf = op->slot->buf;
        } else if ((op->bounce = malloc(len ? len : 1)) != NULL) {
            op->siov.buf = op->bounce;
            e->stats.staging_overflow++;
        } else {
            why = "out of memory";
            kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory staging data");
            kvr_op_end_locked(e, op, KVR_TP_ERROR, why);
            goto reject;
        }
        op->siov.len = len;
        op->stage = KVR_STAGE_XFER;
        acc->iov = &op->siov;
        acc->iovcnt = 1;
    } else {
        acc->iov = op->iov;
        acc->iovcnt = niov;
    }
    acc->op = &op->base;
    return;

protocol:
    kvr_room_failf_locked(e, r, KVR_PROTOCOL, 1, "%s sent a bad data message: %s",
                          r->peer ? r->peer->name : "?", why);
    goto reject;
foreign:
    e->stats.data_foreign++;
    kvr_warn_limited(e, &e->data_log,
                     "decode rank %d: refused a data message (%zu bytes, room tag %016" PRIx64
                     ", sender epoch %016" PRIx64 "): %s",
                     e->rank, len, h.tag, h.epoch, why);
reject:
    e->stats.data_rejected++;
    kvr_log_write(&e->log, KVR_LOG_DEBUG, "decode rank %d: rejected a data message: %s", e->rank,
                  why);
    acc->iovcnt = 0;
    acc->reject_why = why;
}

static void kvr_on_ep_error(void *arg, void *ep_ctx, const char *status_text)
{
    kvr_engine_t *e = arg;
    kvr_peer_t *p = ep_ctx;
    if (e->off_thread) {
        /* Failing a peer may touch its sockets: the engine thread does it
         * (kvr_ep_errors_locked). */
        p->ep_err = 1;
        p->ep_err_ep = p->ep;
        snprintf(p->ep_err_text, sizeof(p->ep_err_text), "%s", status_text);
        e->ep_err_pending = 1;
        return;
    }
    char what[256];
    snprintf(what, sizeof(what), "lost: %s", status_text);
    kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
}

/* Engine thread: the endpoint errors poll()'s progress left for it (only
 * those of endpoints the peers still use). */
static void kvr_ep_errors_locked(kvr_engine_t *e)
{
    e->ep_err_pending = 0;
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->ep_err) {
            p->ep_err = 0;
            if (p->ep != NULL && p->ep == p->ep_err_ep) {
                kvr_on_ep_error(e, p, p->ep_err_text);
            }
        }
    }
}

/*
 * Prefill: posts one data message: positions [h->pos, h->pos + h->npages) of
 * KV buffer h->buf (one piece per run of consecutive source pages), or one
 * aux row (src given).
 */
static void kvr_op_send_locked(kvr_engine_t *e, kvr_room_t *r, kvr_op_t *op,
                               const kvr_tp_iov_t *iov, uint32_t niov, int host)
{
    const char *st = NULL;
    int rc = kvr_tp_send(e->tp, r->peer->ep, op->hdr, sizeof(op->hdr), iov, niov, host,
                         &op->base, &st);
    if (rc <= 0) {
        kvr_op_end_locked(e, op, rc == 0 ? KVR_TP_OK : rc == -2 ? KVR_TP_PEER_GONE : KVR_TP_ERROR,
                          st);
    }
}

/* Prefill: a staged message's copy into its slot is done: send the slot. */
static void kvr_stage_send_locked(kvr_engine_t *e, kvr_op_t *op)
{
    kvr_room_t *r = op->room;
    op->stage = KVR_STAGE_XFER;
    if (r->failing) {
        kvr_op_end_locked(e, op, KVR_TP_ERROR, "not sent: the room is failing");
    } else if (r->peer == NULL || r->peer->ep == NULL) {
        kvr_op_end_locked(e, op, KVR_TP_PEER_GONE, "not sent: no endpoint");
    } else {
        kvr_op_send_locked(e, r, op, &op->siov, 1, 1); /* a pinned host slot */
    }
}

/* Engine: ends the staging copies that are done, in stream order.  Returns
 * how many. */
static unsigned kvr_stage_poll_locked(kvr_engine_t *e)
{
    unsigned n = 0;
    while (e->stage_head != NULL) {
        kvr_op_t *op = e->stage_head;
        char err[256];
        int q = kvr_cuda_event_query(op->event, err, sizeof(err));
        if (q == 0) {
            break;
        }
        e->stage_head = op->stage_next;
        if (e->stage_head == NULL) {
            e->stage_tail = NULL;
        }
        op->stage_next = NULL;
        op->room->stage_copies--;
        kvr_event_put(e, op->event);
        op->event = NULL;
        n++;
        if (q < 0) {
            kvr_cuda_stream_sync(e->stream, NULL, 0);
            kvr_op_end_locked(e, op, KVR_TP_ERROR, err);
        } else if (op->stage == KVR_STAGE_D2H) {
            kvr_stage_send_locked(e, op);
        } else {
            kvr_op_end_locked(e, op, KVR_TP_OK, NULL);
        }
    }
    return n;
}

/* 1 if messages of this buffer are staged on the prefill side. */
static int kvr_prefill_stages(const kvr_engine_t *e, int kind, uint32_t buf)
{
    return e->gpu_path == KVR_GPU_STAGED &&
           (kind == KVR_AM_KIND_KV ? e->kv_dev[buf] : e->aux_dev[buf]);
}

/* Returns 0 (posted, or the room failed), 1 if it must wait for a slot. */
static int kvr_post_one_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_am_header_t *h)
{
    kvr_slot_t *slot = NULL;
    if (kvr_prefill_stages(e, h->kind, h->buf) && (slot = kvr_slot_get(e)) == NULL) {
        kvr_slot_wait(e, r);
        return 1;
    }
    uint64_t len = 0;
    uint32_t niov = kvr_msg_pieces(e, h, r->src_pages, r->src_aux, NULL, &len);
    kvr_op_t *op = kvr_op_new(r, len, niov);
    if (op == NULL) {
        if (slot != NULL) {
            kvr_slot_put(e, slot);
        }
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory posting data");
        return 0;
    }
    kvr_msg_pieces(e, h, r->src_pages, r->src_aux, op->iov, &len);
    kvr_am_header_t wire = *h;
    if (e->test_corrupt != KVR_TEST_CORRUPT_NONE) {
        kvr_test_corrupt_header(&wire, e->test_corrupt, r->ndst, e->nkv);
    }
    kvr_am_header_encode(op->hdr, &wire);
    e->stats.ops_posted++;
    if (slot != NULL) {
        /* Staged: copy the pieces into the slot; the engine sends it when
         * the copy is done (kvr_stage_poll_locked). */
        char err[256];
        op->slot = slot;
        op->siov.buf = slot->buf;
        op->siov.len = len;
        if (kvr_stage_copy_locked(e, op, 1, err, sizeof(err)) != 0) {
            kvr_op_end_locked(e, op, KVR_TP_ERROR, err);
        }
        return 0;
    }
    /* Device pieces go to UCX as they are only on the ucx-cuda path, one
     * buffer per message (merge is 0 with device buffers). */
    int host = !(e->gpu_path == KVR_GPU_UCX &&
                 (h->kind == KVR_AM_KIND_KV ? e->kv_dev[h->buf] : e->aux_dev[h->buf]));
    kvr_op_send_locked(e, r, op, op->iov, niov, host);
    if (e->test_corrupt == KVR_TEST_CORRUPT_DUP && h->kind == KVR_AM_KIND_KV && !r->failing) {
        e->test_corrupt = KVR_TEST_CORRUPT_NONE; /* the copy is sent once */
        kvr_post_one_locked(e, r, h);
        e->test_corrupt = KVR_TEST_CORRUPT_DUP;
    }
    return 0;
}

/*
 * How many buffers from b on (of n, item lengths items) share one message of
 * npages pages with `pieces` pieces per buffer: at least one; more while the
 * message stays within `merge` bytes and KVR_MAX_IOV pieces.
 */
static uint16_t kvr_buf_group(const uint64_t *items, uint32_t n, uint32_t b, uint32_t npages,
                              uint32_t pieces, uint64_t merge)
{
    uint32_t nb = 1;
    uint64_t bytes = (uint64_t)npages * items[b];
    while (b + nb < n && nb < UINT16_MAX && (uint64_t)(nb + 1) * pieces <= KVR_MAX_IOV &&
           bytes + (uint64_t)npages * items[b + nb] <= merge) {
        bytes += (uint64_t)npages * items[b + nb];
        nb++;
    }
    return (uint16_t)nb;
}

/* Prefill: post the operations for pages [posted, given) and, after the last
 * page, the aux rows.  Called on the engine thread with the lock held. */
static void kvr_post_locked(kvr_engine_t *e, kvr_room_t *r)
{
    if (!r->bound || !r->inited || r->failing || kvr_room_terminal(r) || r->rejected_ns ||
        r->peer == NULL || r->peer->state != KVR_PEER_READY) {
        return;
    }
    if (r->peer->ep == NULL) {
        char err[256] = "no worker address";
        if (r->peer->worker == NULL) {
            snprintf(err, sizeof(err), "no UCX worker for it");
        }
        if (r->peer->worker_addr == NULL || r->peer->worker == NULL ||
            kvr_tp_ep_create(r->peer->worker, r->peer->worker_addr, r->peer->worker_addr_len,
                             r->peer, &r->peer->ep, err, sizeof(err)) != 0) {
            kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "cannot reach %s: %s", r->peer->name,
                                  err);
            return;
        }
    }
    if (r->given > r->ndst) {
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "prefill sends %u pages but decode asked for %u", r->total_pages,
                              r->ndst);
        return;
    }
    if (r->dst_aux >= 0 && r->src_aux < 0) {
        /* Checked before any page moves. */
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "decode asked for aux row %" PRId64
                              " but the prefill sender has no aux_index",
                              r->dst_aux);
        return;
    }
    if (r->given > r->posted) {
        kvr_room_advance(r, KVR_POLL_TRANSFERRING);
    }
    kvr_am_header_t h;
    memset(&h, 0, sizeof(h));
    h.tag = r->dst_tag;
    h.epoch = e->epoch;
    /*
     * Messages: a run of pages consecutive on both sides that is at least
     * coalesce_run_bytes long (in the widest buffer) goes alone, as one
     * contiguous message per buffer (UCX moves it zero-copy); shorter runs
     * in a row are coalesced into one scattered message per buffer of at
     * most coalesce_bytes (one rendezvous instead of one per page).
     */
    uint64_t run_bytes = e->cfg.coalesce_run_bytes, cap = e->cfg.coalesce_bytes;
    uint32_t max_pages = UINT32_MAX;
    int shm = kvr_tp_ep_is_shm(r->peer->ep);
    int aux = r->dst_aux >= 0;
    if (shm && e->ndev == 0 && e->kv_item_max <= KVR_TP_SHM_EAGER_BYTES &&
        (!aux || e->aux_item_max <= KVR_TP_SHM_EAGER_BYTES) &&
        (uint64_t)r->total_pages * e->page_bytes + (aux ? e->aux_bytes : 0) <=
            KVR_SHM_EAGER_ROOM_BYTES) {
        /* A small room over shared memory goes as eager messages of at
         * most KVR_TP_SHM_EAGER_BYTES, one fragment of UCX's segment each:
         * send() pushes them all, the decode copies each one out while the
         * next is copied in, and no rendezvous round trip waits for a
         * thread of either side to be woken (measured, README). */
        max_pages = (uint32_t)(KVR_TP_SHM_EAGER_BYTES / e->kv_item_max);
        if (cap > KVR_TP_SHM_EAGER_BYTES) {
            cap = KVR_TP_SHM_EAGER_BYTES;
        }
    }
    if (run_bytes == 0) {
        /* auto: over shared memory UCX moves a scattered message at memory
         * speed, so every run is coalesced; over tcp a scattered message is
         * packed into one copy first, which beats a message per run for
         * 16 KiB runs and loses from 64 KiB (with 256 KiB tcp fragments;
         * measured, README). */
        run_bytes = shm ? UINT64_MAX : KVR_TCP_RUN_BYTES;
    }
    if (e->gpu_path == KVR_GPU_UCX && e->ndev > 0) {
        /* UCX moves device memory itself: contiguous messages only (one
         * per run), which it handles on every protocol. */
        run_bytes = 0;
    } else if (e->gpu_path == KVR_GPU_STAGED) {
        /* Every message of a device buffer must fit one slot: runs are cut
         * at max_pages and coalescing stops at the slot size (the widest
         * item fits a slot: checked at creation). */
        uint32_t slot_pages = (uint32_t)(e->cfg.staging_slot_bytes / e->kv_item_max);
        max_pages = slot_pages < max_pages ? slot_pages : max_pages;
        if (cap > e->cfg.staging_slot_bytes) {
            cap = e->cfg.staging_slot_bytes;
        }
    }
    /* Buffers share a message while it stays within `merge` bytes: every
     * buffer of a small room in one message.  Not with device buffers (each
     * is staged or handed to UCX on its own). */
    uint64_t merge = e->ndev > 0 ? 0 : run_bytes < cap ? run_bytes : cap;
    while (r->posted < r->given) {
        uint32_t pos = r->posted, end = r->post_end;
        if (end <= pos) {
            /* A new position range [pos, end): one message per buffer. */
            uint32_t runs = 0;
            end = pos;
            while (end < r->given && runs < KVR_MAX_IOV) {
                uint32_t n = kvr_run_length(r->src_pages, r->dst_pages, end, r->given);
                if ((uint64_t)n * e->kv_item_max >= run_bytes || n >= max_pages) {
                    if (runs == 0) {
                        end += n < max_pages ? n : max_pages;
                    }
                    break;
                }
                if (runs > 0 && ((uint64_t)(end - pos + n) * e->kv_item_max > cap ||
                                 end - pos + n > max_pages)) {
                    break;
                }
                end += n;
                runs++;
            }
            r->post_end = end;
            r->post_buf = 0;
        }
        h.kind = KVR_AM_KIND_KV;
        h.pos = pos;
        h.npages = end - pos;
        uint32_t pieces = 0; /* per buffer: runs of consecutive source pages */
        for (uint32_t at = pos; at < end; pieces++) {
            at += kvr_run_length(NULL, r->src_pages, at, end);
        }
        for (uint32_t b = r->post_buf; b < e->nkv && !r->failing;) {
            h.buf = (uint16_t)b;
            h.nbuf = kvr_buf_group(e->kv_item, e->nkv, b, h.npages, pieces, merge);
            if (kvr_post_one_locked(e, r, &h) == 1) {
                r->post_buf = b; /* no free slot: resume here */
                return;
            }
            b += h.nbuf;
        }
        if (r->failing) {
            return;
        }
        r->posted = end;
        r->post_end = 0;
        r->post_buf = 0;
    }
    if (r->posted == r->total_pages && !r->aux_posted) {
        if (r->dst_aux >= 0) {
            kvr_room_advance(r, KVR_POLL_TRANSFERRING);
            h.kind = KVR_AM_KIND_AUX;
            h.pos = 0;
            h.npages = 1;
            for (uint32_t a = r->aux_post_buf; a < e->naux && !r->failing;) {
                h.buf = (uint16_t)a;
                h.nbuf = kvr_buf_group(e->aux_item, e->naux, a, 1, 1, merge);
                if (kvr_post_one_locked(e, r, &h) == 1) {
                    r->aux_post_buf = a;
                    return;
                }
                a += h.nbuf;
            }
        }
        r->aux_posted = 1;
    }
}

/* ------------------------------------------------------------------ */
/* Work list: what the API asked for                                   */
/* ------------------------------------------------------------------ */

static void kvr_decode_send_req_locked(kvr_engine_t *e, kvr_room_t *r)
{
    kvr_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVR_MSG_ROOM_REQ;
    m.room = r->id;
    m.tag = r->tag;
    m.aux_index = r->aux_index;
    m.npages = r->npages;
    m.pages = (const unsigned char *)r->pages; /* little-endian host */
    m.prefix_len = r->prefix_len;
    kvr_send_ctrl_to_peer(e, r->peer, &m);
    r->req_sent = 1;
    r->started_ns = kvr_now_ns();
    r->deadline_ns = r->started_ns + e->cfg.deadline_base_ms * KVR_MS +
                     (uint64_t)((double)r->expected * 1e9 / (double)e->cfg.deadline_floor_bps);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING);
}

static void kvr_service_room_locked(kvr_engine_t *e, kvr_room_t *r)
{
    if (r->notice) {
        kvr_send_notice_locked(e, r);
    }
    if (r->done_pending) {
        kvr_send_done_locked(e, r);
    }
    if (r->failing) {
        kvr_room_settle(r);
        return;
    }
    if (kvr_room_terminal(r)) {
        return;
    }
    if (e->mode == KVR_MODE_DECODE) {
        kvr_peer_t *p = r->peer;
        if (p == NULL || !r->init_called) {
            return;
        }
        if (p->state == KVR_PEER_READY && atomic_load(&r->visible) == KVR_POLL_BOOTSTRAPPING) {
            kvr_peer_verify_locked(e, p);
        }
        if (p->state == KVR_PEER_READY && !p->verifying) {
            kvr_room_advance(r, KVR_POLL_WAITING);
            if (r->meta_set && !r->req_sent) {
                kvr_decode_send_req_locked(e, r);
            }
        }
    } else {
        kvr_post_locked(e, r);
        kvr_check_prefill_done_locked(e, r);
    }
}

static void kvr_service_peer_rooms_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r != NULL && r->peer == p) {
            kvr_service_room_locked(e, r);
        }
    }
}

static void kvr_drain_work_locked(kvr_engine_t *e)
{
    while (e->work_head) {
        kvr_room_t *r = e->work_head;
        e->work_head = r->work_next;
        r->on_work = 0;
        r->work_next = NULL;
        if (r->role == KVR_ROLE_DECODE && r->init_called && r->peer != NULL &&
            r->peer->state == KVR_PEER_FAILED && !r->failing && !kvr_room_terminal(r)) {
            /* A new room on a peer that failed earlier: resolve again. */
            char err[256];
            if (kvr_peer_resolve(e, r->peer, err, sizeof(err)) != 0) {
                kvr_room_failf_locked(e, r, KVR_BOOTSTRAP, 0, "%s", err);
            }
        }
        kvr_service_room_locked(e, r);
        kvr_room_unref_locked(e, r);
    }
}

/* ------------------------------------------------------------------ */
/* Control messages in                                                 */
/* ------------------------------------------------------------------ */

static void kvr_bind_request_locked(kvr_engine_t *e, kvr_room_t *r, kvr_peer_t *p, uint64_t tag,
                                    int64_t aux_index, uint32_t npages, int32_t *pages)
{
    r->bound = 1;
    r->peer = p;
    r->peer_counted = 1;
    p->nrooms++;
    r->dst_tag = tag;
    r->dst_aux = aux_index;
    r->ndst = npages;
    r->dst_pages = pages;
    r->started_ns = kvr_now_ns();
    uint64_t bytes = (uint64_t)npages * e->page_bytes + (aux_index >= 0 ? e->aux_bytes : 0);
    r->deadline_ns = r->started_ns + e->cfg.deadline_base_ms * KVR_MS +
                     (uint64_t)((double)bytes * 1e9 / (double)e->cfg.deadline_floor_bps);
    kvr_room_advance(r, KVR_POLL_WAITING);
    if (r->inited && r->total_pages != npages) {
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "decode asked for %u pages, prefill announced %u", npages,
                              r->total_pages);
        return;
    }
    kvr_work_push_locked(e, r);
}

static void kvr_pending_free(kvr_engine_t *e, kvr_pending_t *pd)
{
    e->pending_pages -= pd->npages;
    if (pd->peer != NULL && pd->peer->nrooms > 0) {
        pd->peer->nrooms--;
    }
    free(pd->pages);
    free(pd);
}

static kvr_peer_t *kvr_decode_peer_by_ident(kvr_engine_t *e, const void *ident, size_t len)
{
    char key[2 * KVR_IDENT_MAX + 1];
    if (len == 0 || len > KVR_IDENT_MAX) {
        return NULL;
    }
    for (size_t i = 0; i < len; i++) {
        snprintf(key + 2 * i, 3, "%02x", ((const unsigned char *)ident)[i]);
    }
    return kvr_peer_find(e, KVR_PEER_IS_DECODE, key);
}

/*
 * Prefill: refuses a decode rank's HELLO with code and reason: tells the
 * decode, logs, and releases the rooms the decode already asked for through
 * this peer (they cannot move).
 */
static void kvr_hello_reject_locked(kvr_engine_t *e, kvr_peer_t *p, int code, const char *reason)
{
    kvr_msg_t reply;
    memset(&reply, 0, sizeof(reply));
    reply.type = KVR_MSG_HELLO_REJECT;
    reply.rank = (uint32_t)e->rank;
    reply.code = (uint16_t)code;
    reply.str = reason;
    reply.str_len = (uint16_t)strnlen(reason, KVR_WIRE_MAX_STR);
    kvr_send_ctrl_to_peer(e, p, &reply);
    kvr_log_write(&e->log, KVR_LOG_WARNING, "%s", reason);
    p->state = KVR_PEER_FAILED;
    for (size_t i = 0; i < e->pending.capacity; i++) {
        kvr_pending_t *pd = e->pending.slots[i].value;
        if (pd && pd->peer == p) {
            p->nrooms--;
            pd->peer = NULL;
        }
    }
}

/*
 * Prefill: a decode peer that failed and that nothing refers to any more (no
 * room, alive or draining, and no pending request), renamed to key for a new
 * decode: decode peers that come and go do not pile up.  NULL if none.
 */
static kvr_peer_t *kvr_decode_peer_recycle(kvr_engine_t *e, const char *key)
{
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->kind != KVR_PEER_IS_DECODE || p->state != KVR_PEER_FAILED || p->nrooms > 0) {
            continue;
        }
        int used = 0;
        for (size_t i = 0; !used && i < e->tags.capacity; i++) {
            kvr_room_t *r = e->tags.slots[i].value;
            used = r != NULL && r->peer == p;
        }
        for (size_t i = 0; !used && i < e->pending.capacity; i++) {
            kvr_pending_t *pd = e->pending.slots[i].value;
            used = pd != NULL && pd->peer == p;
        }
        if (!used) {
            kvr_peer_disconnect(e, p);
            free(p->worker_addr);
            kvr_peer_t *next = p->next;
            memset(p, 0, sizeof(*p));
            p->next = next;
            p->kind = KVR_PEER_IS_DECODE;
            p->remote_rank = -1;
            snprintf(p->key, sizeof(p->key), "%s", key);
            snprintf(p->name, sizeof(p->name), "%s", key);
            return p;
        }
    }
    return NULL;
}

/* Prefill: HELLO from a decode rank. */
static void kvr_handle_hello_locked(kvr_engine_t *e, const void *ident, size_t ident_len,
                                    const kvr_msg_t *m)
{
    char key[2 * KVR_IDENT_MAX + 1], why[256], err[256] = "";
    kvr_msg_t reply;
    memset(&reply, 0, sizeof(reply));
    reply.rank = (uint32_t)e->rank;
    for (size_t i = 0; i < ident_len; i++) {
        snprintf(key + 2 * i, 3, "%02x", ((const unsigned char *)ident)[i]);
    }
    kvr_peer_t *p = kvr_peer_find(e, KVR_PEER_IS_DECODE, key);
    if (p == NULL) {
        p = kvr_decode_peer_recycle(e, key);
    }
    if (p == NULL) {
        p = kvr_peer_new(e, KVR_PEER_IS_DECODE, key);
        if (p == NULL) {
            return;
        }
    } else {
        kvr_peer_disconnect(e, p);
    }
    uint32_t live = 0;
    for (kvr_peer_t *q = e->peers; q; q = q->next) {
        live += q != p && q->kind == KVR_PEER_IS_DECODE && q->state == KVR_PEER_READY;
    }
    memcpy(p->ident, ident, ident_len);
    p->ident_len = ident_len;
    p->epoch = m->epoch;
    p->remote_rank = (int)m->rank;
    snprintf(p->name, sizeof(p->name), "decode rank %u (epoch %016" PRIx64 ")", m->rank,
             m->epoch);
    p->last_heard_ns = kvr_now_ns();
    p->state = KVR_PEER_READY; /* so that the reply can be sent */
    char reason[1024];
    if (live >= e->cfg.max_peers) {
        snprintf(reason, sizeof(reason),
                 "prefill rank %d (%s) refused %s: it already serves %u decode ranks "
                 "(max_peers=%u)",
                 e->rank, kvr_ctl_endpoint(e->ctl), p->name, live, e->cfg.max_peers);
        kvr_hello_reject_locked(e, p, KVR_REFUSED, reason);
        return;
    }
    if (kvr_layout_diff(e, &m->layout, why, sizeof(why)) != 0) {
        snprintf(reason, sizeof(reason), "layout mismatch between prefill rank %d (%s) and %s: %s",
                 e->rank, kvr_ctl_endpoint(e->ctl), p->name, why);
        kvr_hello_reject_locked(e, p, KVR_LAYOUT_MISMATCH, reason);
        return;
    }
    /* A decode that does not say (an older build) receives into UCX's
     * default buffers. */
    size_t tx = kvr_tp_tcp_tx_seg(e->tp);
    uint32_t rx = m->tcp_rx_seg ? m->tcp_rx_seg : KVR_TP_TCP_RX_SEG_UCX_DEFAULT;
    if (tx > rx) {
        snprintf(reason, sizeof(reason),
                 "UCX tcp fragments of prefill rank %d (%s) are up to %zu bytes "
                 "(UCX_TCP_TX_SEG_SIZE), %s receives into %" PRIu32 "-byte buffers "
                 "(UCX_TCP_RX_SEG_SIZE): UCX would abort the decode; set its "
                 "UCX_TCP_RX_SEG_SIZE >= the prefill's UCX_TCP_TX_SEG_SIZE",
                 e->rank, kvr_ctl_endpoint(e->ctl), tx, p->name, rx);
        kvr_hello_reject_locked(e, p, KVR_TRANSPORT, reason);
        return;
    }
    /* The endpoint is created on the first data sent to this decode: a
     * decode that never receives costs no connection (and UCX 1.13's tcp
     * transport mishandles connections refused by a worker that is gone). */
    free(p->worker_addr);
    p->worker_addr = NULL;
    if (kvr_tp_address_check(e->tp, m->addr, m->addr_len, err, sizeof(err)) != 0 ||
        (p->worker_addr = malloc(m->addr_len)) == NULL) {
        if (p->worker_addr == NULL && err[0] == '\0') {
            snprintf(err, sizeof(err), "out of memory");
        }
        kvr_hello_reject_locked(e, p, KVR_TRANSPORT, err);
        return;
    }
    memcpy(p->worker_addr, m->addr, m->addr_len);
    p->worker_addr_len = m->addr_len;
    if (kvr_peer_worker(e, p, err, sizeof(err)) != 0) {
        kvr_hello_reject_locked(e, p, KVR_TRANSPORT, err);
        return;
    }
    reply.type = KVR_MSG_HELLO_OK;
    kvr_fill_layout(e, &reply.layout);
    const void *own;
    size_t own_len;
    kvr_tp_address(p->worker, &own, &own_len);
    reply.addr = own;
    reply.addr_len = (uint32_t)own_len;
    kvr_send_ctrl_to_peer(e, p, &reply);
}

/*
 * Prefill: refuses a decode's request: tells the decode (a ROOM_FAIL with
 * code and reason, which its room fails with), fails our own room of that
 * id if it waits unbound, counts and logs.
 */
static void kvr_refuse_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m, int code,
                                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void kvr_refuse_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m, int code,
                                  const char *fmt, ...)
{
    char text[200], reason[KVR_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    snprintf(reason, sizeof(reason),
             "room %" PRIu64 ": prefill rank %d refused the request of %.100s: %.180s", m->room,
             e->rank, p->name, text);
    e->stats.requests_refused++;
    kvr_warn_limited(e, &e->refuse_log, "%s", reason);
    kvr_msg_t f;
    memset(&f, 0, sizeof(f));
    f.type = KVR_MSG_ROOM_FAIL;
    f.room = m->room;
    f.tag = m->tag;
    f.code = (uint16_t)code;
    f.origin_rank = e->rank;
    f.str = reason;
    f.str_len = (uint16_t)strlen(reason);
    kvr_send_ctrl_to_peer(e, p, &f);
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    if (r != NULL && !r->bound && !kvr_room_terminal(r) && !r->failing) {
        kvr_failure_t fl;
        kvr_failure_fill(&fl, code, e->rank, p->name, "%s", reason);
        kvr_room_fail_locked(e, r, &fl, 0);
    }
}

static void kvr_handle_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    /* Indices are the decode's own pages: the prefill cannot check them
     * against the decode's registration, only that they are page numbers. */
    for (uint32_t i = 0; i < m->npages; i++) {
        int32_t v = kvr_wire_i32_at(m->pages, i);
        if (v < 0) {
            kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL, "kv_indices[%u]=%d is negative", i, v);
            return;
        }
    }
    if (m->aux_index < -1) {
        kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL, "aux_index=%" PRId64 " is negative",
                              m->aux_index);
        return;
    }
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    int fresh = r != NULL && !r->bound && !kvr_room_terminal(r) && !r->failing;
    if (r != NULL && !fresh) {
        /* A request for a room that failed here before any decode asked
         * for it (an abort on the prefill, say) gets that cause.  A second
         * request for a room already bound (the decode restarted the room,
         * or a stale duplicate) is refused explicitly. */
        kvr_msg_t f;
        kvr_failure_t rec;
        char reason[KVR_REASON_MAX];
        memset(&f, 0, sizeof(f));
        if (!r->bound && r->failing && r->fail_code) {
            f.code = (uint16_t)r->fail_code;
            if (kvr_registry_peek(&e->registry, r->id, &rec)) {
                snprintf(reason, sizeof(reason), "%s", rec.reason);
            } else {
                snprintf(reason, sizeof(reason), "room %" PRIu64 ": %s on prefill rank %d",
                         m->room, kvr_status_message(r->fail_code), e->rank);
            }
        } else {
            f.code = KVR_PROTOCOL;
            snprintf(reason, sizeof(reason), "room %" PRIu64 ": prefill rank %d already serves it",
                     m->room, e->rank);
        }
        f.type = KVR_MSG_ROOM_FAIL;
        f.room = m->room;
        f.tag = m->tag;
        f.origin_rank = e->rank;
        f.str = reason;
        f.str_len = (uint16_t)strlen(reason);
        kvr_send_ctrl_to_peer(e, p, &f);
        return;
    }
    kvr_pending_t *old = r == NULL ? kvr_table_get(&e->pending, m->room) : NULL;
    if (old != NULL && old->peer != NULL && old->peer != p) {
        /* First come keeps it: a later decode must not take over the room
         * (the first would wait for its deadline while the other got the
         * KV). */
        kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL, "%.100s already asked for this room",
                              old->peer->name);
        return;
    }
    int replaces = old != NULL && old->peer == p;
    if (!replaces && p->nrooms >= e->cfg.max_rooms_per_peer) {
        kvr_refuse_req_locked(e, p, m, KVR_REFUSED,
                              "it already has %u rooms pending or open here "
                              "(max_rooms_per_peer=%u)",
                              p->nrooms, e->cfg.max_rooms_per_peer);
        return;
    }
    if ((int64_t)m->npages > e->min_pages) {
        kvr_refuse_req_locked(e, p, m, KVR_REFUSED,
                              "it asks for %u pages, more than the %" PRId64
                              " this prefill has registered",
                              m->npages, e->min_pages);
        return;
    }
    if (r == NULL && e->pending_pages + m->npages > KVR_MAX_PENDING_PAGES) {
        kvr_refuse_req_locked(e, p, m, KVR_REFUSED,
                              "the requests waiting for senders not created yet hold %" PRIu64
                              " pages (at most %u)",
                              e->pending_pages, KVR_MAX_PENDING_PAGES);
        return;
    }
    if (r == NULL && old == NULL && e->pending.count >= e->cfg.max_pending) {
        kvr_refuse_req_locked(e, p, m, KVR_REFUSED,
                              "%u requests already wait for senders not created yet "
                              "(max_pending=%u)",
                              (unsigned)e->pending.count, e->cfg.max_pending);
        return;
    }
    int32_t *pages = NULL;
    if (m->npages) {
        pages = malloc((size_t)m->npages * sizeof(int32_t));
        if (pages == NULL) {
            return;
        }
        for (uint32_t i = 0; i < m->npages; i++) {
            pages[i] = kvr_wire_i32_at(m->pages, i);
        }
    }
    if (fresh) {
        r->prefix_len = m->prefix_len;
        kvr_bind_request_locked(e, r, p, m->tag, m->aux_index, m->npages, pages);
        return;
    }
    kvr_pending_t *pd = calloc(1, sizeof(*pd));
    if (pd == NULL) {
        free(pages);
        return;
    }
    pd->peer = p;
    p->nrooms++;
    pd->tag = m->tag;
    pd->aux_index = m->aux_index;
    pd->npages = m->npages;
    e->pending_pages += m->npages;
    pd->pages = pages;
    pd->prefix_len = m->prefix_len;
    pd->arrived_ns = kvr_now_ns();
    if (kvr_table_put(&e->pending, m->room, pd) != 0) {
        kvr_pending_free(e, pd);
        return;
    }
    if (old) {
        kvr_pending_free(e, old);
    }
}

/* A ROOM_FAIL from a peer: the peer's root cause becomes ours (unless we
 * already have one). */
static void kvr_handle_remote_fail_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    uint64_t mytag = r == NULL ? 0 : e->mode == KVR_MODE_DECODE ? r->tag : r->dst_tag;
    /* A prefill room no decode has bound yet fails with the decode's cause
     * (the decode gave up on it before asking, e.g. a rejected layout). */
    int unbound = r != NULL && e->mode == KVR_MODE_PREFILL && !r->bound;
    if (r == NULL && e->mode == KVR_MODE_PREFILL) {
        kvr_pending_t *pd = kvr_table_get(&e->pending, m->room);
        if (pd != NULL && (pd->peer != p || pd->tag != m->tag)) {
            return; /* about another decode's request (or an older one) */
        }
        if (pd != NULL) {
            kvr_table_remove(&e->pending, m->room);
            kvr_pending_free(e, pd);
        }
    }
    if (r != NULL && !unbound && (r->peer != p || mytag != m->tag)) {
        return; /* about another incarnation of the room */
    }
    kvr_failure_t f;
    memset(&f, 0, sizeof(f));
    f.code = m->code < KVR_STATUS_LAST && m->code != KVR_OK ? m->code : KVR_REMOTE;
    f.origin_rank = m->origin_rank;
    f.from_remote = 1;
    /* Rank r talks to rank r: a cause that originated at another rank came
     * through that rank's siblings, and ours will hear it from theirs. */
    f.from_sibling = m->origin_rank >= 0 && m->origin_rank != e->rank;
    f.time_ns = kvr_now_ns();
    snprintf(f.reason, sizeof(f.reason), "%.*s", (int)m->str_len, m->str);
    snprintf(f.peer, sizeof(f.peer), "%s", p->name);
    if (r == NULL) {
        if (e->mode == KVR_MODE_PREFILL) {
            /* Kept for a sender not created yet (see kvr_handle_open). */
            kvr_registry_record_early(&e->registry, m->room, &f);
        }
        return;
    }
    kvr_room_fail_locked(e, r, &f, 0);
}

/* Counts a malformed control message; logs at most one line a second. */
static void kvr_drop_locked(kvr_engine_t *e, size_t len, const char *why)
{
    uint64_t now = kvr_now_ns();
    e->stats.ctrl_dropped++;
    e->drop_log_n++;
    if (now - e->drop_log_ns >= 1000 * KVR_MS) {
        kvr_log_write(&e->log, KVR_LOG_WARNING,
                      "%s rank %d: dropped %" PRIu64 " malformed control message(s); the last "
                      "(%zu bytes): %s",
                      kvr_side(e), e->rank, e->drop_log_n, len, why);
        e->drop_log_ns = now;
        e->drop_log_n = 0;
    }
}

/* Who sent a refused message, for the log: a known peer's name, or the
 * address and routing id of a connection to our ROUTER. */
static void kvr_describe_sender(kvr_engine_t *e, kvr_ctl_conn_t *conn, void *conn_ctx,
                                const void *ident, size_t ident_len, const char *from, char *out,
                                size_t n)
{
    if (conn != NULL) {
        kvr_peer_t *p = conn_ctx;
        if (p != NULL) {
            snprintf(out, n, "%s%s", conn == p->conn ? "" : "the bootstrap server for ", p->name);
        } else if (conn == e->bs_conn) {
            snprintf(out, n, "the bootstrap server %s", e->bootstrap_addr);
        } else {
            snprintf(out, n, "a sibling rank's control socket");
        }
        return;
    }
    kvr_peer_t *p = kvr_decode_peer_by_ident(e, ident, ident_len);
    char id[80] = "";
    const unsigned char *b = ident;
    if (ident_len == 12) {
        uint64_t ep;
        uint32_t rk;
        memcpy(&ep, b, 8);
        memcpy(&rk, b + 8, 4);
        snprintf(id, sizeof(id), "routing id: epoch %016" PRIx64 " rank %u", ep, rk);
    } else {
        size_t k = snprintf(id, sizeof(id), "routing id 0x");
        for (size_t i = 0; i < ident_len && i < 16 && k + 3 < sizeof(id); i++) {
            k += (size_t)snprintf(id + k, sizeof(id) - k, "%02x", b[i]);
        }
    }
    snprintf(out, n, "%.100s%s%.64s (%.60s)", p ? p->name : "", p ? " at " : "",
             from[0] ? from : "an unknown address", id);
}

/* A message the control layer refused before decoding it. */
static void kvr_on_refused(kvr_engine_t *e, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
                           const void *ident, size_t ident_len, const char *from, size_t len,
                           const char *why)
{
    char who[240];
    kvr_describe_sender(e, conn, conn_ctx, ident, ident_len, from, who, sizeof(who));
    e->stats.ctrl_dropped++;
    if (kind == KVR_CTL_REFUSED_OVERSIZED) {
        e->stats.ctrl_oversized++;
        kvr_warn_limited(e, &e->size_log,
                         "%s rank %d: refused an oversized control message (%zu bytes) from %s",
                         kvr_side(e), e->rank, len, who);
        return;
    }
    e->stats.auth_rejected++;
    kvr_warn_limited(e, &e->auth_log,
                     "%s rank %d: refused a control message (%zu bytes) from %s: %s%s",
                     kvr_side(e), e->rank, len, who, why,
                     kind == KVR_CTL_REFUSED_AUTH
                         ? "; check that KVRECV_SECRET is the same on both sides"
                         : "");
}

static void kvr_on_router_msg(void *arg, const void *ident, size_t ident_len, const void *data,
                              size_t len)
{
    kvr_engine_t *e = arg;
    kvr_msg_t m;
    const char *why;
    if (kvr_wire_decode(data, len, &m, &why) != 0) {
        kvr_drop_locked(e, len, why);
        return;
    }
    if (m.type == KVR_MSG_SIB_FAIL) {
        if (e->nsib == 0) {
            e->stats.ctrl_dropped++;
            return;
        }
        kvr_handle_sib_fail_locked(e, &m);
        return;
    }
    if (e->mode != KVR_MODE_PREFILL) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (m.type == KVR_MSG_HELLO) {
        if (ident_len == 0 || ident_len > KVR_IDENT_MAX) {
            e->stats.ctrl_dropped++;
            return;
        }
        kvr_handle_hello_locked(e, ident, ident_len, &m);
        return;
    }
    kvr_peer_t *p = kvr_decode_peer_by_ident(e, ident, ident_len);
    if (m.type == KVR_MSG_PING) {
        kvr_msg_t pong;
        memset(&pong, 0, sizeof(pong));
        pong.type = KVR_MSG_PONG;
        pong.rank = (uint32_t)e->rank;
        pong.epoch = e->epoch;
        if (p) {
            p->last_heard_ns = kvr_now_ns();
        }
        if (kvr_wire_encode(&e->wbuf, &pong) == 0) {
            kvr_ctl_send_router(e->ctl, ident, ident_len, e->wbuf.data, e->wbuf.len);
        }
        return;
    }
    if (p != NULL && p->epoch == m.epoch && p->state == KVR_PEER_FAILED &&
        m.type == KVR_MSG_ROOM_FAIL) {
        /* A decode we rejected reports the rooms it gave up on. */
        kvr_handle_remote_fail_locked(e, p, &m);
        return;
    }
    if (p == NULL || p->epoch != m.epoch || p->state != KVR_PEER_READY) {
        e->stats.ctrl_dropped++;
        return;
    }
    p->last_heard_ns = kvr_now_ns();
    switch (m.type) {
    case KVR_MSG_ROOM_REQ:
        kvr_handle_req_locked(e, p, &m);
        break;
    case KVR_MSG_ROOM_DONE: {
        kvr_room_t *r = kvr_table_get(&e->rooms, m.room);
        if (r && r->peer == p && r->dst_tag == m.tag) {
            r->done_received = 1;
            kvr_check_prefill_done_locked(e, r);
        }
        break;
    }
    case KVR_MSG_ROOM_FAIL:
        kvr_handle_remote_fail_locked(e, p, &m);
        break;
    case KVR_MSG_BYE:
        kvr_peer_fail_locked(e, p, KVR_PEER_LOST, "closed its manager");
        break;
    default:
        e->stats.ctrl_dropped++;
    }
}

/*
 * A server we connected to could not authenticate our messages (its secret
 * differs from ours, or one side has none).  Rooms that depend on it fail
 * now with BOOTSTRAP and the server's reason, rather than at the bootstrap
 * timeout.
 */
static void kvr_handle_auth_reject_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, kvr_peer_t *p,
                                          const kvr_msg_t *m)
{
    char reason[KVR_WIRE_MAX_STR + 1];
    snprintf(reason, sizeof(reason), "%.*s", (int)m->str_len, m->str);
    e->stats.auth_refused_by_peer++;
    if (e->mode == KVR_MODE_PREFILL) {
        if (conn != e->bs_conn) {
            kvr_warn_limited(e, &e->auth_log, "prefill rank %d: a sibling rank refused our "
                             "messages: %s", e->rank, reason);
            return;
        }
        snprintf(e->reg_auth_error, sizeof(e->reg_auth_error), "%s", reason);
        kvr_warn_limited(e, &e->auth_log,
                         "prefill rank %d cannot register with the bootstrap server %s: %s",
                         e->rank, e->bootstrap_addr, reason);
        for (size_t i = 0; i < e->rooms.capacity; i++) {
            kvr_room_t *r = e->rooms.slots[i].value;
            if (r != NULL && !r->bound && !r->failing && !kvr_room_terminal(r)) {
                kvr_room_failf_locked(e, r, KVR_BOOTSTRAP, 0,
                                      "this rank cannot register with the bootstrap server %s: %s",
                                      e->bootstrap_addr, reason);
            }
        }
        return;
    }
    if (p == NULL) {
        kvr_warn_limited(e, &e->auth_log, "decode rank %d: a sibling rank refused our messages: %s",
                         e->rank, reason);
        return;
    }
    if (conn == p->vconn) {
        kvr_warn_limited(e, &e->auth_log, "decode rank %d: the bootstrap server %s refused our "
                         "check of %s: %s", e->rank, p->key, p->name, reason);
        if (p->verifying) {
            kvr_peer_verified_locked(e, p, 0, 0);
        }
        return;
    }
    if (conn != p->bs_conn && conn != p->conn) {
        return;
    }
    char what[KVR_WIRE_MAX_STR + 64];
    snprintf(what, sizeof(what), "refused our control messages: %s", reason);
    kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, what);
}

/* Decode: a message from the bootstrap server or a prefill. */
static void kvr_on_conn_msg(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx, const void *data,
                            size_t len)
{
    kvr_engine_t *e = arg;
    kvr_peer_t *p = conn_ctx;
    kvr_msg_t m;
    const char *why;
    char err[256];
    if (kvr_wire_decode(data, len, &m, &why) != 0) {
        kvr_drop_locked(e, len, why);
        return;
    }
    if (m.type == KVR_MSG_AUTH_REJECT) {
        kvr_handle_auth_reject_locked(e, conn, p, &m);
        return;
    }
    if (e->mode == KVR_MODE_PREFILL) {
        /* Our registration with the bootstrap server. */
        if (m.type == KVR_MSG_BS_REGISTER_OK) {
            e->reg_auth_error[0] = '\0';
            if (!e->registered) {
                kvr_log_write(&e->log, KVR_LOG_INFO,
                              "prefill rank %d registered with the bootstrap server %s as %s",
                              e->rank, e->bootstrap_addr, kvr_ctl_endpoint(e->ctl));
            }
            e->registered = 1;
        } else {
            e->stats.ctrl_dropped++;
        }
        return;
    }
    if (p == NULL) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (conn == p->vconn) {
        if (m.type != KVR_MSG_BS_QUERY_REPLY || !p->verifying) {
            e->stats.ctrl_dropped++;
            return;
        }
        kvr_peer_verified_locked(e, p, m.found, m.peer_epoch);
        return;
    }
    if (conn == p->bs_conn) {
        if (m.type != KVR_MSG_BS_QUERY_REPLY || p->state != KVR_PEER_RESOLVING) {
            e->stats.ctrl_dropped++;
            return;
        }
        if (!m.found) {
            return; /* not registered yet: the timer asks again */
        }
        char endpoint[KVR_WIRE_MAX_STR + 1];
        memcpy(endpoint, m.str, m.str_len);
        endpoint[m.str_len] = '\0';
        unsigned char ident[12];
        memcpy(ident, &e->epoch, 8);
        memcpy(ident + 8, &e->rank, 4);
        kvr_peer_disconnect(e, p); /* retires the bootstrap connection */
        p->epoch = m.peer_epoch;
        snprintf(p->name, sizeof(p->name), "prefill rank %d at %.120s", e->rank,
                 strncmp(endpoint, "tcp://", 6) == 0 ? endpoint + 6 : endpoint);
        if (kvr_ctl_connect(e->ctl, endpoint, ident, sizeof(ident), p, &p->conn, err,
                            sizeof(err)) != 0) {
            kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, err);
            return;
        }
        if (kvr_peer_worker(e, p, err, sizeof(err)) != 0) {
            char what[400];
            snprintf(what, sizeof(what), "cannot be reached: %s", err);
            kvr_peer_fail_locked(e, p, KVR_TRANSPORT, what);
            return;
        }
        p->state = KVR_PEER_CONNECTING;
        kvr_peer_hello(e, p);
        return;
    }
    if (conn != p->conn) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (m.epoch != p->epoch) {
        /* A different instance answers at the address we bound rooms to. */
        char what[200];
        snprintf(what, sizeof(what), "restarted (epoch %016" PRIx64 " replaced by %016" PRIx64 ")",
                 p->epoch, m.epoch);
        kvr_peer_fail_locked(e, p, KVR_PEER_RESTARTED, what);
        return;
    }
    p->last_heard_ns = kvr_now_ns();
    switch (m.type) {
    case KVR_MSG_HELLO_OK: {
        if (p->state != KVR_PEER_CONNECTING) {
            break;
        }
        char diff[256];
        if (kvr_layout_diff(e, &m.layout, diff, sizeof(diff)) != 0) {
            char what[400];
            snprintf(what, sizeof(what), "has a different layout: %s", diff);
            kvr_peer_fail_locked(e, p, KVR_LAYOUT_MISMATCH, what);
            break;
        }
        /*
         * The decode holds an endpoint to the prefill's worker too.  UCX
         * pairs it with the prefill's own endpoint to us, so the prefill's
         * data arrives on it: closing it when the prefill is lost cancels
         * the receives the dead peer left hanging, and on transports with
         * peer-failure support its error reports a dead prefill at once.
         */
        char eperr[256];
        if (kvr_tp_ep_create(p->worker, m.addr, m.addr_len, p, &p->ep, eperr, sizeof(eperr)) != 0) {
            char what[400];
            snprintf(what, sizeof(what), "cannot be reached: %s", eperr);
            kvr_peer_fail_locked(e, p, KVR_TRANSPORT, what);
            break;
        }
        p->state = KVR_PEER_READY;
        p->verified_ns = kvr_now_ns();
        kvr_log_write(&e->log, KVR_LOG_INFO, "decode rank %d connected to %s", e->rank, p->name);
        p->next_ping_ns = kvr_now_ns() + e->cfg.heartbeat_interval_ms * KVR_MS;
        kvr_service_peer_rooms_locked(e, p);
        break;
    }
    case KVR_MSG_HELLO_REJECT: {
        kvr_failure_t f;
        kvr_failure_fill(&f, m.code < KVR_STATUS_LAST ? m.code : KVR_REMOTE, (int)m.rank,
                         p->name, "%.*s", (int)m.str_len, m.str);
        f.from_remote = 1;
        for (size_t i = 0; i < e->rooms.capacity; i++) {
            kvr_room_t *r = e->rooms.slots[i].value;
            if (r && r->peer == p && !kvr_room_terminal(r)) {
                kvr_failure_t fr = f;
                snprintf(fr.reason, sizeof(fr.reason), "room %" PRIu64 ": %.*s", r->id,
                         (int)m.str_len, m.str);
                kvr_room_fail_locked(e, r, &fr, 0);
                /* The prefill rejected us before any request: tell it which
                 * rooms this was about, so its senders fail now too. */
                kvr_tell_room_failed(e, p, r, fr.code);
            }
        }
        p->state = KVR_PEER_FAILED;
        kvr_peer_disconnect(e, p);
        break;
    }
    case KVR_MSG_PONG:
        break;
    case KVR_MSG_ROOM_FAIL:
        kvr_handle_remote_fail_locked(e, p, &m);
        break;
    case KVR_MSG_BYE:
        kvr_peer_fail_locked(e, p, KVR_PEER_LOST, "closed its manager");
        break;
    default:
        e->stats.ctrl_dropped++;
    }
}

/* ------------------------------------------------------------------ */
/* Timers                                                              */
/* ------------------------------------------------------------------ */

static void kvr_register_tick_locked(kvr_engine_t *e, uint64_t now)
{
    if (e->mode != KVR_MODE_PREFILL || e->registered || e->bs_conn == NULL ||
        now < e->next_register_ns) {
        return;
    }
    kvr_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVR_MSG_BS_REGISTER;
    m.epoch = e->epoch;
    m.rank = (uint32_t)e->rank;
    m.str = kvr_ctl_endpoint(e->ctl);
    m.str_len = (uint16_t)strlen(m.str);
    if (kvr_wire_encode(&e->wbuf, &m) == 0) {
        kvr_ctl_send_conn(e->bs_conn, e->wbuf.data, e->wbuf.len);
    }
    e->next_register_ns = now + 200 * KVR_MS;
}

static void kvr_timers_locked(kvr_engine_t *e)
{
    uint64_t now = kvr_now_ns();
    kvr_register_tick_locked(e, now);
    kvr_tp_pack_trim(e->tp, now);
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->kind == KVR_PEER_IS_PREFILL) {
            if (p->state == KVR_PEER_RESOLVING || p->state == KVR_PEER_CONNECTING) {
                if (now >= p->resolve_deadline_ns) {
                    char what[200];
                    snprintf(what, sizeof(what), "%s within the bootstrap timeout (%u ms)",
                             p->state == KVR_PEER_RESOLVING
                                 ? "was not found at the bootstrap server (unreachable, or the "
                                   "prefill rank is not registered)"
                                 : "did not answer the handshake",
                             e->cfg.bootstrap_timeout_ms);
                    kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, what);
                } else if (p->state == KVR_PEER_RESOLVING && now >= p->next_try_ns) {
                    kvr_bs_query(e, p->bs_conn);
                    p->next_try_ns = now + 200 * KVR_MS;
                }
            } else if (p->state == KVR_PEER_READY) {
                if (p->verifying && now > p->verify_deadline_ns) {
                    /* The bootstrap server did not answer: keep the peer. */
                    kvr_peer_verified_locked(e, p, 0, 0);
                }
                if (p->state != KVR_PEER_READY) {
                    continue;
                }
                if (now - p->last_heard_ns > e->cfg.heartbeat_timeout_ms * KVR_MS) {
                    char what[200];
                    snprintf(what, sizeof(what), "lost: no heartbeat for %" PRIu64 " ms",
                             (now - p->last_heard_ns) / KVR_MS);
                    e->stats.heartbeats_missed++;
                    kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
                } else if (now >= p->next_ping_ns) {
                    kvr_msg_t m;
                    memset(&m, 0, sizeof(m));
                    m.type = KVR_MSG_PING;
                    m.rank = (uint32_t)e->rank;
                    kvr_send_ctrl_to_peer(e, p, &m);
                    p->next_ping_ns = now + e->cfg.heartbeat_interval_ms * KVR_MS;
                }
            }
        } else if (p->state == KVR_PEER_READY &&
                   now - p->last_heard_ns > e->cfg.heartbeat_timeout_ms * KVR_MS) {
            char what[200];
            snprintf(what, sizeof(what), "lost: no heartbeat for %" PRIu64 " ms",
                     (now - p->last_heard_ns) / KVR_MS);
            e->stats.heartbeats_missed++;
            kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
        }
    }
    /* The scans over every room run at most every KVR_SCAN_NS: with
     * thousands of rooms in flight they would otherwise dominate a busy
     * loop.  Deadlines and force-drains are coarse by nature. */
    if (now < e->next_scan_ns) {
        return;
    }
    e->next_scan_ns = now + KVR_SCAN_NS;
    /*
     * Failing rooms whose peer was declared dead (heartbeat silence, endpoint
     * error) but whose operations never completed: UCX endpoints without
     * peer-failure support (shared memory in UCX 1.13) do not fail them.
     * Ask UCX to cancel them at once, and after two heartbeat intervals
     * declare the room drained.  A dead peer sends nothing more; a live one
     * (an abort) is always waited for.
     */
    kvr_peer_t *stalled = NULL;
    uint64_t stalled_ms = 0;
    for (size_t i = 0; i < e->tags.capacity; i++) {
        kvr_room_t *r = e->tags.slots[i].value;
        if (r == NULL || !r->failing || r->inflight == 0 || r->stage_copies > 0) {
            /* (A CUDA copy always finishes: a room with one in flight waits
             * for it, so nothing lands after Failed.) */
            continue;
        }
        if (r->peer != NULL && r->peer->state == KVR_PEER_READY) {
            /*
             * A live peer completes or fails the operations of a room that
             * failed (an abort, a deadline) -- unless the data path itself
             * stalled while the control path still answers (a blackholed
             * data port: tcp then retries for many minutes).  After the
             * heartbeat timeout plus the time the room's operations take
             * at the floor bandwidth, with no operation of that peer
             * completing meanwhile, the peer is lost: its endpoint is
             * closed, which cancels the operations, and the room drains.
             */
            uint64_t bytes = 0;
            for (kvr_op_t *op = r->ops; op != NULL; op = op->next) {
                bytes += op->len;
            }
            uint64_t grace = e->cfg.heartbeat_timeout_ms * KVR_MS +
                             (uint64_t)((double)bytes * 1e9 / (double)e->cfg.deadline_floor_bps);
            if (stalled == NULL && now - r->failing_since_ns > grace &&
                now - r->peer->last_data_ns > grace) {
                stalled = r->peer;
                stalled_ms = (now - (r->peer->last_data_ns > r->started_ns ? r->peer->last_data_ns
                                                                            : r->started_ns)) /
                             KVR_MS;
            }
            continue;
        }
        if (!r->cancel_sent) {
            r->cancel_sent = 1;
            r->failing_since_ns = now;
            kvr_room_ref(r);
            for (kvr_op_t *op = r->ops; op != NULL;) {
                kvr_op_t *next = op->next; /* cancelling may complete and free op */
                kvr_tp_op_cancel(&op->base);
                op = next;
            }
            kvr_room_unref_locked(e, r);
        } else if (now - r->failing_since_ns > 2 * e->cfg.heartbeat_interval_ms * KVR_MS) {
            e->stats.rooms_force_drained++;
            kvr_room_force_drain(r);
        }
    }
    if (stalled != NULL) {
        char what[200];
        snprintf(what, sizeof(what),
                 "lost: its data path stalled (no data operation completed for %" PRIu64
                 " ms) while its control channel still answered",
                 stalled_ms);
        kvr_peer_fail_locked(e, stalled, KVR_PEER_LOST, what);
    }
    /* Requests whose sender never came, or whose decode is gone. */
    for (size_t i = 0; i < e->pending.capacity; i++) {
        kvr_pending_t *pd = e->pending.slots[i].value;
        if (pd && (pd->peer == NULL || pd->peer->state != KVR_PEER_READY ||
                   now - pd->arrived_ns > e->cfg.bootstrap_timeout_ms * KVR_MS)) {
            kvr_table_remove(&e->pending, e->pending.slots[i].key);
            kvr_pending_free(e, pd);
            i--; /* backward-shift deletion may have moved an entry here */
        }
    }
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r == NULL || r->failing || kvr_room_terminal(r)) {
            continue;
        }
        if (r->rejected_ns && now - r->rejected_ns > 2 * e->cfg.heartbeat_interval_ms * KVR_MS) {
            kvr_rejected_fail_locked(e, r);
            continue;
        }
        if (r->deadline_ns && now > r->deadline_ns) {
            uint64_t expected = e->mode == KVR_MODE_DECODE
                                    ? r->expected
                                    : (uint64_t)r->ndst * e->page_bytes +
                                          (r->dst_aux >= 0 ? e->aux_bytes : 0);
            uint64_t got = e->mode == KVR_MODE_DECODE ? r->received : 0;
            if (e->mode == KVR_MODE_DECODE) {
                kvr_room_failf_locked(e, r, KVR_TIMEOUT, 1,
                                      "no completion within its deadline of %" PRIu64
                                      " ms: %" PRIu64 " of %" PRIu64 " bytes received",
                                      (r->deadline_ns - r->started_ns) / KVR_MS, got, expected);
            } else if (!r->bound) {
                kvr_room_failf_locked(e, r, KVR_BOOTSTRAP, 0,
                                      "no decode asked for the room within the bootstrap "
                                      "timeout (%u ms); this rank is %sregistered with the "
                                      "bootstrap server %s%s%.600s",
                                      e->cfg.bootstrap_timeout_ms, e->registered ? "" : "NOT ",
                                      e->bootstrap_addr,
                                      e->reg_auth_error[0] ? ": " : "", e->reg_auth_error);
            } else {
                kvr_room_failf_locked(e, r, KVR_TIMEOUT, 1,
                                      "no completion within its deadline of %" PRIu64
                                      " ms: %u of %u pages handed to send(), %" PRIu64
                                      " bytes expected",
                                      (r->deadline_ns - r->started_ns) / KVR_MS, r->given,
                                      r->total_pages, expected);
            }
        }
    }
}

/* ------------------------------------------------------------------ */
/* The progress thread                                                 */
/* ------------------------------------------------------------------ */

/* Waits for the staging copies in flight and ends them (the rooms are
 * failing by now: nothing is sent, nothing more is copied). */
static void kvr_stage_finish_locked(kvr_engine_t *e)
{
    if (e->stream != NULL) {
        kvr_cuda_stream_sync(e->stream, NULL, 0);
        kvr_stage_poll_locked(e);
    }
}

static void kvr_shutdown_locked(kvr_engine_t *e)
{
    /* Fail what is still open, tell the peers, then close endpoints (force:
     * outstanding operations complete with an error and the rooms drain). */
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r && !kvr_room_terminal(r)) {
            kvr_room_failf_locked(e, r, KVR_ABORTED, 1, "%s manager rank %d closed",
                                  kvr_side(e), e->rank);
        }
    }
    kvr_msg_t bye;
    memset(&bye, 0, sizeof(bye));
    bye.type = KVR_MSG_BYE;
    bye.rank = (uint32_t)e->rank;
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->state == KVR_PEER_READY) {
            kvr_send_ctrl_to_peer(e, p, &bye);
        }
    }
    kvr_stage_finish_locked(e);
    kvr_drain_work_locked(e); /* sends the notices */
    kvr_siblings_locked(e);
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        kvr_peer_disconnect(e, p);
    }
    kvr_reap_locked(e);
    kvr_tp_progress(e->tp);
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r) {
            kvr_room_settle(r);
        }
    }
}

static void *kvr_engine_main(void *arg)
{
    kvr_engine_t *e = arg;
    int fds[2] = {e->wake_fd, kvr_tp_fd(e->tp)};
    if (e->ndev > 0) {
        /* The staging copies and events of this thread are on that device. */
        kvr_cuda_set_device(e->cuda_device, NULL, 0);
    }
    int ready[2];
    uint64_t last_sock_poll_ns = 0;
    long tick_ms = e->cfg.heartbeat_interval_ms / 2;
    if (tick_ms < 5) {
        tick_ms = 5;
    }
    if (tick_ms > 50) {
        tick_ms = 50;
    }
    pthread_mutex_lock(&e->lock);
    for (;;) {
        if (e->stopping) {
            break;
        }
        kvr_drain_work_locked(e);
        kvr_tp_progress(e->tp);
        if (e->ep_err_pending) {
            kvr_ep_errors_locked(e);
        }
        kvr_stage_poll_locked(e);
        kvr_timers_locked(e);
        kvr_drain_work_locked(e);
        if (e->sib_dirty || e->sib_pending) {
            kvr_siblings_locked(e);
        }
        kvr_reap_locked(e);
        unsigned progressed = kvr_tp_progress(e->tp) + kvr_stage_poll_locked(e);
        int copying = e->stage_head != NULL;
        if (progressed > 0 || e->work_head || e->sib_pending || copying || kvr_tp_arm(e->tp)) {
            /* Still busy (or UCX has events the arm just found): go round
             * again, letting API calls take the lock in between.  The
             * sockets are polled (without sleeping) at most every
             * KVR_BUSY_POLL_NS: a poll per pass was most of a busy
             * sender's time.  Waiting only for staging copies (no event fd
             * tells when they finish): a short nap between polls. */
            int nap = copying && progressed == 0 && e->work_head == NULL && !e->sib_pending;
            uint64_t now = kvr_now_ns();
            pthread_mutex_unlock(&e->lock);
            if (nap) {
                struct timespec ts = {0, KVR_STAGE_NAP_NS};
                nanosleep(&ts, NULL);
            }
            if (now - last_sock_poll_ns >= KVR_BUSY_POLL_NS) {
                last_sock_poll_ns = now;
                kvr_ctl_poll(e->ctl, fds, 2, ready, 0);
            }
            pthread_mutex_lock(&e->lock);
            continue;
        }
        pthread_mutex_unlock(&e->lock);
        last_sock_poll_ns = kvr_now_ns();
        /* The callbacks of kvr_ctl_poll run without the lock; they take it. */
        kvr_ctl_poll(e->ctl, fds, 2, ready, tick_ms);
        pthread_mutex_lock(&e->lock);
        if (ready[0]) {
            uint64_t v;
            ssize_t n = read(e->wake_fd, &v, sizeof(v));
            (void)n;
        }
    }
    kvr_shutdown_locked(e);
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

/* The control callbacks run inside kvr_ctl_poll, which the thread calls
 * without the lock: these wrappers take it. */
static void kvr_on_router_msg_entry(void *arg, const void *ident, size_t ident_len,
                                    const void *data, size_t len)
{
    kvr_engine_t *e = arg;
    pthread_mutex_lock(&e->lock);
    kvr_on_router_msg(e, ident, ident_len, data, len);
    pthread_mutex_unlock(&e->lock);
}

static void kvr_on_conn_msg_entry(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx,
                                  const void *data, size_t len)
{
    kvr_engine_t *e = arg;
    pthread_mutex_lock(&e->lock);
    kvr_on_conn_msg(e, conn, conn_ctx, data, len);
    pthread_mutex_unlock(&e->lock);
}

static void kvr_on_refused_entry(void *arg, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
                                 const void *ident, size_t ident_len, const char *from,
                                 size_t len, const char *why)
{
    kvr_engine_t *e = arg;
    pthread_mutex_lock(&e->lock);
    kvr_on_refused(e, kind, conn, conn_ctx, ident, ident_len, from, len, why);
    pthread_mutex_unlock(&e->lock);
}

/* ------------------------------------------------------------------ */
/* Create / close                                                      */
/* ------------------------------------------------------------------ */

static uint64_t kvr_u64_max(const uint64_t *v, uint32_t n)
{
    uint64_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        m = v[i] > m ? v[i] : m;
    }
    return m;
}

static int kvr_copy_u64(uint64_t **dst, const uint64_t *src, uint32_t n)
{
    *dst = calloc(n ? n : 1, sizeof(uint64_t));
    if (*dst == NULL) {
        return -1;
    }
    if (n) {
        memcpy(*dst, src, n * sizeof(uint64_t));
    }
    return 0;
}

static unsigned char *kvr_le_array(const uint64_t *v, uint32_t n)
{
    unsigned char *out = calloc(n ? n : 1, 8);
    if (out == NULL) {
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        for (int b = 0; b < 8; b++) {
            out[i * 8 + b] = (unsigned char)(v[i] >> (8 * b));
        }
    }
    return out;
}

static int kvr_validate_buffers(const char *what, uint32_t n, const uint64_t *ptrs,
                                const uint64_t *lens, const uint64_t *items, int64_t *min_rows,
                                uint64_t *row_bytes, char *err, size_t errlen)
{
    *min_rows = n ? INT64_MAX : 0;
    *row_bytes = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (items[i] == 0) {
            return kvr_err(err, errlen, KVR_EVALUE, "%s_item_lens[%u] is 0", what, i);
        }
        if (lens[i] % items[i] != 0) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "%s_item_lens[%u]=%" PRIu64 " does not divide %s_data_lens[%u]=%" PRIu64,
                           what, i, items[i], what, i, lens[i]);
        }
        if (ptrs[i] == 0 && lens[i] != 0) {
            return kvr_err(err, errlen, KVR_EVALUE, "%s_data_ptrs[%u] is NULL", what, i);
        }
        int64_t rows = (int64_t)(lens[i] / items[i]);
        if (rows > INT32_MAX) {
            rows = INT32_MAX;
        }
        if (rows < *min_rows) {
            *min_rows = rows;
        }
        *row_bytes += items[i];
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Device memory: kinds, path, staging pool                            */
/* ------------------------------------------------------------------ */

const char *kvr_gpu_path_name(int path)
{
    switch (path) {
    case KVR_GPU_UCX:
        return "ucx-cuda";
    case KVR_GPU_STAGED:
        return "staged";
    default:
        return "host";
    }
}

/* Decides which buffers are device memory (e->kv_dev / aux_dev). */
static int kvr_gpu_kinds(kvr_engine_t *e, const kvr_engine_params_t *p, char *cuda_err,
                         size_t cuda_errlen, char *err, size_t errlen)
{
    uint32_t n = e->nkv + e->naux;
    int any_cuda = 0, any_auto = 0;
    e->kv_dev = calloc(e->nkv ? e->nkv : 1, 1);
    e->aux_dev = calloc(e->naux ? e->naux : 1, 1);
    if (e->kv_dev == NULL || e->aux_dev == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *kinds = i < e->nkv ? p->kv_kinds : p->aux_kinds;
        uint8_t k = kinds ? kinds[i < e->nkv ? i : i - e->nkv] : KVR_MEM_AUTO;
        if (k > KVR_MEM_CUDA) {
            return kvr_err(err, errlen, KVR_EVALUE, "memory kind %u of buffer %u is unknown", k, i);
        }
        any_cuda |= k == KVR_MEM_CUDA;
        any_auto |= k == KVR_MEM_AUTO;
    }
    int loaded = 0;
    if (any_cuda || any_auto) {
        loaded = kvr_cuda_load(cuda_err, cuda_errlen) == 0;
    }
    e->cuda_device = -1;
    for (uint32_t i = 0; i < n; i++) {
        int is_kv = i < e->nkv;
        uint32_t j = is_kv ? i : i - e->nkv;
        const uint8_t *kinds = is_kv ? p->kv_kinds : p->aux_kinds;
        uint8_t k = kinds ? kinds[j] : KVR_MEM_AUTO;
        uint64_t ptr = is_kv ? e->kv_ptrs[j] : e->aux_ptrs[j];
        const char *what = is_kv ? "kv" : "aux";
        if (k == KVR_MEM_HOST || (k == KVR_MEM_AUTO && !loaded)) {
            continue;
        }
        if (k == KVR_MEM_CUDA && !loaded) {
            return kvr_err(err, errlen, KVR_ESYSTEM,
                           "%s buffer %u is declared 'cuda' but the CUDA runtime is not "
                           "available: %s",
                           what, j, cuda_err);
        }
        int dev = -1;
        char cerr[256];
        int kind = kvr_cuda_pointer_kind((const void *)(uintptr_t)ptr, &dev, cerr, sizeof(cerr));
        if (kind < 0) {
            if (k == KVR_MEM_AUTO) {
                continue; /* the runtime cannot say: treat as host memory */
            }
            return kvr_err(err, errlen, KVR_ESYSTEM, "%s buffer %u: %s", what, j, cerr);
        }
        int is_dev = kind == KVR_CUDA_MEM_DEVICE || (k == KVR_MEM_CUDA && kind == KVR_CUDA_MEM_MANAGED);
        if (k == KVR_MEM_CUDA && !is_dev) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "%s buffer %u is declared 'cuda' but CUDA reports %s memory at "
                           "0x%" PRIx64,
                           what, j, kind == KVR_CUDA_MEM_HOST ? "pinned host" : "host", ptr);
        }
        if (!is_dev) {
            continue;
        }
        if (dev < 0) {
            dev = 0;
        }
        if (e->cuda_device >= 0 && dev != e->cuda_device) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "%s buffer %u is on CUDA device %d, other buffers on device %d: a "
                           "manager's buffers must be on one device",
                           what, j, dev, e->cuda_device);
        }
        e->cuda_device = dev;
        (is_kv ? e->kv_dev : e->aux_dev)[j] = 1;
        e->ndev++;
    }
    return 0;
}

/* Chooses the path and, where device memory may be staged, makes the
 * stream and the pinned pool on the buffers' device. */
static int kvr_gpu_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen)
{
    char cuda_err[256] = "";
    int rc = kvr_gpu_kinds(e, p, cuda_err, sizeof(cuda_err), err, errlen);
    if (rc != 0) {
        return rc;
    }
    char types[128];
    unsigned mask = kvr_tp_memory_types(e->tp, types, sizeof(types));
    if (e->ndev == 0) {
        e->gpu_path = KVR_GPU_HOST;
        snprintf(e->gpu_why, sizeof(e->gpu_why), "every buffer is host memory%s%s",
                 cuda_err[0] ? " (CUDA runtime not loaded: " : "", cuda_err[0] ? cuda_err : "");
        if (cuda_err[0]) {
            size_t n = strlen(e->gpu_why);
            snprintf(e->gpu_why + n, sizeof(e->gpu_why) - n, ")");
        }
        return 0;
    }
    if ((mask & KVR_TP_MEM_CUDA) && !e->cfg.force_staging) {
        e->gpu_path = KVR_GPU_UCX;
        snprintf(e->gpu_why, sizeof(e->gpu_why),
                 "%u device buffer(s) on CUDA device %d; UCX moves cuda memory (memory types: %s)",
                 e->ndev, e->cuda_device, types);
    } else {
        e->gpu_path = KVR_GPU_STAGED;
        snprintf(e->gpu_why, sizeof(e->gpu_why),
                 "%u device buffer(s) on CUDA device %d; %s: staged through %u pinned slots of "
                 "%u bytes",
                 e->ndev, e->cuda_device,
                 (mask & KVR_TP_MEM_CUDA) ? "force_staging is set"
                                          : "this UCX cannot move cuda memory",
                 e->cfg.staging_slots, e->cfg.staging_slot_bytes);
        if (!(mask & KVR_TP_MEM_CUDA)) {
            size_t n = strlen(e->gpu_why);
            snprintf(e->gpu_why + n, sizeof(e->gpu_why) - n, " (UCX memory types: %s)", types);
        }
    }
    int staged_prefill = e->mode == KVR_MODE_PREFILL && e->gpu_path == KVR_GPU_STAGED;
    if (staged_prefill) {
        if (e->cfg.staging_slots == 0) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "staging_slots is 0 but device memory must be staged");
        }
        int kv_dev = 0;
        for (uint32_t i = 0; i < e->nkv; i++) {
            kv_dev |= e->kv_dev[i];
        }
        for (uint32_t i = 0; i < e->nkv + e->naux; i++) {
            int is_kv = i < e->nkv;
            uint32_t j = is_kv ? i : i - e->nkv;
            uint64_t item = is_kv ? e->kv_item[j] : e->aux_item[j];
            /* A staged message holds at least one page (KV messages are cut
             * by the widest KV item) or one aux row. */
            if ((is_kv ? e->kv_item_max : item) > e->cfg.staging_slot_bytes &&
                (is_kv ? kv_dev : e->aux_dev[j])) {
                return kvr_err(err, errlen, KVR_EVALUE,
                               "staging_slot_bytes=%u is smaller than %s_item_lens[%u]=%" PRIu64
                               ": a staged message carries at least one page",
                               e->cfg.staging_slot_bytes, is_kv ? "kv" : "aux", j,
                               is_kv ? e->kv_item_max : item);
            }
        }
    }
    if (!staged_prefill && e->mode == KVR_MODE_PREFILL) {
        return 0; /* UCX reads the device pages itself */
    }
    /* Decode (either path: eager and scattered messages are staged too) or
     * a staging prefill: a stream and the pool on the buffers' device. */
    int prev = -1;
    kvr_cuda_get_device(&prev);
    if (kvr_cuda_set_device(e->cuda_device, err, errlen) != 0 ||
        kvr_cuda_stream_create(&e->stream, err, errlen) != 0) {
        rc = KVR_ESYSTEM;
        goto out;
    }
    e->nslots = e->cfg.staging_slots;
    if (e->nslots > 0) {
        size_t total = (size_t)e->nslots * e->cfg.staging_slot_bytes;
        e->slots = calloc(e->nslots, sizeof(kvr_slot_t));
        e->pool = e->slots ? kvr_cuda_host_alloc(total ? total : 1, err, errlen) : NULL;
        if (e->slots == NULL || e->pool == NULL) {
            if (e->slots == NULL) {
                kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
            }
            rc = e->slots == NULL ? KVR_ENOMEM : KVR_ESYSTEM;
            goto out;
        }
        for (uint32_t i = e->nslots; i-- > 0;) {
            e->slots[i].buf = e->pool + (size_t)i * e->cfg.staging_slot_bytes;
            e->slots[i].next = e->slot_free;
            e->slot_free = &e->slots[i];
        }
        if (staged_prefill && e->cfg.register_memory &&
            kvr_tp_mem_map(e->tp, e->pool, total, err, errlen) != 0) {
            rc = KVR_ESYSTEM;
            goto out;
        }
    }
out:
    if (prev >= 0) {
        kvr_cuda_set_device(prev, NULL, 0);
    }
    return rc;
}

/* After the transport is gone (nothing can write into the pool any more). */
static void kvr_gpu_free(kvr_engine_t *e)
{
    if (e->stream != NULL) {
        kvr_cuda_stream_sync(e->stream, NULL, 0);
    }
    for (uint32_t i = 0; i < e->nevents; i++) {
        kvr_cuda_event_destroy(e->events[i]);
    }
    free(e->events);
    e->events = NULL;
    e->nevents = 0;
    kvr_cuda_host_free(e->pool);
    e->pool = NULL;
    free(e->slots);
    e->slots = NULL;
    kvr_cuda_stream_destroy(e->stream);
    e->stream = NULL;
    free(e->kv_dev);
    free(e->aux_dev);
}

int kvr_engine_gpu_path(kvr_engine_t *e, const char **why)
{
    if (why != NULL) {
        *why = e->gpu_why;
    }
    return e->gpu_path;
}

int kvr_engine_buffer_is_device(kvr_engine_t *e, uint32_t i)
{
    if (i < e->nkv) {
        return e->kv_dev ? e->kv_dev[i] : 0;
    }
    i -= e->nkv;
    return i < e->naux && e->aux_dev ? e->aux_dev[i] : 0;
}

int kvr_engine_create(const kvr_engine_params_t *p, kvr_engine_t **e_p, char *err, size_t errlen)
{
    int rc;
    if (p->mode != KVR_MODE_PREFILL && p->mode != KVR_MODE_DECODE) {
        return kvr_err(err, errlen, KVR_EVALUE, "mode must be 'prefill' or 'decode'");
    }
    if (p->nkv == 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "kv_data_ptrs is empty: at least one KV buffer");
    }
    if (p->nkv > KVR_WIRE_MAX_BUFFERS || p->naux > KVR_WIRE_MAX_BUFFERS) {
        return kvr_err(err, errlen, KVR_EVALUE, "more than %d buffers", KVR_WIRE_MAX_BUFFERS);
    }
    if (p->rank < 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "engine_rank must be >= 0");
    }
    if (p->cfg.deadline_floor_bps == 0 || p->cfg.heartbeat_interval_ms == 0 ||
        p->cfg.heartbeat_timeout_ms == 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "deadline_floor_bps, heartbeat_interval_ms and heartbeat_timeout_ms must "
                       "be > 0");
    }
    kvr_engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    e->mode = p->mode;
    e->rank = p->rank;
    e->cfg = p->cfg;
    e->page_size = p->page_size;
    e->nkv = p->nkv;
    e->naux = p->naux;
    e->wake_fd = -1;
    snprintf(e->host, sizeof(e->host), "%s", p->host ? p->host : "127.0.0.1");
    snprintf(e->bootstrap_addr, sizeof(e->bootstrap_addr), "%s",
             p->bootstrap_addr ? p->bootstrap_addr : "");
    kvr_table_init(&e->rooms);
    kvr_table_init(&e->tags);
    kvr_table_init(&e->pending);
    kvr_wbuf_init(&e->wbuf);
    kvr_registry_init(&e->registry);
    if (kvr_log_init(&e->log) != 0) {
        kvr_registry_destroy(&e->registry);
        free(e);
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&e->lock, NULL);
    while (e->epoch == 0) {
        if (getrandom(&e->epoch, sizeof(e->epoch), 0) != sizeof(e->epoch)) {
            e->epoch = kvr_now_ns() ^ ((uint64_t)getpid() << 32);
        }
    }

    rc = kvr_validate_buffers("kv", p->nkv, p->kv_ptrs, p->kv_lens, p->kv_item_lens,
                              &e->min_pages, &e->page_bytes, err, errlen);
    if (rc == 0) {
        rc = kvr_validate_buffers("aux", p->naux, p->aux_ptrs, p->aux_lens, p->aux_item_lens,
                                  &e->aux_rows, &e->aux_bytes, err, errlen);
    }
    if (rc != 0) {
        goto err_free;
    }
    if (kvr_copy_u64(&e->kv_ptrs, p->kv_ptrs, p->nkv) || kvr_copy_u64(&e->kv_lens, p->kv_lens, p->nkv) ||
        kvr_copy_u64(&e->kv_item, p->kv_item_lens, p->nkv) ||
        kvr_copy_u64(&e->aux_ptrs, p->aux_ptrs, p->naux) ||
        kvr_copy_u64(&e->aux_lens, p->aux_lens, p->naux) ||
        kvr_copy_u64(&e->aux_item, p->aux_item_lens, p->naux) ||
        (e->layout_kv = kvr_le_array(p->kv_item_lens, p->nkv)) == NULL ||
        (e->layout_aux = kvr_le_array(p->aux_item_lens, p->naux)) == NULL) {
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto err_free;
    }
    e->kv_item_max = kvr_u64_max(e->kv_item, e->nkv);
    e->aux_item_max = kvr_u64_max(e->aux_item, e->naux);

    e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->wake_fd < 0) {
        rc = kvr_err(err, errlen, KVR_ESYSTEM, "eventfd: %s", strerror(errno));
        goto err_free;
    }
    kvr_tp_callbacks_t tcb = {e, kvr_on_data, kvr_on_recv_done, kvr_on_send_done, kvr_on_ep_error};
    rc = kvr_tp_create(&tcb, (size_t)e->cfg.pack_bytes, &e->tp, err, errlen);
    if (rc != 0) {
        rc = rc == -2 ? KVR_EVALUE : KVR_ESYSTEM;
        goto err_free;
    }
    rc = kvr_gpu_setup(e, p, err, errlen);
    if (rc != 0) {
        goto err_tp;
    }
    if (e->mode == KVR_MODE_PREFILL && e->cfg.register_memory) {
        for (uint32_t i = 0; i < e->nkv + e->naux; i++) {
            if (e->gpu_path == KVR_GPU_STAGED && kvr_engine_buffer_is_device(e, i)) {
                continue; /* this UCX cannot map device memory; the pool is mapped */
            }
            uint64_t ptr = i < e->nkv ? e->kv_ptrs[i] : e->aux_ptrs[i - e->nkv];
            uint64_t len = i < e->nkv ? e->kv_lens[i] : e->aux_lens[i - e->nkv];
            if (len && kvr_tp_mem_map(e->tp, (void *)(uintptr_t)ptr, len, err, errlen) != 0) {
                rc = KVR_ESYSTEM;
                goto err_tp;
            }
        }
    }
    kvr_ctl_callbacks_t ccb = {e, kvr_on_router_msg_entry, kvr_on_conn_msg_entry,
                               kvr_on_refused_entry};
    /* What our ROUTER may legitimately receive: on a prefill, a ROOM_REQ of
     * the most pages a room can have; on a decode, only a sibling's
     * SIB_FAIL (two strings of at most 1 KiB). */
    int64_t max_msg = e->mode == KVR_MODE_PREFILL
                          ? KVR_WIRE_HEADER_LEN + 28 + (int64_t)KVR_WIRE_MAX_PAGES * 4
                          : 65536;
    max_msg += e->cfg.secret_len ? KVR_AUTH_TRAILER_LEN : 0;
    if (kvr_ctl_create(e->host, e->cfg.ctrl_port, max_msg, e->cfg.secret, e->cfg.secret_len,
                       e->epoch, &ccb, &e->ctl, err, errlen) != 0) {
        rc = KVR_ESYSTEM;
        goto err_tp;
    }
    if (e->mode == KVR_MODE_PREFILL) {
        char ep[192];
        if (e->bootstrap_addr[0] == '\0') {
            rc = kvr_err(err, errlen, KVR_EVALUE, "bootstrap_addr is required for a prefill manager");
            goto err_ctl;
        }
        snprintf(ep, sizeof(ep), "tcp://%s", e->bootstrap_addr);
        if (kvr_ctl_connect(e->ctl, ep, NULL, 0, NULL, &e->bs_conn, err, errlen) != 0) {
            rc = KVR_EVALUE;
            goto err_ctl;
        }
    }
    if (pthread_create(&e->thread, NULL, kvr_engine_main, e) != 0) {
        rc = kvr_err(err, errlen, KVR_ESYSTEM, "pthread_create failed");
        goto err_ctl;
    }
    e->thread_started = 1;
    snprintf(e->endpoint, sizeof(e->endpoint), "%s", kvr_ctl_endpoint(e->ctl));
    snprintf(e->transport, sizeof(e->transport), "%s", kvr_tp_describe(e->tp));
    /* "kvr-prefill0" / "kvr-decode1": what top -H and perf show. */
    char tname[16];
    snprintf(tname, sizeof(tname), "kvr-%s%d", kvr_side(e), e->rank % 1000);
    pthread_setname_np(e->thread, tname);
    *e_p = e;
    return 0;

err_ctl:
    kvr_ctl_destroy(e->ctl);
    e->ctl = NULL;
err_tp:
    kvr_tp_destroy(e->tp);
    e->tp = NULL;
err_free:
    e->closed = 1;
    kvr_engine_free(e);
    return rc;
}

void kvr_engine_close(kvr_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    if (e->closed) {
        pthread_mutex_unlock(&e->lock);
        return;
    }
    __atomic_store_n(&e->closed, 1, __ATOMIC_RELEASE);
    e->stopping = 1;
    pthread_mutex_unlock(&e->lock);
    kvr_wake(e);
    if (e->thread_started) {
        pthread_join(e->thread, NULL);
        e->thread_started = 0;
    }
    pthread_mutex_lock(&e->lock);
    if (e->ctl != NULL && e->tp != NULL) {
        kvr_reap_locked(e);
    }
    if (e->bs_conn) {
        kvr_ctl_conn_close(e->ctl, e->bs_conn);
        e->bs_conn = NULL;
    }
    /* Operations that never completed cannot complete any more: their rooms
     * are drained by fiat now that the worker is going away. */
    for (size_t i = 0; i < e->tags.capacity; i++) {
        kvr_room_t *r = e->tags.slots[i].value;
        if (r) {
            r->inflight = 0;
            kvr_room_fail(r, KVR_ABORTED);
            kvr_room_settle(r);
        }
    }
    for (int i = 0; i < e->nsib_conns; i++) {
        kvr_ctl_conn_close(e->ctl, e->sib_conns[i]);
    }
    e->nsib_conns = 0;
    kvr_ctl_destroy(e->ctl);
    e->ctl = NULL;
    kvr_tp_destroy(e->tp);
    e->tp = NULL;
    /* Drop the table's references; handles keep theirs. */
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r) {
            r->in_table = 0;
        }
    }
    kvr_table_t rooms = e->rooms;
    kvr_table_init(&e->rooms);
    for (size_t i = 0; i < rooms.capacity; i++) {
        if (rooms.slots[i].value) {
            kvr_room_unref_locked(e, rooms.slots[i].value);
        }
    }
    kvr_table_destroy(&rooms);
    while (e->work_head) {
        kvr_room_t *r = e->work_head;
        e->work_head = r->work_next;
        r->on_work = 0;
        kvr_room_unref_locked(e, r);
    }
    pthread_mutex_unlock(&e->lock);
    kvr_log_close(&e->log);
}

int kvr_engine_log_read(kvr_engine_t *e, int *levels, char (*texts)[KVR_ENGINE_LOG_TEXT], int max,
                        int timeout_ms)
{
    kvr_log_rec_t recs[16];
    if (max > 16) {
        max = 16;
    }
    int n = kvr_log_read(&e->log, recs, max, timeout_ms);
    for (int i = 0; i < n; i++) {
        levels[i] = recs[i].level;
        memcpy(texts[i], recs[i].text, KVR_ENGINE_LOG_TEXT);
    }
    return n;
}

void kvr_engine_free(kvr_engine_t *e)
{
    if (e == NULL) {
        return;
    }
    if (!e->closed) {
        kvr_engine_close(e);
    }
    for (size_t i = 0; i < e->pending.capacity; i++) {
        if (e->pending.slots[i].value) {
            kvr_pending_free(e, e->pending.slots[i].value);
        }
    }
    kvr_table_destroy(&e->pending);
    /* Rooms still referenced by operations that never completed. */
    for (size_t i = 0; i < e->tags.capacity; i++) {
        kvr_room_t *r = e->tags.slots[i].value;
        if (r) {
            kvr_room_free(r);
        }
    }
    kvr_table_destroy(&e->tags);
    kvr_table_destroy(&e->rooms);
    while (e->peers) {
        kvr_peer_t *p = e->peers;
        e->peers = p->next;
        free(p->worker_addr);
        free(p);
    }
    if (e->wake_fd >= 0) {
        close(e->wake_fd);
    }
    for (int i = 0; i < e->nsib; i++) {
        free(e->sib_eps[i]);
    }
    free(e->sib_eps);
    free(e->sib_conns);
    while (e->sib_out) {
        kvr_sib_out_t *o = e->sib_out;
        e->sib_out = o->next;
        free(o);
    }
    kvr_gpu_free(e);
    kvr_wbuf_free(&e->wbuf);
    kvr_registry_destroy(&e->registry);
    kvr_log_destroy(&e->log);
    pthread_mutex_destroy(&e->lock);
    free(e->kv_ptrs);
    free(e->kv_lens);
    free(e->kv_item);
    free(e->aux_ptrs);
    free(e->aux_lens);
    free(e->aux_item);
    free(e->layout_kv);
    free(e->layout_aux);
    free(e);
}

int kvr_engine_closed(kvr_engine_t *e)
{
    /* Without the lock: close() holds it while endpoints drain. */
    return __atomic_load_n(&e->closed, __ATOMIC_ACQUIRE);
}

const char *kvr_engine_endpoint(kvr_engine_t *e)
{
    return e->endpoint;
}

uint64_t kvr_engine_epoch(kvr_engine_t *e)
{
    return e->epoch;
}

const char *kvr_engine_transport(kvr_engine_t *e)
{
    return e->transport;
}

void kvr_engine_stats(kvr_engine_t *e, kvr_stats_t *s)
{
    pthread_mutex_lock(&e->lock);
    *s = e->stats;
    memset(s->rooms_by_state, 0, sizeof(s->rooms_by_state));
    s->rooms_open = 0;
    s->rooms_draining = 0;
    for (size_t i = 0; i < e->rooms.capacity; i++) {
        kvr_room_t *r = e->rooms.slots[i].value;
        if (r) {
            s->rooms_open++;
            s->rooms_by_state[atomic_load(&r->visible)]++;
        }
    }
    for (size_t i = 0; i < e->tags.capacity; i++) {
        kvr_room_t *r = e->tags.slots[i].value;
        if (r && r->failing && r->inflight > 0) {
            s->rooms_draining++;
        }
    }
    s->pending_requests = e->pending.count;
    if (e->tp != NULL) {
        s->data_packed = kvr_tp_packed(e->tp);
        s->pack_cached_bytes = kvr_tp_pack_cached(e->tp);
        s->ucx_workers = kvr_tp_nworkers(e->tp, &s->ucx_workers_created);
    }
    pthread_mutex_unlock(&e->lock);
    s->log_dropped = kvr_log_dropped(&e->log);
}

/* ------------------------------------------------------------------ */
/* Handles (the binding's view of a room)                              */
/* ------------------------------------------------------------------ */

static kvr_engine_t *kvr_handle_engine(kvr_handle_t *h)
{
    return h->owner;
}

/* Takes the lock and checks that the handle is usable. */
static int kvr_handle_enter(kvr_handle_t *h, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    pthread_mutex_lock(&e->lock);
    if (e->closed) {
        pthread_mutex_unlock(&e->lock);
        return kvr_err(err, errlen, KVR_ERUNTIME, "the manager is closed");
    }
    if (!h->in_table) {
        pthread_mutex_unlock(&e->lock);
        return kvr_err(err, errlen, KVR_ERUNTIME, "room %" PRIu64 " was cleared", h->id);
    }
    return 0;
}

int kvr_handle_open(kvr_engine_t *e, uint64_t room, const char *bootstrap_addr,
                    kvr_handle_t **h_p, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->lock);
    int rc = 0;
    if (e->closed) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "the manager is closed");
        goto out;
    }
    if (kvr_table_get(&e->rooms, room) != NULL) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "bootstrap_room %" PRIu64 " is already in use on this manager", room);
        goto out;
    }
    if (e->rooms.count >= e->cfg.max_rooms) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "too many open rooms (max_rooms=%u)",
                     e->cfg.max_rooms);
        goto out;
    }
    kvr_room_t *r = kvr_room_new(room, kvr_new_tag_locked(e),
                                 e->mode == KVR_MODE_PREFILL ? KVR_ROLE_PREFILL : KVR_ROLE_DECODE);
    if (r == NULL) {
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto out;
    }
    r->owner = e;
    snprintf(r->bootstrap_addr, sizeof(r->bootstrap_addr), "%s",
             bootstrap_addr ? bootstrap_addr : "");
    if (kvr_table_put(&e->rooms, room, r) != 0 || kvr_table_put(&e->tags, r->tag, r) != 0) {
        kvr_table_remove(&e->rooms, room);
        kvr_room_free(r);
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto out;
    }
    r->in_table = 1;
    r->refs = 2; /* table + handle */
    kvr_failure_t prior;
    if (kvr_registry_pop_early(&e->registry, room, &prior) &&
        (prior.from_sibling || prior.from_remote) &&
        kvr_now_ns() - prior.time_ns < e->cfg.bootstrap_timeout_ms * KVR_MS) {
        /* A sibling or the peer failed this room before this rank opened it. */
        kvr_room_fail_locked(e, r, &prior, 0);
    }
    if (e->mode == KVR_MODE_PREFILL) {
        /* Wait for the decode's request, within the bootstrap timeout. */
        r->started_ns = kvr_now_ns();
        r->deadline_ns = r->started_ns + e->cfg.bootstrap_timeout_ms * KVR_MS;
        kvr_pending_t *pd = kvr_table_remove(&e->pending, room);
        if (pd != NULL) {
            if (pd->peer != NULL && pd->peer->state == KVR_PEER_READY) {
                r->prefix_len = pd->prefix_len;
                kvr_bind_request_locked(e, r, pd->peer, pd->tag, pd->aux_index, pd->npages,
                                        pd->pages);
                pd->pages = NULL;
            }
            kvr_pending_free(e, pd);
        }
    }
    *h_p = r;
out:
    pthread_mutex_unlock(&e->lock);
    return rc;
}

static void kvr_handle_drop_locked(kvr_engine_t *e, kvr_room_t *r, const char *why)
{
    if (!r->in_table) {
        return;
    }
    if (!kvr_room_terminal(r) && !r->failing) {
        kvr_room_failf_locked(e, r, KVR_ABORTED, 1, "%s", why);
    }
    kvr_table_remove(&e->rooms, r->id);
    r->in_table = 0;
    if (r->peer_counted && r->peer != NULL && r->peer->nrooms > 0) {
        r->peer->nrooms--;
    }
    r->peer_counted = 0;
    kvr_registry_drop(&e->registry, r->id);
    kvr_work_push_locked(e, r);
    kvr_room_unref_locked(e, r);
}

void kvr_handle_release(kvr_handle_t *h)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    pthread_mutex_lock(&e->lock);
    if (!e->closed) {
        kvr_handle_drop_locked(e, h, "the room's handle was released while in flight");
    }
    h->released = 1;
    kvr_room_unref_locked(e, h);
    int wake = !e->closed;
    pthread_mutex_unlock(&e->lock);
    if (wake) {
        kvr_wake(e);
    }
}

int kvr_handle_recv_init(kvr_handle_t *h, int prefill_dp_rank, const char *bootstrap_addr,
                         char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    int rc = kvr_handle_enter(h, err, errlen);
    if (rc) {
        return rc;
    }
    /* The caller names the rendezvous of the prefill DP group the decode
     * asked for (bootstrap_addr); one rendezvous serves one DP group. */
    (void)prefill_dp_rank;
    if (h->init_called) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "init() was already called for room %" PRIu64,
                     h->id);
        goto out;
    }
    if (bootstrap_addr != NULL && bootstrap_addr[0] != '\0') {
        if (strlen(bootstrap_addr) >= sizeof(h->bootstrap_addr)) {
            rc = kvr_err(err, errlen, KVR_EVALUE, "bootstrap_addr '%.64s...' is too long",
                         bootstrap_addr);
            goto out;
        }
        snprintf(h->bootstrap_addr, sizeof(h->bootstrap_addr), "%s", bootstrap_addr);
    }
    if (h->bootstrap_addr[0] == '\0' || strchr(h->bootstrap_addr, ':') == NULL) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "bootstrap_addr '%s' is not host:port",
                     h->bootstrap_addr);
        goto out;
    }
    h->init_called = 1;
    if (h->failing) {
        goto out;
    }
    kvr_peer_t *p = kvr_peer_find(e, KVR_PEER_IS_PREFILL, h->bootstrap_addr);
    if (p == NULL) {
        p = kvr_peer_new(e, KVR_PEER_IS_PREFILL, h->bootstrap_addr);
        if (p == NULL) {
            rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
            goto out;
        }
        p->state = KVR_PEER_FAILED; /* the engine thread resolves it */
    }
    h->peer = p;
    kvr_work_push_locked(e, h);
out:
    pthread_mutex_unlock(&e->lock);
    if (rc == 0) {
        kvr_wake(e);
    }
    return rc;
}

int kvr_handle_send_metadata(kvr_handle_t *h, const int32_t *pages, size_t n, int64_t aux_index,
                             uint32_t prefix_len, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    int rc = kvr_handle_enter(h, err, errlen);
    if (rc) {
        return rc;
    }
    if (!h->init_called) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "call init() before send_metadata()");
        goto out;
    }
    if (h->meta_set) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME,
                     "send_metadata() was already called for room %" PRIu64, h->id);
        goto out;
    }
    long bad = kvr_pages_check(pages, n, e->min_pages);
    if (bad >= 0) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "kv_indices[%ld]=%d is outside the registered pages [0, %" PRId64 ")", bad,
                     pages[bad], e->min_pages);
        goto out;
    }
    if (n > KVR_WIRE_MAX_PAGES) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "kv_indices has %zu pages, more than %u", n,
                     KVR_WIRE_MAX_PAGES);
        goto out;
    }
    if (aux_index >= 0 && e->naux == 0) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "aux_index=%" PRId64 " but no aux buffers are registered",
                     aux_index);
        goto out;
    }
    if (aux_index >= 0 && aux_index >= e->aux_rows) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "aux_index=%" PRId64 " is outside the registered aux rows [0, %" PRId64 ")",
                     aux_index, e->aux_rows);
        goto out;
    }
    if (n == 0 && (aux_index < 0 || e->naux == 0)) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "kv_indices is empty and there is no aux row: nothing to transfer");
        goto out;
    }
    if (h->failing || kvr_room_terminal(h)) {
        goto out; /* the failure is reported by poll() */
    }
    if (n) {
        h->pages = malloc(n * sizeof(int32_t));
        if (h->pages == NULL) {
            rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
            goto out;
        }
        memcpy(h->pages, pages, n * sizeof(int32_t));
    }
    h->npages = (uint32_t)n;
    h->aux_index = aux_index;
    h->prefix_len = prefix_len;
    h->expected = (uint64_t)n * e->page_bytes + (aux_index >= 0 ? e->aux_bytes : 0);
    h->meta_set = 1;
    kvr_work_push_locked(e, h);
out:
    pthread_mutex_unlock(&e->lock);
    if (rc == 0) {
        kvr_wake(e);
    }
    return rc;
}

int kvr_handle_send_init(kvr_handle_t *h, int64_t num_pages, int64_t aux_index, char *err,
                         size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    int rc = kvr_handle_enter(h, err, errlen);
    if (rc) {
        return rc;
    }
    if (h->inited) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "init() was already called for room %" PRIu64,
                     h->id);
        goto out;
    }
    if (num_pages < 0 || num_pages > (int64_t)KVR_WIRE_MAX_PAGES) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "num_kv_indices=%" PRId64 " must be in [0, %u]",
                     num_pages, KVR_WIRE_MAX_PAGES);
        goto out;
    }
    if (aux_index >= 0 && (e->naux == 0 || aux_index >= e->aux_rows)) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "aux_index=%" PRId64 " is outside the registered aux rows [0, %" PRId64 ")",
                     aux_index, e->aux_rows);
        goto out;
    }
    h->src_pages = malloc((size_t)(num_pages ? num_pages : 1) * sizeof(int32_t));
    if (h->src_pages == NULL) {
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto out;
    }
    h->inited = 1;
    h->total_pages = (uint32_t)num_pages;
    h->src_aux = aux_index;
    if (num_pages == 0) {
        h->ready_ns = kvr_now_ns();
    }
    if (h->bound && h->ndst != h->total_pages && !h->failing) {
        kvr_room_failf_locked(e, h, KVR_LAYOUT_MISMATCH, 1,
                              "decode asked for %u pages, prefill announced %u", h->ndst,
                              h->total_pages);
    }
    /* A room of no pages is complete at init: its aux row may go now. */
    kvr_work_push_locked(e, h);
out:
    pthread_mutex_unlock(&e->lock);
    if (rc == 0) {
        kvr_wake(e);
    }
    return rc;
}

int kvr_handle_send(kvr_handle_t *h, const int32_t *pages, size_t n, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    int wake = 0;
    int rc = kvr_handle_enter(h, err, errlen);
    if (rc) {
        return rc;
    }
    if (!h->inited) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "call init() before send()");
        goto out;
    }
    if (n > (size_t)(h->total_pages - h->given)) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "send() of %zu kv_indices overruns num_kv_indices=%u (%u already sent)", n,
                     h->total_pages, h->given);
        goto out;
    }
    long bad = kvr_pages_check(pages, n, e->min_pages);
    if (bad >= 0) {
        rc = kvr_err(err, errlen, KVR_EVALUE,
                     "kv_indices[%ld]=%d is outside the registered pages [0, %" PRId64 ")", bad,
                     pages[bad], e->min_pages);
        goto out;
    }
    if (h->failing || kvr_room_terminal(h)) {
        goto out; /* poll() reports the failure */
    }
    if (n) {
        memcpy(h->src_pages + h->given, pages, n * sizeof(int32_t));
    }
    h->given += (uint32_t)n;
    if (h->given == h->total_pages && n) {
        h->ready_ns = kvr_now_ns();
    }
    wake = 1;
    if (h->bound && !h->on_work && h->peer != NULL && h->peer->state == KVR_PEER_READY) {
        /* Post from the caller's thread: the worker is serialized by the
         * engine lock, and a message that leaves at once (eager) then needs
         * no hand-off to the engine thread.  Only what needs progress or a
         * socket (rendezvous in flight, a notice, a sibling message) wakes
         * it. */
        kvr_post_locked(e, h);
        kvr_check_prefill_done_locked(e, h);
        wake = h->inflight > 0 || e->work_head != NULL || e->sib_pending;
    } else {
        kvr_work_push_locked(e, h);
    }
out:
    pthread_mutex_unlock(&e->lock);
    if (rc == 0 && wake) {
        kvr_wake(e);
    }
    return rc;
}

uint32_t kvr_handle_prefix_len(kvr_handle_t *h)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    pthread_mutex_lock(&e->lock);
    uint32_t n = h->prefix_len; /* prefill: set when the request is bound */
    pthread_mutex_unlock(&e->lock);
    return n;
}

int kvr_handle_poll(kvr_handle_t *h)
{
    int v = atomic_load_explicit(&h->visible, memory_order_acquire);
    if (v != KVR_POLL_WAITING && v != KVR_POLL_TRANSFERRING) {
        return v;
    }
    kvr_engine_t *e = kvr_handle_engine(h);
    if (e->mode != KVR_MODE_DECODE || !e->cfg.poll_progress) {
        return v;
    }
    /*
     * A decode room waiting for data: progress UCX here, at most every
     * KVR_POLL_PROGRESS_NS and only if the engine lock is free, so a
     * scheduler polling its rooms takes their last bytes itself instead of
     * waiting for the engine thread to be woken and scheduled (most of a
     * one-page room's latency on a busy host).  What needs a socket is left
     * to the engine thread (off_thread), which is woken if anything
     * happened.
     */
    uint64_t now = kvr_now_ns();
    uint64_t last = atomic_load_explicit(&e->poll_progress_ns, memory_order_relaxed);
    if (now - last < KVR_POLL_PROGRESS_NS || pthread_mutex_trylock(&e->lock) != 0) {
        return v;
    }
    atomic_store_explicit(&e->poll_progress_ns, now, memory_order_relaxed);
    int wake = 0;
    if (!e->stopping && e->tp != NULL && e->ndev == 0) {
        e->off_thread = 1;
        unsigned n = kvr_tp_progress(e->tp);
        e->off_thread = 0;
        e->stats.poll_progressed += n;
        wake = n > 0;
        wake |= e->work_head != NULL || e->ep_err_pending;
    }
    pthread_mutex_unlock(&e->lock);
    if (wake) {
        kvr_wake(e);
    }
    return atomic_load_explicit(&h->visible, memory_order_acquire);
}

int kvr_handle_failure(kvr_handle_t *h, kvr_failure_t *out, int pop, uint32_t wait_ms)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    uint64_t deadline = kvr_now_ns() + wait_ms * KVR_MS;
    for (;;) {
        int found = pop ? kvr_registry_pop(&e->registry, h->id, out)
                        : kvr_registry_peek(&e->registry, h->id, out);
        if (found || kvr_now_ns() >= deadline) {
            return found;
        }
        struct timespec ts = {0, 500000};
        nanosleep(&ts, NULL);
    }
}

uint32_t kvr_handle_sibling_wait_ms(kvr_handle_t *h)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    pthread_mutex_lock(&e->lock);
    uint32_t w = e->nsib > 0 ? e->cfg.sibling_wait_ms : 0;
    pthread_mutex_unlock(&e->lock);
    return w;
}

int kvr_engine_set_siblings(kvr_engine_t *e, const char *const *endpoints, int n, char *err,
                            size_t errlen)
{
    char **eps = calloc(n > 0 ? (size_t)n : 1, sizeof(char *));
    if (eps == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        const char *hp = endpoints[i] + 6;
        const char *colon = strncmp(endpoints[i], "tcp://", 6) == 0 ? strrchr(hp, ':') : NULL;
        int ok = colon != NULL && colon > hp && colon[1] != '\0' &&
                 strspn(colon + 1, "0123456789") == strlen(colon + 1) && atoi(colon + 1) > 0 &&
                 atoi(colon + 1) < 65536 && strlen(colon + 1) <= 5;
        if (!ok) {
            for (int j = 0; j < i; j++) {
                free(eps[j]);
            }
            free(eps);
            return kvr_err(err, errlen, KVR_EVALUE, "sibling endpoint '%s' is not tcp://host:port",
                           endpoints[i]);
        }
        eps[i] = strdup(endpoints[i]);
    }
    pthread_mutex_lock(&e->lock);
    if (e->closed) {
        pthread_mutex_unlock(&e->lock);
        for (int i = 0; i < n; i++) {
            free(eps[i]);
        }
        free(eps);
        return kvr_err(err, errlen, KVR_ERUNTIME, "the manager is closed");
    }
    for (int i = 0; i < e->nsib; i++) {
        free(e->sib_eps[i]);
    }
    free(e->sib_eps);
    e->sib_eps = eps;
    e->nsib = n;
    e->sib_dirty = 1;
    pthread_mutex_unlock(&e->lock);
    kvr_wake(e);
    return 0;
}


int kvr_handle_abort(kvr_handle_t *h, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    pthread_mutex_lock(&e->lock);
    if (!e->closed && h->in_table && !kvr_room_terminal(h) && !h->failing) {
        kvr_room_failf_locked(e, h, KVR_ABORTED, 1, "aborted by %s rank %d", kvr_side(e),
                              e->rank);
        kvr_work_push_locked(e, h);
    }
    pthread_mutex_unlock(&e->lock);
    (void)err;
    (void)errlen;
    kvr_wake(e);
    return 0;
}

int kvr_handle_clear(kvr_handle_t *h, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    (void)err;
    (void)errlen;
    pthread_mutex_lock(&e->lock);
    if (!e->closed) {
        kvr_handle_drop_locked(e, h, "cleared while in flight");
    }
    pthread_mutex_unlock(&e->lock);
    kvr_wake(e);
    return 0;
}

void kvr_engine_test_corrupt(kvr_engine_t *e, int mode)
{
    pthread_mutex_lock(&e->lock);
    e->test_corrupt = mode;
    pthread_mutex_unlock(&e->lock);
}

int kvr_handle_role(kvr_handle_t *h)
{
    return h->role == KVR_ROLE_DECODE ? KVR_MODE_DECODE : KVR_MODE_PREFILL;
}
