/*
 * tplane: the transport's lanes (lane.h) -- a worker's lane to its peer,
 * the prefill's listener, and the lanes' fds in the transport's epoll set.
 * A lane belongs to its worker: progressed with it, taken out of the epoll
 * set when it is retired (nothing lands after its peer's rooms failed),
 * freed with the endpoint it serves or with the worker.
 */
#define _GNU_SOURCE
#include "transport_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>

#include "registry.h" /* kvr_now_ns */

/* What a lane's or the listener's event in the transport's epoll set
 * carries: the worker's or the transport's address with a tag in its low
 * bits (both are 8-byte aligned; a worker's own UCX fd carries the bare
 * worker address). */
#define KVR_TPLANE_EV_LANE 1u
#define KVR_TPLANE_EV_LISTENER 2u
#define KVR_TPLANE_EV_MAX 64

static void kvr_tplane_on_frame(void *arg, const void *hdr, size_t hdr_len, size_t len,
                                kvr_tp_accept_t *acc)
{
    kvr_tp_worker_t *w = arg;
    kvr_transport_t *tp = w->tp;
    tp->cb.on_data(tp->cb.arg, w, hdr, hdr_len, len, KVR_TP_LANE, acc);
    if (acc->iovcnt > 0) {
        acc->op->tp = tp;
        acc->op->worker_id = w->id;
        acc->op->req = NULL;
        tp->lane_frames++;
    }
}

static void kvr_tplane_on_recv_done(void *arg, kvr_tp_op_t *op, size_t len, int failed,
                                    const char *text)
{
    kvr_tp_worker_t *w = arg;
    w->tp->cb.on_recv_done(w->tp->cb.arg, op, len, failed, text);
}

static void kvr_tplane_on_send_done(void *arg, kvr_tp_op_t *op, int failed, const char *text)
{
    kvr_tp_worker_t *w = arg;
    w->tp->cb.on_send_done(w->tp->cb.arg, op, failed, text);
}

static void kvr_tplane_on_error(void *arg, const char *text, int was_up)
{
    kvr_tp_worker_t *w = arg;
    kvr_tp_ep_t *ep = w->lane_ep;
    w->lane_events = 0; /* its fd is closed: out of the epoll set */
    if (!was_up || ep == NULL || ep->failed) {
        return; /* never carried data: UCX carries it */
    }
    ep->failed = 1;
    w->tp->cb.on_ep_error(w->tp->cb.arg, ep->ep_ctx, ep, text);
}

static kvr_lane_cb_t kvr_tplane_cb(kvr_tp_worker_t *w)
{
    kvr_lane_cb_t cb = {w, kvr_tplane_on_frame, kvr_tplane_on_recv_done, kvr_tplane_on_send_done,
                        kvr_tplane_on_error};
    return cb;
}

void kvr_tp_lane_sync(kvr_tp_worker_t *w)
{
    if (w->lane == NULL || w->retired || kvr_lane_fd(w->lane) < 0) {
        return;
    }
    uint32_t want = kvr_lane_events(w->lane);
    if (want == w->lane_events) {
        return;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = want;
    ev.data.u64 = (uint64_t)(uintptr_t)w | KVR_TPLANE_EV_LANE;
    if (epoll_ctl(w->tp->epfd, w->lane_events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD,
                  kvr_lane_fd(w->lane), &ev) == 0) {
        w->lane_events = want;
    }
}

void kvr_tp_lane_retire(kvr_tp_worker_t *w)
{
    if (w->lane != NULL && w->lane_events && kvr_lane_fd(w->lane) >= 0) {
        epoll_ctl(w->tp->epfd, EPOLL_CTL_DEL, kvr_lane_fd(w->lane), NULL);
    }
    w->lane_events = 0;
    w->lane_offered = 0;
}

void kvr_tp_lane_drop(kvr_tp_worker_t *w, const kvr_tp_ep_t *ep)
{
    if (w->lane == NULL || (ep != NULL && w->lane_ep != ep)) {
        return;
    }
    kvr_tp_lane_retire(w);
    kvr_lane_free(w->lane); /* closing its fd takes it out of the epoll set */
    w->lane = NULL;
    w->lane_ep = NULL;
}

int kvr_tp_ep_lane(const kvr_tp_ep_t *ep)
{
    const kvr_tp_worker_t *w = ep->w;
    return w->lane != NULL && ep->tcp_eager > 0 && !ep->failed && kvr_lane_up(w->lane) &&
           (w->lane_ep == NULL || w->lane_ep == ep);
}

int kvr_tp_ep_lane_state(const kvr_tp_ep_t *ep)
{
    const kvr_lane_t *l = ep->w->lane;
    if (l == NULL || ep->w->lane_ep != ep || kvr_lane_fd(l) < 0) {
        return -1;
    }
    return kvr_lane_up(l) ? 1 : 0;
}

void kvr_tp_lane_abandon(kvr_tp_ep_t *ep)
{
    kvr_tp_lane_drop(ep->w, ep);
}

kvr_lane_t *kvr_tp_lane_for(kvr_tp_ep_t *ep)
{
    if (!kvr_tp_ep_lane(ep)) {
        return NULL;
    }
    ep->w->lane_ep = ep; /* a prefill's endpoint is made on its first data */
    return ep->w->lane;
}

/* A handshake's token: the offering worker takes the connection. */
static int kvr_tplane_take(void *arg, const unsigned char *token, int fd)
{
    kvr_transport_t *tp = arg;
    for (kvr_tp_worker_t *w = tp->workers; w != NULL; w = w->next) {
        if (w->retired || !w->lane_offered || w->lane != NULL ||
            memcmp(w->lane_token, token, KVR_TP_LANE_TOKEN_LEN) != 0) {
            continue;
        }
        w->lane_offered = 0;
        kvr_lane_cb_t cb = kvr_tplane_cb(w);
        w->lane = kvr_lane_accepted(fd, &cb); /* closes fd when it fails */
        kvr_tp_lane_sync(w);
        return 1;
    }
    return 0;
}

/* The lanes (and the listener) the epoll set says are ready are progressed
 * (one epoll_wait, not a read per lane); the listener also whenever it has
 * connections in their handshake, for their time limit. */
unsigned kvr_tp_lanes_progress(kvr_transport_t *tp)
{
    unsigned n = 0;
    int any = tp->lanes != NULL;
    for (kvr_tp_worker_t *w = tp->workers; w != NULL && !any; w = w->next) {
        any = w->lane != NULL && !w->retired;
    }
    if (!any) {
        return 0;
    }
    struct epoll_event ev[KVR_TPLANE_EV_MAX];
    int k = epoll_wait(tp->epfd, ev, KVR_TPLANE_EV_MAX, 0);
    int listener = tp->lanes != NULL && kvr_lane_listener_waiting(tp->lanes);
    for (int i = 0; i < k; i++) {
        uint64_t tag = ev[i].data.u64 & 7u;
        if (tag == KVR_TPLANE_EV_LISTENER) {
            listener = tp->lanes != NULL;
        } else if (tag == KVR_TPLANE_EV_LANE) {
            kvr_tp_worker_t *w = (kvr_tp_worker_t *)(uintptr_t)(ev[i].data.u64 & ~(uint64_t)7u);
            if (w->lane != NULL && !w->retired) {
                n += kvr_lane_progress(w->lane);
                kvr_tp_lane_sync(w);
            }
        }
    }
    if (listener) {
        n += kvr_lane_listener_progress(tp->lanes, kvr_tplane_take, tp, kvr_now_ns());
    }
    return n;
}

int kvr_tp_lane_listen(kvr_transport_t *tp, const char *host, const char *congestion, char *err,
                       size_t errlen)
{
    if (tp->lanes != NULL) {
        return 0;
    }
    tp->lanes = kvr_lane_listen(host, congestion, err, errlen);
    if (tp->lanes == NULL) {
        return -1;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.u64 = (uint64_t)(uintptr_t)tp | KVR_TPLANE_EV_LISTENER;
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, kvr_lane_listener_fd(tp->lanes), &ev) != 0) {
        snprintf(err, errlen, "epoll_ctl: %s", strerror(errno));
        kvr_lane_listener_free(tp->lanes);
        tp->lanes = NULL;
        return -1;
    }
    return 0;
}

uint16_t kvr_tp_lane_port(const kvr_transport_t *tp)
{
    return tp->lanes != NULL ? kvr_lane_listener_port(tp->lanes) : 0;
}

int kvr_tp_lane_offer(kvr_tp_worker_t *w, unsigned char token[KVR_TP_LANE_TOKEN_LEN])
{
    if (w->tp->lanes == NULL || w->lane != NULL || w->retired) {
        return 0;
    }
    if (getrandom(w->lane_token, KVR_TP_LANE_TOKEN_LEN, 0) != KVR_TP_LANE_TOKEN_LEN) {
        return -1;
    }
    memcpy(token, w->lane_token, KVR_TP_LANE_TOKEN_LEN);
    w->lane_offered = 1;
    return kvr_lane_listener_port(w->tp->lanes);
}

int kvr_tp_lane_connect(kvr_tp_ep_t *ep, const char *host, uint16_t port,
                        const unsigned char token[KVR_TP_LANE_TOKEN_LEN], char *err,
                        size_t errlen)
{
    kvr_tp_worker_t *w = ep->w;
    kvr_tp_lane_drop(w, NULL);
    kvr_lane_cb_t cb = kvr_tplane_cb(w);
    w->lane = kvr_lane_connect(host, port, token, &cb, err, errlen);
    if (w->lane == NULL) {
        return -1;
    }
    w->lane_ep = ep;
    kvr_tp_lane_sync(w);
    return 0;
}

uint64_t kvr_tp_lane_frames(const kvr_transport_t *tp)
{
    return tp->lane_frames;
}

void kvr_tp_lane_budget(kvr_transport_t *tp, size_t bytes)
{
    tp->lane_budget = bytes;
}

void kvr_tp_test_bad_frames(kvr_transport_t *tp, int on)
{
    tp->test_bad_frames = on;
}
