#include "transport.h"
#include "registry.h" /* kvr_now_ns */

#include <stddef.h>
#include <stdio.h>
#include <errno.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>
#include <ucs/sys/string.h>

#include "pagecopy.h"
#include "transport_int.h"
#include "ucxlog.h"

#define KVR_AM_ID_DATA 7

/* kvr_tp_iov_t arrays are handed to UCX as they are. */
_Static_assert(sizeof(kvr_tp_iov_t) == sizeof(ucp_dt_iov_t) &&
                   offsetof(kvr_tp_iov_t, buf) == offsetof(ucp_dt_iov_t, buffer) &&
                   offsetof(kvr_tp_iov_t, len) == offsetof(ucp_dt_iov_t, length),
               "kvr_tp_iov_t must match ucp_dt_iov_t");

/* ---- bounce buffers (packed scattered messages) ---- */

/* A buffer of at least len bytes: a cached one if one is large enough. */
static void *kvr_tp_bounce_get(kvr_transport_t *tp, size_t len, size_t *cap)
{
    tp->pack_used = 1;
    for (int i = 0; i < tp->npack_cache; i++) {
        if (tp->pack_cache_cap[i] >= len) {
            void *b = tp->pack_cache[i];
            *cap = tp->pack_cache_cap[i];
            tp->pack_cached -= *cap;
            tp->npack_cache--;
            tp->pack_cache[i] = tp->pack_cache[tp->npack_cache];
            tp->pack_cache_cap[i] = tp->pack_cache_cap[tp->npack_cache];
            return b;
        }
    }
    *cap = len;
    return malloc(len);
}

static void kvr_tp_pack_free_cache(kvr_transport_t *tp)
{
    for (int i = 0; i < tp->npack_cache; i++) {
        free(tp->pack_cache[i]);
    }
    tp->npack_cache = 0;
    tp->pack_cached = 0;
}

static void kvr_tp_bounce_put(kvr_transport_t *tp, kvr_tp_op_t *op)
{
    if (op->bounce == NULL) {
        return;
    }
    tp->pack_inflight -= op->bounce_cap;
    if (tp->npack_cache < KVR_TP_PACK_CACHE && tp->pack_cached + op->bounce_cap <= tp->pack_max) {
        tp->pack_cache[tp->npack_cache] = op->bounce;
        tp->pack_cache_cap[tp->npack_cache] = op->bounce_cap;
        tp->pack_cached += op->bounce_cap;
        tp->npack_cache++;
    } else {
        free(op->bounce);
    }
    op->bounce = NULL;
}

/* ---- completion callbacks ---- */

/* The statuses that mean the peer (or the way to it) is gone, as opposed to
 * a fault of the one operation. */
static int kvr_tp_outcome(ucs_status_t status)
{
    switch (status) {
    case UCS_OK:
        return KVR_TP_OK;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CANCELED:
    case UCS_ERR_TIMED_OUT:
        return KVR_TP_PEER_GONE;
    case UCS_ERR_REJECTED:
        return KVR_TP_REJECTED;
    default:
        return KVR_TP_ERROR;
    }
}

static void kvr_tp_send_cb(void *request, ucs_status_t status, void *user_data)
{
    kvr_tp_op_t *op = user_data;
    kvr_transport_t *tp = op->tp;
    op->req = NULL;
    kvr_tp_bounce_put(tp, op);
    tp->cb.on_send_done(tp->cb.arg, op, kvr_tp_outcome(status),
                        status == UCS_OK ? NULL : ucs_status_string(status));
    ucp_request_free(request);
}

static void kvr_tp_recv_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    kvr_tp_op_t *op = user_data;
    kvr_transport_t *tp = op->tp;
    op->req = NULL;
    tp->cb.on_recv_done(tp->cb.arg, op, length, kvr_tp_outcome(status),
                        status == UCS_OK ? NULL : ucs_status_string(status));
    ucp_request_free(request);
}

static ucs_status_t kvr_tp_am_cb(void *arg, const void *header, size_t header_length,
                                 void *data, size_t length, const ucp_am_recv_param_t *param)
{
    kvr_tp_worker_t *w = arg;
    kvr_transport_t *tp = w->tp;
    kvr_tp_accept_t acc = {NULL, 0, NULL, NULL, NULL};
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        acc.data = data;
    }
    tp->cb.on_data(tp->cb.arg, w, header, header_length, length,
                   (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0, &acc);
    if (acc.iovcnt == 0) {
        /* Rejected: for rendezvous the sender's request completes with this
         * status, so it learns the receiver refused the data. */
        return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_REJECTED : UCS_OK;
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        /* The payload is here (eager): scatter it.  The engine checked that
         * the pieces add up to length. */
        const char *src = data;
        int stream = length <= KVR_TP_SHM_EAGER_BYTES;
        for (size_t i = 0; i < acc.iovcnt; i++) {
            kvr_page_copy(acc.iov[i].buf, src, acc.iov[i].len, stream);
            src += acc.iov[i].len;
        }
        if (stream) {
            kvr_page_copy_fence();
        }
        tp->cb.on_recv_done(tp->cb.arg, acc.op, length, KVR_TP_OK, NULL);
        return UCS_OK;
    }
    acc.op->tp = tp;
    acc.op->worker_id = w->id;
    acc.op->req = NULL;
    size_t recv_len = 0;
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_RECV_INFO;
    rp.cb.recv_am = kvr_tp_recv_cb;
    rp.user_data = acc.op;
    rp.recv_info.length = &recv_len;
    void *buf = acc.iov[0].buf;
    size_t count = length;
    if (acc.iovcnt > 1) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        rp.datatype = ucp_dt_make_iov();
        buf = acc.iov;
        count = acc.iovcnt;
    }
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(w->worker, data, buf, count, &rp);
    if (req == NULL) {
        tp->cb.on_recv_done(tp->cb.arg, acc.op, length, KVR_TP_OK, NULL);
    } else if (UCS_PTR_IS_ERR(req)) {
        tp->cb.on_recv_done(tp->cb.arg, acc.op, 0, kvr_tp_outcome(UCS_PTR_STATUS(req)),
                            ucs_status_string(UCS_PTR_STATUS(req)));
    } else {
        acc.op->req = req; /* completed later, by kvr_tp_recv_cb */
    }
    /* Otherwise kvr_tp_recv_cb completes it.  UCP owns data either way. */
    return UCS_OK;
}

static void kvr_tp_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvr_tp_ep_t *e = arg;
    (void)ep;
    if (e->failed) {
        return;
    }
    e->failed = 1;
    e->tp->cb.on_ep_error(e->tp->cb.arg, e->ep_ctx, e, ucs_status_string(status));
}

/* ---- lifecycle ---- */

static int kvr_tp_worker_new(kvr_transport_t *tp, kvr_tp_worker_t **w_p, char *err,
                             size_t errlen);
static void kvr_tp_worker_free(kvr_tp_worker_t *w);

/* UCX 1.13's shared-memory transports break on segments of 64 KiB or more
 * (the fragment length no longer fits their queue elements, it seems):
 * measured with kvrecv's scattered messages, a 526 KB message hung with
 * UCX_POSIX_SEG_SIZE=65600 and 65536 crashed the process; 49216 and below
 * moved every byte.  UCX reads UCX_MM_SEG_SIZE for both when the
 * transport's own variable is not set.  0, or -1 with err. */
#define KVR_TP_SHM_SEG_LIMIT 65536

int kvr_tp_check_env(char *err, size_t errlen)
{
    static const char *const own[] = {"UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"};
    for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++) {
        const char *name = own[i];
        const char *v = getenv(name);
        if (v == NULL) {
            name = "UCX_MM_SEG_SIZE";
            v = getenv(name);
        }
        size_t bytes = 0;
        if (v != NULL && ucs_str_to_memunits(v, &bytes) == UCS_OK &&
            bytes != UCS_MEMUNITS_AUTO && bytes >= KVR_TP_SHM_SEG_LIMIT) {
            snprintf(err, errlen,
                     "%s=%s: UCX %s's shared-memory transports lose or corrupt messages in "
                     "segments of %u bytes or more (kvrecv measured a hang and a crash); set it "
                     "below %u (UCX's default is 8256)",
                     name, v, ucp_get_version_string(), KVR_TP_SHM_SEG_LIMIT, KVR_TP_SHM_SEG_LIMIT);
            return -1;
        }
    }
    return 0;
}

int kvr_tp_create(const kvr_tp_callbacks_t *cb, size_t pack_max, kvr_transport_t **tp_p, char *err,
                  size_t errlen)
{
    ucs_status_t st;
    ucp_config_t *config = NULL;
    kvr_transport_t *tp = calloc(1, sizeof(*tp));
    if (tp == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    tp->cb = *cb;
    tp->pack_max = pack_max;
    tp->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (tp->epfd < 0) {
        snprintf(err, errlen, "epoll_create1: %s", strerror(errno));
        free(tp);
        return -1;
    }

    kvr_ucxlog_install();
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_config_read: %s", ucs_status_string(st));
        goto err_free;
    }
    const char *tls = getenv("UCX_TLS");
    kvr_ucxtune_apply(config, tls, tp->tuned, sizeof(tp->tuned), tp->tuned_bytes);
    if (tp->tuned_bytes[KVR_TUNE_TCP_ZCOPY] == UCS_MEMUNITS_INF) {
        /* A packed copy of scattered pieces pays only where UCX would send
         * it zero-copy; without (kvrecv's setting over tcp, ucxtune.c) UCX
         * copies the pieces into its own buffers itself, and packing would
         * be a second copy (random 4-64 KiB pages over tcp: 1.2-1.5x faster
         * and 10-20 % less CPU per byte unpacked). */
        tp->pack_max = 0;
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config, &tp->context);
    ucp_config_release(config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_init: %s", ucs_status_string(st));
        goto err_free;
    }
    /* A first worker (creating one takes ~10 ms here): kept for the first
     * peer, tells the version of this UCX's addresses, and shows now, not
     * at the first peer, whether workers can be created. */
    if (kvr_tp_worker_new(tp, &tp->spare, err, errlen) != 0) {
        goto err_cleanup_context;
    }
    /* Peers' addresses are checked in the format this UCX packs ours in
     * (not its unified mode, whose lengths are not in the address). */
    if (kvr_ucxaddr_learn(&tp->addr_ref, tp->spare->address, tp->spare->address_len, err,
                          errlen) != 0) {
        size_t n = strlen(err);
        snprintf(err + n, errlen - n, " (this UCX's own: kvrecv cannot check peers' addresses%s)",
                 getenv("UCX_UNIFIED_MODE") ? "; unset UCX_UNIFIED_MODE" : "");
        goto err_cleanup_worker;
    }

    snprintf(tp->describe, sizeof(tp->describe), "ucx %s, UCX_TLS=%s%s%s", ucp_get_version_string(),
             tls ? tls : "all", tp->tuned[0] ? ", kvrecv sets " : "", tp->tuned);
    *tp_p = tp;
    return 0;

err_cleanup_worker:
    kvr_tp_worker_free(tp->spare);
err_cleanup_context:
    ucp_cleanup(tp->context);
err_free:
    close(tp->epfd);
    free(tp);
    return -1;
}

/* A worker not yet in tp's list nor its epoll set. */
static int kvr_tp_worker_new(kvr_transport_t *tp, kvr_tp_worker_t **w_p, char *err, size_t errlen)
{
    ucs_status_t st;
    kvr_tp_worker_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    w->tp = tp;
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    /* The engine lock serializes every call: the engine thread progresses,
     * and the prefill's send() posts from the caller's thread. */
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    wp.events = UCP_WAKEUP_RMA | UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV | UCP_WAKEUP_TX |
                UCP_WAKEUP_RX;
    st = ucp_worker_create(tp->context, &wp, &w->worker);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_create: %s", ucs_status_string(st));
        goto err_free;
    }

    ucp_worker_attr_t wa;
    memset(&wa, 0, sizeof(wa));
    wa.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    st = ucp_worker_query(w->worker, &wa);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_query: %s", ucs_status_string(st));
        goto err_destroy_worker;
    }
    w->address = wa.address;
    w->address_len = wa.address_length;

    st = ucp_worker_get_efd(w->worker, &w->efd);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_get_efd: %s", ucs_status_string(st));
        goto err_release_address;
    }

    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = KVR_AM_ID_DATA;
    hp.cb = kvr_tp_am_cb;
    hp.arg = w;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(w->worker, &hp);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
        goto err_release_address;
    }
    *w_p = w;
    return 0;

err_release_address:
    ucp_worker_release_address(w->worker, w->address);
err_destroy_worker:
    ucp_worker_destroy(w->worker);
err_free:
    free(w);
    return -1;
}

static void kvr_tp_worker_free(kvr_tp_worker_t *w)
{
    kvr_lane_free(w->lane);
    ucp_worker_release_address(w->worker, w->address);
    ucp_worker_destroy(w->worker);
    free(w);
}

int kvr_tp_worker_create(kvr_transport_t *tp, kvr_tp_worker_t **w_p, char *err, size_t errlen)
{
    kvr_tp_worker_t *w = tp->spare;
    if (w != NULL) {
        tp->spare = NULL;
    } else if (kvr_tp_worker_new(tp, &w, err, errlen) != 0) {
        return -1;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.ptr = w;
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, w->efd, &ev) != 0) {
        snprintf(err, errlen, "epoll_ctl: %s", strerror(errno));
        kvr_tp_worker_free(w);
        return -1;
    }
    w->next = tp->workers;
    if (tp->workers != NULL) {
        tp->workers->prev = w;
    }
    tp->workers = w;
    tp->nworkers++;
    tp->workers_created++;
    w->id = tp->workers_created;
    *w_p = w;
    return 0;
}

void kvr_tp_worker_retire(kvr_tp_worker_t *w)
{
    if (!w->retired) {
        kvr_tp_lane_retire(w);
        w->retired = 1;
        epoll_ctl(w->tp->epfd, EPOLL_CTL_DEL, w->efd, NULL);
    }
}

void kvr_tp_worker_destroy(kvr_tp_worker_t *w)
{
    if (w == NULL) {
        return;
    }
    kvr_transport_t *tp = w->tp;
    kvr_tp_worker_retire(w);
    if (w->prev != NULL) {
        w->prev->next = w->next;
    } else {
        tp->workers = w->next;
    }
    if (w->next != NULL) {
        w->next->prev = w->prev;
    }
    tp->nworkers--;
    /* Requests still in flight here (a dead peer's receives, which UCX
     * 1.13 can neither complete nor cancel) go with the worker's pools;
     * UCX warns of each. */
    kvr_ucxlog_expect_unreturned(1);
    kvr_tp_worker_free(w);
    kvr_ucxlog_expect_unreturned(0);
}

unsigned kvr_tp_nworkers(const kvr_transport_t *tp, uint64_t *created)
{
    *created = tp->workers_created;
    return tp->nworkers;
}

void kvr_tp_destroy(kvr_transport_t *tp)
{
    if (tp == NULL) {
        return;
    }
    while (tp->workers != NULL) {
        kvr_tp_worker_destroy(tp->workers);
    }
    if (tp->spare != NULL) {
        kvr_tp_worker_free(tp->spare);
    }
    for (size_t i = 0; i < tp->nregions; i++) {
        ucp_mem_unmap(tp->context, tp->regions[i].memh);
    }
    free(tp->regions);
    kvr_tp_pack_free_cache(tp); /* after the workers: nothing refers to them */
    kvr_lane_listener_free(tp->lanes);
    ucp_cleanup(tp->context);
    close(tp->epfd);
    free(tp);
}

void kvr_tp_address(kvr_tp_worker_t *w, const void **addr_p, size_t *len_p)
{
    *addr_p = w->address;
    *len_p = w->address_len;
}

int kvr_tp_fd(kvr_transport_t *tp)
{
    return tp->epfd;
}

/* A progress round (or the time between two) this long means the process
 * was suspended (SIGSTOP, a paused VM) or starved: kvr_tp_progress returns
 * at once, so that the engine looks at its peers' silence again before
 * taking more -- a peer it must now declare lost may have megabytes queued
 * in the socket buffers for receives it accepted before. */
#define KVR_TP_STALL_NS (20ull * 1000 * 1000)

unsigned kvr_tp_progress(kvr_transport_t *tp)
{
    /* Bounded, so the engine lock is released between rounds even under a
     * flood of completions (API calls wait for that lock).  Callbacks may
     * retire workers but never destroy one (the engine's reaper does). */
    unsigned total = kvr_tp_lanes_progress(tp), n;
    uint64_t last = kvr_now_ns();
    for (kvr_tp_worker_t *w = tp->workers; w != NULL; w = w->next) {
        if (w->retired) {
            continue;
        }
        for (int i = 0; i < 64 && (n = ucp_worker_progress(w->worker)) != 0; i++) {
            total += n;
            uint64_t now = kvr_now_ns();
            if (now - last > KVR_TP_STALL_NS) {
                return total;
            }
            last = now;
        }
    }
    return total;
}

int kvr_tp_arm(kvr_transport_t *tp)
{
    int busy = 0;
    for (kvr_tp_worker_t *w = tp->workers; w != NULL; w = w->next) {
        if (w->retired) {
            continue;
        }
        busy |= ucp_worker_arm(w->worker) == UCS_ERR_BUSY;
    }
    /* tp->epfd is level-triggered: it stays readable while any armed
     * worker's fd is, so nothing of it needs consuming. */
    return busy;
}

static unsigned kvr_tp_mem_mask(ucp_context_h ctx, char *names, size_t len)
{
    ucp_context_attr_t a;
    memset(&a, 0, sizeof(a));
    a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (names != NULL && len > 0) {
        names[0] = '\0';
    }
    if (ucp_context_query(ctx, &a) != UCS_OK) {
        return KVR_TP_MEM_HOST;
    }
    static const struct {
        int ucs;
        unsigned bit;
        const char *name;
    } types[] = {
        {UCS_MEMORY_TYPE_HOST, KVR_TP_MEM_HOST, "host"},
        {UCS_MEMORY_TYPE_CUDA, KVR_TP_MEM_CUDA, "cuda"},
        {UCS_MEMORY_TYPE_CUDA_MANAGED, KVR_TP_MEM_CUDA_MANAGED, "cuda-managed"},
        {UCS_MEMORY_TYPE_ROCM, KVR_TP_MEM_ROCM, "rocm"},
        {UCS_MEMORY_TYPE_ROCM_MANAGED, KVR_TP_MEM_ROCM, "rocm-managed"},
    };
    unsigned mask = 0;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (a.memory_types & UCS_BIT(types[i].ucs)) {
            mask |= types[i].bit;
            if (names != NULL && len > 0) {
                size_t n = strlen(names);
                snprintf(names + n, len - n, "%s%s", n ? "," : "", types[i].name);
            }
        }
    }
    return mask;
}

unsigned kvr_tp_memory_types(kvr_transport_t *tp, char *names, size_t len)
{
    return kvr_tp_mem_mask(tp->context, names, len);
}

int kvr_tp_probe_memory_types(unsigned *mask, char *names, size_t len, char *err, size_t errlen)
{
    ucp_config_t *config = NULL;
    kvr_ucxlog_install();
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_config_read: %s", ucs_status_string(st));
        return -1;
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    ucp_context_h ctx;
    st = ucp_init(&params, config, &ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_init: %s", ucs_status_string(st));
        return -1;
    }
    *mask = kvr_tp_mem_mask(ctx, names, len);
    ucp_cleanup(ctx);
    return 0;
}

uint64_t kvr_tp_packed(kvr_transport_t *tp)
{
    return tp->packed;
}

uint64_t kvr_tp_pack_cached(kvr_transport_t *tp)
{
    return tp->pack_cached;
}

void kvr_tp_pack_trim(kvr_transport_t *tp, uint64_t now_ns)
{
    if (tp->pack_inflight > 0 || tp->pack_used) {
        tp->pack_busy_ns = now_ns;
        tp->pack_used = 0;
        return;
    }
    if (tp->npack_cache > 0 && now_ns - tp->pack_busy_ns >= KVR_TP_PACK_IDLE_NS) {
        kvr_tp_pack_free_cache(tp);
    }
}

size_t kvr_tp_tcp_tx_seg(const kvr_transport_t *tp)
{
    return tp->tuned_bytes[KVR_TUNE_TCP_TX_SEG];
}

size_t kvr_tp_tcp_rx_seg(const kvr_transport_t *tp)
{
    return tp->tuned_bytes[KVR_TUNE_TCP_RX_SEG];
}

void kvr_tp_shm_sizes(const kvr_transport_t *tp, uint32_t *seg, uint32_t *fifo)
{
    size_t s = tp->tuned_bytes[KVR_TUNE_MM_SEG], f = tp->tuned_bytes[KVR_TUNE_MM_FIFO];
    *seg = s > UINT32_MAX ? UINT32_MAX : (uint32_t)s;
    *fifo = f > UINT32_MAX ? UINT32_MAX : (uint32_t)f;
}

const char *kvr_tp_describe(kvr_transport_t *tp)
{
    return tp->describe;
}

/* ---- endpoints ---- */

int kvr_tp_address_check(kvr_transport_t *tp, const void *addr, size_t len, char *err,
                         size_t errlen)
{
    return kvr_ucxaddr_check(&tp->addr_ref, addr, len, err, errlen);
}

int kvr_tp_ep_create(kvr_tp_worker_t *w, const void *addr, size_t len, void *ep_ctx,
                     kvr_tp_ep_t **ep_p, char *err, size_t errlen)
{
    kvr_transport_t *tp = w->tp;
    /* UCX asserts (aborting the process) on an address whose header it does
     * not know and reads as far as the address's fields say: check its
     * whole structure against its length before handing it over.  (The
     * control channel is where peers are vetted; this stops garbage, not a
     * forger.) */
    if (kvr_tp_address_check(tp, addr, len, err, errlen) != 0) {
        return -1;
    }
    kvr_tp_ep_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    e->tp = tp;
    e->w = w;
    e->ep_ctx = ep_ctx;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = kvr_tp_ep_err_cb;
    ep.err_handler.arg = e;
    /* Once UCX said it cannot handle peer failures here (it logs an error
     * line each time it is asked), do not ask again. */
    ucs_status_t st = UCS_ERR_UNREACHABLE;
    if (!tp->eps_without_peer_errors) {
        kvr_ucxlog_expect_refusal(1);
        st = ucp_ep_create(w->worker, &ep, &e->ep);
        kvr_ucxlog_expect_refusal(0);
    }
    if (st == UCS_ERR_UNREACHABLE) {
        /* UCX 1.13 offers peer-failure handling only on transports that
         * support it (tcp, not the shared-memory ones).  Without it the
         * engine's heartbeats still detect a dead peer. */
        ep.field_mask &= ~(uint64_t)UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        st = ucp_ep_create(w->worker, &ep, &e->ep);
        if (st == UCS_OK) {
            tp->eps_without_peer_errors++;
            e->no_peer_errors = 1;
        }
    }
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_ep_create: %s", ucs_status_string(st));
        free(e);
        return -1;
    }
    size_t tx_seg = tp->tuned_bytes[KVR_TUNE_TCP_TX_SEG];
    if (!e->no_peer_errors && tx_seg > 2 * KVR_TP_TCP_EAGER_HEADROOM &&
        kvr_ucxlog_ep_tcp_only(e->ep)) {
        e->tcp_eager = tx_seg - KVR_TP_TCP_EAGER_HEADROOM;
    }
    /* Once per transport and kind of endpoint. */
    if (!tp->said_lanes[!e->no_peer_errors]) {
        tp->said_lanes[!e->no_peer_errors] = 1;
        kvr_ucxlog_say_endpoint(e->ep, !e->no_peer_errors);
    }
    *ep_p = e;
    return 0;
}

int kvr_tp_ep_is_shm(const kvr_tp_ep_t *e)
{
    return e->no_peer_errors;
}

size_t kvr_tp_ep_tcp_eager(const kvr_tp_ep_t *e)
{
    return e->tcp_eager;
}

void kvr_tp_ep_close(kvr_tp_ep_t *e, int force)
{
    ucp_worker_h worker = e->w->worker;
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = (force || e->failed) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t req = ucp_ep_close_nbx(e->ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
        /* Bounded drain: a close that does not finish in ~2 s is abandoned
         * (the worker's destruction releases it). */
        for (int i = 0; i < 200000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++) {
            ucp_worker_progress(worker);
        }
        if (ucp_request_check_status(req) == UCS_INPROGRESS) {
            ucp_request_cancel(worker, req);
        }
        ucp_request_free(req);
    }
    kvr_tp_lane_drop(e->w, e);
    free(e);
}

/* ---- data ---- */

static ucp_mem_h kvr_tp_find_memh(kvr_transport_t *tp, const void *buf, size_t len)
{
    const char *b = buf;
    for (size_t i = 0; i < tp->nregions; i++) {
        const char *r = tp->regions[i].addr;
        if (b >= r && b + len <= r + tp->regions[i].len) {
            return tp->regions[i].memh;
        }
    }
    return NULL;
}

int kvr_tp_send(kvr_transport_t *tp, kvr_tp_ep_t *e, const void *hdr, size_t hdr_len,
                const kvr_tp_iov_t *iov, size_t iovcnt, int host, kvr_tp_op_t *op,
                const char **status_text)
{
    op->tp = tp;
    op->worker_id = e->w->id;
    op->bounce = NULL;
    op->req = NULL;
    kvr_lane_t *lane = host ? kvr_tp_lane_for(e) : NULL;
    if (lane != NULL) {
        int rc = kvr_lane_send(lane, hdr, hdr_len, iov, iovcnt, tp->test_bad_frames,
                               &tp->lane_budget, op, status_text);
        tp->lane_frames += rc == KVR_TP_OK || rc == KVR_TP_PENDING;
        kvr_tp_lane_sync(e->w);
        return rc;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = kvr_tp_send_cb;
    p.user_data = op;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    const void *buf = iov;
    size_t count = iovcnt;
    size_t total = 0;
    for (size_t i = 0; i < iovcnt; i++) {
        total += iov[i].len;
    }
    /* One fragment: no rendezvous round trip, and UCX copies the pieces
     * into the fragment itself (a bounce copy would be one more). */
    int eager = host && total <= (e->no_peer_errors ? KVR_TP_SHM_EAGER_BYTES : e->tcp_eager);
    if (eager) {
        p.flags |= UCP_AM_SEND_FLAG_EAGER;
    }
    if (iovcnt > 1 && host && !e->no_peer_errors && !eager &&
        tp->pack_inflight + total <= tp->pack_max &&
        (op->bounce = kvr_tp_bounce_get(tp, total, &op->bounce_cap)) != NULL) {
        char *b = op->bounce;
        for (size_t i = 0; i < iovcnt; i++) {
            memcpy(b, iov[i].buf, iov[i].len);
            b += iov[i].len;
        }
        tp->pack_inflight += op->bounce_cap;
        tp->packed++;
        buf = op->bounce;
        count = total;
    } else if (iovcnt == 1 && !(host && e->no_peer_errors)) {
        buf = iov[0].buf;
        count = iov[0].len;
        ucp_mem_h memh = kvr_tp_find_memh(tp, buf, count);
        if (memh != NULL) {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            p.memh = memh;
        }
    } else if (op->bounce == NULL) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
    }
    ucs_status_ptr_t req = ucp_am_send_nbx(e->ep, KVR_AM_ID_DATA, hdr, hdr_len, buf, count, &p);
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        kvr_tp_bounce_put(tp, op); /* done with it, or never used */
    }
    if (req == NULL) {
        return KVR_TP_OK;
    }
    if (UCS_PTR_IS_ERR(req)) {
        *status_text = ucs_status_string(UCS_PTR_STATUS(req));
        /* (At once, a refusal is no answer of the receiver: an error.) */
        return kvr_tp_outcome(UCS_PTR_STATUS(req)) == KVR_TP_PEER_GONE ? KVR_TP_PEER_GONE
                                                                      : KVR_TP_ERROR;
    }
    op->req = req;
    return KVR_TP_PENDING;
}

void kvr_tp_op_cancel(kvr_tp_op_t *op)
{
    if (op->req == NULL) {
        return;
    }
    for (kvr_tp_worker_t *w = op->tp->workers; w != NULL; w = w->next) {
        if (w->id == op->worker_id) {
            ucp_request_cancel(w->worker, op->req);
            return;
        }
    }
    /* Its worker was destroyed, and the request with it: nothing will
     * complete it (the engine force-drains the room). */
    op->req = NULL;
}

int kvr_tp_mem_map(kvr_transport_t *tp, void *addr, size_t len, char *err, size_t errlen)
{
    kvr_tp_region_t *nr = realloc(tp->regions, (tp->nregions + 1) * sizeof(*nr));
    if (nr == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    tp->regions = nr;
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = addr;
    mp.length = len;
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map(tp->context, &mp, &memh);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_mem_map(%p, %zu): %s", addr, len, ucs_status_string(st));
        return -1;
    }
    tp->regions[tp->nregions].addr = addr;
    tp->regions[tp->nregions].len = len;
    tp->regions[tp->nregions].memh = memh;
    tp->nregions++;
    return 0;
}
