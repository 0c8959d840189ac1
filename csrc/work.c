/*
 * work: the engine's side of a room -- its references, the work list the
 * API calls fill and the engine thread drains, and the bookkeeping of a
 * room failing (root cause, siblings, notice to the peer) or succeeding.
 * The pure state machine these drive is room.c.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvr_room_ref(kvr_room_t *r)
{
    r->refs++;
}

void kvr_room_unref_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (--r->refs > 0) {
        return;
    }
    if (kvr_table_get(&e->tags, r->tag) == r) {
        kvr_table_remove(&e->tags, r->tag);
    }
    kvr_room_t *lead = r->lead;
    kvr_eroom_free(r);
    if (lead != NULL) {
        kvr_room_unref_locked(e, lead); /* a leg's reference to its lead */
    }
}

void kvr_eroom_free(kvr_room_t *r)
{
    KVR_ASSERT(!kvr_heap_contains(&kvr_eroom(r)->timer));
    free(kvr_eroom(r)->notice);
    kvr_cma_lease_end(r);
    kvr_room_free(r);
}

void kvr_room_list_push(kvr_room_t **head, kvr_room_t *r, int *on, kvr_room_t **next)
{
    if (*on) {
        return;
    }
    *on = 1;
    kvr_room_ref(r);
    *next = *head;
    *head = r;
}

void kvr_work_push_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_list_push(&e->work_head, r, &kvr_eroom(r)->on_work, &kvr_eroom(r)->work_next);
}

int kvr_work_drop_head_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (e->work_head != r) {
        return 0;
    }
    e->work_head = kvr_eroom(r)->work_next;
    kvr_eroom(r)->on_work = 0;
    kvr_eroom(r)->work_next = NULL;
    kvr_room_unref_locked(e, r);
    return 1;
}

/*
 * Records the root cause for room r (first wins) and starts failing it.
 * notify: tell the peer.  Returns 1 if this was the first failure.
 */
int kvr_room_fail_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_failure_t *f,
                         int notify)
{
    KVR_ASSERT_LOCKED(e);
    if (!kvr_room_fail(r, f->code)) {
        return 0;
    }
    kvr_cma_lease_end(r); /* before anyone can see it failed */
    r->failing_since_ns = kvr_now_ns();
    kvr_timer_arm_locked(e, r);          /* no deadline any more */
    kvr_timer_watch_drain_locked(e, r);  /* until its operations are done */
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
    kvr_group_fail_locked(e, r, f);
    e->stats.failures_by_code[f->code < KVR_STATUS_LAST ? f->code : 0]++;
    /* Logged once, where it happened; echoes only at debug level. */
    kvr_log_write(&e->log, f->from_remote || f->from_sibling ? KVR_LOG_DEBUG : KVR_LOG_WARNING,
                  "%s rank %d: %s: %s%s", kvr_side(e), e->rank, kvr_status_name(f->code),
                  f->reason, f->from_sibling ? " (from another rank)"
                                             : f->from_remote ? " (reported by the peer)" : "");
    kvr_eroom_t *x = kvr_eroom(r);
    if (notify && r->peer != NULL && x->notice == NULL) {
        /* Sockets belong to the engine thread: it sends the notice. */
        x->notice = malloc(sizeof(kvr_failure_t));
        if (x->notice != NULL) {
            memcpy(x->notice, f, sizeof(*f));
            kvr_work_push_locked(e, r);
        }
    }
    kvr_room_settle(r);
    return 1;
}

/* The root cause a ROOM_FAIL or SIB_FAIL message carries; peer: who sent
 * it, or NULL for the peer the message names.  An unknown code becomes
 * KVR_REMOTE. */
void kvr_failure_from_msg(kvr_failure_t *f, const kvr_msg_t *m, const char *peer)
{
    memset(f, 0, sizeof(*f));
    f->code = m->code > KVR_OK && m->code < KVR_STATUS_LAST ? m->code : KVR_REMOTE;
    f->origin_rank = m->origin_rank;
    f->time_ns = kvr_now_ns();
    snprintf(f->reason, sizeof(f->reason), "%.*s", (int)m->str_len, m->str);
    if (peer != NULL) {
        snprintf(f->peer, sizeof(f->peer), "%s", peer);
    } else {
        snprintf(f->peer, sizeof(f->peer), "%.*s", (int)m->peer_len, m->peer);
    }
}

/* Engine thread: tells the room's peer about the room's failure. */
static void kvr_send_notice_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_failure_t *f = kvr_eroom(r)->notice;
    kvr_eroom(r)->notice = NULL;
    if (r->peer != NULL && r->peer->state == KVR_PEER_READY) {
        kvr_msg_t m = kvr_msg_fail(KVR_MSG_ROOM_FAIL, r->id,
                                   e->mode == KVR_MODE_DECODE ? r->tag : r->dst_tag, f->code,
                                   f->origin_rank, f->reason, f->peer);
        kvr_send_ctrl_to_peer(e, r->peer, &m);
    }
    free(f);
}

int kvr_room_failf_locked(kvr_engine_t *e, kvr_room_t *r, int code, int notify,
                          const char *fmt, ...)
{
    KVR_ASSERT_LOCKED(e);
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

/* A room just became Success: the counter and the per-room histograms
 * (what they measure is documented at kvr_stats_t). */
void kvr_room_succeeded_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    uint64_t now = kvr_now_ns();
    uint64_t from = r->started_ns; /* decode: request sent; prefill: request bound */
    if (e->mode == KVR_MODE_PREFILL && r->ready_ns > from) {
        from = r->ready_ns;
    }
    e->stats.rooms_succeeded++;
    kvr_hist_observe(&e->stats.transfer_latency, KVR_HIST_LATENCY, now > from ? now - from : 0);
    kvr_hist_observe(&e->stats.room_ops, KVR_HIST_OPS, r->ops_posted);
}

static void kvr_service_room_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (kvr_eroom(r)->notice) {
        kvr_send_notice_locked(e, r);
    }
    if (kvr_eroom(r)->done_pending) {
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
            if (r->meta_set && !r->req_sent && kvr_group_may_request_locked(e, r)) {
                kvr_decode_send_req_locked(e, r);
            }
        }
    } else {
        kvr_post_locked(e, r);
        kvr_check_prefill_done_locked(e, r);
    }
}

void kvr_service_peer_rooms_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r != NULL && r->peer == p) {
            kvr_service_room_locked(e, r);
        }
    }
}

void kvr_drain_work_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    while (e->work_head) {
        kvr_room_t *r = e->work_head;
        e->work_head = kvr_eroom(r)->work_next;
        kvr_eroom(r)->on_work = 0;
        kvr_eroom(r)->work_next = NULL;
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
