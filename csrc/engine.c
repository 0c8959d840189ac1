/*
 * engine: the manager's lifecycle and its progress thread.  Create checks
 * the parameters, opens the transport, the device path and the control
 * plane, and starts the thread; the loop drains the work list, progresses
 * UCX, runs the timers and sleeps in the socket poll; close stops it and
 * fails what is open.  The small helpers every part uses live here too.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "engine_int.h"
#include "lanelisten.h"
#include "readers.h"
#include "testhook.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

void kvr_warn_limited(kvr_engine_t *e, kvr_ratelog_t *rl, const char *fmt, ...)
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
uint64_t kvr_new_tag_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
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
    cfg->ctrl_queue_bytes = (uint64_t)64 << 20;
    cfg->poll_progress = 1;
    cfg->secret_len = 0;
    cfg->staging_slots = 8;
    cfg->staging_slot_bytes = 4u << 20;
    cfg->force_staging = 0;
    cfg->cross_memory_bytes = KVR_CMA_DEFAULT_BYTES; /* both sides must have it */
    cfg->cross_memory_readers = KVR_CMA_DEFAULT_READERS;
    cfg->tcp_lane = 1;                               /* both sides must have it */
    /* Reno: no pacing timer (bbr, where no fq qdisc paces for it, releases
     * the lane's segments from a timer: up to 1.46x slower and 1.26x the CPU
     * per GB, benchmarks/README.md), and every host lets any process use it. */
    snprintf(cfg->lane_congestion, sizeof(cfg->lane_congestion), "reno");
}

int kvr_err(char *err, size_t errlen, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

void kvr_engine_ident(const kvr_engine_t *e, unsigned char ident[KVR_ENGINE_IDENT_LEN])
{
    memcpy(ident, &e->epoch, 8);
    memcpy(ident + 8, &e->rank, 4);
}

uint64_t kvr_deadline_ns(const kvr_engine_t *e, uint64_t start_ns, uint64_t bytes)
{
    return start_ns + e->cfg.deadline_base_ms * KVR_MS + kvr_floor_ns(e, bytes);
}

uint64_t kvr_floor_ns(const kvr_engine_t *e, uint64_t bytes)
{
    return (uint64_t)((double)bytes * 1e9 / (double)e->cfg.deadline_floor_bps);
}

void kvr_engine_lock(kvr_engine_t *e)
{
    if (pthread_mutex_trylock(&e->lock) != 0) {
        atomic_fetch_add_explicit(&e->lock_waiters, 1, memory_order_relaxed);
        pthread_mutex_lock(&e->lock);
        atomic_fetch_sub_explicit(&e->lock_waiters, 1, memory_order_relaxed);
    }
#ifdef KVRECV_DEBUG
    e->lock_owner = pthread_self();
    e->lock_held = 1;
#endif
}

int kvr_engine_trylock(kvr_engine_t *e)
{
    if (pthread_mutex_trylock(&e->lock) != 0) {
        return -1;
    }
#ifdef KVRECV_DEBUG
    e->lock_owner = pthread_self();
    e->lock_held = 1;
#endif
    return 0;
}

void kvr_engine_unlock(kvr_engine_t *e)
{
#ifdef KVRECV_DEBUG
    KVR_ASSERT_LOCKED(e);
    e->lock_held = 0;
#endif
    pthread_mutex_unlock(&e->lock);
}

void kvr_wake(kvr_engine_t *e)
{
    uint64_t one = 1;
    ssize_t n = write(e->wake_fd, &one, sizeof(one));
    (void)n; /* an eventfd at its limit is already readable */
}

const char *kvr_side(const kvr_engine_t *e)
{
    return e->mode == KVR_MODE_PREFILL ? "prefill" : "decode";
}

static void kvr_shutdown_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    /* Fail what is still open, tell the peers, then close endpoints (force:
     * outstanding operations complete with an error and the rooms drain). */
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->rooms, &it, NULL)) != NULL;) {
        if (r && !kvr_room_terminal(r)) {
            kvr_room_failf_locked(e, r, KVR_ABORTED, 1, "%s manager rank %d closed",
                                  kvr_side(e), e->rank);
        }
    }
    kvr_msg_t bye = kvr_msg_rank(KVR_MSG_BYE, (uint32_t)e->rank);
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
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->rooms, &it, NULL)) != NULL;) {
        if (r) {
            kvr_room_settle(r);
        }
    }
}

/*
 * A mutex does not queue: a busy engine thread that releases the lock
 * between passes takes it back before a blocked API call is scheduled, so
 * send() of the next room could wait out the whole transfer of the one
 * before (10-16 ms at 64 MiB rooms over a tcp lane).  Between passes the
 * thread lets the blocked callers in first; not for longer than
 * KVR_LOCK_HANDOFF_NS, for a caller not scheduled yet.
 */
static void kvr_engine_let_waiters_in(kvr_engine_t *e)
{
    uint64_t until = 0;
    while (atomic_load_explicit(&e->lock_waiters, memory_order_relaxed) > 0) {
        uint64_t now = kvr_now_ns();
        if (until == 0) {
            until = now + KVR_LOCK_HANDOFF_NS;
        } else if (now >= until) {
            break;
        }
        sched_yield();
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
    kvr_engine_lock(e);
    for (;;) {
        if (e->stopping) {
            break;
        }
        kvr_tp_lane_budget(e->tp, KVR_LANE_INLINE_BYTES);
        kvr_drain_work_locked(e);
        kvr_timer_silences_locked(e);
        kvr_tp_progress(e->tp);
        if (e->ep_err_pending) {
            kvr_ep_errors_locked(e);
        }
        kvr_stage_poll_locked(e);
        kvr_cma_poll_locked(e);
        kvr_timers_locked(e);
        kvr_drain_work_locked(e);
        if (e->sib_dirty || e->sib_pending) {
            kvr_siblings_locked(e);
        }
        kvr_reap_locked(e);
        unsigned progressed =
            kvr_tp_progress(e->tp) + kvr_stage_poll_locked(e) + kvr_cma_poll_locked(e);
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
            kvr_engine_unlock(e);
            kvr_engine_let_waiters_in(e);
            if (nap) {
                struct timespec ts = {0, KVR_STAGE_NAP_NS};
                nanosleep(&ts, NULL);
            }
            if (now - last_sock_poll_ns >= KVR_BUSY_POLL_NS) {
                last_sock_poll_ns = now;
                kvr_ctl_poll(e->ctl, fds, 2, ready, 0);
            }
            kvr_engine_lock(e);
            continue;
        }
        kvr_engine_unlock(e);
        last_sock_poll_ns = kvr_now_ns();
        /* The callbacks of kvr_ctl_poll run without the lock; they take it. */
        kvr_ctl_poll(e->ctl, fds, 2, ready, tick_ms);
        kvr_engine_lock(e);
        if (ready[0]) {
            uint64_t v;
            ssize_t n = read(e->wake_fd, &v, sizeof(v));
            (void)n;
        }
    }
    kvr_shutdown_locked(e);
    kvr_engine_unlock(e);
    return NULL;
}

/* The control callbacks run inside kvr_ctl_poll, which the thread calls
 * without the lock: these wrappers take it. */
static void kvr_on_router_msg_entry(void *arg, const void *ident, size_t ident_len,
                                    const void *data, size_t len)
{
    kvr_engine_t *e = arg;
    kvr_engine_lock(e);
    kvr_on_router_msg(e, ident, ident_len, data, len);
    kvr_engine_unlock(e);
}

static void kvr_on_conn_msg_entry(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx,
                                  const void *data, size_t len)
{
    kvr_engine_t *e = arg;
    kvr_engine_lock(e);
    kvr_on_conn_msg(e, conn, conn_ctx, data, len);
    kvr_engine_unlock(e);
}

static void kvr_on_refused_entry(void *arg, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
                                 const void *ident, size_t ident_len, const char *from,
                                 size_t len, const char *why)
{
    kvr_engine_t *e = arg;
    kvr_engine_lock(e);
    kvr_on_refused(e, kind, conn, conn_ctx, ident, ident_len, from, len, why);
    kvr_engine_unlock(e);
}

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

/* The checks of the parameters that need no engine yet. */
static int kvr_engine_check_params(const kvr_engine_params_t *p, char *err, size_t errlen)
{
    if (p->mode != KVR_MODE_PREFILL && p->mode != KVR_MODE_DECODE) {
        return kvr_err(err, errlen, KVR_EVALUE, "mode must be 'prefill' or 'decode'");
    }
    if (p->nkv == 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "kv_data_ptrs is empty: at least one KV buffer");
    }
    if (p->nstate > p->naux) {
        return kvr_err(err, errlen, KVR_EVALUE, "%u state buffers among %u row buffers",
                       p->nstate, p->naux);
    }
    if (p->nkv > KVR_WIRE_MAX_BUFFERS || p->naux > KVR_WIRE_MAX_BUFFERS) {
        return kvr_err(err, errlen, KVR_EVALUE, "more than %d buffers", KVR_WIRE_MAX_BUFFERS);
    }
    if (p->rank < 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "engine_rank must be >= 0");
    }
    if (p->dp_rank > KVR_WIRE_MAX_DP_PP) {
        return kvr_err(err, errlen, KVR_EVALUE, "attn_dp_rank=%u is above %d", p->dp_rank,
                       KVR_WIRE_MAX_DP_PP);
    }
    if (p->mode == KVR_MODE_DECODE && p->num_layers && (p->pp_size > 1 || p->start_layer)) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "pp_size=%u, start_layer=%u on a decode: a decode split into pipeline "
                       "stages is not supported",
                       p->pp_size, p->start_layer);
    }
    if (p->num_layers) {
        char why[256];
        kvr_layers_t l = {p->pp_size, p->pp_rank, p->start_layer, p->num_layers, p->nkv};
        const char *side = p->mode == KVR_MODE_PREFILL ? "prefill" : "decode";
        if (kvr_layers_check(&l, side, why, sizeof(why)) != 0 ||
            p->pp_size > KVR_WIRE_MAX_DP_PP) {
            return kvr_err(err, errlen, KVR_EVALUE, "%s",
                           p->pp_size > KVR_WIRE_MAX_DP_PP ? "pp_size is above 65535" : why);
        }
    }
    if (p->cfg.cross_memory_readers < 1 || p->cfg.cross_memory_readers > KVR_READERS_MAX) {
        return kvr_err(err, errlen, KVR_EVALUE, "cross_memory_readers=%u is not in 1-%d",
                       p->cfg.cross_memory_readers, KVR_READERS_MAX);
    }
    if (p->cfg.lane_congestion[0] != '\0' &&
        kvr_lane_congestion_check(p->cfg.lane_congestion, err, errlen) != 0) {
        return KVR_EVALUE;
    }
    if (p->cfg.deadline_floor_bps == 0 || p->cfg.heartbeat_interval_ms == 0 ||
        p->cfg.heartbeat_timeout_ms == 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "deadline_floor_bps, heartbeat_interval_ms and heartbeat_timeout_ms must "
                       "be > 0");
    }
    return 0;
}

/* Checks the buffers and keeps copies of their description. */
static int kvr_engine_copy_buffers(kvr_engine_t *e, const kvr_engine_params_t *p, char *err,
                                   size_t errlen)
{
    int rc = kvr_validate_buffers("kv", p->nkv, p->kv_ptrs, p->kv_lens, p->kv_item_lens,
                                  &e->min_pages, &e->page_bytes, err, errlen);
    uint32_t plain = p->naux - p->nstate; /* aux buffers before the state buffers */
    if (rc == 0) {
        rc = kvr_validate_buffers("aux", plain, p->aux_ptrs, p->aux_lens, p->aux_item_lens,
                                  &e->aux_rows, &e->aux_bytes, err, errlen);
    }
    if (rc == 0) {
        int64_t rows;
        uint64_t bytes;
        rc = kvr_validate_buffers("state", p->nstate, p->aux_ptrs + plain, p->aux_lens + plain,
                                  p->aux_item_lens + plain, &rows, &bytes, err, errlen);
    }
    if (rc == 0) {
        rc = kvr_state_setup(e, p, err, errlen);
    }
    if (rc != 0) {
        return rc;
    }
    if (kvr_copy_u64(&e->kv_ptrs, p->kv_ptrs, p->nkv) || kvr_copy_u64(&e->kv_lens, p->kv_lens, p->nkv) ||
        kvr_copy_u64(&e->kv_item, p->kv_item_lens, p->nkv) ||
        kvr_copy_u64(&e->aux_ptrs, p->aux_ptrs, p->naux) ||
        kvr_copy_u64(&e->aux_lens, p->aux_lens, p->naux) ||
        kvr_copy_u64(&e->aux_item, p->aux_item_lens, p->naux) ||
        (e->layout_kv = kvr_le_array(p->kv_item_lens, p->nkv)) == NULL ||
        (e->layout_aux = kvr_le_array(p->aux_item_lens, p->naux)) == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    e->kv_item_max = kvr_u64_max(e->kv_item, e->nkv);
    e->aux_item_max = kvr_u64_max(e->aux_item, e->naux);
    return 0;
}

/* Prefill: registers the buffers with UCX up front (config register_memory). */
static int kvr_engine_map_buffers(kvr_engine_t *e, char *err, size_t errlen)
{
    if (e->mode != KVR_MODE_PREFILL || !e->cfg.register_memory) {
        return 0;
    }
    for (uint32_t i = 0; i < e->nkv + e->naux; i++) {
        if (e->gpu_path == KVR_GPU_STAGED && kvr_engine_buffer_is_device(e, i)) {
            continue; /* this UCX cannot map device memory; the pool is mapped */
        }
        uint64_t ptr = i < e->nkv ? e->kv_ptrs[i] : e->aux_ptrs[i - e->nkv];
        uint64_t len = i < e->nkv ? e->kv_lens[i] : e->aux_lens[i - e->nkv];
        if (len && kvr_tp_mem_map(e->tp, (void *)(uintptr_t)ptr, len, err, errlen) != 0) {
            return KVR_ESYSTEM;
        }
    }
    return 0;
}

/* The control plane: our ROUTER, and on a prefill the connection to the
 * bootstrap server.  On error nothing is left to close but e->ctl. */
static int kvr_engine_open_ctl(kvr_engine_t *e, char *err, size_t errlen)
{
    kvr_ctl_callbacks_t ccb = {e, kvr_on_router_msg_entry, kvr_on_conn_msg_entry,
                               kvr_on_refused_entry};
    /* What our ROUTER may legitimately receive: on a prefill, a ROOM_REQ of
     * the pages this prefill registered (one for more is refused anyway);
     * on a decode, only a sibling's SIB_FAIL (two strings of at most 1 KiB)
     * and its PING.  The bound of the queues follows from it. */
    int64_t pages = e->min_pages < KVR_WIRE_MAX_PAGES ? e->min_pages : KVR_WIRE_MAX_PAGES;
    int64_t max_msg = e->mode == KVR_MODE_PREFILL ? KVR_WIRE_HEADER_LEN + 28 + pages * 4 : 0;
    max_msg = max_msg > KVR_CTL_SMALL_MAX_MSG ? max_msg : KVR_CTL_SMALL_MAX_MSG;
    max_msg += e->cfg.secret_len ? KVR_AUTH_TRAILER_LEN : 0;
    if (kvr_ctl_create(e->host, e->cfg.ctrl_port, max_msg, e->cfg.secret, e->cfg.secret_len,
                       e->epoch, e->cfg.heartbeat_interval_ms, e->cfg.heartbeat_timeout_ms,
                       e->cfg.ctrl_queue_bytes, &ccb, &e->ctl, err, errlen) != 0) {
        return KVR_ESYSTEM;
    }
    if (e->mode == KVR_MODE_PREFILL && e->cfg.tcp_lane && e->ndev == 0) {
        /* Where decodes connect their tcp lanes (lane.h); without it their
         * data goes through UCX. */
        char lerr[256];
        if (kvr_tp_lane_listen(e->tp, e->host, e->cfg.lane_congestion, lerr, sizeof(lerr)) != 0) {
            kvr_log_write(&e->log, KVR_LOG_WARNING,
                          "prefill rank %d: no tcp lanes (%s); data goes through UCX", e->rank,
                          lerr);
        }
    }
    if (e->mode == KVR_MODE_PREFILL) {
        char ep[192];
        if (e->bootstrap_addr[0] == '\0') {
            return kvr_err(err, errlen, KVR_EVALUE, "bootstrap_addr is required for a prefill manager");
        }
        snprintf(ep, sizeof(ep), "tcp://%s", e->bootstrap_addr);
        if (kvr_ctl_connect(e->ctl, ep, NULL, 0, NULL, &e->bs_conn, err, errlen) != 0) {
            return KVR_EVALUE;
        }
    }
    return 0;
}

int kvr_engine_create(const kvr_engine_params_t *p, kvr_engine_t **e_p, char *err, size_t errlen)
{
    int rc = kvr_engine_check_params(p, err, errlen);
    if (rc == 0) {
        rc = kvr_heads_params_check(p, err, errlen);
    }
    if (rc != 0) {
        return rc;
    }
    kvr_engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    e->mode = p->mode;
    e->rank = p->rank;
    e->dp_rank = p->dp_rank;
    e->cfg = p->cfg;
    e->page_size = p->page_size;
    e->heads = (kvr_heads_t){p->tp_size, p->tp_rank, p->heads, p->total_heads};
    e->layers = p->num_layers ? (kvr_layers_t){p->pp_size, p->pp_rank, p->start_layer,
                                               p->num_layers, p->nkv}
                              : (kvr_layers_t){1, 0, 0, p->nkv, p->nkv};
    e->nkv = p->nkv;
    e->naux = p->naux;
    e->wake_fd = -1;
    snprintf(e->host, sizeof(e->host), "%s", p->host ? p->host : "127.0.0.1");
    snprintf(e->bootstrap_addr, sizeof(e->bootstrap_addr), "%s",
             p->bootstrap_addr ? p->bootstrap_addr : "");
    kvr_table_init(&e->rooms);
    kvr_table_init(&e->tags);
    kvr_table_init(&e->peer_index);
    kvr_heap_init(&e->deadlines);
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
    rc = kvr_engine_copy_buffers(e, p, err, errlen);
    if (rc != 0) {
        goto err_free;
    }
    e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->wake_fd < 0) {
        rc = kvr_err(err, errlen, KVR_ESYSTEM, "eventfd: %s", strerror(errno));
        goto err_free;
    }
    kvr_tp_callbacks_t tcb = {e, kvr_on_data, kvr_on_recv_done, kvr_on_send_done, kvr_on_ep_error};
    /* A UCX setting we cannot work with is the caller's to change. */
    if (kvr_tp_check_env(err, errlen) != 0) {
        rc = KVR_EVALUE;
        goto err_free;
    }
    if (kvr_tp_create(&tcb, (size_t)e->cfg.pack_bytes, &e->tp, err, errlen) != 0) {
        rc = KVR_ESYSTEM;
        goto err_free;
    }
    rc = kvr_gpu_setup(e, p, err, errlen);
    if (rc != 0) {
        goto err_tp;
    }
    rc = kvr_engine_map_buffers(e, err, errlen);
    if (rc != 0) {
        goto err_tp;
    }
    rc = kvr_engine_open_ctl(e, err, errlen);
    if (rc != 0) {
        goto err_ctl;
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

/* Operations of room r that never completed, now that nothing can complete
 * them (the transport is gone): freed with what they held, and the room
 * drained by fiat.  Their references stay: kvr_engine_free frees the rooms
 * left in e->tags. */
static void kvr_ops_drop_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_eroom_t *x = kvr_eroom(r);
    while (x->ops != NULL) {
        kvr_op_t *op = x->ops;
        x->ops = op->next;
        kvr_op_unstage(e, op);
        free(op->base.bounce); /* a packed copy the transport never got back */
        kvr_room_op_ended(r);
        free(op);
    }
    KVR_ASSERT(r->inflight == 0 || r->drained_by_force);
    kvr_room_abandon(r, KVR_ABORTED);
}

void kvr_engine_close(kvr_engine_t *e)
{
    kvr_engine_lock(e);
    if (e->closed) {
        kvr_engine_unlock(e);
        return;
    }
    __atomic_store_n(&e->closed, 1, __ATOMIC_RELEASE);
    e->stopping = 1;
    kvr_engine_unlock(e);
    kvr_wake(e);
    if (e->thread_started) {
        pthread_join(e->thread, NULL);
        e->thread_started = 0;
    }
    kvr_engine_lock(e);
    if (e->ctl != NULL && e->tp != NULL) {
        kvr_reap_locked(e);
    }
    if (e->bs_conn) {
        kvr_ctl_conn_close(e->ctl, e->bs_conn);
        e->bs_conn = NULL;
    }
    for (int i = 0; i < e->nsib_conns; i++) {
        kvr_ctl_conn_close(e->ctl, e->sib_conns[i]);
    }
    e->nsib_conns = 0;
    /* The transport first: a completion UCX still delivers while its
     * workers go finds its operation counted.  (The control layer after
     * it: such a completion may queue a notice.) */
    kvr_tp_destroy(e->tp);
    e->tp = NULL;
    /* No UCX progress any more, so no read starts; the helpers finish
     * theirs (the ops stay with their rooms, dropped below). */
    kvr_readers_free(e->readers);
    e->readers = NULL;
    kvr_ctl_destroy(e->ctl);
    e->ctl = NULL;
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r) {
            kvr_ops_drop_locked(e, r);
        }
    }
    /* Drop the table's references; handles keep theirs. */
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->rooms, &it, NULL)) != NULL;) {
        if (r) {
            r->in_table = 0;
        }
    }
    kvr_heap_destroy(&e->deadlines); /* no timer runs any more */
    kvr_table_t rooms = e->rooms;
    kvr_table_init(&e->rooms);
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&rooms, &it, NULL)) != NULL;) {
        kvr_room_unref_locked(e, r);
    }
    kvr_table_destroy(&rooms);
    while (e->work_head) {
        r = e->work_head;
        e->work_head = kvr_eroom(r)->work_next;
        kvr_eroom(r)->on_work = 0;
        kvr_room_unref_locked(e, r);
    }
    while (e->draining) {
        r = e->draining;
        e->draining = kvr_eroom(r)->drain_next;
        kvr_eroom(r)->draining = 0;
        kvr_room_unref_locked(e, r);
    }
    while (e->slot_waiters) {
        r = e->slot_waiters;
        e->slot_waiters = kvr_eroom(r)->slot_next;
        kvr_eroom(r)->slot_waiting = 0;
        kvr_room_unref_locked(e, r);
    }
    kvr_engine_unlock(e);
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
    kvr_pending_t *pd;
    for (kvr_table_iter_t it = {0}; (pd = kvr_table_next(&e->pending, &it, NULL)) != NULL;) {
        kvr_pending_free(e, pd);
    }
    kvr_table_destroy(&e->pending);
    /* Rooms still referenced by operations that never completed. */
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r) {
            kvr_eroom_free(r);
        }
    }
    kvr_table_destroy(&e->tags);
    kvr_table_destroy(&e->rooms);
    kvr_table_destroy(&e->peer_index);
    while (e->peers) {
        kvr_peer_t *p = e->peers;
        e->peers = p->next;
        free(p->worker_addr);
        free(p);
    }
    if (e->wake_fd >= 0) {
        close(e->wake_fd);
    }
    kvr_siblings_free(e);
    kvr_gpu_free(e);
    kvr_dead_free(e);
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
    free(e->state_comp);
    free(e->state_rules);
    free(e->state_rule_at);
    free(e->state_replicated);
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
    kvr_engine_lock(e);
    *s = e->stats;
    memset(s->rooms_by_state, 0, sizeof(s->rooms_by_state));
    s->rooms_open = 0;
    s->rooms_draining = 0;
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->rooms, &it, NULL)) != NULL;) {
        if (r) {
            s->rooms_open++;
            s->rooms_by_state[atomic_load(&r->visible)]++;
        }
    }
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r && r->failing && r->inflight > 0) {
            s->rooms_draining++;
        }
    }
    s->pending_requests = e->pending.count;
    if (e->tp != NULL) {
        s->data_packed = kvr_tp_packed(e->tp);
        s->lane_messages = kvr_tp_lane_frames(e->tp);
        s->lane_port = kvr_tp_lane_port(e->tp);
        s->pack_cached_bytes = kvr_tp_pack_cached(e->tp);
        s->ucx_workers = kvr_tp_nworkers(e->tp, &s->ucx_workers_created);
    }
    kvr_engine_unlock(e);
    s->log_dropped = kvr_log_dropped(&e->log);
}

void kvr_engine_test_corrupt(kvr_engine_t *e, int mode)
{
    kvr_engine_lock(e);
    e->test_corrupt = mode;
    kvr_tp_test_bad_frames(e->tp, mode == KVR_TEST_CORRUPT_FRAME);
    kvr_engine_unlock(e);
}

void kvr_engine_test_forge(kvr_engine_t *e, uint64_t tag, uint64_t epoch)
{
    kvr_engine_lock(e);
    e->test_forge_tag = tag;
    e->test_forge_epoch = epoch;
    kvr_engine_unlock(e);
}

uint64_t kvr_engine_test_room_tag(kvr_engine_t *e, uint64_t room)
{
    kvr_engine_lock(e);
    kvr_room_t *r = kvr_table_get(&e->rooms, room);
    uint64_t tag = r != NULL ? (r->role == KVR_ROLE_PREFILL ? r->dst_tag : r->tag) : 0;
    kvr_engine_unlock(e);
    return tag;
}
