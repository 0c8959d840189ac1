/*
 * heap: a binary min-heap of deadlines, pure logic, no I/O.
 *
 * The caller embeds a kvr_heap_node_t in each object that can have a
 * deadline; the node keeps its position in the heap, so removing or moving
 * an object is O(log n) and the earliest one is found in O(1).  The heap
 * holds pointers only: it neither owns nor references the objects, and an
 * object must leave the heap before it is freed.
 *
 * Not thread-safe: the owner serializes (the engine: its lock).
 */
#ifndef KVR_HEAP_H
#define KVR_HEAP_H

#include <stdint.h>

typedef struct kvr_heap_node {
    uint64_t key; /* the deadline, ns */
    uint32_t pos; /* 0: not in a heap; else the index + 1 */
} kvr_heap_node_t;

typedef struct {
    kvr_heap_node_t **v;
    uint32_t n, cap;
} kvr_heap_t;

void kvr_heap_init(kvr_heap_t *h);
/* Frees the array; the nodes still in it are marked out of it. */
void kvr_heap_destroy(kvr_heap_t *h);

/* Puts node in the heap with key, or moves it there if it is in already.
 * Returns 0, or -1 if memory ran out (node unchanged, still where it was). */
int kvr_heap_set(kvr_heap_t *h, kvr_heap_node_t *node, uint64_t key);

/* Takes node out of the heap; nothing if it is not in it. */
void kvr_heap_remove(kvr_heap_t *h, kvr_heap_node_t *node);

/* The node with the smallest key, or NULL if empty (left in the heap). */
kvr_heap_node_t *kvr_heap_top(const kvr_heap_t *h);

static inline int kvr_heap_contains(const kvr_heap_node_t *node)
{
    return node->pos != 0;
}

#endif
