#include "plan.h"

#include "room.h"

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
    while (end < p->given && runs < KVR_MAX_IOV) {
        uint32_t n = kvr_run_length(p->src_pages, p->dst_pages, end, p->given);
        if ((uint64_t)n * p->kv_item_max >= p->run_bytes || n >= p->max_pages) {
            if (runs == 0) {
                end += n < p->max_pages ? n : p->max_pages;
            }
            break;
        }
        if (runs > 0 && ((uint64_t)(end - pos + n) * p->kv_item_max > p->cap ||
                         end - pos + n > p->max_pages)) {
            break;
        }
        end += n;
        runs++;
    }
    return end;
}

int kvr_post_plan(const kvr_plan_t *p, kvr_plan_cursor_t *c, kvr_am_header_t *h)
{
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
        h->buf = (uint16_t)c->buf;
        h->nbuf = kvr_plan_buf_group(p->kv_item, p->nkv, c->buf, h->npages, pieces, p->merge);
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
    if (!p->aux || c->aux_buf >= p->naux) {
        c->aux_done = 1;
        return 0;
    }
    h->kind = KVR_AM_KIND_AUX;
    h->pos = 0;
    h->npages = 1;
    h->buf = (uint16_t)c->aux_buf;
    h->nbuf = kvr_plan_buf_group(p->aux_item, p->naux, c->aux_buf, 1, 1, p->merge);
    c->aux_buf += h->nbuf;
    c->aux_done = c->aux_buf >= p->naux;
    return 1;
}

void kvr_plan_hold(kvr_plan_cursor_t *c, const kvr_am_header_t *h)
{
    if (h->kind == KVR_AM_KIND_KV) {
        c->end = h->pos + h->npages;
        c->buf = h->buf;
    } else {
        c->aux_buf = h->buf;
    }
}
