#include "registry.h"

#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t kvr_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

void kvr_registry_init(kvr_registry_t *reg)
{
    pthread_mutex_init(&reg->lock, NULL);
    kvr_table_init(&reg->records);
    kvr_table_init(&reg->early);
    reg->early_head = 0;
    reg->early_n = 0;
}

void kvr_registry_destroy(kvr_registry_t *reg)
{
    void *v;
    for (kvr_table_iter_t it = {0}; (v = kvr_table_next(&reg->records, &it, NULL)) != NULL;) {
        free(v);
    }
    kvr_table_destroy(&reg->records);
    for (kvr_table_iter_t it = {0}; (v = kvr_table_next(&reg->early, &it, NULL)) != NULL;) {
        free(v);
    }
    kvr_table_destroy(&reg->early);
    pthread_mutex_destroy(&reg->lock);
}

/* Stores a copy of f under room in t unless one is there: 1, 0, or -1. */
static int kvr_registry_put_locked(kvr_table_t *t, uint64_t room, const kvr_failure_t *f)
{
    int ret = 0;
    if (kvr_table_get(t, room) == NULL) {
        kvr_failure_t *copy = malloc(sizeof(*copy));
        if (copy == NULL) {
            ret = -1;
        } else {
            *copy = *f;
            /* Reasons are cut to fit: never in the middle of a character. */
            copy->reason[sizeof(copy->reason) - 1] = '\0';
            copy->peer[sizeof(copy->peer) - 1] = '\0';
            kvr_utf8_trim(copy->reason);
            kvr_utf8_trim(copy->peer);
            if (kvr_table_put(t, room, copy) != 0) {
                free(copy);
                ret = -1;
            } else {
                ret = 1;
            }
        }
    }
    return ret;
}

int kvr_registry_record(kvr_registry_t *reg, uint64_t room, const kvr_failure_t *f)
{
    pthread_mutex_lock(&reg->lock);
    int ret = kvr_registry_put_locked(&reg->records, room, f);
    pthread_mutex_unlock(&reg->lock);
    return ret;
}

int kvr_registry_record_early(kvr_registry_t *reg, uint64_t room, const kvr_failure_t *f)
{
    pthread_mutex_lock(&reg->lock);
    if (kvr_table_get(&reg->early, room) == NULL && reg->early_n == KVR_REGISTRY_EARLY_MAX) {
        /* Full: the oldest goes (it may have been popped already). */
        uint64_t old = reg->early_ring[reg->early_head];
        reg->early_head = (reg->early_head + 1) % KVR_REGISTRY_EARLY_MAX;
        reg->early_n--;
        free(kvr_table_remove(&reg->early, old));
    }
    int ret = kvr_registry_put_locked(&reg->early, room, f);
    if (ret == 1) {
        reg->early_ring[(reg->early_head + reg->early_n) % KVR_REGISTRY_EARLY_MAX] = room;
        reg->early_n++;
    }
    pthread_mutex_unlock(&reg->lock);
    return ret;
}


int kvr_registry_peek(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out)
{
    pthread_mutex_lock(&reg->lock);
    kvr_failure_t *f = kvr_table_get(&reg->records, room);
    if (f != NULL) {
        *out = *f;
    }
    pthread_mutex_unlock(&reg->lock);
    return f != NULL;
}

/* Removes room's record from t (one of reg's tables) into out: 1, or 0. */
static int kvr_registry_take(kvr_registry_t *reg, kvr_table_t *t, uint64_t room,
                             kvr_failure_t *out)
{
    pthread_mutex_lock(&reg->lock);
    kvr_failure_t *f = kvr_table_remove(t, room);
    pthread_mutex_unlock(&reg->lock);
    if (f == NULL) {
        return 0;
    }
    *out = *f;
    free(f);
    return 1;
}

int kvr_registry_pop(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out)
{
    return kvr_registry_take(reg, &reg->records, room, out);
}

int kvr_registry_pop_early(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out)
{
    return kvr_registry_take(reg, &reg->early, room, out);
}

void kvr_registry_drop(kvr_registry_t *reg, uint64_t room)
{
    pthread_mutex_lock(&reg->lock);
    free(kvr_table_remove(&reg->records, room));
    pthread_mutex_unlock(&reg->lock);
}

size_t kvr_registry_count(kvr_registry_t *reg)
{
    pthread_mutex_lock(&reg->lock);
    size_t n = reg->records.count + reg->early.count;
    pthread_mutex_unlock(&reg->lock);
    return n;
}

void kvr_failure_fill(kvr_failure_t *f, int code, int origin_rank, const char *peer,
                      const char *fmt, ...)
{
    va_list ap;
    memset(f, 0, sizeof(*f));
    f->code = code;
    f->origin_rank = origin_rank;
    f->time_ns = kvr_now_ns();
    snprintf(f->peer, sizeof(f->peer), "%s", peer ? peer : "");
    va_start(ap, fmt);
    vsnprintf(f->reason, sizeof(f->reason), fmt, ap);
    va_end(ap);
    if (f->reason[0] == '\0') {
        snprintf(f->reason, sizeof(f->reason), "%s", "unknown failure");
    }
}
