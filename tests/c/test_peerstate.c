#include "runner.h"

#include "../../csrc/peerstate.h"

enum { R = KVR_PEER_RESOLVING, C = KVR_PEER_CONNECTING, OK = KVR_PEER_READY, F = KVR_PEER_FAILED };

/* Every (from, to) pair of both kinds against the diagram in peer.c. */
TEST_IMPL(peer_state_transitions)
{
    /* legal[kind][from][to] */
    static const int legal[2][4][4] = {
        /* decode's view of a prefill: R C OK F */
        {{1, 1, 0, 1},  /* from RESOLVING: found, or fails */
         {0, 1, 1, 1},  /* from CONNECTING: HELLO_OK, or fails */
         {1, 0, 1, 1},  /* from READY: a restarted instance, or fails */
         {1, 0, 0, 1}}, /* from FAILED: resolved again */
        /* prefill's view of a decode: it only ever says HELLO */
        {{1, 0, 1, 1}, {0, 1, 1, 1}, {0, 0, 1, 1}, {0, 0, 1, 1}},
    };
    for (int kind = 0; kind < 2; kind++) {
        for (int from = R; from <= F; from++) {
            for (int to = R; to <= F; to++) {
                if (kvr_peer_state_legal(kind, from, to) != legal[kind][from][to]) {
                    printf("kind %d: %d -> %d\n", kind, from, to);
                }
                ASSERT_EQ(kvr_peer_state_legal(kind, from, to), legal[kind][from][to]);
            }
        }
    }
    /* the path a prefill peer takes, a failure, and the way back */
    int path[] = {R, C, OK, F, R, C, OK, R, C, F};
    for (unsigned i = 1; i < sizeof(path) / sizeof(path[0]); i++) {
        ASSERT(kvr_peer_state_legal(KVR_PEER_IS_PREFILL, path[i - 1], path[i]));
    }
    /* out of range: never legal */
    ASSERT_EQ(kvr_peer_state_legal(KVR_PEER_IS_PREFILL, -1, F), 0);
    ASSERT_EQ(kvr_peer_state_legal(KVR_PEER_IS_PREFILL, R, 4), 0);
    ASSERT_EQ(kvr_peer_state_legal(2, R, F), 0);
}
