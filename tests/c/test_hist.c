#include "runner.h"

#include <string.h>

#include "../../csrc/hist.h"

/* The bucket a reference linear scan puts v in. */
static int ref_bucket(const uint64_t *b, int n, uint64_t v)
{
    for (int i = 0; i < n; i++) {
        if (v <= b[i]) {
            return i;
        }
    }
    return n;
}

TEST_IMPL(hist_bounds_tables)
{
    int n = -1;
    const uint64_t *b = kvr_hist_bounds(KVR_HIST_LATENCY, &n);
    ASSERT(b != NULL);
    ASSERT_EQ(n, 22);
    ASSERT_U64_EQ(b[0], 10000);            /* 10 us */
    ASSERT_U64_EQ(b[n - 1], 100000000000); /* 100 s */
    for (int i = 1; i < n; i++) {
        ASSERT(b[i] > b[i - 1]);
        /* log-spaced: each step is x2 or x2.5 */
        ASSERT(b[i] * 2 == b[i - 1] * 4 || b[i] * 2 == b[i - 1] * 5);
    }
    ASSERT(n < KVR_HIST_SLOTS);
    b = kvr_hist_bounds(KVR_HIST_OPS, &n);
    ASSERT_EQ(n, 17);
    for (int i = 0; i < n; i++) {
        ASSERT_U64_EQ(b[i], 1ull << i);
    }
    ASSERT(n < KVR_HIST_SLOTS);
    ASSERT(kvr_hist_bounds(7, &n) == NULL);
    ASSERT_EQ(n, 0);
}

TEST_IMPL(hist_observe_edges)
{
    kvr_hist_t h;
    memset(&h, 0, sizeof(h));
    int n;
    const uint64_t *b = kvr_hist_bounds(KVR_HIST_LATENCY, &n);
    kvr_hist_observe(&h, KVR_HIST_LATENCY, 0);          /* first bucket */
    kvr_hist_observe(&h, KVR_HIST_LATENCY, b[0]);       /* le is inclusive */
    kvr_hist_observe(&h, KVR_HIST_LATENCY, b[0] + 1);   /* next bucket */
    kvr_hist_observe(&h, KVR_HIST_LATENCY, b[n - 1]);   /* last finite */
    kvr_hist_observe(&h, KVR_HIST_LATENCY, b[n - 1] + 1); /* +Inf */
    ASSERT_U64_EQ(h.counts[0], 2);
    ASSERT_U64_EQ(h.counts[1], 1);
    ASSERT_U64_EQ(h.counts[n - 1], 1);
    ASSERT_U64_EQ(h.counts[n], 1);
    ASSERT_U64_EQ(h.count, 5);
    ASSERT_U64_EQ(h.sum, 0 + b[0] + b[0] + 1 + b[n - 1] + b[n - 1] + 1);
    /* the sum saturates instead of wrapping */
    kvr_hist_observe(&h, KVR_HIST_LATENCY, UINT64_MAX);
    ASSERT_U64_EQ(h.sum, UINT64_MAX);
    ASSERT_U64_EQ(h.counts[n], 2);
    ASSERT_U64_EQ(h.count, 6);
}

TEST_IMPL(hist_random_vs_reference)
{
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int kind = KVR_HIST_LATENCY; kind <= KVR_HIST_OPS; kind++) {
        kvr_hist_t h, want;
        memset(&h, 0, sizeof(h));
        memset(&want, 0, sizeof(want));
        int n;
        const uint64_t *b = kvr_hist_bounds(kind, &n);
        for (int i = 0; i < 100000; i++) {
            uint64_t r = test_rand(&seed);
            /* spread over every magnitude, and hit the bounds themselves */
            uint64_t v = (i % 3 == 0) ? b[r % (uint64_t)n] + (r >> 63) - ((r >> 62) & 1)
                                      : r >> (r % 64);
            kvr_hist_observe(&h, kind, v);
            want.counts[ref_bucket(b, n, v)]++;
        }
        uint64_t total = 0;
        for (int i = 0; i <= n; i++) {
            ASSERT_U64_EQ(h.counts[i], want.counts[i]);
            total += h.counts[i];
        }
        for (int i = n + 1; i < KVR_HIST_SLOTS; i++) {
            ASSERT_U64_EQ(h.counts[i], 0);
        }
        ASSERT_U64_EQ(total, 100000);
        ASSERT_U64_EQ(h.count, 100000);
    }
}
