/*
 * stage: device memory -- which buffers are on the device, which path moves
 * them (UCX itself, or staged through pinned host slots with CUDA copies),
 * the slot pool, the copy events and the FIFO of copies in flight.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- staging of device memory ---------------------------------------
 *
 * Where UCX cannot move device memory, each message of a device buffer goes
 * through one pinned host slot of a bounded pool:
 *   prefill: cudaMemcpyAsync of the message's source pieces into the slot
 *            (one stream), an event; when the engine sees the event done it
 *            sends the slot as one contiguous message (KVR_STAGE_D2H ->
 *            XFER); the slot is free again when the send completes.  Messages
 *            are cut to at most staging_slot_bytes; with no slot free the
 *            room waits (its posting cursor keeps its place) and resumes when
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

kvr_slot_t *kvr_slot_get(kvr_engine_t *e)
{
    kvr_slot_t *s = e->slot_free;
    if (s != NULL) {
        e->slot_free = s->next;
        s->next = NULL;
    }
    return s;
}

void kvr_slot_put(kvr_engine_t *e, kvr_slot_t *s)
{
    s->next = e->slot_free;
    e->slot_free = s;
    if (e->slot_waiters == NULL) {
        return;
    }
    /* Rooms that stopped for want of a slot go round again. */
    while (e->slot_waiters != NULL) {
        kvr_room_t *r = e->slot_waiters;
        e->slot_waiters = kvr_eroom(r)->slot_next;
        kvr_eroom(r)->slot_next = NULL;
        kvr_eroom(r)->slot_waiting = 0;
        kvr_work_push_locked(e, r);
        kvr_room_unref_locked(e, r);
    }
    kvr_wake(e);
}

void kvr_slot_wait(kvr_engine_t *e, kvr_room_t *r)
{
    e->stats.staging_waits++;
    kvr_room_list_push(&e->slot_waiters, r, &kvr_eroom(r)->slot_waiting,
                       &kvr_eroom(r)->slot_next);
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
void kvr_op_unstage(kvr_engine_t *e, kvr_op_t *op)
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
int kvr_stage_copy_locked(kvr_engine_t *e, kvr_op_t *op, int d2h, char *err,
                          size_t errlen)
{
    KVR_ASSERT_LOCKED(e);
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

/* Prefill: a staged message's copy into its slot is done: send the slot. */
static void kvr_stage_send_locked(kvr_engine_t *e, kvr_op_t *op)
{
    KVR_ASSERT_LOCKED(e);
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
unsigned kvr_stage_poll_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
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

/* Waits for the staging copies in flight and ends them (the rooms are
 * failing by now: nothing is sent, nothing more is copied). */
void kvr_stage_finish_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    if (e->stream != NULL) {
        kvr_cuda_stream_sync(e->stream, NULL, 0);
        kvr_stage_poll_locked(e);
    }
}

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
int kvr_gpu_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen)
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
void kvr_gpu_free(kvr_engine_t *e)
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
