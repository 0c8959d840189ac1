/*
 * handle: the calls the binding makes on a room (engine.h): open, init,
 * send_metadata, send, poll, failure, abort, clear, release.  Any thread;
 * each takes the engine lock briefly (poll only tries it) and wakes the
 * engine thread when it left work for it.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The end of an API call that handed the engine work: the lock released,
 * then the engine thread woken if the call succeeded.  Returns rc. */
static int kvr_handle_unlock_wake(kvr_engine_t *e, int rc)
{
    kvr_engine_unlock(e);
    if (rc == 0) {
        kvr_wake(e);
    }
    return rc;
}

static kvr_engine_t *kvr_handle_engine(kvr_handle_t *h)
{
    return kvr_eroom(h)->owner;
}

/* Takes the lock and checks that the handle is usable. */
static int kvr_handle_enter(kvr_handle_t *h, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    kvr_engine_lock(e);
    if (e->closed) {
        kvr_engine_unlock(e);
        return kvr_err(err, errlen, KVR_ERUNTIME, "the manager is closed");
    }
    if (!h->in_table) {
        kvr_engine_unlock(e);
        return kvr_err(err, errlen, KVR_ERUNTIME, "room %" PRIu64 " was cleared", h->id);
    }
    return 0;
}

/* Checks page indices against the registered pages. */
static int kvr_handle_pages_check(const kvr_engine_t *e, const int32_t *pages, size_t n, char *err,
                                  size_t errlen)
{
    long bad = kvr_pages_check(pages, n, e->min_pages);
    if (bad >= 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "kv_indices[%ld]=%d is outside the registered pages [0, %" PRId64 ")", bad,
                       pages[bad], e->min_pages);
    }
    return 0;
}

/* A decode page or list slot named twice in a room would get two writes
 * landing in no defined order: refused.  The pages are checked before the
 * engine's lock is taken; a window's list slots (few) after kvr_state_take,
 * under it. */
static int kvr_handle_repeat_check(const int32_t *v, size_t n, const char *what,
                                   const char *unit, char *err, size_t errlen)
{
    long first = -1, again = kvr_pages_repeat(v, n, &first);
    if (again == -2) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    if (again >= 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "%s[%ld] and %s[%ld] are both %s %d: a decode %s can receive one %s of "
                       "a room",
                       what, first, what, again, unit, v[again], unit, unit);
    }
    return 0;
}

int kvr_handle_open(kvr_engine_t *e, uint64_t room, const char *bootstrap_addr,
                    kvr_handle_t **h_p, char *err, size_t errlen)
{
    kvr_engine_lock(e);
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
    kvr_room_t *r = kvr_room_new(sizeof(kvr_eroom_t), room, kvr_new_tag_locked(e),
                                 e->mode == KVR_MODE_PREFILL ? KVR_ROLE_PREFILL : KVR_ROLE_DECODE);
    if (r == NULL) {
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto out;
    }
    kvr_eroom(r)->owner = e;
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
        kvr_now_ns() - prior.time_ns < e->cfg.bootstrap_timeout_ms * KVR_MS) {
        /* A sibling or the peer failed this room before this rank opened
         * it, or the decode that asked for it failed (a prefill). */
        kvr_room_fail_locked(e, r, &prior, 0);
    }
    if (e->mode == KVR_MODE_PREFILL) {
        /* Wait for the decode's request, within the bootstrap timeout. */
        r->started_ns = kvr_now_ns();
        r->deadline_ns = r->started_ns + e->cfg.bootstrap_timeout_ms * KVR_MS;
        kvr_timer_arm_locked(e, r);
        kvr_pending_t *pd = kvr_table_remove(&e->pending, room);
        for (kvr_pending_t *q = pd; q != NULL; q = q->next) { /* several: head layouts */
            if (q->peer != NULL && q->peer->state == KVR_PEER_READY) {
                r->prefix_len = q->prefix_len;
                kvr_bind_request_locked(e, r, q->peer, q->tag, q->aux_index, q->states,
                                        &q->lists, q->npages, q->pages);
                q->pages = NULL;
            }
        }
        kvr_pending_free(e, pd);
    }
    *h_p = r;
out:
    kvr_engine_unlock(e);
    return rc;
}

static void kvr_handle_drop_locked(kvr_engine_t *e, kvr_room_t *r, const char *why)
{
    KVR_ASSERT_LOCKED(e);
    if (!r->in_table) {
        return;
    }
    if (!kvr_room_terminal(r) && !r->failing) {
        kvr_room_failf_locked(e, r, KVR_ABORTED, 1, "%s", why);
    }
    kvr_table_remove(&e->rooms, r->id);
    r->in_table = 0;
    kvr_timer_arm_locked(e, r);
    if (r->peer_counted && r->peer != NULL && r->peer->nrooms > 0) {
        r->peer->nrooms--;
    }
    r->peer_counted = 0;
    kvr_registry_drop(&e->registry, r->id);
    kvr_group_drop_locked(e, r);
    kvr_work_push_locked(e, r);
    kvr_room_unref_locked(e, r);
}

void kvr_handle_release(kvr_handle_t *h)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    kvr_engine_lock(e);
    if (!e->closed) {
        kvr_handle_drop_locked(e, h, "the room's handle was released while in flight");
    }
    h->released = 1;
    kvr_room_unref_locked(e, h);
    int wake = !e->closed;
    kvr_engine_unlock(e);
    if (wake) {
        kvr_wake(e);
    }
}

int kvr_handle_recv_init(kvr_handle_t *h, int prefill_dp_rank, const char *bootstrap_addr,
                         uint32_t prefill_tp_size, uint32_t prefill_pp_size, char *err,
                         size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    int rc = kvr_handle_enter(h, err, errlen);
    if (rc) {
        return rc;
    }
    if (h->init_called) {
        rc = kvr_err(err, errlen, KVR_ERUNTIME, "init() was already called for room %" PRIu64,
                     h->id);
        goto out;
    }
    if (prefill_dp_rank < 0 || prefill_dp_rank > KVR_WIRE_MAX_DP_PP) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "prefill_dp_rank=%d is not in [0, %d]",
                     prefill_dp_rank, KVR_WIRE_MAX_DP_PP);
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
    if (prefill_pp_size > KVR_MAX_PP) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "prefill_pp_size=%u is above %d", prefill_pp_size,
                     KVR_MAX_PP);
        goto out;
    }
    if ((prefill_tp_size > 0 || prefill_pp_size > 0) && !h->failing) {
        /* Heads from prefill ranks chosen by the head layouts, layers from
         * every PP stage (group.c). */
        rc = kvr_group_open_locked(e, h, (uint32_t)prefill_dp_rank, prefill_tp_size,
                                   prefill_pp_size, err, errlen);
        h->init_called = rc == 0;
        goto out;
    }
    h->init_called = 1;
    if (h->failing) {
        goto out;
    }
    kvr_peer_t *p = kvr_prefill_peer_get(e, h->bootstrap_addr, (uint32_t)prefill_dp_rank, -1, -1);
    if (p == NULL) {
        rc = kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        goto out;
    }
    h->peer = p;
    kvr_work_push_locked(e, h);
out:
    return kvr_handle_unlock_wake(e, rc);
}

int kvr_handle_send_metadata(kvr_handle_t *h, const int32_t *pages, size_t n, int64_t aux_index,
                             const int64_t *states, uint32_t nstates, const kvr_state_in_t *in,
                             uint32_t prefix_len, char *err, size_t errlen)
{
    kvr_slot_lists_t lists = {0};
    kvr_engine_t *e = kvr_handle_engine(h);
    int rc = kvr_handle_repeat_check(pages, n, "kv_indices", "page", err, errlen);
    if (rc != 0) {
        return rc;
    }
    rc = kvr_handle_enter(h, err, errlen);
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
    rc = kvr_handle_pages_check(e, pages, n, err, errlen);
    if (rc != 0) {
        goto out;
    }
    if (n > KVR_WIRE_MAX_PAGES) {
        rc = kvr_err(err, errlen, KVR_EVALUE, "kv_indices has %zu pages, more than %u", n,
                     KVR_WIRE_MAX_PAGES);
        goto out;
    }
    if (aux_index >= 0 && e->naux == e->nstate) {
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
    int64_t slots[KVR_MAX_STATES];
    rc = kvr_state_take(e, states, nstates, in, slots, &lists, err, errlen);
    for (uint32_t c = 0; c < KVR_MAX_STATES && rc == 0; c++) {
        if (lists.n[c] < 2) {
            continue;
        }
        char what[32];
        snprintf(what, sizeof(what), "state_indices[%u]", c);
        rc = kvr_handle_repeat_check(lists.slots + lists.at[c], lists.n[c], what, "slot", err,
                                     errlen);
    }
    if (rc != 0) {
        goto out;
    }
    if (n == 0 && (aux_index < 0 || e->naux == e->nstate) && !kvr_state_any(slots)) {
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
    memcpy(h->states, slots, sizeof(slots));
    h->lists = lists; /* taken */
    memset(&lists, 0, sizeof(lists));
    h->claim_lists = kvr_state_list_bit(e, &h->lists, e->naux);
    h->prefix_len = prefix_len;
    h->expected =
        (uint64_t)n * e->page_bytes + kvr_state_bytes(e, aux_index, h->states, &h->lists);
    h->meta_set = 1;
    if (h->nlegs > 0 && kvr_group_meta_locked(e, h) != 0) {
        kvr_room_failf_locked(e, h, KVR_TRANSPORT, 1, "out of memory handing pages to the legs");
    }
    kvr_work_push_locked(e, h);
out:
    kvr_state_lists_free(&lists);
    return kvr_handle_unlock_wake(e, rc);
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
    if (aux_index >= 0 && (e->naux == e->nstate || aux_index >= e->aux_rows)) {
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
    kvr_group_sync_locked(e, h);
out:
    return kvr_handle_unlock_wake(e, rc);
}

int kvr_handle_send(kvr_handle_t *h, const int32_t *pages, size_t n, const int64_t *states,
                    uint32_t nstates, const kvr_state_in_t *in, char *err, size_t errlen)
{
    kvr_slot_lists_t lists = {0};
    int64_t slots[KVR_MAX_STATES];
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
    rc = kvr_handle_pages_check(e, pages, n, err, errlen);
    if (rc == 0) {
        rc = kvr_state_take(e, states, nstates, in, slots, &lists, err, errlen);
    }
    if (rc != 0) {
        goto out;
    }
    if (h->failing || kvr_room_terminal(h)) {
        goto out; /* poll() reports the failure */
    }
    if (n) {
        memcpy(h->src_pages + h->given, pages, n * sizeof(int32_t));
    }
    if (nstates) { /* sglang: with the last chunk */
        memcpy(h->src_states, slots, sizeof(slots));
        kvr_state_lists_free(&h->src_lists);
        h->src_lists = lists; /* taken */
        memset(&lists, 0, sizeof(lists));
    }
    h->given += (uint32_t)n;
    if (h->given == h->total_pages && n) {
        h->ready_ns = kvr_now_ns();
    }
    wake = 1;
    if (e->tp != NULL) {
        kvr_tp_lane_budget(e->tp, KVR_LANE_INLINE_BYTES);
    }
    kvr_group_sync_locked(e, h); /* a lead's legs get the pages and post them */
    if (h->bound && h->peer != NULL && h->peer->state == KVR_PEER_READY) {
        /* Post from the caller's thread: the worker is serialized by the
         * engine lock, and a message that leaves at once (eager) then needs
         * no hand-off to the engine thread.  Only what needs progress or a
         * socket (rendezvous in flight, a notice, a sibling message) wakes
         * it.  Also when the room still waits on the work list: the
         * request that bound it was just handled, and a caller that saw
         * WaitingForInput and sent at once waited for the engine thread to
         * wake (2 of 3 one-page rooms of the latency benchmark).  Posting
         * resumes from the room's cursor, so the entry, if left, finds
         * nothing more to post.  Not when posting failed the room: the
         * entry then carries the notice to the decode, which only the
         * engine thread sends. */
        kvr_post_locked(e, h);
        kvr_check_prefill_done_locked(e, h);
        if (kvr_eroom(h)->notice == NULL) {
            kvr_work_drop_head_locked(e, h);
        }
        wake = h->inflight > 0 || e->work_head != NULL || e->sib_pending;
    } else {
        kvr_work_push_locked(e, h);
    }
out:
    kvr_state_lists_free(&lists);
    kvr_engine_unlock(e);
    if (rc == 0 && wake) {
        kvr_wake(e);
    }
    return rc;
}

uint32_t kvr_handle_prefix_len(kvr_handle_t *h)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    kvr_engine_lock(e);
    uint32_t n = h->prefix_len; /* prefill: set when the request is bound */
    kvr_engine_unlock(e);
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
    if (now - last < KVR_POLL_PROGRESS_NS || kvr_engine_trylock(e) != 0) {
        return v;
    }
    atomic_store_explicit(&e->poll_progress_ns, now, memory_order_relaxed);
    int wake = 0;
    if (kvr_peers_silent_locked(e, now)) {
        /* This process may have been suspended: the engine thread declares
         * the silent peer lost before anything queued meanwhile is taken. */
        wake = 1;
    } else if (!e->stopping && e->tp != NULL && e->ndev == 0) {
        e->off_thread = 1;
        unsigned n = kvr_tp_progress(e->tp) + kvr_cma_poll_locked(e);
        e->off_thread = 0;
        e->stats.poll_progressed += n;
        wake = n > 0;
        wake |= e->work_head != NULL || e->ep_err_pending;
    }
    kvr_engine_unlock(e);
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
    kvr_engine_lock(e);
    uint32_t w = e->nsib > 0 ? e->cfg.sibling_wait_ms : 0;
    kvr_engine_unlock(e);
    return w;
}

int kvr_handle_abort(kvr_handle_t *h, char *err, size_t errlen)
{
    kvr_engine_t *e = kvr_handle_engine(h);
    kvr_engine_lock(e);
    if (!e->closed && h->in_table && !kvr_room_terminal(h) && !h->failing) {
        char stage[32] = "";
        if (e->layers.pp_size > 1) {
            snprintf(stage, sizeof(stage), " of PP stage %u", e->layers.pp_rank);
        }
        kvr_room_failf_locked(e, h, KVR_ABORTED, 1, "aborted by %s rank %d%s", kvr_side(e),
                              e->rank, stage);
        kvr_work_push_locked(e, h);
    }
    kvr_engine_unlock(e);
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
    kvr_engine_lock(e);
    if (!e->closed) {
        kvr_handle_drop_locked(e, h, "cleared while in flight");
    }
    kvr_engine_unlock(e);
    kvr_wake(e);
    return 0;
}

int kvr_handle_role(kvr_handle_t *h)
{
    return h->role == KVR_ROLE_DECODE ? KVR_MODE_DECODE : KVR_MODE_PREFILL;
}
