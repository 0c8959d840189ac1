#include "room.h"

#include <stdlib.h>
#include <string.h>

#include "debug.h"

kvr_room_t *kvr_room_new(size_t size, uint64_t id, uint64_t tag, int role)
{
    KVR_ASSERT(size >= sizeof(kvr_room_t));
    kvr_room_t *r = calloc(1, size);
    if (r == NULL) {
        return NULL;
    }
    r->id = id;
    r->tag = tag;
    r->role = role;
    r->aux_index = -1;
    r->src_aux = -1;
    r->dst_aux = -1;
    for (int i = 0; i < KVR_MAX_STATES; i++) {
        r->states[i] = r->src_states[i] = r->dst_states[i] = -1;
    }
    atomic_init(&r->visible, KVR_POLL_BOOTSTRAPPING);
    return r;
}

void kvr_room_free(kvr_room_t *r)
{
    if (r == NULL) {
        return;
    }
    free(r->pages);
    free(r->src_pages);
    free(r->dst_pages);
    free(r->lists.slots);
    free(r->src_lists.slots);
    free(r->dst_lists.slots);
    free(r->claimed);
    free(r->legs);
    free(r);
}

/* Claims bits first + i x stride + [0, count) for i < nbuf (all or none). */
static int kvr_room_claim_bits(kvr_room_t *r, uint64_t total, uint64_t first, uint64_t stride,
                               uint32_t nbuf, uint64_t count)
{
    if (r->claimed == NULL) {
        r->claimed = calloc((size_t)((total + 7) / 8), 1);
        if (r->claimed == NULL) {
            return KVR_CLAIM_NOMEM;
        }
    }
    for (int set = 0; set < 2; set++) {
        for (uint32_t b = 0; b < nbuf; b++) {
            for (uint64_t i = first + b * stride; i < first + b * stride + count; i++) {
                unsigned char bit = (unsigned char)(1u << (i & 7));
                if (set) {
                    r->claimed[i >> 3] |= bit;
                } else if (r->claimed[i >> 3] & bit) {
                    return KVR_CLAIM_REPEATED;
                }
            }
        }
    }
    return KVR_CLAIM_OK;
}

int kvr_room_claim(kvr_room_t *r, int aux, uint32_t nkv, uint32_t naux, uint32_t buf,
                   uint32_t nbuf, uint32_t pos, uint32_t npages)
{
    uint64_t kv_bits = (uint64_t)nkv * r->npages, total = kv_bits + naux + r->claim_lists;
    if (aux) {
        return kvr_room_claim_bits(r, total, kv_bits + buf, 1, nbuf, 1);
    }
    return kvr_room_claim_bits(r, total, (uint64_t)buf * r->npages + pos, r->npages, nbuf,
                               npages);
}

int kvr_room_claim_list(kvr_room_t *r, uint32_t nkv, uint32_t naux, uint64_t first,
                        uint32_t stride, uint32_t nbuf, uint32_t pos, uint32_t npages)
{
    uint64_t kv_bits = (uint64_t)nkv * r->npages, total = kv_bits + naux + r->claim_lists;
    return kvr_room_claim_bits(r, total, kv_bits + naux + first + pos, stride, nbuf, npages);
}

int kvr_room_terminal(const kvr_room_t *r)
{
    int v = atomic_load(&r->visible);
    return v == KVR_POLL_SUCCESS || v == KVR_POLL_FAILED;
}

/* A leg ended (Success or Failed): its lead may end now. */
static void kvr_room_leg_end(kvr_room_t *r)
{
    kvr_room_t *g = r->lead;
    if (g == NULL || r->leg_ended) {
        return;
    }
    r->leg_ended = 1;
    KVR_ASSERT(g->held > 0);
    g->held--;
    g->legs_done += atomic_load(&r->visible) == KVR_POLL_SUCCESS;
    if (g->failing) {
        kvr_room_settle(g);
    } else if (g->held == 0 && g->legs_done >= g->legs_want) {
        kvr_room_advance(g, KVR_POLL_SUCCESS);
    }
}

/* A leg moved on: its lead shows the least advanced of its legs. */
static void kvr_room_lead_follow(kvr_room_t *g)
{
    int least = KVR_POLL_SUCCESS;
    for (uint32_t i = 0; i < g->nlegs; i++) {
        int v = atomic_load(&g->legs[i]->visible);
        if (v != KVR_POLL_FAILED && v < least) {
            least = v;
        }
    }
    if (least < KVR_POLL_SUCCESS) {
        kvr_room_advance(g, least);
    }
}

int kvr_room_advance(kvr_room_t *r, int state)
{
    if (kvr_room_terminal(r) || r->failing || state <= KVR_POLL_FAILED ||
        state > KVR_POLL_SUCCESS) {
        return 0;
    }
    if (state <= atomic_load(&r->visible)) {
        return 0;
    }
    atomic_store(&r->visible, state);
    if (r->lead != NULL) {
        if (state == KVR_POLL_SUCCESS) {
            kvr_room_leg_end(r);
        }
        kvr_room_lead_follow(r->lead);
    }
    return 1;
}

void kvr_room_op_started(kvr_room_t *r)
{
    KVR_ASSERT(!kvr_room_terminal(r) && r->inflight >= 0);
    r->inflight++;
    r->ops_posted++;
}

void kvr_room_op_ended(kvr_room_t *r)
{
    if (!r->drained_by_force) {
        KVR_ASSERT(r->inflight > 0);
        r->inflight--;
    }
}

int kvr_room_succeed(kvr_room_t *r)
{
    int done = r->role == KVR_ROLE_DECODE
                   ? kvr_room_complete(r)
                   : !r->failing && r->done_received && r->inflight == 0;
    if (!done || !kvr_room_advance(r, KVR_POLL_SUCCESS)) {
        return 0;
    }
    KVR_ASSERT(r->inflight == 0 && (r->role != KVR_ROLE_DECODE || r->received == r->expected));
    return 1;
}

void kvr_room_abandon(kvr_room_t *r, int code)
{
    r->inflight = 0;
    kvr_room_fail(r, code);
    kvr_room_settle(r);
}

int kvr_room_fail(kvr_room_t *r, int code)
{
    if (r->failing || atomic_load(&r->visible) == KVR_POLL_SUCCESS) {
        return 0;
    }
    r->failing = 1;
    r->fail_code = code;
    return 1;
}

int kvr_room_force_drain(kvr_room_t *r)
{
    if (!r->failing || r->inflight == 0) {
        return 0;
    }
    r->drained_by_force = 1;
    r->inflight = 0;
    return kvr_room_settle(r);
}

int kvr_room_settle(kvr_room_t *r)
{
    if (!r->failing || r->inflight > 0 || r->held > 0 ||
        atomic_load(&r->visible) == KVR_POLL_FAILED) {
        return 0;
    }
    KVR_ASSERT(r->inflight == 0);
    atomic_store(&r->visible, KVR_POLL_FAILED);
    kvr_room_leg_end(r);
    return 1;
}

int kvr_room_complete(const kvr_room_t *r)
{
    return r->meta_set && !r->failing && r->inflight == 0 && r->received == r->expected;
}

uint32_t kvr_run_length(const int32_t *src, const int32_t *dst, uint32_t pos, uint32_t end)
{
    if (pos >= end) {
        return 0;
    }
    uint32_t n = 1;
    /* 64-bit sums: a page near INT32_MAX must not overflow. */
    while (pos + n < end && (int64_t)dst[pos + n] == (int64_t)dst[pos] + n &&
           (src == NULL || (int64_t)src[pos + n] == (int64_t)src[pos] + n)) {
        n++;
    }
    return n;
}

static int kvr_page_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

long kvr_pages_repeat(const int32_t *pages, size_t n, long *first)
{
    if (n < 2) {
        return -1;
    }
    int32_t *v = malloc(n * sizeof(int32_t));
    if (v == NULL) {
        return -2;
    }
    memcpy(v, pages, n * sizeof(int32_t));
    qsort(v, n, sizeof(int32_t), kvr_page_cmp);
    int found = 0;
    int32_t twice = 0;
    for (size_t i = 1; i < n && !found; i++) {
        if (v[i] == v[i - 1]) {
            found = 1;
            twice = v[i];
        }
    }
    free(v);
    if (!found) {
        return -1;
    }
    long at = -1;
    for (size_t i = 0; i < n; i++) {
        if (pages[i] != twice) {
            continue;
        }
        if (at >= 0) {
            *first = at;
            return (long)i;
        }
        at = (long)i;
    }
    return -1; /* not reached */
}

long kvr_pages_check(const int32_t *pages, size_t n, int64_t limit)
{
    for (size_t i = 0; i < n; i++) {
        if (pages[i] < 0 || pages[i] >= limit) {
            return (long)i;
        }
    }
    return -1;
}
