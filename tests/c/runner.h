/*
 * A small test runner in the style of libuv's: every test runs in its own
 * forked process under a timeout, so a crash, a hang or a sanitizer report
 * fails that one test and the others still run.
 */
#ifndef KVR_TEST_RUNNER_H
#define KVR_TEST_RUNNER_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define TEST_IMPL(name) void run_test_##name(void)

/* Failure: file:line and the expression, then abort (the child dies). */
#define ASSERT(expr)                                                          \
    do {                                                                      \
        if (!(expr)) {                                                        \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__,       \
                    __LINE__, #expr);                                         \
            fflush(stderr);                                                   \
            abort();                                                          \
        }                                                                     \
    } while (0)

/* Integer comparison that also prints both values. */
#define ASSERT_OP(a, op, b)                                                   \
    do {                                                                      \
        long long a_ = (long long)(a), b_ = (long long)(b);                   \
        if (!(a_ op b_)) {                                                    \
            fprintf(stderr, "%s:%d: assertion failed: %s %s %s (%lld vs %lld)\n", \
                    __FILE__, __LINE__, #a, #op, #b, a_, b_);                 \
            fflush(stderr);                                                   \
            abort();                                                          \
        }                                                                     \
    } while (0)

#define ASSERT_EQ(a, b) ASSERT_OP(a, ==, b)
#define ASSERT_NE(a, b) ASSERT_OP(a, !=, b)

#define ASSERT_U64_EQ(a, b)                                                   \
    do {                                                                      \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                      \
        if (a_ != b_) {                                                       \
            fprintf(stderr, "%s:%d: assertion failed: %s == %s (%" PRIu64     \
                    " vs %" PRIu64 ")\n", __FILE__, __LINE__, #a, #b, a_, b_); \
            fflush(stderr);                                                   \
            abort();                                                          \
        }                                                                     \
    } while (0)

/* Deterministic PRNG for randomized tests (xorshift64*). */
static inline uint64_t test_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* Seed for randomized tests: TEST_SEED in the environment, or a constant. */
uint64_t test_seed(void);

#endif
