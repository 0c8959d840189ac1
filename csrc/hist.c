#include "hist.h"

#define US 1000ull
#define MS 1000000ull
#define S 1000000000ull

static const uint64_t kvr_latency_bounds[] = {
    10 * US,  20 * US,  50 * US,  100 * US, 200 * US, 500 * US, 1 * MS,  2 * MS,
    5 * MS,   10 * MS,  20 * MS,  50 * MS,  100 * MS, 200 * MS, 500 * MS, 1 * S,
    2 * S,    5 * S,    10 * S,   20 * S,   50 * S,   100 * S,
};

static const uint64_t kvr_ops_bounds[] = {
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
};

#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Every table and its +Inf bucket fit in a kvr_hist_t. */
_Static_assert(sizeof(kvr_latency_bounds) / sizeof(uint64_t) < KVR_HIST_SLOTS, "latency bounds");
_Static_assert(sizeof(kvr_ops_bounds) / sizeof(uint64_t) < KVR_HIST_SLOTS, "ops bounds");

const uint64_t *kvr_hist_bounds(int kind, int *n_p)
{
    switch (kind) {
    case KVR_HIST_LATENCY:
        *n_p = NELEM(kvr_latency_bounds);
        return kvr_latency_bounds;
    case KVR_HIST_OPS:
        *n_p = NELEM(kvr_ops_bounds);
        return kvr_ops_bounds;
    default:
        *n_p = 0;
        return 0;
    }
}

void kvr_hist_observe(kvr_hist_t *h, int kind, uint64_t v)
{
    int n;
    const uint64_t *b = kvr_hist_bounds(kind, &n);
    /* Binary search for the first bound >= v; n (the +Inf bucket) if none. */
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (b[mid] >= v) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    h->counts[lo]++;
    h->count++;
    h->sum = v > UINT64_MAX - h->sum ? UINT64_MAX : h->sum + v;
}
