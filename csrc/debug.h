/*
 * debug: checks of the core's invariants that run in debug and sanitizer
 * builds (KVRECV_DEBUG defined: setup.py defines it when KVRECV_SANITIZE or
 * KVRECV_DEBUG is set, scripts/ctest.sh always) and compile to nothing in a
 * release build.  A failed check prints where and what, then aborts: an
 * invariant that does not hold is a bug of the core, never a condition to
 * recover from.  Any thread.
 */
#ifndef KVR_DEBUG_H
#define KVR_DEBUG_H

#ifdef KVRECV_DEBUG
#include <stdio.h>
#include <stdlib.h>
#define KVR_ASSERT(cond)                                                               \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "kvrecv: %s:%d: %s: check failed: %s\n", __FILE__, __LINE__, \
                    __func__, #cond);                                                  \
            abort();                                                                   \
        }                                                                              \
    } while (0)
#else
/* sizeof: the condition is still compiled (no unused variables, no rot), never
 * evaluated. */
#define KVR_ASSERT(cond) ((void)sizeof(!(cond)))
#endif

#endif
