#include "table.h"

#include <stdlib.h>

static size_t kvr_table_hash(uint64_t key)
{
    /* splitmix64 finaliser: room ids are random, tags are sequential. */
    key ^= key >> 30;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 27;
    key *= 0x94d049bb133111ebULL;
    key ^= key >> 31;
    return (size_t)key;
}

void kvr_table_init(kvr_table_t *t)
{
    t->slots = NULL;
    t->capacity = 0;
    t->count = 0;
}

void kvr_table_destroy(kvr_table_t *t)
{
    free(t->slots);
    kvr_table_init(t);
}

void *kvr_table_get(const kvr_table_t *t, uint64_t key)
{
    if (t->capacity == 0) {
        return NULL;
    }
    size_t mask = t->capacity - 1;
    for (size_t i = kvr_table_hash(key) & mask;; i = (i + 1) & mask) {
        if (t->slots[i].value == NULL) {
            return NULL;
        }
        if (t->slots[i].key == key) {
            return t->slots[i].value;
        }
    }
}

static int kvr_table_grow(kvr_table_t *t)
{
    size_t ncap = t->capacity ? t->capacity * 2 : 64;
    kvr_table_slot_t *nslots = calloc(ncap, sizeof(*nslots));
    if (nslots == NULL) {
        return -1;
    }
    for (size_t j = 0; j < t->capacity; j++) {
        if (t->slots[j].value == NULL) {
            continue;
        }
        size_t i = kvr_table_hash(t->slots[j].key) & (ncap - 1);
        while (nslots[i].value != NULL) {
            i = (i + 1) & (ncap - 1);
        }
        nslots[i] = t->slots[j];
    }
    free(t->slots);
    t->slots = nslots;
    t->capacity = ncap;
    return 0;
}

int kvr_table_put(kvr_table_t *t, uint64_t key, void *value)
{
    if ((t->count + 1) * 4 > t->capacity * 3 && kvr_table_grow(t) != 0) {
        return -1;
    }
    size_t mask = t->capacity - 1;
    size_t i = kvr_table_hash(key) & mask;
    while (t->slots[i].value != NULL && t->slots[i].key != key) {
        i = (i + 1) & mask;
    }
    if (t->slots[i].value == NULL) {
        t->count++;
    }
    t->slots[i].key = key;
    t->slots[i].value = value;
    return 0;
}

void *kvr_table_remove(kvr_table_t *t, uint64_t key)
{
    if (t->capacity == 0) {
        return NULL;
    }
    size_t mask = t->capacity - 1;
    size_t i = kvr_table_hash(key) & mask;
    while (t->slots[i].value != NULL && t->slots[i].key != key) {
        i = (i + 1) & mask;
    }
    void *old = t->slots[i].value;
    if (old == NULL) {
        return NULL;
    }
    /* Backward-shift deletion keeps probe chains intact without tombstones. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; t->slots[j].value != NULL; j = (j + 1) & mask) {
        size_t home = kvr_table_hash(t->slots[j].key) & mask;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole].value = NULL;
    t->count--;
    return old;
}

void *kvr_table_next(const kvr_table_t *t, kvr_table_iter_t *it, uint64_t *key_p)
{
    size_t mask = t->capacity - 1;
    if (!it->begun) {
        /* Start after an empty slot (there always is one): removals then
         * shift entries only from slots not visited yet into the current
         * one, never into a visited slot. */
        it->begun = 1;
        it->start = 0;
        for (size_t i = 0; i < t->capacity; i++) {
            if (t->slots[i].value == NULL) {
                it->start = (i + 1) & mask;
                break;
            }
        }
    }
    while (it->step < t->capacity) {
        const kvr_table_slot_t *s = &t->slots[(it->start + it->step++) & mask];
        if (s->value != NULL) {
            if (key_p != NULL) {
                *key_p = s->key;
            }
            return s->value;
        }
    }
    return NULL;
}

void kvr_table_remove_current(kvr_table_t *t, kvr_table_iter_t *it)
{
    /* Backward-shift deletion may move a later entry into this slot: the
     * next call looks at it again. */
    it->step--;
    kvr_table_remove(t, t->slots[(it->start + it->step) & (t->capacity - 1)].key);
}
