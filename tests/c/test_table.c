#include "runner.h"

#include <string.h>

#include "../../csrc/table.h"

/* Distinct non-NULL values without allocating. */
static char vals[1 << 16];
#define VAL(i) ((void *)&vals[(size_t)(i) % sizeof(vals)])

/* Same finaliser as table.c, used only to build colliding keys. */
static size_t home_of(uint64_t key, size_t cap)
{
    key ^= key >> 30;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 27;
    key *= 0x94d049bb133111ebULL;
    key ^= key >> 31;
    return (size_t)key & (cap - 1);
}

/* Structural invariants: count matches, load factor below 1, and every
 * stored key is reachable from its home slot without crossing an empty one
 * (what backward-shift deletion must preserve). */
static void check_structure(const kvr_table_t *t)
{
    if (t->capacity == 0) {
        ASSERT_EQ(t->count, 0);
        return;
    }
    ASSERT_EQ(t->capacity & (t->capacity - 1), 0);
    size_t used = 0;
    for (size_t i = 0; i < t->capacity; i++) {
        if (t->slots[i].value == NULL) {
            continue;
        }
        used++;
        size_t h = home_of(t->slots[i].key, t->capacity);
        for (size_t j = h; j != i; j = (j + 1) & (t->capacity - 1)) {
            ASSERT(t->slots[j].value != NULL);
        }
        ASSERT(kvr_table_get(t, t->slots[i].key) == t->slots[i].value);
    }
    ASSERT_EQ(used, t->count);
    ASSERT(t->count < t->capacity);
}

TEST_IMPL(table_empty)
{
    kvr_table_t t;
    kvr_table_init(&t);
    ASSERT(kvr_table_get(&t, 0) == NULL);
    ASSERT(kvr_table_get(&t, 12345) == NULL);
    ASSERT(kvr_table_remove(&t, 12345) == NULL);
    ASSERT_EQ(t.count, 0);
    kvr_table_destroy(&t);
    kvr_table_destroy(&t); /* idempotent after destroy (re-initialised) */
    ASSERT_EQ(t.capacity, 0);
    /* remove of a missing key on a non-empty table */
    ASSERT_EQ(kvr_table_put(&t, 1, VAL(1)), 0);
    ASSERT(kvr_table_remove(&t, 2) == NULL);
    ASSERT_EQ(t.count, 1);
    kvr_table_destroy(&t);
}

TEST_IMPL(table_many_keys)
{
    enum { N = 50000 };
    kvr_table_t t;
    kvr_table_init(&t);
    /* sequential keys (like tags) and spread keys (like room ids) */
    for (uint64_t i = 0; i < N; i++) {
        ASSERT_EQ(kvr_table_put(&t, i, VAL(i)), 0);
        ASSERT_EQ(kvr_table_put(&t, i * 0x9E3779B97F4A7C15ULL + (1ULL << 63), VAL(i + 7)), 0);
    }
    ASSERT_EQ(t.count, 2 * N);
    check_structure(&t);
    for (uint64_t i = 0; i < N; i++) {
        ASSERT(kvr_table_get(&t, i) == VAL(i));
        ASSERT(kvr_table_get(&t, i * 0x9E3779B97F4A7C15ULL + (1ULL << 63)) == VAL(i + 7));
    }
    ASSERT(kvr_table_get(&t, N) == NULL);
    /* remove every other sequential key, then check all */
    for (uint64_t i = 0; i < N; i += 2) {
        ASSERT(kvr_table_remove(&t, i) == VAL(i));
        ASSERT(kvr_table_remove(&t, i) == NULL);
    }
    ASSERT_EQ(t.count, 2 * N - N / 2);
    check_structure(&t);
    for (uint64_t i = 0; i < N; i++) {
        ASSERT(kvr_table_get(&t, i) == ((i % 2) ? VAL(i) : NULL));
    }
    /* empty it completely */
    for (uint64_t i = 0; i < N; i++) {
        kvr_table_remove(&t, i);
        ASSERT(kvr_table_remove(&t, i * 0x9E3779B97F4A7C15ULL + (1ULL << 63)) == VAL(i + 7));
    }
    ASSERT_EQ(t.count, 0);
    for (size_t i = 0; i < t.capacity; i++) {
        ASSERT(t.slots[i].value == NULL);
    }
    kvr_table_destroy(&t);
}

TEST_IMPL(table_replace)
{
    kvr_table_t t;
    kvr_table_init(&t);
    for (int round = 0; round < 5; round++) {
        for (uint64_t i = 0; i < 100; i++) {
            ASSERT_EQ(kvr_table_put(&t, i, VAL(i + round)), 0);
        }
        ASSERT_EQ(t.count, 100);
    }
    for (uint64_t i = 0; i < 100; i++) {
        ASSERT(kvr_table_get(&t, i) == VAL(i + 4));
    }
    check_structure(&t);
    kvr_table_destroy(&t);
}

TEST_IMPL(table_extreme_keys)
{
    kvr_table_t t;
    kvr_table_init(&t);
    uint64_t keys[] = {0, 1, UINT64_MAX, UINT64_MAX - 1, 1ULL << 63, 0x8000000000000001ULL};
    size_t n = sizeof(keys) / sizeof(keys[0]);
    for (size_t i = 0; i < n; i++) {
        ASSERT_EQ(kvr_table_put(&t, keys[i], VAL(i)), 0);
    }
    for (size_t i = 0; i < n; i++) {
        ASSERT(kvr_table_get(&t, keys[i]) == VAL(i));
    }
    ASSERT(kvr_table_remove(&t, 0) == VAL(0));
    ASSERT(kvr_table_get(&t, 0) == NULL);
    ASSERT(kvr_table_get(&t, UINT64_MAX) == VAL(2));
    check_structure(&t);
    kvr_table_destroy(&t);
}

/* Keys whose home slot is the last slot (and the one before), so probe
 * chains wrap to slot 0; deleting from the front of such a chain must shift
 * the wrapped entries back across the end of the array. */
TEST_IMPL(table_wraparound_cluster)
{
    kvr_table_t t;
    kvr_table_init(&t);
    ASSERT_EQ(kvr_table_put(&t, 0xdead, VAL(0)), 0); /* allocate 64 slots */
    ASSERT(kvr_table_remove(&t, 0xdead) == VAL(0));
    ASSERT_EQ(t.capacity, 64);
    uint64_t keys[12];
    size_t nk = 0;
    for (uint64_t k = 1; nk < 12; k++) {
        size_t h = home_of(k, 64);
        if ((h == 63 && nk < 6) || (h == 62 && nk >= 6) || (h == 0 && nk >= 9)) {
            keys[nk++] = k;
        }
    }
    for (int order = 0; order < 3; order++) {
        for (size_t i = 0; i < nk; i++) {
            ASSERT_EQ(kvr_table_put(&t, keys[i], VAL(i + 1)), 0);
        }
        ASSERT_EQ(t.capacity, 64);
        check_structure(&t);
        /* delete in three different orders, checking after every step */
        for (size_t s = 0; s < nk; s++) {
            size_t i = order == 0 ? s : order == 1 ? nk - 1 - s : (s * 5) % nk;
            ASSERT(kvr_table_remove(&t, keys[i]) == VAL(i + 1));
            check_structure(&t);
            for (size_t j = 0; j < nk; j++) {
                int gone;
                if (order == 0) {
                    gone = j <= s;
                } else if (order == 1) {
                    gone = j >= nk - 1 - s;
                } else {
                    gone = 0;
                    for (size_t q = 0; q <= s; q++) {
                        gone |= (q * 5) % nk == j;
                    }
                }
                ASSERT(kvr_table_get(&t, keys[j]) == (gone ? NULL : VAL(j + 1)));
            }
        }
        ASSERT_EQ(t.count, 0);
    }
    kvr_table_destroy(&t);
}

/* Random put/remove/get against a plain array, over a small key universe so
 * collisions, long clusters and deletions inside them are frequent. */
TEST_IMPL(table_random_vs_reference)
{
    enum { U = 700, OPS = 200000 };
    uint64_t seed = test_seed();
    void *ref[U];
    uint64_t keyof[U];
    memset(ref, 0, sizeof(ref));
    for (size_t i = 0; i < U; i++) {
        /* half small sequential keys, half random 64-bit keys */
        keyof[i] = (i % 2) ? i : test_rand(&seed);
    }
    kvr_table_t t;
    kvr_table_init(&t);
    size_t live = 0;
    for (int op = 0; op < OPS; op++) {
        uint64_t r = test_rand(&seed);
        size_t k = (size_t)(r % U);
        /* phases that bias towards growth or shrinking */
        int grow = (op / 20000) % 2 == 0;
        int kind = (int)((r >> 32) % 10);
        if (kind < (grow ? 6 : 3)) {
            void *v = VAL(r >> 40);
            ASSERT_EQ(kvr_table_put(&t, keyof[k], v), 0);
            if (ref[k] == NULL) {
                live++;
            }
            ref[k] = v;
        } else if (kind < 9) {
            void *old = kvr_table_remove(&t, keyof[k]);
            ASSERT(old == ref[k]);
            if (ref[k] != NULL) {
                live--;
            }
            ref[k] = NULL;
        } else {
            ASSERT(kvr_table_get(&t, keyof[k]) == ref[k]);
        }
        ASSERT_EQ(t.count, live);
        if (op % 997 == 0) {
            check_structure(&t);
            for (size_t i = 0; i < U; i++) {
                ASSERT(kvr_table_get(&t, keyof[i]) == ref[i]);
            }
        }
    }
    check_structure(&t);
    for (size_t i = 0; i < U; i++) {
        ASSERT(kvr_table_get(&t, keyof[i]) == ref[i]);
    }
    kvr_table_destroy(&t);
}

/* The iterator returns every entry once; removing the current entry as it
 * goes (backward shifts included) neither skips nor repeats one. */
TEST_IMPL(table_iterate_and_remove)
{
    uint64_t seed = 12345;
    for (int round = 0; round < 50; round++) {
        kvr_table_t t;
        kvr_table_init(&t);
        static uint64_t keys[2000];
        static uint8_t seen[2000];
        int n = 1 + (int)(test_rand(&seed) % 2000);
        for (int i = 0; i < n; i++) {
            keys[i] = test_rand(&seed) | 1;
            seen[i] = 0;
            ASSERT_EQ(kvr_table_put(&t, keys[i], &keys[i]), 0);
        }
        kvr_table_iter_t it = {0};
        uint64_t key;
        uint64_t *v;
        int visits = 0;
        while ((v = kvr_table_next(&t, &it, &key)) != NULL) {
            int i = (int)(v - keys);
            ASSERT_U64_EQ(key, keys[i]);
            ASSERT_EQ(seen[i], 0);
            seen[i] = 1;
            visits++;
            if (key % 4 == 1) {
                kvr_table_remove_current(&t, &it);
            }
        }
        ASSERT_EQ(visits, n);
        for (int i = 0; i < n; i++) {
            ASSERT_EQ(kvr_table_get(&t, keys[i]) != NULL, keys[i] % 4 != 1);
        }
        kvr_table_destroy(&t);
    }
}
