/*
 * group: prefill and decode instances of different TP sizes (plan.h's head
 * layouts).  Each pair of ranks that exchanges heads is a link, and each
 * side knows its peer's end of the link from the HELLO: the head slice of
 * its own page rows and of the peer's that the link's data messages carry
 * (kvr_peer_t.slice, .peer_slice).
 *
 * A decode rank reads a room from every prefill rank it has a link with:
 * the room the caller holds leads one leg per link, each leg a room of its
 * own (its tag, its peer, its request, its bytes), in the tag table but not
 * in the id table.  room.c keeps the lead's visible state: the least
 * advanced leg's, Success once every leg succeeded, Failed once every leg
 * ended after the first leg's failure -- which the lead takes as its root
 * cause (registry, siblings) and every other leg is failed with, telling
 * its prefill.
 *
 * Engine lock held, as in the rest of the engine.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Most links of one rank a room is served over. */
#define KVR_MAX_LEGS 64

int kvr_heads_params_check(const kvr_engine_params_t *p, char *err, size_t errlen)
{
    if (p->heads == 0 && p->tp_size == 0 && p->total_heads == 0) {
        return 0;
    }
    char why[256];
    kvr_heads_t h = {p->tp_size, p->tp_rank, p->heads, p->total_heads};
    if (kvr_heads_check(&h, p->mode == KVR_MODE_PREFILL ? "prefill" : "decode", why,
                        sizeof(why)) != 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "%s", why);
    }
    for (uint32_t b = 0; b < p->nkv; b++) {
        uint64_t unit = (uint64_t)p->page_size * p->heads;
        if (p->kv_item_lens[b] % unit != 0) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "kv_item_lens[%u]=%" PRIu64 " is not page_size %u x %u KV heads x "
                           "bytes per head",
                           b, p->kv_item_lens[b], p->page_size, p->heads);
        }
    }
    return 0;
}

/* The layout l of a peer as a head layout. */
static kvr_heads_t kvr_wire_heads(const kvr_wire_layout_t *l)
{
    kvr_heads_t h = {l->tp_size, l->tp_rank, l->heads, l->total_heads};
    return h;
}

int kvr_layout_heads_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n)
{
    kvr_heads_t theirs = kvr_wire_heads(l);
    uint64_t *items = malloc((e->nkv ? e->nkv : 1) * sizeof(uint64_t));
    if (items == NULL) {
        snprintf(why, n, "out of memory");
        return -1;
    }
    for (uint32_t b = 0; b < e->nkv; b++) {
        items[b] = kvr_wire_u64_at(l->kv_item_lens, b);
    }
    int pre = e->mode == KVR_MODE_PREFILL;
    int rc = kvr_heads_compat(pre ? &e->heads : &theirs, pre ? e->kv_item : items,
                              pre ? &theirs : &e->heads, pre ? items : e->kv_item, e->nkv,
                              e->page_size, why, n);
    free(items);
    return rc;
}

int kvr_peer_link(kvr_engine_t *e, kvr_peer_t *p, const kvr_wire_layout_t *l, char *why,
                  size_t n)
{
    kvr_slice_t whole = {0, 0, 0};
    p->slice = p->peer_slice = whole;
    p->slink = kvr_state_link(0, 0, 0, 0); /* whole rows */
    if (e->heads.heads == 0 || l->heads == 0) {
        if (p->want_tp) {
            snprintf(why, n,
                     "the room asks for prefill TP %u but %s registered no head layout "
                     "(kv_head_num, total_kv_head_num)",
                     p->want_tp, e->heads.heads ? "the prefill" : "this decode");
            return -1;
        }
        return 0; /* rank to rank, layouts equal (kvr_layout_diff) */
    }
    kvr_heads_t theirs = kvr_wire_heads(l);
    int pre = e->mode == KVR_MODE_PREFILL;
    const kvr_heads_t *ph = pre ? &e->heads : &theirs, *dh = pre ? &theirs : &e->heads;
    if (!pre && p->want_tp && theirs.tp_size != p->want_tp) {
        snprintf(why, n, "the room asks for prefill TP %u, the prefill has TP %u", p->want_tp,
                 theirs.tp_size);
        return -1;
    }
    if (kvr_state_link_set(e, p, l, ph, dh, why, n) != 0) {
        return -1;
    }
    kvr_link_t links[KVR_MAX_LEGS];
    uint32_t k = kvr_heads_links(ph, dh, 1, dh->tp_rank, links, KVR_MAX_LEGS);
    for (uint32_t i = 0; i < k && i < KVR_MAX_LEGS; i++) {
        if (links[i].prefill != ph->tp_rank) {
            continue;
        }
        p->slice = kvr_link_slice(&links[i], &e->heads, e->heads.tp_rank);
        p->links = kvr_heads_links(ph, dh, 0, ph->tp_rank, NULL, 0);
        p->peer_slice = kvr_link_slice(&links[i], &theirs, theirs.tp_rank);
        if (!pre && !p->want_tp && p->slice.n != p->slice.heads) {
            break; /* a rank-to-rank room cannot take a slice */
        }
        return 0;
    }
    snprintf(why, n,
             "decode rank %u (TP %u, %u heads) does not read heads %u-%u of prefill rank %u "
             "(TP %u) as one room%s",
             dh->tp_rank, dh->tp_size, dh->heads, kvr_heads_first(ph, ph->tp_rank),
             kvr_heads_first(ph, ph->tp_rank) + ph->heads - 1, ph->tp_rank, ph->tp_size,
             pre ? "" : "; give the receiver's init() the prefill's tp size");
    return -1;
}

const kvr_slice_t *kvr_room_slice(const kvr_room_t *r, int peer_side)
{
    if (r->peer == NULL || r->peer->slice.heads == 0) {
        return NULL;
    }
    const kvr_slice_t *s = peer_side ? &r->peer->peer_slice : &r->peer->slice;
    return s->n == s->heads ? NULL : s;
}

/* Bytes of one page of every KV buffer in a slice of n of `heads` heads. */
static uint64_t kvr_slice_page_bytes(const kvr_engine_t *e, uint32_t n, uint32_t heads)
{
    uint64_t bytes = 0;
    for (uint32_t b = 0; b < e->nkv; b++) {
        bytes += e->kv_item[b] / heads * n;
    }
    return bytes;
}

int kvr_group_open_locked(kvr_engine_t *e, kvr_room_t *h, uint32_t prefill_dp,
                          uint32_t prefill_tp, char *err, size_t errlen)
{
    KVR_ASSERT_LOCKED(e);
    if (e->heads.heads == 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "prefill_tp_size=%u needs the decode's head layout (KVArgs kv_head_num, "
                       "total_kv_head_num)",
                       prefill_tp);
    }
    uint32_t total = e->heads.total_heads; /* prefill_tp > 0 (the caller's check) */
    kvr_heads_t pre = {prefill_tp, 0, prefill_tp <= total ? total / prefill_tp : 1, total};
    char why[256];
    if (kvr_heads_check(&pre, "prefill", why, sizeof(why)) != 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "prefill_tp_size=%u: %s", prefill_tp, why);
    }
    kvr_link_t links[KVR_MAX_LEGS];
    uint32_t n = kvr_heads_links(&pre, &e->heads, 1, e->heads.tp_rank, links, KVR_MAX_LEGS);
    if (n > KVR_MAX_LEGS) {
        return kvr_err(err, errlen, KVR_EVALUE, "decode rank %u would read from %u prefill ranks "
                       "(at most %u)", e->heads.tp_rank, n, KVR_MAX_LEGS);
    }
    h->legs = calloc(n, sizeof(*h->legs));
    if (h->legs == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    for (uint32_t i = 0; i < n; i++) {
        kvr_room_t *leg = kvr_room_new(sizeof(kvr_eroom_t), h->id, kvr_new_tag_locked(e),
                                       KVR_ROLE_DECODE);
        kvr_peer_t *p = kvr_prefill_peer_get(e, h->bootstrap_addr, prefill_dp,
                                             (int)links[i].prefill);
        if (leg == NULL || p == NULL || kvr_table_put(&e->tags, leg->tag, leg) != 0) {
            kvr_room_free(leg);
            return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        }
        kvr_eroom(leg)->owner = e;
        kvr_eroom(leg)->leg_heads = links[i].nheads;
        snprintf(leg->bootstrap_addr, sizeof(leg->bootstrap_addr), "%s", h->bootstrap_addr);
        leg->refs = 1; /* the lead's */
        leg->lead = h;
        kvr_room_ref(h);
        p->want_tp = prefill_tp;
        leg->peer = p;
        leg->init_called = 1;
        h->legs[h->nlegs++] = leg;
        h->held++;
        kvr_work_push_locked(e, leg);
    }
    h->legs_want = n;
    return 0;
}

int kvr_group_meta_locked(kvr_engine_t *e, kvr_room_t *h)
{
    KVR_ASSERT_LOCKED(e);
    for (uint32_t i = 0; i < h->nlegs; i++) {
        kvr_room_t *leg = h->legs[i];
        if (h->npages && (leg->pages = malloc(h->npages * sizeof(int32_t))) == NULL) {
            return -1;
        }
        if (h->npages) {
            memcpy(leg->pages, h->pages, h->npages * sizeof(int32_t));
        }
        leg->npages = h->npages;
        leg->prefix_len = h->prefix_len;
        /* The aux row comes with the first leg, which always reads heads;
         * the state slots too, unless the rows are sliced (TP sizes
         * differ): then every leg carries its share (state.c). */
        kvr_state_link_t sl = kvr_state_link(leg->peer->want_tp, (uint32_t)leg->peer->query_rank,
                                             e->heads.tp_size, e->heads.tp_rank);
        int sliced = sl.sliced && e->nstate_rules > 0;
        leg->aux_index = i == 0 ? h->aux_index : -1;
        kvr_state_copy(leg->states, h->states, i == 0 || sliced ? KVR_MAX_STATES : 0);
        leg->expected = (uint64_t)h->npages *
                            kvr_slice_page_bytes(e, kvr_eroom(leg)->leg_heads, e->heads.heads) +
                        kvr_state_link_bytes(e, sliced ? &sl : NULL, leg->aux_index, leg->states);
        leg->meta_set = 1;
        kvr_work_push_locked(e, leg);
    }
    h->expected = h->received = 0;
    return 0;
}

void kvr_group_fail_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_failure_t *f)
{
    KVR_ASSERT_LOCKED(e);
    if (r->lead != NULL) {
        kvr_room_fail_locked(e, r->lead, f, 0);
    }
    for (uint32_t i = 0; i < r->nlegs; i++) {
        kvr_room_fail_locked(e, r->legs[i], f, 1);
    }
}

void kvr_group_drop_locked(kvr_engine_t *e, kvr_room_t *h)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t **legs = h->legs;
    uint32_t n = h->nlegs;
    h->legs = NULL;
    h->nlegs = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvr_room_t *leg = legs[i];
        if (leg->peer_counted && leg->peer != NULL && leg->peer->nrooms > 0) {
            leg->peer->nrooms--;
        }
        leg->peer_counted = 0;
        kvr_room_unref_locked(e, leg);
    }
    free(legs);
}

/* Prefill: copies what lead h was given (init, pages) into its leg. */
static void kvr_group_sync_leg(kvr_engine_t *e, kvr_room_t *h, kvr_room_t *leg)
{
    if (!h->inited || leg->failing || kvr_room_terminal(leg)) {
        return;
    }
    if (!leg->inited) {
        leg->src_pages = malloc((size_t)(h->total_pages ? h->total_pages : 1) * sizeof(int32_t));
        if (leg->src_pages == NULL) {
            kvr_room_failf_locked(e, leg, KVR_TRANSPORT, 1, "out of memory");
            return;
        }
        leg->inited = 1;
        leg->total_pages = h->total_pages;
        leg->src_aux = h->src_aux;
        if (leg->bound && leg->ndst != leg->total_pages) {
            kvr_room_failf_locked(e, leg, KVR_LAYOUT_MISMATCH, 1,
                                  "decode asked for %u pages, prefill announced %u", leg->ndst,
                                  leg->total_pages);
            return;
        }
    }
    memcpy(leg->src_states, h->src_states, sizeof(leg->src_states));
    if (h->given > leg->given) {
        memcpy(leg->src_pages + leg->given, h->src_pages + leg->given,
               (size_t)(h->given - leg->given) * sizeof(int32_t));
        leg->given = h->given;
    }
    leg->ready_ns = h->ready_ns;
    if (leg->bound && !kvr_eroom(leg)->on_work && leg->peer != NULL &&
        leg->peer->state == KVR_PEER_READY) {
        /* As send() does for a room of one link: post from here. */
        kvr_post_locked(e, leg);
        kvr_check_prefill_done_locked(e, leg);
    } else {
        kvr_work_push_locked(e, leg);
    }
}

void kvr_group_sync_locked(kvr_engine_t *e, kvr_room_t *h)
{
    KVR_ASSERT_LOCKED(e);
    for (uint32_t i = 0; i < h->nlegs; i++) {
        kvr_group_sync_leg(e, h, h->legs[i]);
    }
}

kvr_room_t *kvr_group_leg_locked(kvr_engine_t *e, kvr_room_t *h, kvr_peer_t *p, uint64_t tag)
{
    KVR_ASSERT_LOCKED(e);
    for (uint32_t i = 0; i < h->nlegs; i++) {
        if (h->legs[i]->peer == p) {
            char reason[200];
            snprintf(reason, sizeof(reason),
                     "room %" PRIu64 ": prefill rank %d already serves it to %.100s", h->id,
                     e->rank, p->name);
            kvr_msg_t f = kvr_msg_fail(KVR_MSG_ROOM_FAIL, h->id, tag, KVR_PROTOCOL, e->rank,
                                       reason, NULL);
            kvr_send_ctrl_to_peer(e, p, &f);
            return NULL;
        }
    }
    kvr_room_t **legs = realloc(h->legs, (h->nlegs + 1) * sizeof(*legs));
    if (legs == NULL) {
        return NULL;
    }
    h->legs = legs;
    kvr_room_t *leg = kvr_room_new(sizeof(kvr_eroom_t), h->id, kvr_new_tag_locked(e),
                                   KVR_ROLE_PREFILL);
    if (leg == NULL || kvr_table_put(&e->tags, leg->tag, leg) != 0) {
        kvr_room_free(leg);
        return NULL;
    }
    kvr_eroom(leg)->owner = e;
    leg->refs = 1; /* the lead's */
    leg->lead = h;
    kvr_room_ref(h);
    leg->prefix_len = h->prefix_len;
    h->legs[h->nlegs++] = leg;
    h->held++;
    if (p->links > h->legs_want) {
        h->legs_want = p->links;
    }
    if (h->nlegs >= h->legs_want) {
        /* Every decode rank asked: the legs' deadlines take over. */
        h->deadline_ns = 0;
        kvr_timer_arm_locked(e, h);
    }
    kvr_group_sync_leg(e, h, leg);
    return leg;
}

kvr_room_t *kvr_group_room_for_peer(kvr_engine_t *e, uint64_t id, const kvr_peer_t *p)
{
    kvr_room_t *r = kvr_table_get(&e->rooms, id);
    for (uint32_t i = 0; r != NULL && i < r->nlegs; i++) {
        if (r->legs[i]->peer == p) {
            return r->legs[i];
        }
    }
    return r;
}
