#include "heap.h"

#include <stdlib.h>

#include "debug.h"

void kvr_heap_init(kvr_heap_t *h)
{
    h->v = NULL;
    h->n = h->cap = 0;
}

void kvr_heap_destroy(kvr_heap_t *h)
{
    for (uint32_t i = 0; i < h->n; i++) {
        h->v[i]->pos = 0;
    }
    free(h->v);
    kvr_heap_init(h);
}

static void kvr_heap_place(kvr_heap_t *h, uint32_t i, kvr_heap_node_t *node)
{
    h->v[i] = node;
    node->pos = i + 1;
}

/* Moves the node at i up or down until the order holds again. */
static void kvr_heap_fix(kvr_heap_t *h, uint32_t i)
{
    kvr_heap_node_t *node = h->v[i];
    while (i > 0 && h->v[(i - 1) / 2]->key > node->key) {
        kvr_heap_place(h, i, h->v[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->n) {
            break;
        }
        if (c + 1 < h->n && h->v[c + 1]->key < h->v[c]->key) {
            c++;
        }
        if (h->v[c]->key >= node->key) {
            break;
        }
        kvr_heap_place(h, i, h->v[c]);
        i = c;
    }
    kvr_heap_place(h, i, node);
}

int kvr_heap_set(kvr_heap_t *h, kvr_heap_node_t *node, uint64_t key)
{
    if (node->pos == 0) {
        if (h->n == h->cap) {
            uint32_t cap = h->cap ? 2 * h->cap : 64;
            kvr_heap_node_t **v = realloc(h->v, (size_t)cap * sizeof(*v));
            if (v == NULL) {
                return -1;
            }
            h->v = v;
            h->cap = cap;
        }
        kvr_heap_place(h, h->n++, node);
    }
    KVR_ASSERT(node->pos <= h->n && h->v[node->pos - 1] == node);
    node->key = key;
    kvr_heap_fix(h, node->pos - 1);
    return 0;
}

void kvr_heap_remove(kvr_heap_t *h, kvr_heap_node_t *node)
{
    if (node->pos == 0) {
        return;
    }
    uint32_t i = node->pos - 1;
    KVR_ASSERT(i < h->n && h->v[i] == node);
    node->pos = 0;
    kvr_heap_node_t *last = h->v[--h->n];
    if (last != node) {
        kvr_heap_place(h, i, last);
        kvr_heap_fix(h, i);
    }
}

kvr_heap_node_t *kvr_heap_top(const kvr_heap_t *h)
{
    return h->n ? h->v[0] : NULL;
}
