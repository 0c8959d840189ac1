/*
 * A hash table from 64-bit keys to pointers (open addressing, linear
 * probing, backward-shift deletion).  Not thread safe: the owner locks.
 */
#ifndef KVR_TABLE_H
#define KVR_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t key;
    void *value; /* NULL marks an empty slot */
} kvr_table_slot_t;

typedef struct {
    kvr_table_slot_t *slots;
    size_t capacity; /* a power of two, or 0 before the first insert */
    size_t count;
} kvr_table_t;

void kvr_table_init(kvr_table_t *t);
/* Frees the slots, not the values. */
void kvr_table_destroy(kvr_table_t *t);
/* Returns the value for key, or NULL. */
void *kvr_table_get(const kvr_table_t *t, uint64_t key);
/* Inserts or replaces; value must not be NULL.  Returns 0, or -1 on ENOMEM. */
int kvr_table_put(kvr_table_t *t, uint64_t key, void *value);
/* Removes key; returns the old value or NULL. */
void *kvr_table_remove(kvr_table_t *t, uint64_t key);

/* Iteration: for (i = 0; i < t->capacity; i++) if (t->slots[i].value) ... */

#endif
