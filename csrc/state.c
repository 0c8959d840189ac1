/*
 * state: per-request state buffers of hybrid models (Mamba conv/ssm state,
 * other buffers addressed by a request's slot rather than by its pages).
 * Each state buffer belongs to a component (sglang's state types); a room
 * names one slot per component on each side, and every buffer of the
 * component moves that slot's row, of the buffer's own item length.
 *
 * The engine keeps the state buffers after the aux buffers, as row buffers
 * of the same kind on the wire (KVR_AM_KIND_AUX): a row message covers
 * buffers [buf, buf + nbuf) of aux then state buffers, each at its own row
 * (kvr_state_row).  So state rows go with the room's last chunk like the
 * aux row, are claimed, counted and checked like it, and share the room's
 * completion, abort and failure.
 *
 * State rows across TP sizes: each buffer may have a slicing rule
 * (stateslice.h).  A decode room then asks every leg for the slots, and
 * each link moves its share of every sliced row (its pieces, in one row
 * message with the other buffers' as before) and, over the link of the
 * decode rank's first share, the replicated rows whole.
 *
 * Thread: any; the functions read the engine's fixed description only
 * (and a peer's link, set under the engine lock).
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The slicing rules of the state buffers, when given. */
static int kvr_state_rules_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err,
                                 size_t errlen)
{
    uint32_t n = p->nstate;
    e->state_rules = malloc((p->nstate_rules ? p->nstate_rules : 1) * sizeof(uint32_t));
    e->state_rule_at = malloc((n ? n : 1) * sizeof(uint32_t));
    e->state_replicated = calloc(n ? n : 1, 1);
    if (e->state_rules == NULL || e->state_rule_at == NULL || e->state_replicated == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    char why[256];
    if (kvr_state_rules_check(p->state_rules, p->nstate_rules, p->aux_item_lens + p->naux - n,
                              n, p->state_comp, e->state_rule_at, why, sizeof(why)) != 0) {
        return kvr_err(err, errlen, KVR_EVALUE, "%s", why);
    }
    memcpy(e->state_rules, p->state_rules, p->nstate_rules * sizeof(uint32_t));
    e->nstate_rules = p->nstate_rules;
    e->state_pieces_max = 1;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t *r = e->state_rules + e->state_rule_at[i];
        e->state_replicated[i] = (unsigned char)kvr_state_rule_replicated(r);
        if (r[0] * r[1] > e->state_pieces_max) {
            e->state_pieces_max = r[0] * r[1];
        }
    }
    return 0;
}

int kvr_state_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen)
{
    if (p->nstate_rules > 0 && (p->nstate == 0 || p->state_comp == NULL)) {
        return kvr_err(err, errlen, KVR_EVALUE, "state_slicing given without state buffers");
    }
    if (p->nstate == 0) {
        return p->state_list ? kvr_err(err, errlen, KVR_EVALUE,
                                       "state_lists given without state buffers")
                             : 0;
    }
    if (p->nstate > p->naux || p->state_comp == NULL) {
        return kvr_err(err, errlen, KVR_EVALUE, "%u state buffers but %u row buffers", p->nstate,
                       p->naux);
    }
    e->state_comp = malloc(p->nstate * sizeof(uint32_t));
    if (e->state_comp == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    uint32_t base = p->naux - p->nstate;
    for (uint32_t i = 0; i < p->nstate; i++) {
        uint32_t c = p->state_comp[i], prev = i ? p->state_comp[i - 1] : 0;
        if (c >= KVR_MAX_STATES || c < prev || c > prev + (i ? 1 : 0)) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "state buffer %u is of component %u: components must be 0, 1, ... "
                           "in order, at most %d",
                           i, c, KVR_MAX_STATES);
        }
        int64_t rows = (int64_t)(p->aux_lens[base + i] / p->aux_item_lens[base + i]);
        if (c >= e->nstates) {
            e->nstates = c + 1;
            e->state_rows[c] = rows;
        } else if (rows < e->state_rows[c]) {
            e->state_rows[c] = rows;
        }
        e->state_bytes[c] += p->aux_item_lens[base + i];
        e->state_comp[i] = c;
    }
    e->nstate = p->nstate;
    if (p->state_list >> e->nstates) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "state_lists names component %u, %u state components are registered",
                       31 - (uint32_t)__builtin_clz(p->state_list), e->nstates);
    }
    e->state_list = p->state_list;
    return p->nstate_rules > 0 ? kvr_state_rules_setup(e, p, err, errlen) : 0;
}

int64_t kvr_state_row(const kvr_engine_t *e, uint32_t b, int64_t aux, const int64_t *states)
{
    uint32_t base = e->naux - e->nstate;
    return b < base ? aux : states[e->state_comp[b - base]];
}

uint64_t kvr_state_bytes(const kvr_engine_t *e, int64_t aux, const int64_t *states,
                         const kvr_slot_lists_t *lists)
{
    uint64_t bytes = aux >= 0 ? e->aux_bytes : 0;
    for (uint32_t c = 0; c < e->nstates; c++) {
        uint64_t rows = e->state_list >> c & 1u ? (lists != NULL ? lists->n[c] : 0) : 1;
        bytes += states[c] >= 0 ? e->state_bytes[c] * rows : 0;
    }
    return bytes;
}

/* Checks slot s of entry c (list position i, or -1 for a one-slot entry). */
static int kvr_state_slot_check(const kvr_engine_t *e, uint32_t c, int64_t i, int64_t s,
                                char *err, size_t errlen)
{
    if (s >= 0 && s < e->state_rows[c]) {
        return 0;
    }
    char at[32] = "";
    if (i >= 0) {
        snprintf(at, sizeof(at), "[%" PRId64 "]", i);
    }
    return kvr_err(err, errlen, KVR_EVALUE,
                   "state_indices[%u]%s=%" PRId64
                   " is outside the registered state slots [0, %" PRId64 ")",
                   c, at, s, e->state_rows[c]);
}

int kvr_state_take(const kvr_engine_t *e, const int64_t *states, uint32_t n,
                   const kvr_state_in_t *in, int64_t *out, kvr_slot_lists_t *lists, char *err,
                   size_t errlen)
{
    memset(lists, 0, sizeof(*lists));
    if (n > e->nstates) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "state_indices names %u state components, %u are registered", n,
                       e->nstates);
    }
    const int64_t *from[KVR_MAX_STATES];
    uint64_t off = 0;
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        int seq = c < n && in != NULL && (in->seq >> c & 1u);
        uint32_t len = seq ? in->n[c] : (c < n && states[c] >= 0);
        from[c] = seq ? in->slots + off : states + c;
        off += seq ? in->n[c] : 0;
        out[c] = c < n && !seq ? states[c] : -1;
        if (!(e->state_list >> c & 1u)) {
            if (seq && len != 1) {
                return kvr_err(err, errlen, KVR_EVALUE,
                               "state_indices[%u] has %u slots: state component %u takes one "
                               "slot per request (a list of slots is for a component registered "
                               "as a list, such as sliding-window pages)",
                               c, len, c);
            }
            out[c] = seq ? from[c][0] : out[c];
            if (out[c] >= 0 && kvr_state_slot_check(e, c, -1, out[c], err, errlen) != 0) {
                return KVR_EVALUE;
            }
            continue;
        }
        for (uint32_t i = 0; i < len; i++) {
            if (kvr_state_slot_check(e, c, seq ? (int64_t)i : -1, from[c][i], err, errlen) != 0) {
                return KVR_EVALUE;
            }
        }
        lists->n[c] = len;
        lists->at[c] = lists->total;
        lists->total += len;
        out[c] = len ? 0 : -1;
    }
    if (lists->total == 0) {
        return 0;
    }
    lists->slots = malloc((size_t)lists->total * sizeof(int32_t));
    if (lists->slots == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        for (uint32_t i = 0; i < lists->n[c]; i++) {
            lists->slots[lists->at[c] + i] = (int32_t)from[c][i];
        }
    }
    return 0;
}

int kvr_state_list_of(const kvr_engine_t *e, uint32_t b)
{
    uint32_t base = e->naux - e->nstate;
    if (b < base || b >= e->naux || !(e->state_list >> e->state_comp[b - base] & 1u)) {
        return -1;
    }
    return (int)e->state_comp[b - base];
}

int kvr_state_lists_copy(kvr_slot_lists_t *dst, const kvr_slot_lists_t *src)
{
    *dst = *src;
    dst->slots = NULL;
    if (src->total == 0) {
        return 0;
    }
    dst->slots = malloc((size_t)src->total * sizeof(int32_t));
    if (dst->slots == NULL) {
        return -1;
    }
    memcpy(dst->slots, src->slots, (size_t)src->total * sizeof(int32_t));
    return 0;
}

void kvr_state_lists_free(kvr_slot_lists_t *l)
{
    free(l->slots);
    memset(l, 0, sizeof(*l));
}

uint64_t kvr_state_list_bit(const kvr_engine_t *e, const kvr_slot_lists_t *l, uint32_t b)
{
    uint64_t bit = 0;
    for (uint32_t i = e->naux - e->nstate; i < b; i++) {
        int c = kvr_state_list_of(e, i);
        bit += c >= 0 ? l->n[c] : 0;
    }
    return bit;
}

void kvr_state_copy(int64_t *dst, const int64_t *src, uint32_t n)
{
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        dst[c] = c < n ? src[c] : -1;
    }
}

int kvr_state_any(const int64_t *states)
{
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        if (states[c] >= 0) {
            return 1;
        }
    }
    return 0;
}

/* The peer's rules (layout l) in host order, checked; NULL with why. */
static uint32_t *kvr_state_peer_rules(const kvr_engine_t *e, const kvr_wire_layout_t *l,
                                      const uint64_t *items, const char *side, char *why,
                                      size_t n)
{
    uint32_t *rules = malloc(l->nrules * sizeof(uint32_t));
    if (rules == NULL) {
        snprintf(why, n, "out of memory");
        return NULL;
    }
    for (uint32_t i = 0; i < l->nrules; i++) {
        const unsigned char *b = l->rules + (size_t)i * 4;
        rules[i] = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                   (uint32_t)b[3] << 24;
    }
    char sub[200];
    if (kvr_state_rules_check(rules, l->nrules, items, e->nstate, e->state_comp, NULL, sub,
                              sizeof(sub)) != 0) {
        snprintf(why, n, "the %s's %s", side, sub);
        free(rules);
        return NULL;
    }
    return rules;
}

int kvr_state_link_set(kvr_engine_t *e, kvr_peer_t *p, const kvr_wire_layout_t *l,
                       const kvr_heads_t *ph, const kvr_heads_t *dh, char *why, size_t n)
{
    kvr_state_link_t sl = kvr_state_link(ph->tp_size, ph->tp_rank, dh->tp_size, dh->tp_rank);
    if (e->state_list && ph->tp_size != dh->tp_size) {
        /* Sliding-window pages are KV pages of their own heads; slicing
         * them by head is not built. */
        snprintf(why, n,
                 "state component %u takes a list of slots (sliding-window pages), which moves "
                 "between equal TP sizes only: prefill TP %u, decode TP %u",
                 (uint32_t)__builtin_ctz(e->state_list), ph->tp_size, dh->tp_size);
        return -1;
    }
    if (e->nstate == 0 || ph->tp_size == dh->tp_size) {
        p->slink = sl;
        return 0;
    }
    int pre = e->mode == KVR_MODE_PREFILL;
    uint32_t pre_rules = pre ? e->nstate_rules : l->nrules;
    uint32_t dec_rules = pre ? l->nrules : e->nstate_rules;
    if (pre_rules == 0 || dec_rules == 0) {
        snprintf(why, n,
                 "state buffers move between equal TP sizes only, unless both sides give "
                 "state_slicing: prefill TP %u (%s), decode TP %u (%s)",
                 ph->tp_size, pre_rules ? "given" : "not given", dh->tp_size,
                 dec_rules ? "given" : "not given");
        return -1;
    }
    if (ph->tp_size > ph->total_heads || dh->tp_size > dh->total_heads) {
        /* The room's links follow the KV heads; with replicated heads (GQA
         * with fewer heads than ranks, MLA) they are not the pairs of
         * ranks whose state shares meet. */
        snprintf(why, n,
                 "state buffers move across TP sizes only when the KV heads split over the "
                 "ranks: prefill TP %u, decode TP %u, %u KV heads",
                 ph->tp_size, dh->tp_size, ph->total_heads);
        return -1;
    }
    uint32_t base = e->naux - e->nstate;
    uint64_t *items = malloc((e->nstate ? e->nstate : 1) * sizeof(uint64_t));
    if (items == NULL) {
        snprintf(why, n, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < e->nstate; i++) {
        items[i] = kvr_wire_u64_at(l->aux_item_lens, base + i);
    }
    int rc = -1;
    uint32_t *theirs = kvr_state_peer_rules(e, l, items, pre ? "decode" : "prefill", why, n);
    if (theirs != NULL) {
        const uint64_t *own = e->aux_item + base;
        rc = kvr_state_rules_compat(pre ? e->state_rules : theirs, pre ? own : items, ph->tp_size,
                                    pre ? theirs : e->state_rules, pre ? items : own, dh->tp_size,
                                    e->nstate, e->state_comp, why, n);
    }
    free(theirs);
    free(items);
    if (rc == 0) {
        p->slink = sl;
    }
    return rc;
}

const kvr_state_link_t *kvr_room_state_link(const kvr_room_t *r)
{
    return r->peer != NULL && r->peer->slink.sliced ? &r->peer->slink : NULL;
}

int kvr_state_skip(const kvr_engine_t *e, const kvr_state_link_t *sl, uint32_t i)
{
    return sl != NULL && sl->sliced && !sl->rep && e->state_replicated != NULL &&
           e->state_replicated[i];
}

uint64_t kvr_state_link_bytes(const kvr_engine_t *e, const kvr_state_link_t *sl, int64_t aux,
                              const int64_t *states, const kvr_slot_lists_t *lists)
{
    if (sl == NULL || !sl->sliced || e->nstate_rules == 0) {
        return kvr_state_bytes(e, aux, states, lists);
    }
    uint64_t bytes = aux >= 0 ? e->aux_bytes : 0;
    for (uint32_t i = 0; i < e->nstate; i++) {
        if (states[e->state_comp[i]] >= 0) {
            kvr_state_pieces(e, sl, i, 0, NULL, &bytes);
        }
    }
    return bytes;
}

uint32_t kvr_state_pieces(const kvr_engine_t *e, const kvr_state_link_t *sl, uint32_t i,
                          int64_t row, kvr_tp_iov_t *out, uint64_t *bytes)
{
    uint32_t b = e->naux - e->nstate + i;
    kvr_state_chunk_t chunks[KVR_STATE_MAX_PIECES];
    uint64_t len = 0;
    uint32_t k = kvr_state_chunks(e->state_rules + e->state_rule_at[i], e->aux_item[b],
                                  e->heads.tp_size, e->heads.tp_rank, sl,
                                  out != NULL ? chunks : NULL, &len);
    for (uint32_t j = 0; out != NULL && j < k; j++) {
        out[j].buf = (char *)(uintptr_t)e->aux_ptrs[b] + (uint64_t)row * e->aux_item[b] +
                     chunks[j].off;
        out[j].len = (size_t)chunks[j].len;
    }
    *bytes += len;
    return k;
}
