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

/* State buffers (the last row buffers): only the rows the decode asked for
 * go, each message covering buffers asked for only, after the last page. */
TEST_IMPL(plan_state_rows)
{
    int32_t src[2] = {0, 1}, dst[2] = {4, 5};
    /* 1 aux buffer, then state buffers of components 0, 0, 1, 2, 2. */
    uint64_t items[1] = {64}, rows[6] = {8, 48, 200, 72, 16, 16};
    uint32_t comp[5] = {0, 0, 1, 2, 2};
    int64_t want[KVR_MAX_STATES] = {3, -1, 0, -1, -1, -1, -1, -1};
    kvr_plan_t p;
    base(&p, src, dst, 2, items, 1);
    p.given = 1;
    p.naux = 6;
    p.aux_item = rows;
    p.nstate = 5;
    p.state_comp = comp;
    p.dst_states = want;
    p.merge = UINT64_MAX;
    ASSERT_EQ(kvr_plan_row_wanted(&p, 0), 0); /* no aux row asked for */
    ASSERT_EQ(kvr_plan_row_wanted(&p, 1), 1);
    ASSERT_EQ(kvr_plan_row_wanted(&p, 3), 0);
    ASSERT_EQ(kvr_plan_row_wanted(&p, 5), 1);
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 1); /* the first page; no row before the last */
    ASSERT_EQ(c.aux_done, 0);
    p.given = 2;
    drain(&p, &c, &m);
    /* page 2, then component 0's two buffers in one message, then
     * component 2's two (component 1 between them is not asked for). */
    ASSERT_EQ(m.n, 4);
    ASSERT_EQ(m.h[2].kind, KVR_AM_KIND_AUX);
    ASSERT_EQ(m.h[2].buf, 1);
    ASSERT_EQ(m.h[2].nbuf, 2);
    ASSERT_EQ(m.h[3].kind, KVR_AM_KIND_AUX);
    ASSERT_EQ(m.h[3].buf, 4);
    ASSERT_EQ(m.h[3].nbuf, 2);
    ASSERT_EQ(c.aux_done, 1);
    /* Nothing asked for: no row message, and the plan is done. */
    int64_t none[KVR_MAX_STATES] = {-1, -1, -1, -1, -1, -1, -1, -1};
    kvr_plan_cursor_t c2 = {0};
    msgs_t m2 = {0};
    p.dst_states = none;
    drain(&p, &c2, &m2);
    ASSERT_EQ(m2.n, 1); /* the two pages, consecutive on both sides */
    ASSERT_EQ(c2.aux_done, 1);
}

/* Plans ref_n messages from the start, every other one held first ("no
 * slot") and planned again, into got. */
static void replan_held(const kvr_plan_t *p, int ref_n, msgs_t *got)
{
    kvr_plan_cursor_t c;
    memset(&c, 0, sizeof(c));
    for (int k = 0; got->n < ref_n; k++) {
        kvr_plan_cursor_t next = c;
        kvr_am_header_t h;
        ASSERT(kvr_post_plan(p, &next, &h));
        if (k % 2 == 0) {
            kvr_plan_hold(&c, &h); /* "no slot": retry */
            continue;
        }
        got->h[got->n++] = h;
        c = next;
    }
}

/* A list component (sliding-window pages): its buffers' rows are list
 * positions, one message per range and group of its buffers whatever the
 * list's length when its slots run; scattered slots become pieces, a new
 * range after KVR_MAX_IOV runs; a held message is planned again, the
 * same; one-slot rows before it never share its message. */
TEST_IMPL(plan_state_lists)
{
    static int32_t src[3000], dst[3000];
    int32_t page = 0;
    /* 1 aux buffer, state buffers of components 0 (one slot) and 1 (a list, 2 buffers). */
    uint64_t items[1] = {64}, rows[4] = {8, 48, 32, 32};
    uint32_t comp[3] = {0, 1, 1};
    int64_t want[KVR_MAX_STATES] = {3, 0, -1, -1, -1, -1, -1, -1};
    kvr_slot_lists_t sl = {src, {0}, {0, 3000}, 3000}, dl = {dst, {0}, {0, 3000}, 3000};
    kvr_plan_t p;
    base(&p, &page, &page, 1, items, 1);
    p.naux = 4;
    p.aux_item = rows;
    p.nstate = 3;
    p.state_comp = comp;
    p.dst_states = want;
    p.merge = UINT64_MAX;
    p.state_list = 2;
    p.src_lists = &sl;
    p.dst_lists = &dl;
    for (int len = 1; len <= 3000; len *= 10) {
        for (int i = 0; i < len; i++) {
            src[i] = 3000 + i; /* consecutive: one run */
            dst[i] = 7 + i;
        }
        sl.n[1] = dl.n[1] = (uint32_t)len;
        kvr_plan_cursor_t c = {0};
        msgs_t m = {0};
        drain(&p, &c, &m);
        ASSERT_EQ(m.n, 3); /* the page, component 0's row, the whole list of both buffers */
        ASSERT(m.h[1].buf == 1 && m.h[1].nbuf == 1 && m.h[1].npages == 1);
        ASSERT(m.h[2].kind == KVR_AM_KIND_AUX && m.h[2].buf == 2 && m.h[2].nbuf == 2);
        ASSERT(m.h[2].pos == 0 && m.h[2].npages == (uint32_t)len);
        ASSERT_EQ(c.aux_done, 1);
    }
    for (int i = 0; i < 3000; i++) {
        src[i] = 2 * i; /* every slot its own run */
        dst[i] = i;
    }
    sl.n[1] = dl.n[1] = 3000;
    msgs_t ref = {0}, got = {0};
    kvr_plan_cursor_t c = {0};
    drain(&p, &c, &ref);
    /* The page, the row, then per range of KVR_MAX_IOV positions one
     * message a buffer (two buffers' pieces would pass KVR_MAX_IOV). */
    ASSERT_EQ(ref.n, 2 + 3 * 2);
    uint32_t at = 0;
    for (int i = 2; i < ref.n; i += 2) {
        ASSERT(ref.h[i].pos == at && ref.h[i + 1].pos == at);
        ASSERT(ref.h[i].buf == 2 && ref.h[i + 1].buf == 3 && ref.h[i].nbuf == 1);
        ASSERT(ref.h[i].npages == (at + KVR_MAX_IOV <= 3000 ? KVR_MAX_IOV : 3000 - at));
        at += ref.h[i].npages;
    }
    ASSERT_EQ(at, 3000);
    replan_held(&p, ref.n, &got);
    for (int i = 0; i < ref.n; i++) {
        ASSERT(got.h[i].buf == ref.h[i].buf && got.h[i].nbuf == ref.h[i].nbuf);
        ASSERT(got.h[i].pos == ref.h[i].pos && got.h[i].npages == ref.h[i].npages);
    }
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
    replan_held(&p, ref.n, &got);
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

/* Every decode head is read exactly once, from a prefill rank that holds
 * it, whichever rank's view is asked; each prefill rank's links are the
 * decode ranks' links to it (plus a zero-head one if nobody reads it). */
static void check_cover(uint32_t H, uint32_t P, uint32_t D)
{
    kvr_heads_t pre = {P, 0, P <= H ? H / P : 1, H}, dec = {D, 0, D <= H ? H / D : 1, H};
    char why[256];
    ASSERT_EQ(kvr_heads_check(&pre, "prefill", why, sizeof(why)), 0);
    ASSERT_EQ(kvr_heads_check(&dec, "decode", why, sizeof(why)), 0);
    uint32_t load[64] = {0}, seen_by_prefill = 0, seen_by_decode = 0;
    for (uint32_t d = 0; d < D; d++) {
        kvr_link_t l[64];
        uint32_t n = kvr_heads_links(&pre, &dec, 1, d, l, 64), covered = 0;
        ASSERT(n <= 64);
        uint32_t next = kvr_heads_first(&dec, d);
        for (uint32_t i = 0; i < n; i++) {
            ASSERT_EQ(l[i].decode, d);
            ASSERT(l[i].prefill < P);
            seen_by_decode++;
            if (l[i].nheads == 0) {
                continue;
            }
            ASSERT_EQ(l[i].head, next); /* in order, no gap, no overlap */
            next += l[i].nheads;
            covered += l[i].nheads;
            /* the source holds those heads */
            uint32_t pf = kvr_heads_first(&pre, l[i].prefill);
            ASSERT(l[i].head >= pf && l[i].head + l[i].nheads <= pf + pre.heads);
            load[l[i].prefill] += l[i].nheads;
            kvr_slice_t sp = kvr_link_slice(&l[i], &pre, l[i].prefill);
            kvr_slice_t sd = kvr_link_slice(&l[i], &dec, d);
            ASSERT(sp.first + sp.n <= sp.heads && sd.first + sd.n <= sd.heads);
        }
        ASSERT_EQ(covered, dec.heads);
    }
    for (uint32_t p = 0; p < P; p++) {
        kvr_link_t l[64];
        uint32_t n = kvr_heads_links(&pre, &dec, 0, p, l, 64);
        ASSERT(n >= 1); /* every prefill rank hears from some decode rank */
        seen_by_prefill += n;
        for (uint32_t i = 0; i < n; i++) {
            ASSERT_EQ(l[i].prefill, p);
            /* the decode rank has the same link */
            kvr_link_t m[64];
            uint32_t k = kvr_heads_links(&pre, &dec, 1, l[i].decode, m, 64), found = 0;
            for (uint32_t j = 0; j < k; j++) {
                found += m[j].prefill == p && m[j].head == l[i].head &&
                         m[j].nheads == l[i].nheads;
            }
            ASSERT_EQ(found, 1);
        }
    }
    ASSERT_EQ(seen_by_prefill, seen_by_decode);
    if (P > H && D >= P) {
        /* replicas share the work: every prefill rank sends something */
        for (uint32_t p = 0; p < P; p++) {
            ASSERT(load[p] > 0);
        }
    }
}

TEST_IMPL(plan_heads_links)
{
    static const uint32_t cases[][3] = {
        /* H, P, D */
        {8, 2, 1}, {8, 1, 2}, {2, 4, 2}, {8, 8, 16}, {8, 16, 8}, {1, 2, 4}, {1, 4, 2},
        {4, 4, 4}, {2, 2, 4}, {32, 8, 2}, {8, 4, 32}, {1, 1, 8}, {6, 2, 3}, {6, 3, 2},
        {6, 12, 3}, {12, 4, 6},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        check_cover(cases[i][0], cases[i][1], cases[i][2]);
    }
    /* TP 2 -> 1, 8 heads: the decode reads heads 0-3 from rank 0 into the
     * first half of its rows, 4-7 from rank 1 into the second half. */
    kvr_heads_t pre = {2, 0, 4, 8}, dec = {1, 0, 8, 8};
    kvr_link_t l[4];
    ASSERT_EQ(kvr_heads_links(&pre, &dec, 1, 0, l, 4), 2);
    ASSERT(l[1].prefill == 1 && l[1].head == 4 && l[1].nheads == 4);
    kvr_slice_t s = kvr_link_slice(&l[1], &dec, 0);
    ASSERT(s.first == 4 && s.n == 4 && s.heads == 8);
    s = kvr_link_slice(&l[1], &pre, 1);
    ASSERT(s.first == 0 && s.n == 4 && s.heads == 4);
    /* TP 4 -> 2 with 2 KV heads (replicated): one source per decode rank,
     * replicas 0 and 3 read, 1 and 2 told they are not needed. */
    kvr_heads_t pre4 = {4, 0, 1, 2}, dec2 = {2, 0, 1, 2};
    ASSERT_EQ(kvr_heads_links(&pre4, &dec2, 1, 0, l, 4), 2);
    ASSERT(l[0].prefill == 0 && l[0].nheads == 1 && l[1].prefill == 2 && l[1].nheads == 0);
    ASSERT_EQ(kvr_heads_links(&pre4, &dec2, 1, 1, l, 4), 2);
    ASSERT(l[0].prefill == 3 && l[0].head == 1 && l[1].prefill == 1 && l[1].nheads == 0);
    /* MLA 2 -> 4: one latent "head", decode ranks alternate prefill ranks. */
    kvr_heads_t mp = {2, 0, 1, 1}, md = {4, 0, 1, 1};
    for (uint32_t d = 0; d < 4; d++) {
        ASSERT_EQ(kvr_heads_links(&mp, &md, 1, d, l, 4), 1);
        ASSERT_EQ(l[0].prefill, d % 2);
    }
    ASSERT_EQ(kvr_heads_links(&mp, &md, 0, 1, l, 4), 2);
    ASSERT(l[0].decode == 1 && l[1].decode == 3);
}

TEST_IMPL(plan_heads_bad)
{
    char why[256];
    kvr_heads_t h = {3, 0, 2, 8};
    ASSERT_EQ(kvr_heads_check(&h, "decode", why, sizeof(why)), -1);
    ASSERT(strstr(why, "8 KV heads do not split over tp_size 3") != NULL);
    h = (kvr_heads_t){6, 0, 1, 4}; /* 6 ranks, 4 heads: neither divides */
    ASSERT_EQ(kvr_heads_check(&h, "prefill", why, sizeof(why)), -1);
    h = (kvr_heads_t){2, 2, 4, 8}; /* rank outside */
    ASSERT_EQ(kvr_heads_check(&h, "prefill", why, sizeof(why)), -1);
    kvr_heads_t pre = {2, 0, 4, 8}, dec = {1, 0, 8, 8}, dec4 = {1, 0, 4, 4};
    uint64_t pi[2] = {4 * 128, 4 * 128}, di[2] = {8 * 128, 8 * 64};
    ASSERT_EQ(kvr_heads_compat(&pre, pi, &dec, di, 2, 1, why, sizeof(why)), -1);
    ASSERT(strstr(why, "KV buffer 1: item_len 512 for 4 heads on the prefill, 512 for 8 heads on "
                       "the decode") != NULL);
    di[1] = 8 * 128;
    ASSERT_EQ(kvr_heads_compat(&pre, pi, &dec, di, 2, 1, why, sizeof(why)), 0);
    ASSERT_EQ(kvr_heads_compat(&pre, pi, &dec4, di, 2, 1, why, sizeof(why)), -1);
    ASSERT(strstr(why, "8 KV heads in all on the prefill, 4 on the decode") != NULL);
}

/* Sliced rows: a piece per row per page, at most KVR_MAX_IOV pieces per
 * message, so the messages of a room grow with pages only past that; an
 * empty slice plans only the aux row. */
TEST_IMPL(plan_heads_rows)
{
    static int32_t src[4096], dst[4096];
    for (int i = 0; i < 4096; i++) {
        src[i] = 3 * i;
        dst[i] = 5 * i + 1;
    }
    uint64_t items[8] = {2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048};
    uint32_t msgs_for[3] = {0};
    uint32_t npages[3] = {16, 64, 128};
    for (int k = 0; k < 3; k++) {
        kvr_plan_t p;
        base(&p, src, dst, npages[k], items, 8);
        p.merge = 8 << 20;
        p.cap = 8 << 20;
        p.src_rows = 1;
        p.dst_rows = 1; /* page_size 1: one piece per page */
        kvr_plan_cursor_t c = {0};
        msgs_t m = {0};
        drain(&p, &c, &m);
        msgs_for[k] = (uint32_t)m.n;
        for (int i = 0; i < m.n; i++) {
            ASSERT((uint64_t)m.h[i].npages * m.h[i].nbuf <= KVR_MAX_IOV);
        }
    }
    /* 16, 64 and 128 scattered pages of 8 buffers (within the byte
     * limits): one message each. */
    ASSERT_EQ(msgs_for[0], 1);
    ASSERT_EQ(msgs_for[1], 1);
    ASSERT_EQ(msgs_for[2], 1);
    kvr_plan_t p;
    base(&p, src, dst, 100, items, 2);
    p.src_rows = 16; /* page_size 16, sliced on the prefill */
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    for (int i = 0; i < m.n; i++) {
        ASSERT((uint64_t)m.h[i].npages * 16 <= KVR_MAX_IOV);
    }
    base(&p, src, dst, 100, items, 2);
    p.kv_none = 1;
    p.aux = 1;
    p.naux = 1;
    p.aux_item = items;
    memset(&c, 0, sizeof(c));
    m.n = 0;
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 1);
    ASSERT_EQ(m.h[0].kind, KVR_AM_KIND_AUX);
}

/* Layers: a PP stage's buffers (K of its layers, then V) land in the
 * decode's K and V groups at its start layer; merged messages stay inside
 * one group. */
TEST_IMPL(plan_layers_map)
{
    kvr_layers_t st = {2, 1, 3, 2, 4}, dec = {1, 0, 0, 5, 10};
    uint32_t want[4] = {3, 4, 8, 9};
    for (uint32_t b = 0; b < 4; b++) {
        ASSERT_EQ(kvr_layers_map(&st, &dec, b), want[b]);
    }
    for (uint32_t b = 0; b < 10; b++) {
        int in = b == 3 || b == 4 || b == 8 || b == 9;
        ASSERT_EQ(kvr_layers_holds(&st, &dec, b), in);
    }
    ASSERT_EQ(kvr_layers_identity(&st, &dec), 0);
    kvr_layers_t whole = {1, 0, 0, 5, 10};
    ASSERT_EQ(kvr_layers_identity(&whole, &dec), 1);
    char why[256];
    ASSERT_EQ(kvr_layers_compat(&st, &dec, why, sizeof(why)), 0);
    /* merge as much as bytes allow, but never across K and V */
    int32_t src[2] = {0, 1}, dst[2] = {4, 5};
    uint64_t items[4] = {100, 100, 100, 100};
    kvr_plan_t p;
    base(&p, src, dst, 2, items, 4);
    p.merge = UINT64_MAX;
    p.group = 2;
    kvr_plan_cursor_t c = {0};
    msgs_t m = {0};
    drain(&p, &c, &m);
    ASSERT_EQ(m.n, 2);
    ASSERT(m.h[0].buf == 0 && m.h[0].nbuf == 2 && m.h[1].buf == 2 && m.h[1].nbuf == 2);
    p.group = 0;
    memset(&c, 0, sizeof(c));
    m.n = 0;
    drain(&p, &c, &m);
    ASSERT(m.n == 1 && m.h[0].nbuf == 4);
}

TEST_IMPL(plan_layers_bad)
{
    char why[256];
    kvr_layers_t l = {2, 2, 0, 1, 2};
    ASSERT_EQ(kvr_layers_check(&l, "prefill", why, sizeof(why)), -1);
    ASSERT(strcmp(why, "prefill: pp_rank 2 is not a stage of pp_size 2") == 0);
    l = (kvr_layers_t){2, 0, 0, 3, 4};
    ASSERT_EQ(kvr_layers_check(&l, "prefill", why, sizeof(why)), -1);
    ASSERT(strstr(why, "prefill: 4 KV buffers do not hold num_layers=3 layers") == why);
    l = (kvr_layers_t){2, 1, UINT32_MAX, 1, 2};
    ASSERT_EQ(kvr_layers_check(&l, "prefill", why, sizeof(why)), -1);
    kvr_layers_t dec = {1, 0, 0, 4, 8}, mla = {1, 0, 0, 4, 4};
    kvr_layers_t st = {2, 1, 2, 3, 6};
    ASSERT_EQ(kvr_layers_compat(&st, &dec, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "prefill PP stage 1 of 2 holds layers 2-4, the decode has 4 layers") == 0);
    st = (kvr_layers_t){2, 0, 0, 2, 4};
    ASSERT_EQ(kvr_layers_compat(&st, &mla, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "2 KV buffers per layer on the prefill (4 buffers, 2 layers), 1 on the "
                       "decode (4 buffers, 4 layers)") == 0);
    kvr_layers_t one = {1, 0, 0, 2, 4};
    ASSERT_EQ(kvr_layers_compat(&one, &dec, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "the prefill (one PP stage) holds layers 0-1, the decode has 4 layers") ==
           0);
}

/* The stages' ranges must cover the decode's layers once each. */
TEST_IMPL(plan_layers_cover)
{
    char why[256];
    kvr_layers_t ok[3] = {{3, 0, 0, 2, 4}, {3, 1, 2, 1, 2}, {3, 2, 3, 3, 6}};
    ASSERT_EQ(kvr_layers_cover(ok, 3, 6, why, sizeof(why)), 0);
    kvr_layers_t shuffled[3] = {{3, 0, 3, 3, 6}, {3, 1, 0, 2, 4}, {3, 2, 2, 1, 2}};
    ASSERT_EQ(kvr_layers_cover(shuffled, 3, 6, why, sizeof(why)), 0);
    kvr_layers_t gap[2] = {{2, 0, 0, 2, 4}, {2, 1, 3, 1, 2}};
    ASSERT_EQ(kvr_layers_cover(gap, 2, 4, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "the prefill's PP stages hold layers 0-1 (stage 0), 3-3 (stage 1): "
                       "layers 2-2 of the decode's 4 are in none") == 0);
    kvr_layers_t tail[2] = {{2, 0, 0, 2, 4}, {2, 1, 2, 1, 2}};
    ASSERT_EQ(kvr_layers_cover(tail, 2, 4, why, sizeof(why)), -1);
    ASSERT(strstr(why, ": layers 3-3 of the decode's 4 are in none") != NULL);
    kvr_layers_t head[2] = {{2, 0, 1, 1, 2}, {2, 1, 2, 2, 4}};
    ASSERT_EQ(kvr_layers_cover(head, 2, 4, why, sizeof(why)), -1);
    ASSERT(strstr(why, ": layers 0-0 of the decode's 4 are in none") != NULL);
    kvr_layers_t over[2] = {{2, 0, 0, 3, 6}, {2, 1, 2, 2, 4}};
    ASSERT_EQ(kvr_layers_cover(over, 2, 4, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "the prefill's PP stages hold layers 0-2 (stage 0), 2-3 (stage 1): "
                       "layer 2 is in stage 0 and stage 1") == 0);
    kvr_layers_t same[2] = {{2, 0, 0, 2, 4}, {2, 1, 0, 2, 4}};
    ASSERT_EQ(kvr_layers_cover(same, 2, 2, why, sizeof(why)), -1);
    ASSERT(strstr(why, "layer 0 is in stage 0 and stage 1") != NULL);
}
