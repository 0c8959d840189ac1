/*
 * What the fuzz targets share: CHECK (abort with the failed condition, so
 * libFuzzer records the input) and FUZZ_EXPECT_VALID=1, under which every
 * input must decode (used to check the seed corpus).
 */
#ifndef KVR_FUZZ_UTIL_H
#define KVR_FUZZ_UTIL_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        if (!(x)) {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #x); \
            abort();                                                              \
        }                                                                         \
    } while (0)

static inline int expect_valid(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("FUZZ_EXPECT_VALID");
        v = e != NULL && e[0] == '1';
    }
    return v;
}

#endif
