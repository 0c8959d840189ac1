/*
 * The failure registry: one record per room id, the first root cause wins.
 *
 * A record holds the code, the reason text written by the first function
 * that saw the failure (with the room and the peer in it), the rank where it
 * happened and when.  Echoes of a failure (the peer telling us about the
 * abort we sent it, a second error for the same room) never overwrite the
 * first record.  The registry has its own mutex, so any thread may call any
 * function; none of them blocks on I/O.
 */
#ifndef KVR_REGISTRY_H
#define KVR_REGISTRY_H

#include <pthread.h>
#include <stdint.h>

#include "table.h"

#define KVR_REASON_MAX 384
#define KVR_PEER_MAX 160

typedef struct {
    int code;                     /* kvr_status_t */
    int origin_rank;              /* rank that detected it; -1 if unknown */
    int from_remote;              /* 1 if the peer (the other side) told us */
    int from_sibling;             /* 1 if another rank of this instance told us */
    uint64_t time_ns;             /* CLOCK_MONOTONIC when recorded */
    char peer[KVR_PEER_MAX];      /* "host:port" or "" */
    char reason[KVR_REASON_MAX];  /* full text, never empty */
} kvr_failure_t;

/* Most records kept for rooms not open here (see kvr_registry_record_early). */
#define KVR_REGISTRY_EARLY_MAX 1024

typedef struct {
    pthread_mutex_t lock;
    kvr_table_t records; /* room id -> kvr_failure_t* */
    kvr_table_t early;   /* room id -> kvr_failure_t*, rooms not open here */
    uint64_t early_ring[KVR_REGISTRY_EARLY_MAX]; /* their ids, oldest first */
    size_t early_head, early_n;
} kvr_registry_t;

void kvr_registry_init(kvr_registry_t *reg);
void kvr_registry_destroy(kvr_registry_t *reg);

/*
 * Records a failure for room unless one is already there.  Returns 1 if this
 * call's record was stored (it is the root cause), 0 if an earlier record
 * wins, -1 on ENOMEM (nothing stored).
 */
int kvr_registry_record(kvr_registry_t *reg, uint64_t room, const kvr_failure_t *f);

/*
 * Keeps a failure a peer or a sibling reported for a room that is not open
 * here (yet, or any more), for kvr_registry_pop_early when it opens.  At
 * most KVR_REGISTRY_EARLY_MAX are kept: the oldest goes first, so messages
 * about rooms that never open cannot grow memory.  First record wins.
 * Returns 1 if stored, 0 if one was there, -1 on ENOMEM.
 */
int kvr_registry_record_early(kvr_registry_t *reg, uint64_t room, const kvr_failure_t *f);

/* Takes the early record of room out; returns 1 if there was one. */
int kvr_registry_pop_early(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out);

/* Copies the record out; returns 1 if there was one, 0 otherwise. */
int kvr_registry_peek(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out);

/* Like peek, and removes the record. */
int kvr_registry_pop(kvr_registry_t *reg, uint64_t room, kvr_failure_t *out);

/* Drops the record of room, if any. */
void kvr_registry_drop(kvr_registry_t *reg, uint64_t room);

/* Number of records held (early ones included). */
size_t kvr_registry_count(kvr_registry_t *reg);

/* Fills f (code, rank, peer, printf-style reason).  Never fails. */
void kvr_failure_fill(kvr_failure_t *f, int code, int origin_rank, const char *peer,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

uint64_t kvr_now_ns(void);

#endif
