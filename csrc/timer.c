/*
 * timer: what the engine thread does because time passed -- registration
 * retries, peer timeouts and heartbeats, the force-drain of rooms whose
 * operations a dead peer left hanging, expired pending requests, and room
 * deadlines.  Every function here runs on the engine thread with the engine
 * lock held, except the two that say otherwise.
 *
 * Rooms are never scanned: an open room with a deadline (or an unexplained
 * rejection to time out) sits in e->deadlines, a min-heap keyed by the
 * earliest of them, and a pass looks only at the rooms due; a failing room
 * with operations in flight sits on e->draining until they are done.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

/* A ready peer silent for longer than the heartbeat timeout is lost.
 * Returns 1 if it was declared lost. */
static int kvr_timer_silence_locked(kvr_engine_t *e, kvr_peer_t *p, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    if (!kvr_peer_silent(e, p, now)) {
        return 0;
    }
    char what[200];
    snprintf(what, sizeof(what), "lost: no heartbeat for %" PRIu64 " ms",
             (now - p->last_heard_ns) / KVR_MS);
    e->stats.heartbeats_missed++;
    kvr_peer_fail_locked(e, p, KVR_PEER_LOST, what);
    return 1;
}

/* Decode: a prefill peer's bootstrap timeout, query retries, verification
 * timeout, heartbeat silence and pings. */
static void kvr_timer_prefill_peer_locked(kvr_engine_t *e, kvr_peer_t *p, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
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
            kvr_bs_query(e, p, p->bs_conn);
            p->next_try_ns = now + 200 * KVR_MS;
        } else if (p->state == KVR_PEER_CONNECTING && p->lane_wait) {
            kvr_decode_lane_settled_locked(e, p, now);
        } else if (p->state == KVR_PEER_CONNECTING && now >= p->next_try_ns) {
            kvr_decode_hello_locked(e, p);
        }
        return;
    }
    if (p->state != KVR_PEER_READY) {
        return;
    }
    if (p->verifying && now > p->verify_deadline_ns) {
        /* The bootstrap server did not answer: keep the peer. */
        kvr_peer_verified_locked(e, p, 0, 0);
    }
    if (p->state != KVR_PEER_READY || kvr_timer_silence_locked(e, p, now)) {
        return;
    }
    if (now >= p->next_ping_ns) {
        kvr_msg_t m = kvr_msg_rank(KVR_MSG_PING, (uint32_t)e->rank);
        kvr_send_ctrl_to_peer(e, p, &m);
        p->next_ping_ns = now + e->cfg.heartbeat_interval_ms * KVR_MS;
    }
}

static void kvr_timer_peers_locked(kvr_engine_t *e, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->kind == KVR_PEER_IS_PREFILL) {
            kvr_timer_prefill_peer_locked(e, p, now);
        } else if (p->state == KVR_PEER_READY) {
            kvr_timer_silence_locked(e, p, now);
        }
    }
}

/* Declares silent peers lost; run before UCX is progressed, so that after
 * this process was suspended nothing queued meanwhile is taken first. */
void kvr_timer_silences_locked(kvr_engine_t *e)
{
    uint64_t now = kvr_now_ns();
    for (kvr_peer_t *p = e->peers; p; p = p->next) {
        if (p->state == KVR_PEER_READY) {
            kvr_timer_silence_locked(e, p, now);
        }
    }
}

/* Time from t to now, 0 if t is later: rooms failed in this pass (their
 * deadline) were stamped after the pass took its `now`. */
static uint64_t kvr_timer_since(uint64_t now, uint64_t t)
{
    return now > t ? now - t : 0;
}

/*
 * Failing rooms whose peer was declared dead (heartbeat silence, endpoint
 * error) but whose operations never completed: UCX endpoints without
 * peer-failure support (shared memory in UCX 1.13) do not fail them.
 * Ask UCX to cancel them at once, and after two heartbeat intervals
 * declare the room drained.  A dead peer sends nothing more; a live one
 * (an abort) is always waited for.
 */
static void kvr_timer_drains_locked(kvr_engine_t *e, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    kvr_peer_t *stalled = NULL;
    uint64_t stalled_ms = 0;
    /* Rooms whose operations are done leave the list first: the pass below
     * may complete operations (a cancel) and free rooms it holds no
     * reference to otherwise. */
    for (kvr_room_t **pp = &e->draining; *pp != NULL;) {
        kvr_room_t *r = *pp;
        if (r->inflight > 0) {
            pp = &kvr_eroom(r)->drain_next;
            continue;
        }
        *pp = kvr_eroom(r)->drain_next;
        kvr_eroom(r)->drain_next = NULL;
        kvr_eroom(r)->draining = 0;
        kvr_room_unref_locked(e, r);
    }
    for (kvr_room_t *r = e->draining, *rnext; r != NULL; r = rnext) {
        rnext = kvr_eroom(r)->drain_next; /* the list's reference keeps both */
        KVR_ASSERT(r->failing);
        if (r->inflight == 0 || r->stage_copies > 0) {
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
            for (kvr_op_t *op = kvr_eroom(r)->ops; op != NULL; op = op->next) {
                bytes += op->len;
            }
            uint64_t grace = e->cfg.heartbeat_timeout_ms * KVR_MS + kvr_floor_ns(e, bytes);
            if (stalled == NULL && kvr_timer_since(now, r->failing_since_ns) > grace &&
                kvr_timer_since(now, r->peer->last_data_ns) > grace) {
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
            for (kvr_op_t *op = kvr_eroom(r)->ops; op != NULL;) {
                kvr_op_t *next = op->next; /* cancelling may complete and free op */
                kvr_tp_op_cancel(&op->base);
                op = next;
            }
            kvr_room_unref_locked(e, r);
        } else if (kvr_timer_since(now, r->failing_since_ns) >
                       2 * e->cfg.heartbeat_interval_ms * KVR_MS &&
                   !kvr_cma_reading(r)) {
            /* (A read always ends, and writes the pages until it does.) */
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
        /* Told over the control channel, which still answers: the peer
         * drops its side too, before a new room is sent down it. */
        kvr_msg_t lost = kvr_msg_rank(KVR_MSG_PATH_LOST, (uint32_t)e->rank);
        kvr_send_ctrl_to_peer(e, stalled, &lost);
        kvr_peer_fail_locked(e, stalled, KVR_PEER_LOST, what);
    }
}

/* Prefill: requests whose sender never came, or whose decode is gone. */
static void kvr_timer_pending_locked(kvr_engine_t *e, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    kvr_pending_t *pd;
    for (kvr_table_iter_t it = {0}; (pd = kvr_table_next(&e->pending, &it, NULL)) != NULL;) {
        if (pd->peer == NULL || pd->peer->state != KVR_PEER_READY ||
            now - pd->arrived_ns > e->cfg.bootstrap_timeout_ms * KVR_MS) {
            kvr_table_remove_current(&e->pending, &it);
            kvr_pending_free(e, pd);
        }
    }
}

/* Room r passed its deadline: it fails, saying how far it got. */
static void kvr_timer_deadline_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    uint64_t expected = e->mode == KVR_MODE_DECODE
                            ? r->expected
                            : (uint64_t)r->ndst * e->page_bytes +
                                  kvr_state_bytes(e, r->dst_aux, r->dst_states, &r->dst_lists);
    uint64_t got = e->mode == KVR_MODE_DECODE ? r->received : 0;
    if (e->mode == KVR_MODE_DECODE) {
        kvr_room_failf_locked(e, r, KVR_TIMEOUT, 1,
                              "no completion within its deadline of %" PRIu64
                              " ms: %" PRIu64 " of %" PRIu64 " bytes received",
                              (r->deadline_ns - r->started_ns) / KVR_MS, got, expected);
    } else if (r->nlegs > 0) {
        /* A lead (group.c) whose decode ranks did not all ask. */
        kvr_room_failf_locked(e, r, KVR_BOOTSTRAP, 0,
                              "only %u of the %u decode ranks this prefill rank serves asked "
                              "for the room within the bootstrap timeout (%u ms)",
                              r->nlegs, r->legs_want, e->cfg.bootstrap_timeout_ms);
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

/* When an unexplained rejection fails the room (0: never). */
static uint64_t kvr_timer_rejected_due(const kvr_engine_t *e, const kvr_room_t *r)
{
    return r->rejected_ns ? r->rejected_ns + 2 * e->cfg.heartbeat_interval_ms * KVR_MS : 0;
}

void kvr_timer_arm_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_heap_node_t *node = &kvr_eroom(r)->timer;
    uint64_t due = r->deadline_ns;
    uint64_t rejected = kvr_timer_rejected_due(e, r);
    if (rejected && (due == 0 || rejected < due)) {
        due = rejected;
    }
    if (due == 0 || !r->in_table || r->failing || kvr_room_terminal(r)) {
        kvr_heap_remove(&e->deadlines, node);
    } else if (kvr_heap_set(&e->deadlines, node, due) != 0) {
        /* Without the heap no deadline would ever fail the room. */
        kvr_heap_remove(&e->deadlines, node);
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory for its deadline");
    }
}

void kvr_timer_watch_drain_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    KVR_ASSERT(r->failing);
    if (r->inflight > 0) {
        kvr_room_list_push(&e->draining, r, &kvr_eroom(r)->draining, &kvr_eroom(r)->drain_next);
    }
}

/* Rooms refused by their decode without a reason, and rooms past their
 * deadline: only those due, earliest first. */
static void kvr_timer_rooms_locked(kvr_engine_t *e, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    kvr_heap_node_t *node;
    while ((node = kvr_heap_top(&e->deadlines)) != NULL && now > node->key) {
        kvr_room_t *r = &((kvr_eroom_t *)((char *)node - offsetof(kvr_eroom_t, timer)))->room;
        kvr_heap_remove(&e->deadlines, node);
        KVR_ASSERT(r->in_table);
        if (r->failing || kvr_room_terminal(r)) {
            continue;
        }
        uint64_t rejected = kvr_timer_rejected_due(e, r);
        if (rejected && now > rejected) {
            kvr_rejected_fail_locked(e, r);
        } else if (r->deadline_ns && now > r->deadline_ns) {
            kvr_timer_deadline_locked(e, r);
        }
        kvr_timer_arm_locked(e, r); /* not due yet, or not failed after all */
    }
}

void kvr_timers_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    uint64_t now = kvr_now_ns();
    kvr_register_tick_locked(e, now);
    kvr_tp_pack_trim(e->tp, now);
    kvr_timer_peers_locked(e, now);
    kvr_timer_rooms_locked(e, now);
    /* The force-drains and the pending requests are looked at every
     * KVR_SCAN_NS: they are coarse by nature. */
    if (now < e->next_scan_ns) {
        return;
    }
    e->next_scan_ns = now + KVR_SCAN_NS;
    kvr_timer_drains_locked(e, now);
    kvr_timer_pending_locked(e, now);
}
