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

kvr_layers_t kvr_wire_layers(const kvr_wire_layout_t *l)
{
    if (l->layers == 0) {
        return (kvr_layers_t){1, 0, 0, l->nkv, l->nkv};
    }
    return (kvr_layers_t){l->pp_size, l->pp_rank, l->start_layer, l->layers, l->nkv};
}

int kvr_layout_kv_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n)
{
    /* Per buffer of the prefill (stage): its item length and the one of
     * the decode buffer it lands in (layers checked compatible). */
    kvr_layers_t theirs_l = kvr_wire_layers(l);
    int pre = e->mode == KVR_MODE_PREFILL;
    const kvr_layers_t *pl = pre ? &e->layers : &theirs_l, *dl = pre ? &theirs_l : &e->layers;
    uint32_t nb = pl->nkv;
    uint64_t *items = malloc(2 * (nb ? nb : 1) * sizeof(uint64_t));
    if (items == NULL) {
        snprintf(why, n, "out of memory");
        return -1;
    }
    uint64_t *pi = items, *di = items + nb;
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t d = kvr_layers_map(pl, dl, b);
        pi[b] = pre ? e->kv_item[b] : kvr_wire_u64_at(l->kv_item_lens, b);
        di[b] = pre ? kvr_wire_u64_at(l->kv_item_lens, d) : e->kv_item[d];
    }
    int rc = 0;
    if (e->heads.heads && l->heads) {
        kvr_heads_t theirs = kvr_wire_heads(l);
        rc = kvr_heads_compat(pre ? &e->heads : &theirs, pi, pre ? &theirs : &e->heads, di, nb,
                              e->page_size, why, n);
    }
    for (uint32_t b = 0; rc == 0 && !(e->heads.heads && l->heads) && b < nb; b++) {
        if (pi[b] != di[b]) {
            snprintf(why, n, "KV buffer %u item_len %" PRIu64 " here, %" PRIu64 " there",
                     pre ? b : kvr_layers_map(pl, dl, b), pre ? pi[b] : di[b],
                     pre ? di[b] : pi[b]);
            rc = -1;
        }
    }
    free(items);
    return rc;
}

/* Decode: prefill p (its layers known) is the PP stage its rooms asked for. */
static int kvr_peer_link_stage(const kvr_peer_t *p, char *why, size_t n)
{
    const kvr_layers_t *y = &p->layers;
    if (p->want_pp == 0 && y->pp_size > 1) {
        snprintf(why, n,
                 "the prefill has PP %u (stage %u holds layers %u-%u); give the receiver's "
                 "init() prefill_pp_size",
                 y->pp_size, y->pp_rank, y->start, y->start + y->layers - 1);
        return -1;
    }
    if (p->want_pp > 0 && y->pp_size != p->want_pp) {
        snprintf(why, n, "the room asks for prefill PP %u, the prefill has PP %u", p->want_pp,
                 y->pp_size);
        return -1;
    }
    if (p->query_pp >= 0 && y->pp_rank != (uint32_t)p->query_pp) {
        snprintf(why, n, "registered as PP stage %d, it says it is stage %u", p->query_pp,
                 y->pp_rank);
        return -1;
    }
    return 0;
}

int kvr_peer_link(kvr_engine_t *e, kvr_peer_t *p, const kvr_wire_layout_t *l, char *why,
                  size_t n)
{
    kvr_slice_t whole = {0, 0, 0};
    p->slice = p->peer_slice = whole;
    p->layers = kvr_wire_layers(l);
    if (e->mode == KVR_MODE_DECODE && kvr_peer_link_stage(p, why, n) != 0) {
        return -1;
    }
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

/* Bytes of one page of every KV buffer decode leg r reads: the buffers of
 * its prefill's PP stage (all of them before its layers are known), a
 * slice of leg_heads of their heads (whole pages without head layouts). */
static uint64_t kvr_leg_page_bytes(const kvr_engine_t *e, const kvr_room_t *r)
{
    const kvr_layers_t *y = r->peer != NULL && r->peer->layers.layers ? &r->peer->layers : NULL;
    uint64_t bytes = 0;
    for (uint32_t b = 0; b < e->nkv; b++) {
        if (y != NULL && !kvr_layers_holds(y, &e->layers, b)) {
            continue;
        }
        uint32_t n = ((const kvr_eroom_t *)r)->leg_heads;
        bytes += e->heads.heads ? e->kv_item[b] / e->heads.heads * n : e->kv_item[b];
    }
    return bytes;
}

/* How the state rows of decode leg r split (state.c): sliced only with
 * state slicing rules and TP sizes that differ; else whole rows. */
static kvr_state_link_t kvr_leg_state_link(const kvr_engine_t *e, const kvr_room_t *r)
{
    if (r->peer == NULL || e->nstate_rules == 0) {
        return kvr_state_link(0, 0, 0, 0);
    }
    return kvr_state_link(r->peer->want_tp, (uint32_t)r->peer->query_rank, e->heads.tp_size,
                          e->heads.tp_rank);
}

uint64_t kvr_group_leg_bytes(const kvr_engine_t *e, const kvr_room_t *r)
{
    kvr_state_link_t sl = kvr_leg_state_link(e, r);
    return (uint64_t)r->npages * kvr_leg_page_bytes(e, r) +
           kvr_state_link_bytes(e, &sl, r->aux_index, r->states, &r->lists);
}

/* The links of decode room h to the prefill's TP ranks: by the head
 * layouts with prefill_tp, else the prefill rank of our number, whole. */
static int kvr_group_links(kvr_engine_t *e, uint32_t prefill_tp, kvr_link_t *links,
                           uint32_t *n, char *err, size_t errlen)
{
    if (prefill_tp == 0) {
        uint32_t first = e->heads.heads ? kvr_heads_first(&e->heads, e->heads.tp_rank) : 0;
        links[0] = (kvr_link_t){(uint32_t)e->rank, (uint32_t)e->rank, first, e->heads.heads};
        *n = 1;
        return 0;
    }
    if (e->heads.heads == 0) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "prefill_tp_size=%u needs the decode's head layout (KVArgs kv_head_num, "
                       "total_kv_head_num)",
                       prefill_tp);
    }
    uint32_t total = e->heads.total_heads;
    kvr_heads_t pre = {prefill_tp, 0, prefill_tp <= total ? total / prefill_tp : 1, total};
    char why[256];
    if (kvr_heads_check(&pre, "prefill", why, sizeof(why)) != 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "prefill_tp_size=%u: %s", prefill_tp, why);
    }
    *n = kvr_heads_links(&pre, &e->heads, 1, e->heads.tp_rank, links, KVR_MAX_LEGS);
    return 0;
}

int kvr_group_open_locked(kvr_engine_t *e, kvr_room_t *h, uint32_t prefill_dp,
                          uint32_t prefill_tp, uint32_t prefill_pp, char *err, size_t errlen)
{
    KVR_ASSERT_LOCKED(e);
    kvr_link_t links[KVR_MAX_LEGS];
    uint32_t k = 0, stages = prefill_pp ? prefill_pp : 1;
    int rc = kvr_group_links(e, prefill_tp, links, &k, err, errlen);
    if (rc != 0) {
        return rc;
    }
    uint32_t n = k * stages;
    if (k > KVR_MAX_LEGS || n > KVR_MAX_LEGS) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "decode rank %d would read from %u prefill ranks (at most %u)", e->rank, n,
                       KVR_MAX_LEGS);
    }
    h->legs = calloc(n, sizeof(*h->legs));
    if (h->legs == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    kvr_eroom(h)->pp_stages = prefill_pp;
    for (uint32_t i = 0; i < n; i++) {
        /* Stage after stage, each with every TP link. */
        const kvr_link_t *l = &links[i % k];
        kvr_room_t *leg = kvr_room_new(sizeof(kvr_eroom_t), h->id, kvr_new_tag_locked(e),
                                       KVR_ROLE_DECODE);
        kvr_peer_t *p = kvr_prefill_peer_get(e, h->bootstrap_addr, prefill_dp, (int)l->prefill,
                                             prefill_pp ? (int)(i / k) : -1);
        if (leg == NULL || p == NULL || kvr_table_put(&e->tags, leg->tag, leg) != 0) {
            kvr_room_free(leg);
            return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
        }
        kvr_eroom(leg)->owner = e;
        kvr_eroom(leg)->leg_heads = l->nheads;
        kvr_eroom(leg)->leg_stage = i / k;
        snprintf(leg->bootstrap_addr, sizeof(leg->bootstrap_addr), "%s", h->bootstrap_addr);
        leg->refs = 1; /* the lead's */
        leg->lead = h;
        kvr_room_ref(h);
        p->want_tp = prefill_tp;
        p->want_pp = prefill_pp;
        leg->peer = p;
        leg->init_called = 1;
        h->legs[h->nlegs++] = leg;
        h->held++;
        kvr_work_push_locked(e, leg);
    }
    h->legs_want = n;
    return 0;
}

/* Decode PP room h: the layers of stage s as its prefill ranks told. */
static int kvr_group_stage_layers(const kvr_room_t *h, kvr_layers_t *st, char *why, size_t n)
{
    uint8_t seen[KVR_MAX_LEGS] = {0};
    for (uint32_t i = 0; i < h->nlegs; i++) {
        const kvr_room_t *leg = h->legs[i];
        uint32_t s = ((const kvr_eroom_t *)leg)->leg_stage;
        const kvr_layers_t *y = &leg->peer->layers;
        if (!seen[s]) {
            st[s] = *y;
            seen[s] = 1;
        } else if (st[s].start != y->start || st[s].layers != y->layers) {
            snprintf(why, n, "prefill ranks of PP stage %u hold layers %u-%u and %u-%u", s,
                     st[s].start, st[s].start + st[s].layers - 1, y->start,
                     y->start + y->layers - 1);
            return -1;
        }
    }
    return 0;
}

int kvr_group_may_request_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *h = r->lead;
    if (h == NULL || kvr_eroom(h)->pp_stages == 0 || kvr_eroom(h)->layers_checked) {
        return 1;
    }
    /* Every stage's layers are known before any of them is asked for
     * data: the room fails before any byte moves if they do not cover
     * ours exactly. */
    for (uint32_t i = 0; i < h->nlegs; i++) {
        kvr_peer_t *p = h->legs[i]->peer;
        if (p == NULL || p->state != KVR_PEER_READY || p->layers.layers == 0) {
            return 0;
        }
    }
    kvr_layers_t st[KVR_MAX_LEGS];
    char why[400];
    if (kvr_group_stage_layers(h, st, why, sizeof(why)) != 0 ||
        kvr_layers_cover(st, kvr_eroom(h)->pp_stages, e->layers.layers, why, sizeof(why)) != 0) {
        kvr_room_failf_locked(e, r, KVR_LAYOUT_MISMATCH, 1, "room %" PRIu64 ": %s", h->id, why);
        return 0;
    }
    kvr_eroom(h)->layers_checked = 1;
    for (uint32_t i = 0; i < h->nlegs; i++) {
        if (h->legs[i] != r) {
            kvr_work_push_locked(e, h->legs[i]);
        }
    }
    return 1;
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
        /* The aux row and the state slots come with the first leg of the
         * last PP stage (the one that has the output, as in sglang), which
         * always reads heads; state rows sliced over TP ranks (TP sizes
         * differ, state.c) come in shares over every leg of that stage. */
        int last = kvr_eroom(leg)->leg_stage + 1 ==
                   (kvr_eroom(h)->pp_stages ? kvr_eroom(h)->pp_stages : 1);
        int rows = last && (i == 0 || kvr_eroom(h->legs[i - 1])->leg_stage !=
                                          kvr_eroom(leg)->leg_stage);
        kvr_state_link_t sl = kvr_leg_state_link(e, leg);
        leg->aux_index = rows ? h->aux_index : -1;
        kvr_state_copy(leg->states, h->states, rows || (last && sl.sliced) ? KVR_MAX_STATES : 0);
        if (rows && kvr_state_lists_copy(&leg->lists, &h->lists) != 0) {
            return -1;
        }
        leg->claim_lists = kvr_state_list_bit(e, &leg->lists, e->naux);
        leg->expected = kvr_group_leg_bytes(e, leg);
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
    if (h->src_lists.total > 0) { /* given with the last chunk */
        kvr_state_lists_free(&leg->src_lists);
        if (kvr_state_lists_copy(&leg->src_lists, &h->src_lists) != 0) {
            kvr_room_failf_locked(e, leg, KVR_TRANSPORT, 1, "out of memory");
            return;
        }
    }
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
