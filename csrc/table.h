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

/*
 * Iteration:
 *     for (kvr_table_iter_t it = {0}; (v = kvr_table_next(t, &it, &key)) != NULL;) ...
 * returns every entry once.  key_p may be NULL.  The loop may remove the
 * entry it was given with kvr_table_remove_current.  Other removals during
 * the loop may make it miss an entry that moved (never repeat one); it must
 * not insert.
 */
typedef struct {
    size_t start; /* a slot right after an empty one: no cluster spans it */
    size_t step;  /* slots looked at */
    int begun;
} kvr_table_iter_t;

void *kvr_table_next(const kvr_table_t *t, kvr_table_iter_t *it, uint64_t *key_p);
void kvr_table_remove_current(kvr_table_t *t, kvr_table_iter_t *it);

#endif
