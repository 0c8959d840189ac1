/*
 * proto_prefill: the control messages that arrive on our ROUTER -- on a
 * prefill, the decode ranks' HELLO, ROOM_REQ, ROOM_DONE, ROOM_FAIL, PING and
 * BYE; on either side, a sibling's SIB_FAIL -- and the prefill's registration
 * with the bootstrap server.  Also what both sides do with a message that is
 * malformed or refused before decoding.  Engine thread, lock held.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * Prefill: refuses a decode's request: tells the decode (a ROOM_FAIL with
 * code and reason, which its room fails with), fails our own room of that
 * id if it waits unbound, counts and logs.
 */
static void kvr_refuse_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m, int code,
                                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Prefill: room r's decode refused its data and then said it had every
 * byte (done_received), or said nothing since: the data path failed. */
void kvr_rejected_fail_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
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

void kvr_check_prefill_done_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (r->failing || kvr_room_terminal(r) || !r->done_received) {
        return;
    }
    if (r->rejected_ns) {
        kvr_rejected_fail_locked(e, r);
        return;
    }
    const kvr_plan_cursor_t *c = &kvr_eroom(r)->post;
    int rows = r->dst_aux >= 0 || kvr_state_any(r->dst_states);
    if (!r->inited || c->posted < r->total_pages || (rows && !c->aux_done)) {
        /* The decode cannot hold bytes this side never sent: it lies, or
         * it is talking about another room. */
        kvr_room_failf_locked(e, r, KVR_PROTOCOL, 1,
                              "%s reported every byte landed before the prefill sent them "
                              "(%u of %u pages%s posted)",
                              r->peer ? r->peer->name : "the decode", c->posted,
                              r->total_pages,
                              rows && !c->aux_done ? ", the aux and state rows not" : "");
        return;
    }
    if (kvr_room_succeed(r)) {
        kvr_room_succeeded_locked(e, r);
    }
}

void kvr_bind_request_locked(kvr_engine_t *e, kvr_room_t *r, kvr_peer_t *p, uint64_t tag,
                             int64_t aux_index, const int64_t *states,
                             kvr_slot_lists_t *lists, uint32_t npages, int32_t *pages)
{
    KVR_ASSERT_LOCKED(e);
    if (p->slice.heads && (r = kvr_group_leg_locked(e, r, p, tag)) == NULL) {
        free(pages); /* a second request of that decode rank (refused), or no memory */
        kvr_state_lists_free(lists);
        return;
    }
    kvr_state_lists_free(&r->dst_lists);
    r->dst_lists = *lists; /* taken */
    memset(lists, 0, sizeof(*lists));
    r->bound = 1;
    r->peer = p;
    r->peer_counted = 1;
    p->nrooms++;
    r->dst_tag = tag;
    r->dst_aux = aux_index;
    memcpy(r->dst_states, states, sizeof(r->dst_states));
    r->ndst = npages;
    r->dst_pages = pages;
    r->started_ns = kvr_now_ns();
    uint64_t bytes =
        (uint64_t)npages * e->page_bytes +
        kvr_state_bytes(e, aux_index, r->dst_states, &r->dst_lists);
    r->deadline_ns = kvr_deadline_ns(e, r->started_ns, bytes);
    kvr_timer_arm_locked(e, r);
    kvr_room_advance(r, KVR_POLL_WAITING);
    if (r->inited && r->total_pages != npages) {
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "decode asked for %u pages, prefill announced %u", npages,
                              r->total_pages);
        return;
    }
    kvr_work_push_locked(e, r);
}

void kvr_pending_free(kvr_engine_t *e, kvr_pending_t *pd)
{
    while (pd != NULL) {
        kvr_pending_t *next = pd->next;
        e->pending_pages -= pd->npages;
        if (pd->peer != NULL && pd->peer->nrooms > 0) {
            pd->peer->nrooms--;
        }
        free(pd->pages);
        free(pd->lists.slots);
        free(pd);
        pd = next;
    }
}

/* The state slots of request m into states, and its list components'
 * (whose entries are list lengths, made 0 here) lengths and count checked
 * into *lists (no slots yet: kvr_req_slots), or the request refused (-1).
 * The slots are the decode's own, like its pages: checked there against
 * its registration; here only that they name components this side has. */
static int kvr_req_states_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m,
                                 int64_t *states, kvr_slot_lists_t *lists)
{
    memset(lists, 0, sizeof(*lists));
    if (m->nstates > e->nstates) {
        kvr_refuse_req_locked(e, p, m, KVR_LAYOUT_MISMATCH,
                              "it asks for %u state components, this prefill has %u",
                              m->nstates, e->nstates);
        return -1;
    }
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        states[c] = c < m->nstates ? (int64_t)kvr_wire_u64_at(m->states, c) : -1;
        if (states[c] < -1) {
            kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL,
                                  "state_indices[%u]=%" PRId64 " is negative", c, states[c]);
            return -1;
        }
    }
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        if (!(e->state_list >> c & 1u) || states[c] < 0) {
            continue;
        }
        if (states[c] == 0 || states[c] > (int64_t)KVR_WIRE_MAX_PAGES) {
            kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL,
                                  "state component %u: a list of %" PRId64 " slots", c,
                                  states[c]);
            return -1;
        }
        lists->n[c] = (uint32_t)states[c];
        lists->at[c] = lists->total;
        lists->total += lists->n[c];
        states[c] = 0;
    }
    if (lists->total != m->nslots) {
        kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL,
                              "its state lists name %u slots, it carries %u", lists->total,
                              m->nslots);
        return -1;
    }
    for (uint32_t i = 0; i < m->nslots; i++) {
        if (kvr_wire_i32_at(m->slots, i) < 0) {
            kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL, "state list slot %d is negative",
                                  kvr_wire_i32_at(m->slots, i));
            return -1;
        }
    }
    return 0;
}

/* The slots of request m's lists, counted by kvr_req_states_locked;
 * -1 out of memory. */
static int kvr_req_slots(const kvr_msg_t *m, kvr_slot_lists_t *lists)
{
    if (lists->total && (lists->slots = malloc((size_t)lists->total * sizeof(int32_t))) == NULL) {
        return -1;
    }
    for (uint32_t i = 0; i < lists->total; i++) {
        lists->slots[i] = kvr_wire_i32_at(m->slots, i);
    }
    return 0;
}

/* The request of peer p among the pending requests pd of one room. */
static kvr_pending_t *kvr_pending_of(kvr_pending_t *pd, const kvr_peer_t *p)
{
    for (; pd != NULL && pd->peer != p; pd = pd->next) {
    }
    return pd;
}

void kvr_pending_peer_failed_locked(kvr_engine_t *e, const kvr_peer_t *p, int code,
                                    const char *what)
{
    KVR_ASSERT_LOCKED(e);
    kvr_pending_t *pd;
    uint64_t room;
    for (kvr_table_iter_t it = {0}; (pd = kvr_table_next(&e->pending, &it, &room)) != NULL;) {
        if (kvr_pending_of(pd, p) == NULL) {
            continue;
        }
        /* Its request is gone with it (the timers drop it): without this
         * record the sender would wait out the bootstrap timeout for a
         * request that does not come again. */
        kvr_failure_t f;
        kvr_failure_fill(&f, code, e->rank, p->name,
                         "room %" PRIu64 ": %s %s (after it asked for the room, before this "
                         "prefill's sender for it was created)",
                         room, p->name, what);
        kvr_registry_record_early(&e->registry, room, &f);
    }
}

/*
 * Head layouts (group.c): request pd of a decode rank joins the requests
 * old of other decode ranks for the same room, each to become a leg; it
 * replaces an older request of its own rank.
 */
static void kvr_pending_join(kvr_engine_t *e, uint64_t room, kvr_pending_t *old,
                             kvr_pending_t *pd)
{
    kvr_pending_t *mine = kvr_pending_of(old, pd->peer), **at = &old->next;
    if (mine == old) { /* the table's entry: the new one takes its place */
        pd->next = old->next;
        old->next = NULL;
        if (kvr_table_put(&e->pending, room, pd) != 0) {
            old->next = pd->next;
            pd->next = NULL;
            mine = pd; /* no memory: the old one stays */
        }
        kvr_pending_free(e, mine);
        return;
    }
    for (; mine != NULL && *at != mine; at = &(*at)->next) {
    }
    if (mine != NULL) {
        *at = mine->next;
        mine->next = NULL;
        kvr_pending_free(e, mine);
    }
    pd->next = old->next;
    old->next = pd;
}

/* A decode peer's key: its routing id in hex (len <= KVR_IDENT_MAX). */
static void kvr_ident_key(const void *ident, size_t len, char key[2 * KVR_IDENT_MAX + 1])
{
    key[0] = '\0';
    for (size_t i = 0; i < len; i++) {
        snprintf(key + 2 * i, 3, "%02x", ((const unsigned char *)ident)[i]);
    }
}

static kvr_peer_t *kvr_decode_peer_by_ident(kvr_engine_t *e, const void *ident, size_t len)
{
    char key[2 * KVR_IDENT_MAX + 1];
    if (len == 0 || len > KVR_IDENT_MAX) {
        return NULL;
    }
    kvr_ident_key(ident, len, key);
    return kvr_peer_find(e, KVR_PEER_IS_DECODE, key);
}

/* Prefill: the requests decode peer p has pending will not be bound to it
 * (the timers drop them). */
static void kvr_pending_release(kvr_engine_t *e, kvr_peer_t *p)
{
    kvr_pending_t *pd;
    for (kvr_table_iter_t it = {0}; (pd = kvr_table_next(&e->pending, &it, NULL)) != NULL;) {
        if ((pd = kvr_pending_of(pd, p)) != NULL) {
            p->nrooms--;
            pd->peer = NULL;
        }
    }
}

/*
 * Prefill: refuses a decode rank's HELLO with code and reason: tells the
 * decode, logs, and releases the rooms the decode already asked for through
 * this peer (they cannot move).
 */
static void kvr_hello_reject_locked(kvr_engine_t *e, kvr_peer_t *p, int code, const char *reason)
{
    KVR_ASSERT_LOCKED(e);
    kvr_msg_t reply = kvr_msg_text(KVR_MSG_HELLO_REJECT, (uint32_t)e->rank, code, reason);
    kvr_send_ctrl_to_peer(e, p, &reply);
    kvr_log_write(&e->log, KVR_LOG_WARNING, "%s", reason);
    kvr_peer_set_state(p, KVR_PEER_FAILED);
    kvr_pending_release(e, p);
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
        kvr_room_t *r;
        for (kvr_table_iter_t it = {0};
             !used && (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
            used = r->peer == p;
        }
        kvr_pending_t *pd;
        for (kvr_table_iter_t it = {0};
             !used && (pd = kvr_table_next(&e->pending, &it, NULL)) != NULL;) {
            used = kvr_pending_of(pd, p) != NULL;
        }
        if (!used) {
            kvr_peer_disconnect(e, p);
            free(p->worker_addr);
            kvr_peer_t *next = p->next, *hnext = p->hnext;
            char old[sizeof(p->key)];
            memcpy(old, p->key, sizeof(old));
            memset(p, 0, sizeof(*p));
            p->next = next;
            p->hnext = hnext;
            p->state = KVR_PEER_FAILED;
            p->kind = KVR_PEER_IS_DECODE;
            p->remote_rank = -1;
            memcpy(p->key, old, sizeof(old)); /* where the index has it */
            return kvr_peer_rekey(e, p, key) == 0 ? p : NULL;
        }
    }
    return NULL;
}

/*
 * Prefill: a HELLO under the routing id of live decode peer p, from another
 * instance (epoch): p keeps the id, its rooms and its worker; the sender is
 * refused.  A decode's routing id names its own epoch, so only a decode
 * whose previous instance died (then p is silent or failed) or a sender
 * posing as p asks this.
 */
static void kvr_hello_taken_locked(kvr_engine_t *e, kvr_peer_t *p, const void *ident,
                                   size_t ident_len, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    char reason[512];
    snprintf(reason, sizeof(reason),
             "prefill rank %d (%s) refused decode rank %u (epoch %016" PRIx64
             "): its routing id belongs to %s, which is alive (heard %" PRIu64 " ms ago)",
             e->rank, kvr_ctl_endpoint(e->ctl), m->rank, m->epoch, p->name,
             (kvr_now_ns() - p->last_heard_ns) / KVR_MS);
    e->stats.ctrl_dropped++;
    kvr_warn_limited(e, &e->refuse_log, "%s", reason);
    kvr_msg_t reply = kvr_msg_text(KVR_MSG_HELLO_REJECT, (uint32_t)e->rank, KVR_REFUSED, reason);
    reply.epoch = e->epoch;
    if (kvr_wire_encode(&e->wbuf, &reply) == 0) {
        kvr_ctl_send_router(e->ctl, ident, ident_len, e->wbuf.data, e->wbuf.len);
    }
}

/* Prefill: HELLO from a decode rank. */
static void kvr_on_hello_locked(kvr_engine_t *e, const void *ident, size_t ident_len,
                                const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    char key[2 * KVR_IDENT_MAX + 1], why[256], err[256] = "";
    kvr_ident_key(ident, ident_len, key);
    kvr_peer_t *p = kvr_peer_find(e, KVR_PEER_IS_DECODE, key);
    if (p != NULL && p->epoch != m->epoch) {
        /* Another instance under this routing id: refused while the one
         * that holds it is alive; once it is silent or failed, its rooms
         * and requests go before the new one takes the id. */
        if (p->state == KVR_PEER_READY && !kvr_peer_silent(e, p, kvr_now_ns())) {
            kvr_hello_taken_locked(e, p, ident, ident_len, m);
            return;
        }
        if (p->state == KVR_PEER_READY) {
            char what[96];
            snprintf(what, sizeof(what),
                     "restarted: epoch %016" PRIx64 " says HELLO under its routing id", m->epoch);
            kvr_peer_fail_locked(e, p, KVR_PEER_RESTARTED, what);
        }
        kvr_pending_release(e, p);
    }
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
    kvr_peer_set_state(p, KVR_PEER_READY); /* so that the reply can be sent */
    char reason[1024];
    if (live >= e->cfg.max_peers) {
        snprintf(reason, sizeof(reason),
                 "prefill rank %d (%s) refused %s: it already serves %u decode ranks "
                 "(max_peers=%u)",
                 e->rank, kvr_ctl_endpoint(e->ctl), p->name, live, e->cfg.max_peers);
        kvr_hello_reject_locked(e, p, KVR_REFUSED, reason);
        return;
    }
    if (kvr_layout_diff(e, &m->layout, why, sizeof(why)) != 0 ||
        kvr_peer_link(e, p, &m->layout, why, sizeof(why)) != 0) {
        char stage[32] = "";
        if (e->layers.pp_size > 1) {
            snprintf(stage, sizeof(stage), " of PP stage %u", e->layers.pp_rank);
        }
        snprintf(reason, sizeof(reason),
                 "layout mismatch between prefill rank %d%s (%s) and %s: %s", e->rank, stage,
                 kvr_ctl_endpoint(e->ctl), p->name, why);
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
    /* A decode that does not say (an older build) uses UCX's defaults. */
    uint32_t seg, fifo;
    kvr_tp_shm_sizes(e->tp, &seg, &fifo);
    uint32_t dseg = m->has_shm ? m->shm_seg : KVR_TP_SHM_SEG_UCX_DEFAULT;
    uint32_t dfifo = m->has_shm ? m->shm_fifo : KVR_TP_SHM_FIFO_UCX_DEFAULT;
    if (seg && fifo && dseg && dfifo && (seg != dseg || fifo != dfifo)) {
        snprintf(reason, sizeof(reason),
                 "UCX shared-memory segments of prefill rank %d (%s) are %" PRIu32
                 " bytes in a FIFO of %" PRIu32 ", %s's %" PRIu32 " in %" PRIu32
                 " (UCX_MM_SEG_SIZE, UCX_MM_FIFO_SIZE): UCX would stop or overrun "
                 "between them; set the same on both",
                 e->rank, kvr_ctl_endpoint(e->ctl), seg, fifo, p->name, dseg, dfifo);
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
    kvr_wire_layout_t layout;
    kvr_fill_layout(e, &layout);
    const void *own;
    size_t own_len;
    kvr_tp_address(p->worker, &own, &own_len);
    kvr_msg_t reply = kvr_msg_hello(KVR_MSG_HELLO_OK, (uint32_t)e->rank, &layout, own,
                                    (uint32_t)own_len);
    kvr_cma_accept(e, p, m, &reply);
    int port = m->has_lane && e->cfg.tcp_lane && e->ndev == 0
                   ? kvr_tp_lane_offer(p->worker, reply.lane_token)
                   : 0;
    if (port > 0) {
        reply.has_lane = 1;
        reply.lane_port = (uint16_t)port;
    }
    kvr_send_ctrl_to_peer(e, p, &reply);
}

static void kvr_refuse_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m, int code,
                                  const char *fmt, ...)
{
    KVR_ASSERT_LOCKED(e);
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
    kvr_msg_t f = kvr_msg_fail(KVR_MSG_ROOM_FAIL, m->room, m->tag, code, e->rank, reason, NULL);
    kvr_send_ctrl_to_peer(e, p, &f);
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    if (r != NULL && !r->bound && !kvr_room_terminal(r) && !r->failing) {
        kvr_failure_t fl;
        kvr_failure_fill(&fl, code, e->rank, p->name, "%s", reason);
        kvr_room_fail_locked(e, r, &fl, 0);
    }
}

static void kvr_on_room_req_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
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
    int64_t states[KVR_MAX_STATES];
    kvr_slot_lists_t lists;
    if (kvr_req_states_locked(e, p, m, states, &lists) != 0) {
        return;
    }
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    int fresh = r != NULL && !r->bound && !kvr_room_terminal(r) && !r->failing;
    if (r != NULL && !fresh) {
        /* A request for a room that failed here before any decode asked
         * for it (an abort on the prefill, say) gets that cause.  A second
         * request for a room already bound (the decode restarted the room,
         * or a stale duplicate) is refused explicitly. */
        kvr_failure_t rec;
        char reason[KVR_REASON_MAX];
        int code = KVR_PROTOCOL;
        if (!r->bound && r->failing && r->fail_code) {
            code = r->fail_code;
            if (kvr_registry_peek(&e->registry, r->id, &rec)) {
                snprintf(reason, sizeof(reason), "%s", rec.reason);
            } else {
                snprintf(reason, sizeof(reason), "room %" PRIu64 ": %s on prefill rank %d",
                         m->room, kvr_status_message(r->fail_code), e->rank);
            }
        } else {
            snprintf(reason, sizeof(reason), "room %" PRIu64 ": prefill rank %d already serves it",
                     m->room, e->rank);
        }
        kvr_msg_t f = kvr_msg_fail(KVR_MSG_ROOM_FAIL, m->room, m->tag, code, e->rank, reason, NULL);
        kvr_send_ctrl_to_peer(e, p, &f);
        return;
    }
    kvr_pending_t *old = r == NULL ? kvr_table_get(&e->pending, m->room) : NULL;
    if (old != NULL && old->peer != NULL && old->peer != p && !p->slice.heads) {
        /* First come keeps it: a later decode must not take over the room
         * (the first would wait for its deadline while the other got the
         * KV). */
        kvr_refuse_req_locked(e, p, m, KVR_PROTOCOL, "%.100s already asked for this room",
                              old->peer->name);
        return;
    }
    int replaces = kvr_pending_of(old, p) != NULL;
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
    if (kvr_req_slots(m, &lists) != 0) {
        return;
    }
    if (m->npages) {
        pages = malloc((size_t)m->npages * sizeof(int32_t));
        if (pages == NULL) {
            free(lists.slots);
            return;
        }
        for (uint32_t i = 0; i < m->npages; i++) {
            pages[i] = kvr_wire_i32_at(m->pages, i);
        }
    }
    if (fresh) {
        r->prefix_len = m->prefix_len;
        kvr_bind_request_locked(e, r, p, m->tag, m->aux_index, states, &lists, m->npages,
                                pages);
        return;
    }
    kvr_pending_t *pd = calloc(1, sizeof(*pd));
    if (pd == NULL) {
        free(pages);
        free(lists.slots);
        return;
    }
    pd->lists = lists;
    pd->peer = p;
    p->nrooms++;
    pd->tag = m->tag;
    pd->aux_index = m->aux_index;
    memcpy(pd->states, states, sizeof(states));
    pd->npages = m->npages;
    e->pending_pages += m->npages;
    pd->pages = pages;
    pd->prefix_len = m->prefix_len;
    pd->arrived_ns = kvr_now_ns();
    if (old != NULL && p->slice.heads) {
        kvr_pending_join(e, m->room, old, pd);
        return;
    }
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
static void kvr_on_room_fail_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *r = kvr_group_room_for_peer(e, m->room, p);
    uint64_t mytag = r == NULL ? 0 : e->mode == KVR_MODE_DECODE ? r->tag : r->dst_tag;
    /* A prefill room no decode has bound yet fails with the decode's cause
     * (the decode gave up on it before asking, e.g. a rejected layout). */
    int unbound = r != NULL && e->mode == KVR_MODE_PREFILL && !r->bound;
    if (r == NULL && e->mode == KVR_MODE_PREFILL) {
        kvr_pending_t *pd = kvr_table_get(&e->pending, m->room), *mine = kvr_pending_of(pd, p);
        if (pd != NULL && (mine == NULL || mine->tag != m->tag)) {
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
    kvr_failure_from_msg(&f, m, p->name);
    f.from_remote = 1;
    /* Rank r talks to rank r: a cause that originated at another rank came
     * through that rank's siblings, and ours will hear it from theirs. */
    f.from_sibling = m->origin_rank >= 0 && m->origin_rank != e->rank;
    if (r == NULL) {
        if (e->mode == KVR_MODE_PREFILL) {
            /* Kept for a sender not created yet (see kvr_handle_open). */
            kvr_registry_record_early(&e->registry, m->room, &f);
        }
        return;
    }
    kvr_room_fail_locked(e, r, &f, 0);
}

void kvr_on_peer_msg_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    switch (m->type) {
    case KVR_MSG_ROOM_FAIL:
        kvr_on_room_fail_locked(e, p, m);
        break;
    case KVR_MSG_BYE:
        kvr_peer_fail_locked(e, p, KVR_PEER_LOST, "closed its manager");
        break;
    case KVR_MSG_PATH_LOST: {
        /* It failed our rooms and closed its side of the data path: so do
         * we, now, rather than when the dead connection errors out (which
         * would fail a room opened meanwhile). */
        char what[160];
        snprintf(what, sizeof(what),
                 "lost: it found its data path to this %s stalled while the control channel "
                 "still answered, and dropped it",
                 kvr_side(e));
        kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
        break;
    }
    default:
        e->stats.ctrl_dropped++;
    }
}

/* Counts a malformed control message; logs at most one line a second. */
void kvr_drop_locked(kvr_engine_t *e, size_t len, const char *why)
{
    KVR_ASSERT_LOCKED(e);
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
void kvr_on_refused(kvr_engine_t *e, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
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

void kvr_on_router_msg(void *arg, const void *ident, size_t ident_len, const void *data,
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
        kvr_on_sib_fail_locked(e, ident, ident_len, &m);
        return;
    }
    kvr_peer_t *p = kvr_decode_peer_by_ident(e, ident, ident_len);
    if (m.type == KVR_MSG_PING) {
        /* Decode ranks' heartbeats, and siblings asking who we are. */
        kvr_msg_t pong = kvr_msg_rank(KVR_MSG_PONG, (uint32_t)e->rank);
        pong.epoch = e->epoch;
        if (p && p->epoch == m.epoch) {
            p->last_heard_ns = kvr_now_ns(); /* not kept alive by another instance */
        }
        if (kvr_wire_encode(&e->wbuf, &pong) == 0) {
            kvr_ctl_send_router(e->ctl, ident, ident_len, e->wbuf.data, e->wbuf.len);
        }
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
        kvr_on_hello_locked(e, ident, ident_len, &m);
        return;
    }
    if (p != NULL && p->epoch == m.epoch && p->state == KVR_PEER_FAILED &&
        m.type == KVR_MSG_ROOM_FAIL) {
        /* A decode we rejected reports the rooms it gave up on. */
        kvr_on_room_fail_locked(e, p, &m);
        return;
    }
    if (p == NULL || p->epoch != m.epoch || p->state != KVR_PEER_READY) {
        e->stats.ctrl_dropped++;
        return;
    }
    p->last_heard_ns = kvr_now_ns();
    switch (m.type) {
    case KVR_MSG_ROOM_REQ:
        kvr_on_room_req_locked(e, p, &m);
        break;
    case KVR_MSG_ROOM_DONE: {
        kvr_room_t *r = kvr_group_room_for_peer(e, m.room, p);
        if (r && r->peer == p && r->dst_tag == m.tag) {
            r->done_received = 1;
            kvr_check_prefill_done_locked(e, r);
        }
        break;
    }
    default:
        kvr_on_peer_msg_locked(e, p, &m);
    }
}

void kvr_register_tick_locked(kvr_engine_t *e, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    if (e->mode != KVR_MODE_PREFILL || e->registered || e->bs_conn == NULL ||
        now < e->next_register_ns) {
        return;
    }
    kvr_msg_t m = kvr_msg_bs(KVR_MSG_BS_REGISTER, e->dp_rank, (uint32_t)e->rank, e->layers.pp_rank,
                             kvr_ctl_endpoint(e->ctl));
    kvr_send_conn_locked(e, e->bs_conn, &m);
    e->next_register_ns = now + 200 * KVR_MS;
}
