/*
 * post: the prefill's posting of data messages.  kvr_post_locked checks
 * that the room may post, chooses the coalescing limits for its peer, and
 * posts the messages plan.c chooses, each as one operation (op.c), staged
 * (stage.c) where its buffer is device memory UCX cannot move.
 */
#include "engine_int.h"
#include "testhook.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

/* 1 if messages of this buffer are staged on the prefill side. */
static int kvr_prefill_stages(const kvr_engine_t *e, int kind, uint32_t buf)
{
    return e->gpu_path == KVR_GPU_STAGED &&
           (kind == KVR_AM_KIND_KV ? e->kv_dev[buf] : e->aux_dev[buf]);
}

/* Returns 0 (posted, or the room failed), 1 if it must wait for a slot. */
static int kvr_post_one_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_am_header_t *h)
{
    KVR_ASSERT_LOCKED(e);
    kvr_slot_t *slot = NULL;
    if (kvr_prefill_stages(e, h->kind, h->buf) && (slot = kvr_slot_get(e)) == NULL) {
        kvr_slot_wait(e, r);
        return 1;
    }
    uint64_t len = 0;
    const kvr_slice_t *s = h->kind == KVR_AM_KIND_KV ? kvr_room_slice(r, 0) : NULL;
    const kvr_state_link_t *sl = kvr_room_state_link(r);
    uint32_t niov = kvr_msg_pieces(e, h, r->src_pages, r->src_aux, r->src_states, &r->src_lists,
                                   s, sl, NULL, &len);
    kvr_op_t *op = kvr_op_new(r, len, niov);
    if (op == NULL) {
        if (slot != NULL) {
            kvr_slot_put(e, slot);
        }
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory posting data");
        return 0;
    }
    kvr_msg_pieces(e, h, r->src_pages, r->src_aux, r->src_states, &r->src_lists, s, sl, op->iov,
                   &len);
    kvr_am_header_t wire = *h;
    if (h->kind == KVR_AM_KIND_KV) {
        /* The decode's numbering of the buffers (a PP stage's layers). */
        wire.buf = (uint16_t)kvr_layers_map(&e->layers, &r->peer->layers, h->buf);
    }
    if (e->test_corrupt != KVR_TEST_CORRUPT_NONE) {
        kvr_test_corrupt_header(&wire, e->test_corrupt, r->ndst, e->nkv, e->naux);
    }
    if (e->test_forge_tag != 0) {
        wire.tag = e->test_forge_tag;
        wire.epoch = e->test_forge_epoch;
    }
    if (slot == NULL && kvr_cma_post_locked(e, r, op, &wire, niov)) {
        niov = 1; /* the descriptor */
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
 * The coalescing limits for room r's peer: over shared memory a small room
 * goes as eager messages; the auto run length depends on the transport;
 * device memory limits messages to what UCX or a staging slot takes.
 */
static void kvr_post_limits(const kvr_engine_t *e, const kvr_room_t *r, kvr_plan_t *p)
{
    uint64_t run_bytes = e->cfg.coalesce_run_bytes, cap = e->cfg.coalesce_bytes;
    uint32_t max_pages = UINT32_MAX;
    p->row_cap = 0;
    p->row_run_alone = 0;
    int shm = kvr_tp_ep_is_shm(r->peer->ep);
    int aux = r->dst_aux >= 0 || kvr_state_any(r->dst_states);
    if (shm && e->ndev == 0 && e->kv_item_max <= KVR_TP_SHM_EAGER_BYTES &&
        (!aux || e->aux_item_max <= KVR_TP_SHM_EAGER_BYTES) &&
        (uint64_t)r->total_pages * e->page_bytes +
                kvr_state_bytes(e, r->dst_aux, r->dst_states, &r->dst_lists) <=
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
    int lane = e->ndev == 0 && kvr_tp_ep_lane(r->peer->ep);
    uint64_t eager = lane ? 0 : kvr_tp_ep_tcp_eager(r->peer->ep);
    if (e->ndev > 0 || eager < e->kv_item_max) {
        eager = 0;
    } else {
        /* Over tcp every message of KV pages fits one fragment: it goes
         * eagerly, with no rendezvous round trip, the decode copying it
         * once out of UCX's fragment (contiguous runs 1.2-1.6x faster,
         * random 64 KiB pages 2x; measured, benchmarks/README.md). */
        uint64_t n = eager / e->kv_item_max;
        max_pages = n < max_pages ? (uint32_t)n : max_pages;
        cap = cap < eager ? cap : eager;
    }
    if (run_bytes == 0) {
        /* auto: over shared memory UCX moves a scattered message at memory
         * speed, so every run is coalesced; so is every run over tcp
         * shorter than a fragment, into messages of one fragment.  Without
         * the fragment (an item larger, another lane) a scattered message is
         * packed into one copy first, which beats a message per run for
         * 16 KiB runs and loses from 64 KiB (with 256 KiB tcp fragments;
         * measured, README).  Over a tcp lane (lane.h) a message of any
         * length or number of pieces goes from the pages into the pages:
         * every run is coalesced, as over shared memory. */
        run_bytes = shm || lane ? UINT64_MAX : eager ? eager : KVR_TCP_RUN_BYTES;
    }
    if (shm && r->peer->cma && e->cfg.cross_memory_bytes > 0 &&
        run_bytes > e->cfg.cross_memory_bytes) {
        /* A run that long goes alone, whole, as one read (cma.c). */
        run_bytes = e->cfg.cross_memory_bytes;
    }
    if (e->gpu_path == KVR_GPU_UCX && e->ndev > 0) {
        /* UCX moves device memory itself: contiguous messages only (one
         * per run), which it handles on every protocol. */
        run_bytes = 0;
        p->row_run_alone = 1;
    } else if (e->gpu_path == KVR_GPU_STAGED) {
        /* Every message of a device buffer must fit one slot: runs are cut
         * at max_pages and coalescing stops at the slot size (the widest
         * item fits a slot: checked at creation). */
        uint32_t slot_pages = (uint32_t)(e->cfg.staging_slot_bytes / e->kv_item_max);
        max_pages = slot_pages < max_pages ? slot_pages : max_pages;
        if (cap > e->cfg.staging_slot_bytes) {
            cap = e->cfg.staging_slot_bytes;
        }
        p->row_cap = e->cfg.staging_slot_bytes; /* list rows too */
    }
    p->src_pages = r->src_pages;
    p->dst_pages = r->dst_pages;
    p->given = r->given;
    p->total_pages = r->total_pages;
    p->aux = r->dst_aux >= 0;
    p->nkv = e->nkv;
    p->naux = e->naux;
    p->nstate = e->nstate;
    p->state_comp = e->state_comp;
    p->dst_states = r->dst_states;
    const kvr_state_link_t *sl = kvr_room_state_link(r);
    p->row_pieces = sl != NULL ? e->state_pieces_max : 1;
    p->state_skip = sl != NULL && !sl->rep ? e->state_replicated : NULL;
    p->state_list = e->state_list;
    p->src_lists = &r->src_lists;
    p->dst_lists = &r->dst_lists;
    p->kv_item = e->kv_item;
    p->aux_item = e->aux_item;
    p->kv_item_max = e->kv_item_max;
    p->run_bytes = run_bytes;
    p->cap = cap;
    /* Buffers share a message while it stays within `merge` bytes: every
     * buffer of a small room in one message.  Not with device buffers (each
     * is staged or handed to UCX on its own). */
    p->merge = e->ndev > 0 ? 0 : run_bytes < cap ? run_bytes : cap;
    p->max_pages = max_pages;
    p->group = kvr_layers_identity(&e->layers, &r->peer->layers) ? 0 : e->layers.layers;
    /* A slice of the heads: a piece per token row on the sliced side, and
     * n of `heads` heads of each item on the wire, which the plan counts
     * as whole items: its byte limits grow by heads / n. */
    const kvr_slice_t *mine = kvr_room_slice(r, 0), *theirs = kvr_room_slice(r, 1);
    p->src_rows = mine != NULL ? e->page_size : 1;
    p->dst_rows = theirs != NULL ? e->page_size : 1;
    p->kv_none = mine != NULL && mine->n == 0;
    if (mine != NULL && mine->n > 0 && e->ndev == 0) {
        uint64_t *limits[3] = {&p->run_bytes, &p->cap, &p->merge};
        for (int i = 0; i < 3; i++) {
            *limits[i] = *limits[i] > UINT64_MAX / mine->heads
                             ? UINT64_MAX
                             : *limits[i] * mine->heads / mine->n;
        }
    }
}

/* Prefill: whether room r may post now; fails it if it never can.  Creates
 * the endpoint to its decode on the first data. */
static int kvr_post_ready_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (!r->bound || !r->inited || r->failing || kvr_room_terminal(r) || r->rejected_ns ||
        r->peer == NULL || r->peer->state != KVR_PEER_READY) {
        return 0;
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
            return 0;
        }
    }
    if (r->given > r->ndst) {
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "prefill sends %u pages but decode asked for %u", r->total_pages,
                              r->ndst);
        return 0;
    }
    if (r->dst_aux >= 0 && r->src_aux < 0) {
        /* Checked before any page moves. */
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                              "decode asked for aux row %" PRId64
                              " but the prefill sender has no aux_index",
                              r->dst_aux);
        return 0;
    }
    for (uint32_t c = 0; c < e->nstates && r->given == r->total_pages; c++) {
        if ((e->state_list >> c & 1u) && r->dst_states[c] >= 0 &&
            r->dst_lists.n[c] != r->src_lists.n[c]) {
            /* A list component's rows pair up by list position. */
            kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                                  "state component %u: the decode asked for %u slots, the "
                                  "prefill sender gave %u",
                                  c, r->dst_lists.n[c], r->src_lists.n[c]);
            return 0;
        }
        if (r->dst_states[c] >= 0 && r->src_states[c] < 0) {
            /* Checked once every page was handed over: sglang gives the
             * state slots with the last chunk. */
            kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1,
                                  "decode asked for slot %" PRId64 " of state component %u but "
                                  "the prefill sender gave no state_indices for it",
                                  r->dst_states[c], c);
            return 0;
        }
    }
    return 1;
}

/* Prefill: posts the messages for pages [posted, given) and, after the last
 * page, the aux rows, as the plan says.  Engine lock held (engine thread,
 * or send()'s caller). */
void kvr_post_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    if (!kvr_post_ready_locked(e, r)) {
        return;
    }
    kvr_plan_t plan;
    kvr_post_limits(e, r, &plan);
    kvr_am_header_t h;
    memset(&h, 0, sizeof(h));
    h.tag = r->dst_tag;
    h.epoch = e->epoch;
    for (;;) {
        kvr_plan_cursor_t next = kvr_eroom(r)->post;
        if (!kvr_post_plan(&plan, &next, &h)) {
            kvr_eroom(r)->post = next;
            if (plan.kv_none && !plan.aux && !kvr_state_any(r->dst_states) &&
                r->given == r->total_pages) {
                /* Nothing of ours for this decode rank: done once every
                 * page was handed over (the decode expects no bytes). */
                r->done_received = 1;
            }
            return;
        }
        kvr_room_advance(r, KVR_POLL_TRANSFERRING);
        if (kvr_post_one_locked(e, r, &h) == 1) {
            kvr_plan_hold(&kvr_eroom(r)->post, &h); /* no free slot: resume here */
            return;
        }
        if (r->failing) {
            return;
        }
        kvr_eroom(r)->post = next;
    }
}
