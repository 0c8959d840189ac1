#include "runner.h"

#include <stdlib.h>

#include "../../csrc/heap.h"

TEST_IMPL(heap_empty_and_order)
{
    kvr_heap_t h;
    kvr_heap_init(&h);
    ASSERT(kvr_heap_top(&h) == NULL);
    kvr_heap_node_t n[5] = {{0, 0}};
    uint64_t keys[5] = {50, 10, 40, 10, 30};
    for (int i = 0; i < 5; i++) {
        ASSERT_EQ(kvr_heap_set(&h, &n[i], keys[i]), 0);
        ASSERT(kvr_heap_contains(&n[i]));
    }
    uint64_t last = 0;
    for (int i = 0; i < 5; i++) {
        kvr_heap_node_t *t = kvr_heap_top(&h);
        ASSERT(t != NULL);
        ASSERT(t->key >= last);
        last = t->key;
        kvr_heap_remove(&h, t);
        ASSERT(!kvr_heap_contains(t));
    }
    ASSERT(kvr_heap_top(&h) == NULL);
    kvr_heap_remove(&h, &n[0]); /* not in it: nothing */
    ASSERT_EQ(h.n, 0u);
    kvr_heap_destroy(&h);
}

TEST_IMPL(heap_update_moves_both_ways)
{
    kvr_heap_t h;
    kvr_heap_init(&h);
    kvr_heap_node_t a = {0, 0}, b = {0, 0}, c = {0, 0};
    kvr_heap_set(&h, &a, 10);
    kvr_heap_set(&h, &b, 20);
    kvr_heap_set(&h, &c, 30);
    ASSERT(kvr_heap_top(&h) == &a);
    ASSERT_EQ(kvr_heap_set(&h, &c, 5), 0); /* up */
    ASSERT(kvr_heap_top(&h) == &c);
    ASSERT_EQ(kvr_heap_set(&h, &c, 25), 0); /* down */
    ASSERT(kvr_heap_top(&h) == &a);
    ASSERT_EQ(h.n, 3u);
    kvr_heap_destroy(&h);
    ASSERT(!kvr_heap_contains(&a) && !kvr_heap_contains(&b) && !kvr_heap_contains(&c));
}

/* Random inserts, removals, key changes and pops of the minimum against a
 * brute-force model (an array scanned for its smallest key). */
TEST_IMPL(heap_random_vs_model)
{
    enum { N = 600, STEPS = 60000 };
    static kvr_heap_node_t nodes[N];
    static int in[N];
    static uint64_t key[N];
    kvr_heap_t h;
    kvr_heap_init(&h);
    for (int i = 0; i < N; i++) {
        nodes[i].pos = 0;
        in[i] = 0;
    }
    unsigned seed = 12345;
    int count = 0;
    for (int s = 0; s < STEPS; s++) {
        int i = rand_r(&seed) % N;
        int op = rand_r(&seed) % 4;
        /* Small key range: many equal keys. */
        uint64_t k = (uint64_t)(rand_r(&seed) % 200);
        if (op <= 1) {
            ASSERT_EQ(kvr_heap_set(&h, &nodes[i], k), 0);
            count += !in[i];
            in[i] = 1;
            key[i] = k;
        } else if (op == 2) {
            kvr_heap_remove(&h, &nodes[i]);
            count -= in[i];
            in[i] = 0;
        } else {
            kvr_heap_node_t *t = kvr_heap_top(&h);
            uint64_t min = UINT64_MAX;
            for (int j = 0; j < N; j++) {
                if (in[j] && key[j] < min) {
                    min = key[j];
                }
            }
            if (count == 0) {
                ASSERT(t == NULL);
                continue;
            }
            ASSERT(t != NULL);
            int j = (int)(t - nodes);
            ASSERT(j >= 0 && j < N && in[j]);
            ASSERT_U64_EQ(t->key, min);
            ASSERT_U64_EQ(key[j], min);
            kvr_heap_remove(&h, t);
            in[j] = 0;
            count--;
        }
        ASSERT_EQ(h.n, (uint32_t)count);
        for (int j = 0; j < N; j++) {
            ASSERT_EQ(kvr_heap_contains(&nodes[j]), in[j]);
        }
    }
    /* Empty it in order. */
    uint64_t last = 0;
    for (kvr_heap_node_t *t; (t = kvr_heap_top(&h)) != NULL;) {
        ASSERT(t->key >= last);
        last = t->key;
        kvr_heap_remove(&h, t);
        count--;
    }
    ASSERT_EQ(count, 0);
    kvr_heap_destroy(&h);
}
