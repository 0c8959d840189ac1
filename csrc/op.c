/*
 * op: one data operation in flight (a message posted by the prefill or
 * accepted by the decode), the room's list of them, and how an operation
 * ends: accounting, then the room settles, succeeds or fails.
 */
#include "engine_int.h"

#include <stdlib.h>

kvr_op_t *kvr_op_new(kvr_room_t *r, uint64_t len, uint32_t niov)
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
    kvr_eroom_t *x = kvr_eroom(r);
    op->next = x->ops;
    if (x->ops) {
        x->ops->prev = op;
    }
    x->ops = op;
    kvr_room_ref(r);
    kvr_room_op_started(r);
    if (r->failing) {
        kvr_timer_watch_drain_locked(x->owner, r);
    }
    return op;
}

static void kvr_op_unlink(kvr_room_t *r, kvr_op_t *op)
{
    if (op->prev) {
        op->prev->next = op->next;
    } else {
        kvr_eroom(r)->ops = op->next;
    }
    if (op->next) {
        op->next->prev = op->prev;
    }
}

/* Ends one operation of a room: accounting, then settle or succeed. */
void kvr_op_end_locked(kvr_engine_t *e, kvr_op_t *op, int failed, const char *status_text)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *r = op->room;
    kvr_op_unlink(r, op);
    kvr_op_unstage(e, op);
    kvr_room_op_ended(r);
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
            kvr_timer_arm_locked(e, r);
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
        if (kvr_room_succeed(r)) {
            kvr_room_succeeded_locked(e, r);
            if (r->peer) {
                /* Sockets belong to the engine thread: from poll()'s
                 * progress it sends the notice. */
                kvr_eroom(r)->done_pending = 1;
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

void kvr_on_recv_done(void *arg, kvr_tp_op_t *tp_op, size_t len, int failed,
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

void kvr_on_send_done(void *arg, kvr_tp_op_t *op, int failed, const char *status_text)
{
    kvr_op_end_locked(arg, (kvr_op_t *)op, failed, status_text);
}

/*
 * The pieces of the data message h, in order: for each buffer of
 * [h->buf, h->buf + h->nbuf) of its kind, the runs of consecutive pages of
 * `pages` over positions [h->pos, h->pos + h->npages) (KV), or each row
 * buffer's row (aux row `aux`, state slots `states`: kvr_state_row; a list
 * component's rows: positions [pos, pos + npages) of its list in `lists`,
 * one piece per run of consecutive slots).  The
 * prefill passes its source pages and rows, the decode its own
 * destination pages and rows; s, unless NULL, the slice of the heads of
 * their pages the message carries (group.c); sl, unless NULL, the share of
 * the state rows (state.c).  With out == NULL only counts.  Returns the
 * number of pieces; *bytes gets their total length.  h was checked against
 * the layout and the room.
 */
uint32_t kvr_msg_pieces(const kvr_engine_t *e, const kvr_am_header_t *h,
                        const int32_t *pages, int64_t aux, const int64_t *states,
                        const kvr_slot_lists_t *lists, const kvr_slice_t *s,
                        const kvr_state_link_t *sl, kvr_tp_iov_t *out, uint64_t *bytes)
{
    uint32_t n = 0, end = h->pos + h->npages;
    uint64_t total = 0;
    for (uint32_t b = h->buf; b < (uint32_t)h->buf + h->nbuf; b++) {
        int lc = h->kind == KVR_AM_KIND_AUX ? kvr_state_list_of(e, b) : -1;
        if (lc >= 0) {
            /* List positions [pos, end) of a list component's rows: one
             * piece per run of consecutive slots, as pages. */
            const int32_t *slots = lists->slots + lists->at[lc];
            for (uint32_t at = h->pos; at < end; n++) {
                uint32_t run = kvr_run_length(NULL, slots, at, end);
                if (out != NULL) {
                    out[n].buf = (char *)(uintptr_t)e->aux_ptrs[b] +
                                 (uint64_t)slots[at] * e->aux_item[b];
                    out[n].len = (size_t)run * e->aux_item[b];
                }
                at += run;
            }
            total += (uint64_t)h->npages * e->aux_item[b];
            continue;
        }
        if (h->kind == KVR_AM_KIND_AUX) {
            int64_t row = kvr_state_row(e, b, aux, states);
            if (sl != NULL && b >= e->naux - e->nstate) {
                n += kvr_state_pieces(e, sl, b - (e->naux - e->nstate), row,
                                      out != NULL ? out + n : NULL, &total);
                continue;
            }
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
        if (s != NULL) {
            /* A slice of the heads: one piece per token row of each page
             * (the pages are [page_size][heads][bytes per head]). */
            uint64_t head = item / ((uint64_t)e->page_size * s->heads);
            uint64_t rowb = head * s->heads, off = head * s->first, len = head * s->n;
            for (uint32_t at = h->pos; at < end && len > 0; at++) {
                for (uint32_t t = 0; t < e->page_size; t++, n++) {
                    if (out != NULL) {
                        out[n].buf = base + (uint64_t)pages[at] * item + t * rowb + off;
                        out[n].len = (size_t)len;
                    }
                }
            }
            total += (uint64_t)h->npages * e->page_size * len;
            continue;
        }
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

/*
 * Prefill: posts one data message: positions [h->pos, h->pos + h->npages) of
 * KV buffer h->buf (one piece per run of consecutive source pages), or one
 * aux row (src given).
 */
void kvr_op_send_locked(kvr_engine_t *e, kvr_room_t *r, kvr_op_t *op,
                        const kvr_tp_iov_t *iov, uint32_t niov, int host)
{
    KVR_ASSERT_LOCKED(e);
    const char *st = NULL;
    int outcome = kvr_tp_send(e->tp, r->peer->ep, op->hdr, sizeof(op->hdr), iov, niov, host,
                              &op->base, &st);
    if (outcome != KVR_TP_PENDING) {
        kvr_op_end_locked(e, op, outcome, st);
    }
}
