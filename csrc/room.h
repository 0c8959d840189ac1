/*
 * room: one bootstrap room's state machine and its bookkeeping, pure logic,
 * no I/O.  The engine decides when a transition is due (a message, a
 * completion, a deadline) and calls the function below that performs it;
 * what the engine itself keeps per room (its operations, the lists the room
 * is on, the failure notice, the posting cursor, the deadline heap node)
 * lives beside the room in kvr_eroom_t (engine_int.h), not here.
 *
 *   visible state (what poll() returns; sglang's KVPoll values)
 *
 *      Bootstrapping(1) --peer ready--> WaitingForInput(2)
 *            |                               |
 *            |                    data flows (decode: metadata sent;
 *            |                                prefill: first send posted)
 *            |                               v
 *            |                         Transferring(3) --all bytes--> Success(4)
 *            |                               |
 *            +-------------+-----------------+
 *                          | kvr_room_fail: failing, visible state kept
 *                          v
 *                   (failing, draining) --inflight == 0, or force-drained-->
 *                                                                 Failed(0)
 *
 *   transition                         performed by
 *   -> Bootstrapping                   kvr_room_new
 *   Bootstrapping -> WaitingForInput   kvr_room_advance (engine: peer ready,
 *                                      or the decode's request bound)
 *   -> Transferring                    kvr_room_advance (decode: request sent;
 *                                      prefill: first message posted)
 *   an operation starts / ends         kvr_room_op_started / kvr_room_op_ended
 *   Transferring -> Success            kvr_room_succeed
 *   any but Success -> failing         kvr_room_fail (first cause wins)
 *   failing -> Failed                  kvr_room_settle, once inflight == 0
 *                                      (a lead: and every leg ended)
 *   failing -> Failed, ops lingering   kvr_room_force_drain (dead peer)
 *   any -> Failed (engine closing)     kvr_room_abandon
 *
 * Invariants, per state:
 *   Bootstrapping, WaitingForInput: no operation in flight (inflight == 0);
 *     prefill: not bound to a request before WaitingForInput.
 *   Transferring: received <= expected (decode); each byte of the room is
 *     accepted at most once (kvr_room_claim).
 *   failing (any visible state but Success, failing == 1): fail_code is the
 *     first cause and never changes; no new data is accepted and no new
 *     operation posted; the room becomes visibly Failed only once its
 *     operations are done, so after poll() says Failed no byte of the room
 *     lands in local memory.
 *   Success: terminal; decode: received == expected, nothing in flight,
 *     never failing.
 *   Failed: terminal; failing, and inflight == 0 (or drained_by_force).
 *   Always: the visible state only grows, except to Failed; nothing leaves
 *   Success or Failed (no resurrection).
 *
 * Threads: the engine lock protects every field (the caller holds it),
 * except `visible`, which poll() reads without it.
 */
#ifndef KVR_ROOM_H
#define KVR_ROOM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "plan.h"

enum {
    KVR_POLL_FAILED = 0,
    KVR_POLL_BOOTSTRAPPING = 1,
    KVR_POLL_WAITING = 2,
    KVR_POLL_TRANSFERRING = 3,
    KVR_POLL_SUCCESS = 4,
};

enum { KVR_ROLE_PREFILL = 0, KVR_ROLE_DECODE = 1 };

struct kvr_peer;

typedef struct kvr_room {
    uint64_t id;            /* the bootstrap room */
    uint64_t tag;           /* unique per incarnation on this manager */
    int role;
    atomic_int visible;     /* KVR_POLL_* */
    int refs;               /* table + handle + operations in flight */
    int in_table;
    int released;           /* the Python handle is gone */
    int failing;            /* a failure was recorded for this room */
    int fail_code;
    int notified;           /* the peer was told of our failure / completion */
    int inflight;           /* transport operations outstanding */
    uint64_t failing_since_ns;
    int cancel_sent;        /* the stuck operations were asked to cancel */
    int drained_by_force;   /* declared drained although operations linger */
    uint64_t deadline_ns;   /* 0: none */
    uint64_t started_ns;
    struct kvr_peer *peer;  /* the engine's; never looked at here */
    char bootstrap_addr[128];

    /* decode */
    int init_called;
    int meta_set;
    int req_sent;
    int32_t *pages;         /* destination pages (positions -> page) */
    uint32_t npages;
    int64_t aux_index;
    int64_t states[KVR_MAX_STATES]; /* state slots (state.c), -1: none */
    kvr_slot_lists_t lists; /* of the list components (state.c) */
    uint64_t claim_lists;   /* claim bits of their rows, after the aux bits */
    uint64_t expected;      /* bytes */
    uint64_t received;
    unsigned char *claimed; /* one bit per (buffer, position) accepted (kvr_room_claim) */

    /* prefill */
    int inited;
    uint32_t total_pages;   /* announced by init() */
    int32_t *src_pages;     /* source pages given so far */
    uint32_t given;         /* pages handed over by send() */
    int64_t src_aux;
    int64_t src_states[KVR_MAX_STATES]; /* given by send(); -1: none */
    kvr_slot_lists_t src_lists;         /* given by send() */
    int bound;              /* decode's request arrived */
    int32_t *dst_pages;
    uint32_t ndst;
    int64_t dst_aux;
    int64_t dst_states[KVR_MAX_STATES];
    kvr_slot_lists_t dst_lists;
    uint64_t dst_tag;
    int done_received;
    uint64_t rejected_ns;   /* the decode refused a data message (0: never) */
    const char *rejected_why; /* UCX's text for it (static) */
    uint64_t ready_ns;      /* the last page was handed to send() (or init() of 0 pages) */

    /* both: data operations (prefill: posted; decode: data messages accepted) */
    uint64_t ops_posted;
    /* both: tokens of the request the decode already holds (its radix cache
     * prefix); decode: given to send_metadata, prefill: came with the
     * request.  Only carried: the pages exchanged cover the rest. */
    uint32_t prefix_len;
    int peer_counted;       /* counted in its decode peer's rooms (max_rooms_per_peer) */

    /* staging of device memory (both sides) */
    int stage_copies;       /* operations in a CUDA copy (never force-drained) */

    /* A room served over several links of ranks (group.c): the lead is the
     * room the caller holds, each link a leg, a room of its own.  The lead
     * shows the least advanced leg's state, Success when legs_want legs
     * succeeded, and Failed only once every leg has ended. */
    struct kvr_room *lead;  /* leg: its lead (a reference) */
    struct kvr_room **legs; /* lead: its legs (references until dropped) */
    uint32_t nlegs;
    uint32_t held;          /* lead: legs not ended yet */
    uint32_t legs_done;     /* lead: legs that succeeded */
    uint32_t legs_want;     /* lead: legs it needs to succeed */
    int leg_ended;          /* leg: counted out of its lead's held */
} kvr_room_t;

/* Allocates size bytes, zeroed, holding a room in Bootstrapping at their
 * start: the engine keeps its own fields after it (engine_int.h,
 * kvr_eroom_t).  NULL on ENOMEM. */
kvr_room_t *kvr_room_new(size_t size, uint64_t id, uint64_t tag, int role);
/* Frees the room, its page arrays and the block kvr_room_new allocated. */
void kvr_room_free(kvr_room_t *r);

/* Moves the visible state forward to `state` (never backwards, never out of
 * a terminal state).  Returns 1 if it changed. */
int kvr_room_advance(kvr_room_t *r, int state);

/* Marks the room failing with code (first cause wins); returns 1 if this was
 * the first failure. */
int kvr_room_fail(kvr_room_t *r, int code);

/* Publishes Failed if the room is failing and has drained; returns 1 if it
 * did. */
int kvr_room_settle(kvr_room_t *r);

/* An operation of the room starts (posted, or a data message accepted). */
void kvr_room_op_started(kvr_room_t *r);

/* An operation of the room ended (completed, failed or cancelled).  After a
 * force-drain the room no longer counts them. */
void kvr_room_op_ended(kvr_room_t *r);

/* Publishes Success if the room is done -- decode: kvr_room_complete;
 * prefill: the decode reported every byte landed and nothing of ours is in
 * flight.  Returns 1 if it did. */
int kvr_room_succeed(kvr_room_t *r);

/* The engine is closing: whatever is in flight will never complete.  The
 * room fails with code (unless it already ended) and becomes Failed now. */
void kvr_room_abandon(kvr_room_t *r, int code);

/* Declares a failing room drained although operations are still
 * outstanding (their peer is dead); publishes Failed.  Returns 1 if it did. */
int kvr_room_force_drain(kvr_room_t *r);

/*
 * Decode: claims the pieces of an accepted data message: positions
 * [pos, pos + npages) of KV buffers [buf, buf + nbuf) (aux: rows of aux
 * buffers [buf, buf + nbuf), npages 1), of a room of r->npages positions
 * over nkv KV and naux aux buffers.  The ranges were checked against the
 * room.  Returns KVR_CLAIM_OK, KVR_CLAIM_REPEATED if a piece was claimed
 * before (nothing is claimed: the sender repeats data), or KVR_CLAIM_NOMEM.
 * So each byte of the room is accepted at most once, whether or not earlier
 * messages have landed yet.
 */
enum { KVR_CLAIM_OK = 0, KVR_CLAIM_REPEATED = 1, KVR_CLAIM_NOMEM = 2 };
int kvr_room_claim(kvr_room_t *r, int aux, uint32_t nkv, uint32_t naux, uint32_t buf,
                   uint32_t nbuf, uint32_t pos, uint32_t npages);
/* As kvr_room_claim, for rows of a list component (state.c): list
 * positions [pos, pos + npages) of nbuf buffers, buffer i's bits from
 * `first` + i x stride, counted after the KV and aux bits (r->claim_lists
 * of them). */
int kvr_room_claim_list(kvr_room_t *r, uint32_t nkv, uint32_t naux, uint64_t first,
                        uint32_t stride, uint32_t nbuf, uint32_t pos, uint32_t npages);

/* Decode: 1 when every expected byte has landed and nothing is in flight. */
int kvr_room_complete(const kvr_room_t *r);

/* 1 if the visible state is Success or Failed. */
int kvr_room_terminal(const kvr_room_t *r);

/*
 * Length of the run starting at position pos: the largest n such that
 * src[pos+k] == src[pos]+k and dst[pos+k] == dst[pos]+k for k < n, capped at
 * end - pos.  src may be NULL (then only dst must be contiguous).
 */
uint32_t kvr_run_length(const int32_t *src, const int32_t *dst, uint32_t pos, uint32_t end);

/*
 * Checks page indices against [0, limit).  Returns -1 if all are valid, or
 * the position of the first bad one.
 */
long kvr_pages_check(const int32_t *pages, size_t n, int64_t limit);
/* The index of the second place some page appears in pages (*first gets
 * the first), -1 if every page appears once, -2 out of memory. */
long kvr_pages_repeat(const int32_t *pages, size_t n, long *first);

#endif
