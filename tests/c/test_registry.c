#include "runner.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "../../csrc/registry.h"
#include "../../csrc/status.h"

TEST_IMPL(registry_first_cause_wins)
{
    kvr_registry_t reg;
    kvr_registry_init(&reg);
    kvr_failure_t a, b, out;
    kvr_failure_fill(&a, KVR_PEER_LOST, 3, "10.0.0.1:5000", "room %d: peer gone", 7);
    kvr_failure_fill(&b, KVR_ABORTED, 1, "10.0.0.2:6000", "echo of abort");
    b.from_remote = 1;
    ASSERT_EQ(kvr_registry_record(&reg, 7, &a), 1);
    ASSERT_EQ(kvr_registry_record(&reg, 7, &b), 0);
    ASSERT_EQ(kvr_registry_record(&reg, 7, &b), 0);
    ASSERT_EQ(kvr_registry_count(&reg), 1);
    memset(&out, 0xAB, sizeof(out));
    ASSERT_EQ(kvr_registry_peek(&reg, 7, &out), 1);
    ASSERT_EQ(out.code, KVR_PEER_LOST);
    ASSERT_EQ(out.origin_rank, 3);
    ASSERT_EQ(out.from_remote, 0);
    ASSERT(strcmp(out.reason, "room 7: peer gone") == 0);
    ASSERT(strcmp(out.peer, "10.0.0.1:5000") == 0);
    ASSERT_U64_EQ(out.time_ns, a.time_ns);
    /* another room is independent */
    ASSERT_EQ(kvr_registry_record(&reg, 8, &b), 1);
    ASSERT_EQ(kvr_registry_peek(&reg, 8, &out), 1);
    ASSERT_EQ(out.code, KVR_ABORTED);
    ASSERT_EQ(out.from_remote, 1);
    ASSERT_EQ(kvr_registry_count(&reg), 2);
    /* the record is a copy: changing the caller's struct changes nothing */
    a.code = KVR_TIMEOUT;
    strcpy(a.reason, "changed");
    ASSERT_EQ(kvr_registry_peek(&reg, 7, &out), 1);
    ASSERT_EQ(out.code, KVR_PEER_LOST);
    ASSERT(strcmp(out.reason, "room 7: peer gone") == 0);
    kvr_registry_destroy(&reg); /* frees the records (LSan checks) */
}

TEST_IMPL(registry_peek_pop_drop)
{
    kvr_registry_t reg;
    kvr_registry_init(&reg);
    kvr_failure_t f, out;
    memset(&out, 0, sizeof(out));
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 0);
    ASSERT_EQ(kvr_registry_pop(&reg, 1, &out), 0);
    kvr_registry_drop(&reg, 1);
    ASSERT_EQ(kvr_registry_count(&reg), 0);

    kvr_failure_fill(&f, KVR_TIMEOUT, 0, NULL, "t");
    ASSERT_EQ(kvr_registry_record(&reg, 1, &f), 1);
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 1);
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 1); /* peek keeps it */
    ASSERT_EQ(kvr_registry_count(&reg), 1);
    ASSERT_EQ(kvr_registry_pop(&reg, 1, &out), 1);
    ASSERT_EQ(out.code, KVR_TIMEOUT);
    ASSERT(strcmp(out.reason, "t") == 0);
    ASSERT(strcmp(out.peer, "") == 0);
    ASSERT_EQ(kvr_registry_pop(&reg, 1, &out), 0); /* pop removed it */
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 0);
    ASSERT_EQ(kvr_registry_count(&reg), 0);
    /* after pop, a new failure of the same room id is a new root cause */
    kvr_failure_fill(&f, KVR_REMOTE, 2, "p", "second life");
    ASSERT_EQ(kvr_registry_record(&reg, 1, &f), 1);
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 1);
    ASSERT_EQ(out.code, KVR_REMOTE);
    /* drop */
    kvr_registry_drop(&reg, 1);
    ASSERT_EQ(kvr_registry_peek(&reg, 1, &out), 0);
    ASSERT_EQ(kvr_registry_count(&reg), 0);
    kvr_registry_drop(&reg, 1);
    ASSERT_EQ(kvr_registry_record(&reg, 1, &f), 1);
    /* room ids 0 and UINT64_MAX are ordinary keys */
    ASSERT_EQ(kvr_registry_record(&reg, 0, &f), 1);
    ASSERT_EQ(kvr_registry_record(&reg, UINT64_MAX, &f), 1);
    ASSERT_EQ(kvr_registry_record(&reg, 0, &f), 0);
    ASSERT_EQ(kvr_registry_count(&reg), 3);
    kvr_registry_destroy(&reg);
}

TEST_IMPL(registry_many_rooms)
{
    enum { N = 20000 };
    kvr_registry_t reg;
    kvr_registry_init(&reg);
    kvr_failure_t f, out;
    for (uint64_t i = 0; i < N; i++) {
        kvr_failure_fill(&f, (int)(i % KVR_STATUS_LAST), (int)i, "peer", "room %llu",
                         (unsigned long long)i);
        ASSERT_EQ(kvr_registry_record(&reg, i * 2654435761ULL, &f), 1);
    }
    ASSERT_EQ(kvr_registry_count(&reg), N);
    for (uint64_t i = 0; i < N; i += 3) {
        ASSERT_EQ(kvr_registry_pop(&reg, i * 2654435761ULL, &out), 1);
        ASSERT_EQ(out.origin_rank, (int)i);
        char want[64];
        snprintf(want, sizeof(want), "room %llu", (unsigned long long)i);
        ASSERT(strcmp(out.reason, want) == 0);
    }
    for (uint64_t i = 0; i < N; i++) {
        int have = kvr_registry_peek(&reg, i * 2654435761ULL, &out);
        ASSERT_EQ(have, i % 3 != 0);
        if (have) {
            ASSERT_EQ(out.origin_rank, (int)i);
        }
    }
    /* destroy with records still held: freed by destroy (LSan checks) */
    kvr_registry_destroy(&reg);
}

TEST_IMPL(registry_failure_fill)
{
    kvr_failure_t f;
    char big[1000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    memset(&f, 0x5A, sizeof(f));
    kvr_failure_fill(&f, KVR_TRANSPORT, -1, big, "%s", big);
    ASSERT_EQ(f.code, KVR_TRANSPORT);
    ASSERT_EQ(f.origin_rank, -1);
    ASSERT_EQ(f.from_remote, 0);
    ASSERT_EQ(f.from_sibling, 0);
    ASSERT_EQ(strlen(f.peer), KVR_PEER_MAX - 1);
    ASSERT_EQ(strlen(f.reason), KVR_REASON_MAX - 1);
    ASSERT(f.time_ns > 0);
    uint64_t t0 = kvr_now_ns();
    uint64_t t1 = kvr_now_ns();
    ASSERT(t1 >= t0);
    ASSERT(f.time_ns <= t0);
    kvr_failure_fill(&f, KVR_OK, 5, NULL, "code=%d peer=%s", 3, "h:1");
    ASSERT(strcmp(f.reason, "code=3 peer=h:1") == 0);
    ASSERT(strcmp(f.peer, "") == 0);
}

/* Several threads race to record the first failure of the same rooms:
 * exactly one wins each room, and the stored record is the winner's. */
#define NTHREADS 8
#define NROOMS 2000
static kvr_registry_t g_reg;
static atomic_int g_wins[NROOMS];
static int g_winner[NROOMS];
static atomic_int g_go;

static void *record_thread(void *arg)
{
    int id = (int)(intptr_t)arg;
    while (!atomic_load(&g_go)) {
    }
    for (int k = 0; k < NROOMS; k++) {
        /* different threads walk the rooms in different orders */
        int room = (id % 2) ? k : NROOMS - 1 - k;
        kvr_failure_t f;
        kvr_failure_fill(&f, 1 + id % (KVR_STATUS_LAST - 1), id, "peer", "thread %d room %d",
                         id, room);
        int r = kvr_registry_record(&g_reg, (uint64_t)room, &f);
        ASSERT(r == 0 || r == 1);
        if (r == 1) {
            atomic_fetch_add(&g_wins[room], 1);
            g_winner[room] = id; /* only one writer per room if correct */
        }
    }
    return NULL;
}

TEST_IMPL(registry_concurrent_record)
{
    pthread_t th[NTHREADS];
    kvr_registry_init(&g_reg);
    for (int i = 0; i < NTHREADS; i++) {
        ASSERT_EQ(pthread_create(&th[i], NULL, record_thread, (void *)(intptr_t)i), 0);
    }
    atomic_store(&g_go, 1);
    for (int i = 0; i < NTHREADS; i++) {
        ASSERT_EQ(pthread_join(th[i], NULL), 0);
    }
    ASSERT_EQ(kvr_registry_count(&g_reg), NROOMS);
    for (int room = 0; room < NROOMS; room++) {
        ASSERT_EQ(atomic_load(&g_wins[room]), 1);
        kvr_failure_t out;
        ASSERT_EQ(kvr_registry_peek(&g_reg, (uint64_t)room, &out), 1);
        ASSERT_EQ(out.origin_rank, g_winner[room]);
        char want[64];
        snprintf(want, sizeof(want), "thread %d room %d", g_winner[room], room);
        ASSERT(strcmp(out.reason, want) == 0);
    }
    kvr_registry_destroy(&g_reg);
}

/* Recorders, peekers, poppers and droppers at once: records are never torn
 * (reason always matches origin_rank), pops return each record at most once. */
static atomic_int g_popped;
static void *mixed_thread(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint64_t seed = test_seed() + (uint64_t)id * 7919;
    while (!atomic_load(&g_go)) {
    }
    for (int i = 0; i < 20000; i++) {
        uint64_t room = test_rand(&seed) % 64;
        kvr_failure_t f, out;
        switch (id % 4) {
        case 0:
        case 1:
            kvr_failure_fill(&f, KVR_REMOTE, id, "p", "r%d", id);
            ASSERT(kvr_registry_record(&g_reg, room, &f) >= 0);
            break;
        case 2:
            if (kvr_registry_peek(&g_reg, room, &out)) {
                char want[16];
                snprintf(want, sizeof(want), "r%d", out.origin_rank);
                ASSERT(strcmp(out.reason, want) == 0);
            }
            (void)kvr_registry_count(&g_reg);
            break;
        default:
            if (i % 2) {
                if (kvr_registry_pop(&g_reg, room, &out)) {
                    char want[16];
                    snprintf(want, sizeof(want), "r%d", out.origin_rank);
                    ASSERT(strcmp(out.reason, want) == 0);
                    atomic_fetch_add(&g_popped, 1);
                }
            } else {
                kvr_registry_drop(&g_reg, room);
            }
        }
    }
    return NULL;
}

TEST_IMPL(registry_concurrent_mixed)
{
    pthread_t th[NTHREADS];
    kvr_registry_init(&g_reg);
    for (int i = 0; i < NTHREADS; i++) {
        ASSERT_EQ(pthread_create(&th[i], NULL, mixed_thread, (void *)(intptr_t)i), 0);
    }
    atomic_store(&g_go, 1);
    for (int i = 0; i < NTHREADS; i++) {
        ASSERT_EQ(pthread_join(th[i], NULL), 0);
    }
    ASSERT(kvr_registry_count(&g_reg) <= 64);
    size_t n = 0;
    for (uint64_t room = 0; room < 64; room++) {
        kvr_failure_t out;
        n += (size_t)kvr_registry_peek(&g_reg, room, &out);
    }
    ASSERT_EQ(n, kvr_registry_count(&g_reg));
    kvr_registry_destroy(&g_reg);
}

TEST_IMPL(registry_early_bounded)
{
    kvr_registry_t reg;
    kvr_registry_init(&reg);
    kvr_failure_t f, out;
    kvr_failure_fill(&f, 6, 1, "", "early");
    for (uint64_t room = 1; room <= 3 * KVR_REGISTRY_EARLY_MAX; room++) {
        ASSERT_EQ(kvr_registry_record_early(&reg, room, &f), 1);
    }
    ASSERT_EQ(kvr_registry_record_early(&reg, 3 * KVR_REGISTRY_EARLY_MAX, &f), 0);
    ASSERT_EQ(kvr_registry_count(&reg), KVR_REGISTRY_EARLY_MAX);
    ASSERT_EQ(kvr_registry_pop_early(&reg, 1, &out), 0); /* the oldest went */
    ASSERT_EQ(kvr_registry_pop_early(&reg, 2 * KVR_REGISTRY_EARLY_MAX + 1, &out), 1);
    ASSERT(strcmp(out.reason, "early") == 0);
    ASSERT_EQ(kvr_registry_pop_early(&reg, 2 * KVR_REGISTRY_EARLY_MAX + 1, &out), 0);
    ASSERT_EQ(kvr_registry_peek(&reg, 3 * KVR_REGISTRY_EARLY_MAX, &out), 0); /* apart */
    ASSERT_EQ(kvr_registry_count(&reg), KVR_REGISTRY_EARLY_MAX - 1);
    kvr_registry_destroy(&reg); /* frees what is left (LSan checks) */
}
