/*
 * peer_lookup: the cost of finding a decode peer by its routing id (what
 * every control message on a prefill's ROUTER does) as the number of
 * peers grows.  Only peer.c's lookup runs; the functions of the core it
 * never calls are stubbed:
 *
 *   cc -O2 -Icsrc -c csrc/peer.c csrc/table.c
 *   nm -u peer.o | awk '$2 ~ /^kvr_/ && $2 !~ /^kvr_table/ \
 *       {print "void " $2 "(void) { __builtin_trap(); }"}' > stubs.c
 *   cc -O2 -Icsrc benchmarks/peer_lookup.c peer.o table.o stubs.c -o peer_lookup
 */
#include "engine_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double kvr_bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(void)
{
    static const unsigned sizes[] = {1, 16, 64, 256, 1024, 4096};
    enum { LOOKUPS = 1000000, KEYS = 4096 };
    static char keys[KEYS][25];
    for (unsigned i = 0; i < KEYS; i++) {
        /* The key a prefill gives a decode: its 12-byte routing id in hex. */
        snprintf(keys[i], sizeof(keys[i]), "%016x%08x", i * 2654435761u, i);
    }
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        kvr_engine_t *e = calloc(1, sizeof(*e)); /* zeroed: empty peer list and index */
        for (unsigned i = 0; i < sizes[s]; i++) {
            kvr_peer_new(e, KVR_PEER_IS_DECODE, keys[i]);
        }
        unsigned found = 0;
        double t0 = kvr_bench_now();
        for (unsigned k = 0; k < LOOKUPS; k++) {
            found += kvr_peer_find(e, KVR_PEER_IS_DECODE, keys[(k * 7919u) % sizes[s]]) != NULL;
        }
        double ns = (kvr_bench_now() - t0) * 1e9 / LOOKUPS;
        printf("%5u peers: %8.1f ns per lookup (%u of %u found)\n", sizes[s], ns, found,
               (unsigned)LOOKUPS);
    }
    return 0; /* the peers are left to the process's exit */
}
