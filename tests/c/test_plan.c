#include "runner.h"

#include <string.h>

#include "../../csrc/plan.h"
#include "../../csrc/room.h"

#define MAXMSG 8192

typedef struct {
    kvr_am_header_t h[MAXMSG];
    int n;
} msgs_t;

/* Plans until the plan says nothing more can go now. */
static void drain(const kvr_plan_t *p, kvr_plan_cursor_t *c, msgs_t *out)
{
    kvr_am_header_t h;
    memset(&h, 0, sizeof(h));
    while (kvr_post_plan(p, c, &h)) {
        ASSERT(out->n < MAXMSG);
        out->h[out->n++] = h;
    }
}

static void base(kvr_plan_t *p, const int32_t *src, const int32_t *dst, uint32_t n,
                 const uint64_t *items, uint32_t nkv)
{
    memset(p, 0, sizeof(*p));
    p->src_pages = src;
    p->dst_pages = dst;
    p->given = n;
    p->total_pages = n;
    p->nkv = nkv;
    p->kv_item = items;
    p->kv_item_max = 0;
    for (uint32_t i = 0; i < nkv; i++) {
        p->kv_item_max = items[i] > p->kv_item_max ? items[i] : p->kv_item_max;
    }
    p->run_bytes = 64 << 10;
    p->cap = 1 << 20;
    p->merge = 0;
    p->max_pages = UINT32_MAX;
}

/* A run consecutive on both sides and at least run_bytes long goes alone,
 * one contiguous message per buffer. */
TEST_IMPL(plan_long_run_alone)
{
    int32_t src[32], dst[32];
    for (int i = 0; i < 32; i++) {
        src[i] = 100 + i;
        dst[i] = 7 + i;
    }
    uint64_t items[2] = {4096, 4096};
    kvr_plan_t p;
    base(&p, src, dst, 32, items, 2);
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 2);
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ(m.h[i].kind, KVR_AM_KIND_KV);
        ASSERT_EQ(m.h[i].buf, i);
        ASSERT_EQ(m.h[i].nbuf, 1);
        ASSERT_EQ(m.h[i].pos, 0);
        ASSERT_EQ(m.h[i].npages, 32);
    }
    ASSERT_EQ(c.posted, 32);
    ASSERT_EQ(c.aux_done, 1); /* no aux row asked for */
}

/* Short runs are coalesced up to cap bytes per buffer; max_pages cuts a
 * long run. */
TEST_IMPL(plan_coalesce_and_cut)
{
    int32_t src[10], dst[10];
    for (int i = 0; i < 10; i++) {
        src[i] = 2 * i; /* every page its own run */
        dst[i] = i;
    }
    uint64_t items[1] = {1000};
    kvr_plan_t p;
    base(&p, src, dst, 10, items, 1);
    p.cap = 3000; /* three pages per message */
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 4);
    uint32_t want_pos[4] = {0, 3, 6, 9}, want_n[4] = {3, 3, 3, 1};
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ(m.h[i].pos, want_pos[i]);
        ASSERT_EQ(m.h[i].npages, want_n[i]);
    }
    /* One run of 10 consecutive pages, max_pages 4: 4 + 4 + 2. */
    for (int i = 0; i < 10; i++) {
        src[i] = i;
    }
    p.max_pages = 4;
    p.run_bytes = UINT64_MAX;
    memset(&c, 0, sizeof(c));
    m.n = 0;
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 3);
    ASSERT_EQ(m.h[0].npages, 4);
    ASSERT_EQ(m.h[1].npages, 4);
    ASSERT_EQ(m.h[2].npages, 2);
    ASSERT_EQ(m.h[2].pos, 8);
}

/* Buffers share a message while it stays within merge bytes. */
TEST_IMPL(plan_merge_buffers)
{
    int32_t src[4] = {0, 1, 2, 3}, dst[4] = {9, 10, 11, 12};
    uint64_t items[5] = {100, 100, 100, 100, 100};
    kvr_plan_t p;
    base(&p, src, dst, 4, items, 5);
    p.merge = 1200; /* 3 buffers of 4 x 100 bytes */
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 2);
    ASSERT_EQ(m.h[0].buf, 0);
    ASSERT_EQ(m.h[0].nbuf, 3);
    ASSERT_EQ(m.h[1].buf, 3);
    ASSERT_EQ(m.h[1].nbuf, 2);
    ASSERT_EQ(kvr_plan_buf_group(items, 5, 0, 4, 1, 0), 1);
    ASSERT_EQ(kvr_plan_buf_group(items, 5, 4, 4, 1, UINT64_MAX), 1); /* the last buffer */
    /* The pieces limit: 600 pieces per buffer, two would pass KVR_MAX_IOV. */
    ASSERT_EQ(kvr_plan_buf_group(items, 5, 0, 1, 600, UINT64_MAX), 1);
    ASSERT_EQ(kvr_plan_buf_group(items, 5, 0, 1, 200, UINT64_MAX), 5);
}

/* Pages handed over in parts: the plan goes as far as given, then on. The
 * aux rows follow only the last page. */
TEST_IMPL(plan_resume_and_aux)
{
    int32_t src[6] = {0, 1, 2, 10, 11, 12}, dst[6] = {0, 1, 2, 3, 4, 5};
    uint64_t items[1] = {64 << 10}, aux_items[3] = {8, 8, 8};
    kvr_plan_t p;
    base(&p, src, dst, 6, items, 1);
    p.given = 3;
    p.aux = 1;
    p.naux = 3;
    p.aux_item = aux_items;
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 1);
    ASSERT_EQ(m.h[0].npages, 3);
    ASSERT_EQ(c.aux_done, 0); /* not before the last page */
    p.given = 6;
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 5);
    ASSERT_EQ(m.h[1].kind, KVR_AM_KIND_KV);
    ASSERT_EQ(m.h[1].pos, 3);
    ASSERT_EQ(m.h[1].npages, 3);
    for (int i = 2; i < 5; i++) {
        ASSERT_EQ(m.h[i].kind, KVR_AM_KIND_AUX);
        ASSERT_EQ(m.h[i].buf, i - 2);
        ASSERT_EQ(m.h[i].nbuf, 1);
        ASSERT_EQ(m.h[i].npages, 1);
    }
    ASSERT_EQ(c.aux_done, 1);
    kvr_am_header_t h;
    ASSERT_EQ(kvr_post_plan(&p, &c, &h), 0);
}

/* A message that could not be posted is planned again, the same. */
TEST_IMPL(plan_hold_retries_same)
{
    int32_t src[8], dst[8];
    for (int i = 0; i < 8; i++) {
        src[i] = 3 * i;
        dst[i] = i;
    }
    uint64_t items[3] = {100, 100, 100}, aux_items[2] = {4, 4};
    kvr_plan_t p;
    base(&p, src, dst, 8, items, 3);
    p.cap = 500;
    p.aux = 1;
    p.naux = 2;
    p.aux_item = aux_items;
    msgs_t ref = {0}, got = {0};
    kvr_plan_cursor_t c = {0};
    drain(&p, &c, &ref);
    memset(&c, 0, sizeof(c));
    for (int k = 0; got.n < ref.n; k++) {
        kvr_plan_cursor_t next = c;
        kvr_am_header_t h;
        ASSERT(kvr_post_plan(&p, &next, &h));
        if (k % 2 == 0) {
            kvr_plan_hold(&c, &h); /* "no slot": retry */
            continue;
        }
        got.h[got.n++] = h;
        c = next;
    }
    for (int i = 0; i < ref.n; i++) {
        ASSERT_EQ(got.h[i].kind, ref.h[i].kind);
        ASSERT_EQ(got.h[i].buf, ref.h[i].buf);
        ASSERT_EQ(got.h[i].nbuf, ref.h[i].nbuf);
        ASSERT_EQ(got.h[i].pos, ref.h[i].pos);
        ASSERT_EQ(got.h[i].npages, ref.h[i].npages);
    }
}

/* Random page lists and limits: every (position, buffer) is carried once,
 * in order, within the limits. */
TEST_IMPL(plan_random_cover)
{
    uint64_t seed = 0x9E3779B97F4A7C15ULL;
    static int32_t src[1000], dst[1000];
    static uint8_t seen[1000][6];
    static msgs_t m;
    for (int iter = 0; iter < 300; iter++) {
        uint32_t n = 1 + (uint32_t)(test_rand(&seed) % 1000);
        int32_t s = 0, d = 0;
        for (uint32_t i = 0; i < n; i++) {
            s += 1 + (test_rand(&seed) % 4 == 0 ? (int32_t)(test_rand(&seed) % 5) : 0);
            d += 1 + (test_rand(&seed) % 6 == 0 ? 2 : 0);
            src[i] = s;
            dst[i] = d;
        }
        uint32_t nkv = 1 + (uint32_t)(test_rand(&seed) % 6);
        uint64_t items[6];
        for (uint32_t b = 0; b < nkv; b++) {
            items[b] = 1 + test_rand(&seed) % 5000;
        }
        kvr_plan_t p;
        base(&p, src, dst, n, items, nkv);
        p.run_bytes = test_rand(&seed) % 200000;
        p.cap = 1 + test_rand(&seed) % 300000;
        p.merge = test_rand(&seed) % 2 ? 0 : test_rand(&seed) % 400000;
        p.max_pages = 1 + (uint32_t)(test_rand(&seed) % 64);
        memset(seen, 0, sizeof(seen));
        kvr_plan_cursor_t c = {0};
        m.n = 0;
        /* Hand the pages over in a few parts. */
        for (uint32_t given = 0; given < n;) {
            given += 1 + (uint32_t)(test_rand(&seed) % n);
            p.given = given < n ? given : n;
            given = p.given;
            drain(&p, &c, &m);
            ASSERT_EQ(c.posted, p.given);
        }
        uint32_t next_pos = 0;
        for (int i = 0; i < m.n; i++) {
            kvr_am_header_t *h = &m.h[i];
            ASSERT_EQ(h->kind, KVR_AM_KIND_KV);
            ASSERT(h->npages >= 1 && h->npages <= p.max_pages);
            ASSERT(h->pos == next_pos || h->pos + h->npages == next_pos);
            next_pos = h->pos + h->npages;
            uint32_t runs = 0, pieces = 0;
            for (uint32_t at = h->pos; at < next_pos; runs++) {
                at += kvr_run_length(src, dst, at, next_pos);
            }
            for (uint32_t at = h->pos; at < next_pos; pieces++) {
                at += kvr_run_length(NULL, src, at, next_pos);
            }
            if (runs > 1) {
                ASSERT((uint64_t)h->npages * p.kv_item_max <= p.cap);
            }
            ASSERT((uint64_t)pieces * h->nbuf <= KVR_MAX_IOV || h->nbuf == 1);
            uint64_t bytes = 0;
            for (uint32_t b = h->buf; b < (uint32_t)h->buf + h->nbuf; b++) {
                ASSERT(b < nkv);
                bytes += (uint64_t)h->npages * items[b];
                for (uint32_t at = h->pos; at < next_pos; at++) {
                    ASSERT_EQ(seen[at][b], 0);
                    seen[at][b] = 1;
                }
            }
            ASSERT(h->nbuf == 1 || bytes <= p.merge);
        }
        for (uint32_t at = 0; at < n; at++) {
            for (uint32_t b = 0; b < nkv; b++) {
                ASSERT_EQ(seen[at][b], 1);
            }
        }
    }
}
