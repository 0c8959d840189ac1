#include "plan.h"

#include "room.h"

#include <inttypes.h>
#include <stdio.h>

int kvr_heads_check(const kvr_heads_t *h, const char *side, char *why, size_t n)
{
    if (h->tp_size == 0 || h->tp_rank >= h->tp_size || h->total_heads == 0 || h->heads == 0) {
        snprintf(why, n, "%s: tp_rank %u of tp_size %u with %u of %u KV heads is not a layout",
                 side, h->tp_rank, h->tp_size, h->heads, h->total_heads);
        return -1;
    }
    if (h->tp_size <= h->total_heads ? h->total_heads % h->tp_size != 0 ||
                                           h->heads != h->total_heads / h->tp_size
                                     : h->tp_size % h->total_heads != 0 || h->heads != 1) {
        snprintf(why, n,
                 "%s: %u KV heads do not split over tp_size %u as %u heads per rank (the heads "
                 "must divide by the ranks, or the ranks by the heads with one head each)",
                 side, h->total_heads, h->tp_size, h->heads);
        return -1;
    }
    return 0;
}

uint32_t kvr_heads_first(const kvr_heads_t *h, uint32_t rank)
{
    if (h->tp_size <= h->total_heads) {
        return rank * h->heads;
    }
    return rank / (h->tp_size / h->total_heads);
}

/* The prefill rank decode rank d reads head `head` from. */
static uint32_t kvr_heads_source(const kvr_heads_t *pre, uint32_t head, uint32_t d)
{
    if (pre->tp_size <= pre->total_heads) {
        return head / pre->heads;
    }
    uint32_t replicas = pre->tp_size / pre->total_heads;
    return head * replicas + d % replicas;
}

/* Appends the links of decode rank d (one per run of heads of one source)
 * to out[n..max); returns the new count. */
static uint32_t kvr_decode_links(const kvr_heads_t *pre, const kvr_heads_t *dec, uint32_t d,
                                 kvr_link_t *out, uint32_t n, uint32_t max)
{
    uint32_t first = kvr_heads_first(dec, d), end = first + dec->heads;
    for (uint32_t h = first; h < end;) {
        uint32_t src = kvr_heads_source(pre, h, d), h0 = h;
        while (h < end && kvr_heads_source(pre, h, d) == src) {
            h++;
        }
        if (n < max) {
            out[n] = (kvr_link_t){src, d, h0, h - h0};
        }
        n++;
    }
    return n;
}

/* 1 if some decode rank reads heads from prefill rank p. */
static int kvr_prefill_read(const kvr_heads_t *pre, const kvr_heads_t *dec, uint32_t p)
{
    for (uint32_t d = 0; d < dec->tp_size; d++) {
        uint32_t first = kvr_heads_first(dec, d);
        for (uint32_t h = first; h < first + dec->heads; h++) {
            if (kvr_heads_source(pre, h, d) == p) {
                return 1;
            }
        }
    }
    return 0;
}

uint32_t kvr_heads_links(const kvr_heads_t *pre, const kvr_heads_t *dec, int decode,
                         uint32_t rank, kvr_link_t *out, uint32_t max)
{
    uint32_t n = 0;
    if (decode) {
        n = kvr_decode_links(pre, dec, rank, out, 0, max);
        for (uint32_t p = rank; p < pre->tp_size; p += dec->tp_size) {
            if (!kvr_prefill_read(pre, dec, p)) {
                if (n < max) {
                    out[n] = (kvr_link_t){p, rank, 0, 0};
                }
                n++;
            }
        }
        return n;
    }
    for (uint32_t d = 0; d < dec->tp_size; d++) {
        /* A decode rank reads one run of heads from a prefill rank (the
         * source only grows with the head). */
        uint32_t first = kvr_heads_first(dec, d), h0 = UINT32_MAX, h1 = 0;
        for (uint32_t h = first; h < first + dec->heads; h++) {
            if (kvr_heads_source(pre, h, d) == rank) {
                h0 = h0 == UINT32_MAX ? h : h0;
                h1 = h + 1;
            }
        }
        if (h0 != UINT32_MAX) {
            if (n < max) {
                out[n] = (kvr_link_t){rank, d, h0, h1 - h0};
            }
            n++;
        }
    }
    if (!kvr_prefill_read(pre, dec, rank)) {
        if (n < max) {
            out[n] = (kvr_link_t){rank, rank % dec->tp_size, 0, 0};
        }
        n++;
    }
    return n;
}

kvr_slice_t kvr_link_slice(const kvr_link_t *l, const kvr_heads_t *h, uint32_t rank)
{
    kvr_slice_t s = {0, l->nheads, h->heads};
    if (l->nheads > 0) {
        s.first = l->head - kvr_heads_first(h, rank);
    }
    return s;
}

int kvr_heads_compat(const kvr_heads_t *pre, const uint64_t *pre_items, const kvr_heads_t *dec,
                     const uint64_t *dec_items, uint32_t nkv, uint32_t page_size, char *why,
                     size_t n)
{
    if (kvr_heads_check(pre, "prefill", why, n) != 0 ||
        kvr_heads_check(dec, "decode", why, n) != 0) {
        return -1;
    }
    if (pre->total_heads != dec->total_heads) {
        snprintf(why, n, "%u KV heads in all on the prefill, %u on the decode", pre->total_heads,
                 dec->total_heads);
        return -1;
    }
    for (uint32_t b = 0; b < nkv; b++) {
        uint64_t pu = (uint64_t)page_size * pre->heads, du = (uint64_t)page_size * dec->heads;
        if (pre_items[b] % pu != 0 || dec_items[b] % du != 0 ||
            pre_items[b] / pu != dec_items[b] / du) {
            snprintf(why, n,
                     "KV buffer %u: item_len %" PRIu64 " for %u heads on the prefill, %" PRIu64
                     " for %u heads on the decode (page_size %u): the bytes per head differ",
                     b, pre_items[b], pre->heads, dec_items[b], dec->heads, page_size);
            return -1;
        }
    }
    return 0;
}

int kvr_layers_check(const kvr_layers_t *l, const char *side, char *why, size_t n)
{
    if (l->pp_size == 0 || l->pp_rank >= l->pp_size) {
        snprintf(why, n, "%s: pp_rank %u is not a stage of pp_size %u", side, l->pp_rank,
                 l->pp_size);
        return -1;
    }
    if (l->layers == 0 || l->nkv == 0 || l->nkv % l->layers != 0) {
        snprintf(why, n,
                 "%s: %u KV buffers do not hold num_layers=%u layers (the buffers must be a "
                 "whole number of groups, e.g. K and V, of one buffer per layer)",
                 side, l->nkv, l->layers);
        return -1;
    }
    if (l->start > UINT32_MAX - l->layers) {
        snprintf(why, n, "%s: start_layer %u + num_layers %u is past the last layer", side,
                 l->start, l->layers);
        return -1;
    }
    return 0;
}

int kvr_layers_identity(const kvr_layers_t *pre, const kvr_layers_t *dec)
{
    return pre->start == 0 && pre->layers == dec->layers;
}

uint32_t kvr_layers_map(const kvr_layers_t *pre, const kvr_layers_t *dec, uint32_t b)
{
    return b / pre->layers * dec->layers + pre->start + b % pre->layers;
}

int kvr_layers_holds(const kvr_layers_t *pre, const kvr_layers_t *dec, uint32_t b)
{
    uint32_t j = b % dec->layers;
    return j >= pre->start && j - pre->start < pre->layers;
}

int kvr_layers_compat(const kvr_layers_t *pre, const kvr_layers_t *dec, char *why, size_t n)
{
    if (kvr_layers_check(pre, "prefill", why, n) != 0 ||
        kvr_layers_check(dec, "decode", why, n) != 0) {
        return -1;
    }
    if (pre->nkv / pre->layers != dec->nkv / dec->layers) {
        snprintf(why, n,
                 "%u KV buffers per layer on the prefill (%u buffers, %u layers), %u on the "
                 "decode (%u buffers, %u layers)",
                 pre->nkv / pre->layers, pre->nkv, pre->layers, dec->nkv / dec->layers, dec->nkv,
                 dec->layers);
        return -1;
    }
    if (pre->start + pre->layers > dec->layers) {
        snprintf(why, n, "prefill PP stage %u of %u holds layers %u-%u, the decode has %u layers",
                 pre->pp_rank, pre->pp_size, pre->start, pre->start + pre->layers - 1,
                 dec->layers);
        return -1;
    }
    if (pre->pp_size == 1 && !kvr_layers_identity(pre, dec)) {
        snprintf(why, n, "the prefill (one PP stage) holds layers %u-%u, the decode has %u layers",
                 pre->start, pre->start + pre->layers - 1, dec->layers);
        return -1;
    }
    return 0;
}

/* Appends "a-b (stage s), " for every stage to out. */
static void kvr_layers_list(const kvr_layers_t *st, uint32_t n, char *out, size_t len)
{
    size_t at = 0;
    out[0] = '\0';
    for (uint32_t s = 0; s < n && at < len; s++) {
        int k = snprintf(out + at, len - at, "%s%u-%u (stage %u)", s ? ", " : "", st[s].start,
                         st[s].start + st[s].layers - 1, s);
        at += k > 0 ? (size_t)k : 0;
    }
}

int kvr_layers_cover(const kvr_layers_t *stages, uint32_t n, uint32_t total, char *why,
                     size_t len)
{
    char list[256];
    kvr_layers_list(stages, n, list, sizeof(list));
    /* Stages in the order of their first layer (n is small). */
    uint32_t next = 0, prev = UINT32_MAX;
    for (uint32_t done = 0; done < n; done++) {
        uint32_t s = UINT32_MAX;
        for (uint32_t i = 0; i < n; i++) {
            int after = prev == UINT32_MAX || stages[i].start > stages[prev].start ||
                        (stages[i].start == stages[prev].start && i > prev);
            if (after && (s == UINT32_MAX || stages[i].start < stages[s].start)) {
                s = i;
            }
        }
        if (stages[s].start > next) {
            break; /* a gap: reported below */
        }
        if (stages[s].start < next) {
            snprintf(why, len,
                     "the prefill's PP stages hold layers %s: layer %u is in stage %u and "
                     "stage %u",
                     list, stages[s].start, prev, s);
            return -1;
        }
        next = stages[s].start + stages[s].layers;
        prev = s;
    }
    if (next != total) {
        uint32_t end = total;
        for (uint32_t i = 0; i < n; i++) {
            if (stages[i].start > next && stages[i].start < end) {
                end = stages[i].start;
            }
        }
        if (next > total) {
            snprintf(why, len, "the prefill's PP stages hold layers %s, the decode has %u", list,
                     total);
        } else {
            snprintf(why, len,
                     "the prefill's PP stages hold layers %s: layers %u-%u of the decode's %u "
                     "are in none",
                     list, next, end - 1, total);
        }
        return -1;
    }
    return 0;
}

uint16_t kvr_plan_buf_group(const uint64_t *items, uint32_t n, uint32_t b, uint32_t npages,
                            uint32_t pieces, uint64_t merge)
{
    uint32_t nb = 1;
    uint64_t bytes = (uint64_t)npages * items[b];
    while (b + nb < n && nb < UINT16_MAX && (uint64_t)(nb + 1) * pieces <= KVR_MAX_IOV &&
           bytes + (uint64_t)npages * items[b + nb] <= merge) {
        bytes += (uint64_t)npages * items[b + nb];
        nb++;
    }
    return (uint16_t)nb;
}

/* The end of the position range that starts at pos: one message per
 * buffer covers [pos, end). */
static uint32_t kvr_plan_range(const kvr_plan_t *p, uint32_t pos)
{
    uint32_t runs = 0, end = pos;
    uint32_t rows = p->src_rows > p->dst_rows ? p->src_rows : p->dst_rows;
    uint32_t max_pages = p->max_pages;
    if (rows > 1 && KVR_MAX_IOV / rows < max_pages) {
        /* Slices of rows: a piece per row of each page on that side. */
        max_pages = KVR_MAX_IOV / rows > 0 ? KVR_MAX_IOV / rows : 1;
    }
    while (end < p->given && runs < KVR_MAX_IOV) {
        uint32_t n = kvr_run_length(p->src_pages, p->dst_pages, end, p->given);
        if ((uint64_t)n * p->kv_item_max >= p->run_bytes || n >= max_pages) {
            if (runs == 0) {
                end += n < max_pages ? n : max_pages;
            }
            break;
        }
        if (runs > 0 && ((uint64_t)(end - pos + n) * p->kv_item_max > p->cap ||
                         end - pos + n > max_pages)) {
            break;
        }
        end += n;
        runs++;
    }
    return end;
}

/* 1 if row buffer b is a buffer of a list component. */
static int kvr_plan_is_list(const kvr_plan_t *p, uint32_t b)
{
    uint32_t base = p->naux - p->nstate;
    return b >= base && (p->state_list >> p->state_comp[b - base] & 1u);
}

/* Runs of list positions [pos, end) consecutive on both sides, at most
 * max_runs, over at most max_pos positions; *end (0: up to len) becomes
 * where they stop. */
static uint32_t kvr_plan_list_runs(const int32_t *src, const int32_t *dst, uint32_t pos,
                                   uint32_t *end, uint32_t len, uint32_t max_runs,
                                   uint32_t max_pos)
{
    uint32_t runs = 0, at = pos, stop = *end ? *end : len;
    if (stop - pos > max_pos) {
        stop = pos + max_pos;
    }
    while (at < stop && runs < max_runs) {
        at += kvr_run_length(src, dst, at, stop);
        runs++;
    }
    *end = at;
    return runs;
}

/* The next message of the list component whose buffer c->aux_buf is: a
 * range of list positions (at most KVR_MAX_IOV runs) over a group of the
 * component's buffers, then the next group, then the next range. */
static int kvr_plan_list(const kvr_plan_t *p, kvr_plan_cursor_t *c, kvr_am_header_t *h)
{
    uint32_t base = p->naux - p->nstate, comp = p->state_comp[c->aux_buf - base];
    uint32_t first = c->aux_buf, last = c->aux_buf + 1;
    while (first > base && p->state_comp[first - 1 - base] == comp) {
        first--;
    }
    while (last < p->naux && p->state_comp[last - base] == comp) {
        last++;
    }
    const int32_t *src = p->src_lists->slots + p->src_lists->at[comp];
    const int32_t *dst = p->dst_lists->slots + p->dst_lists->at[comp];
    uint32_t len = p->dst_lists->n[comp], max_runs = p->row_run_alone ? 1 : KVR_MAX_IOV;
    uint64_t item = 0, max_pos = UINT32_MAX;
    for (uint32_t b = first; b < last; b++) {
        item = p->aux_item[b] > item ? p->aux_item[b] : item;
    }
    if (p->row_cap > 0) {
        max_pos = p->row_cap / item > 0 ? p->row_cap / item : 1;
    }
    if (c->row_end <= c->row_pos) {
        c->row_end = 0;
        kvr_plan_list_runs(src, dst, c->row_pos, &c->row_end, len, max_runs, (uint32_t)max_pos);
        c->aux_buf = first;
    }
    uint32_t end = c->row_end;
    uint32_t runs =
        kvr_plan_list_runs(src, dst, c->row_pos, &end, len, max_runs, (uint32_t)max_pos);
    h->kind = KVR_AM_KIND_AUX;
    h->pos = c->row_pos;
    h->npages = c->row_end - c->row_pos;
    h->buf = (uint16_t)c->aux_buf;
    h->nbuf = kvr_plan_buf_group(p->aux_item, last, c->aux_buf, h->npages, runs, p->merge);
    c->aux_buf += h->nbuf;
    if (c->aux_buf >= last) {
        c->row_pos = c->row_end;
        c->row_end = 0;
        c->aux_buf = first;
        if (c->row_pos >= len) {
            c->row_pos = 0;
            c->aux_buf = last;
            while (c->aux_buf < p->naux && !kvr_plan_row_wanted(p, c->aux_buf)) {
                c->aux_buf++;
            }
            c->aux_done = c->aux_buf >= p->naux;
        }
    }
    return 1;
}

int kvr_post_plan(const kvr_plan_t *p, kvr_plan_cursor_t *c, kvr_am_header_t *h)
{
    if (p->kv_none && c->posted < p->given) {
        c->posted = p->given;
        c->end = 0;
    }
    if (c->posted < p->given) {
        if (c->end <= c->posted) {
            c->end = kvr_plan_range(p, c->posted);
            c->buf = 0;
        }
        h->kind = KVR_AM_KIND_KV;
        h->pos = c->posted;
        h->npages = c->end - c->posted;
        uint32_t pieces = 0; /* per buffer: runs of consecutive source pages */
        for (uint32_t at = h->pos; at < c->end; pieces++) {
            at += kvr_run_length(NULL, p->src_pages, at, c->end);
        }
        if (p->src_rows > 1) {
            pieces = h->npages * p->src_rows;
        }
        if (p->dst_rows > 1 && h->npages * p->dst_rows > pieces) {
            pieces = h->npages * p->dst_rows;
        }
        h->buf = (uint16_t)c->buf;
        h->nbuf = kvr_plan_kv_group(p, c->buf, h->npages, pieces);
        c->buf += h->nbuf;
        if (c->buf >= p->nkv) {
            c->posted = c->end;
            c->end = 0;
            c->buf = 0;
        }
        return 1;
    }
    if (c->posted != p->total_pages || c->aux_done) {
        return 0;
    }
    while (c->aux_buf < p->naux && !kvr_plan_row_wanted(p, c->aux_buf)) {
        c->aux_buf++;
    }
    if (c->aux_buf >= p->naux) {
        c->aux_done = 1;
        return 0;
    }
    if (kvr_plan_is_list(p, c->aux_buf)) {
        return kvr_plan_list(p, c, h);
    }
    c->row_pos = c->row_end = 0;
    h->kind = KVR_AM_KIND_AUX;
    h->pos = 0;
    h->npages = 1;
    h->buf = (uint16_t)c->aux_buf;
    uint16_t nb = kvr_plan_buf_group(p->aux_item, p->naux, c->aux_buf, 1,
                                     p->row_pieces ? p->row_pieces : 1, p->merge);
    h->nbuf = 1;
    while (h->nbuf < nb && kvr_plan_row_wanted(p, c->aux_buf + h->nbuf) &&
           !kvr_plan_is_list(p, c->aux_buf + h->nbuf)) {
        h->nbuf++; /* a message covers only rows asked for */
    }
    c->aux_buf += h->nbuf;
    while (c->aux_buf < p->naux && !kvr_plan_row_wanted(p, c->aux_buf)) {
        c->aux_buf++;
    }
    c->aux_done = c->aux_buf >= p->naux;
    return 1;
}

uint16_t kvr_plan_kv_group(const kvr_plan_t *p, uint32_t b, uint32_t npages, uint32_t pieces)
{
    uint32_t n = p->group ? (b / p->group + 1) * p->group : p->nkv;
    return kvr_plan_buf_group(p->kv_item, n < p->nkv ? n : p->nkv, b, npages, pieces, p->merge);
}

int kvr_plan_row_wanted(const kvr_plan_t *p, uint32_t b)
{
    uint32_t base = p->naux - p->nstate;
    if (b < base) {
        return p->aux;
    }
    return p->dst_states != NULL && p->dst_states[p->state_comp[b - base]] >= 0 &&
           (p->state_skip == NULL || !p->state_skip[b - base]);
}

void kvr_plan_hold(kvr_plan_cursor_t *c, const kvr_am_header_t *h)
{
    if (h->kind == KVR_AM_KIND_KV) {
        c->end = h->pos + h->npages;
        c->buf = h->buf;
    } else {
        c->aux_buf = h->buf;
        c->row_pos = h->pos; /* a list range (kvr_plan_list); else reset there */
        c->row_end = h->pos + h->npages;
    }
}
