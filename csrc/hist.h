/*
 * hist: fixed-bucket histograms for the manager's metrics (pure logic, no
 * locking: the engine updates them under its lock and copies them out in
 * kvr_engine_stats).
 *
 * Two kinds, each with a fixed table of upper bounds, so every manager of
 * every process exposes the same buckets and Prometheus can aggregate them:
 *
 *   KVR_HIST_LATENCY  nanoseconds, log-spaced 1-2-5 per decade from 10 us
 *                     to 100 s (22 bounds)
 *   KVR_HIST_OPS      a count (data operations of a room), powers of two
 *                     from 1 to 65536 (17 bounds)
 *
 * Bucket i counts the observations v with bounds[i-1] < v <= bounds[i]
 * (Prometheus's "le"); the bucket after the last bound counts everything
 * larger (+Inf).  Counts are per bucket, not cumulative.
 */
#ifndef KVR_HIST_H
#define KVR_HIST_H

#include <stdint.h>

enum { KVR_HIST_LATENCY = 0, KVR_HIST_OPS = 1 };

/* Bounds + 1 (+Inf), for the largest kind. */
#define KVR_HIST_SLOTS 23

typedef struct {
    uint64_t counts[KVR_HIST_SLOTS]; /* per bucket; [nbounds] is +Inf */
    uint64_t count;                  /* observations */
    uint64_t sum;                    /* of the observed values (saturates) */
} kvr_hist_t;

/* The upper bounds of a kind (static storage) and their number in *n_p;
 * NULL and *n_p = 0 for an unknown kind. */
const uint64_t *kvr_hist_bounds(int kind, int *n_p);

/* Adds one observation to h (a histogram of that kind).  Never fails. */
void kvr_hist_observe(kvr_hist_t *h, int kind, uint64_t v);

#endif
