/*
 * engine internals: the types and functions the files of the engine share
 * (never the binding, which sees engine.h only).
 *
 * The map, following a prefill send() down to the wire:
 *   handle.c        kvr_handle_send: pages into the room, then
 *   post.c          kvr_post_locked: may the room post, with which limits;
 *   plan.c          kvr_post_plan: which message next;
 *   post.c          kvr_post_one_locked: one message, staged or not;
 *   op.c            kvr_op_new, kvr_op_send_locked -> transport.c;
 *   stage.c         (device memory) the copy into a slot first;
 *   op.c            kvr_op_end_locked on completion;
 *   proto_prefill.c the decode's ROOM_DONE: kvr_check_prefill_done_locked;
 *   work.c          kvr_room_succeeded_locked, or kvr_room_fail_locked.
 * engine.c runs the loop that drives all of it; peer.c, sibling.c and
 * timer.c keep the connections, the siblings and the deadlines.
 *
 * Threads and locks: every function here expects the engine lock held
 * (struct kvr_engine.lock), whether or not its name ends in _locked, except
 * the transport and control callbacks (which the transport calls from the
 * progress it was given, under the lock, and which the *_entry wrappers of
 * engine.c lock for) and the few that say otherwise.  Functions that touch
 * sockets run on the engine thread only; the API calls of handle.c that run
 * under the lock on the caller's thread leave socket work on the work list.
 * None of them blocks.
 *
 * Return codes, one convention across the core (engine, transport,
 * control, wire, auth, cuda and the pure parts alike):
 *   - A function that can fail returns 0, or -1 with the cause written into
 *     err (errlen bytes) when it takes one.  Nothing else negative.
 *   - Only the API boundary answers with a KVR_E* code (engine.h: negative,
 *     it names the Python exception): the engine.h functions and the few
 *     helpers that build their answer (kvr_err writes the message and
 *     returns the code; kvr_gpu_setup).  A helper's -1 becomes a KVR_E* code
 *     once, in the caller that knows what the failure means.
 *   - More than two outcomes: a named enum, never more negative numbers
 *     (kvr_tp_send: KVR_TP_*; kvr_room_claim: KVR_CLAIM_*).
 *   - "Did it happen" and yes/no questions return 1 or 0 (kvr_room_fail:
 *     1 if this was the first failure); counts return >= 0.
 *   - Failures of a room or a peer are not returned: they are recorded
 *     (kvr_room_fail_locked, kvr_peer_fail_locked) and reported by poll().
 * Status codes of failures (KVR_BOOTSTRAP, ...) are data, in status.h.
 */
#ifndef KVR_ENGINE_INT_H
#define KVR_ENGINE_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "control.h"
#include "cuda.h"
#include "debug.h"
#include "engine.h"
#include "heap.h"
#include "peerstate.h"
#include "log.h"
#include "room.h"
#include "stateslice.h"
#include "table.h"
#include "transport.h"
#include "wire.h"

/* ------------------------------------------------------------------ */
/* Types                                                               */
/* ------------------------------------------------------------------ */

/* Peer states (peerstate.h): see the diagram in peer.c. */

#define KVR_MS ((uint64_t)1000000)
#define KVR_MAX_PENDING_PAGES (16u << 20) /* held by pending requests: 64 MiB */
#define KVR_SCAN_NS (5 * KVR_MS) /* period of the timer scans over all rooms */
#define KVR_BUSY_POLL_NS (100 * 1000) /* socket polls of a busy engine loop */
#define KVR_TCP_RUN_BYTES (64u << 10)  /* auto coalesce_run_bytes over tcp */
/* Decode: the longest its rooms wait for a tcp lane's handshake before the
 * data goes through UCX instead (lane.h); at most half the heartbeat
 * timeout (no PING goes meanwhile). */
#define KVR_LANE_WAIT_MS 1000u
/* Prefill: the most bytes one send() call (and one engine pass) writes to
 * tcp lanes itself; the rest of its messages wait in the lanes' queues for
 * the engine thread, so that a large room does not hold the scheduler's
 * thread (and the engine lock) for as long as its transfer takes.  A room
 * up to this size leaves without the engine thread: at 1 MiB, rooms of
 * 4 MiB between two processes had a p90 of 7-11 ms in 4 of 6 runs,
 * against 2 ms written whole (benchmarks/README.md). */
#define KVR_LANE_INLINE_BYTES (8u << 20)
#define KVR_SHM_EAGER_ROOM_BYTES (512u << 10) /* rooms sent as eager messages over shm */
/* Default cross_memory_bytes: messages of 1 MiB and more over shared memory
 * go as cross-memory reads (cma.c), one kernel copy against two through the
 * FIFO (1, 16 MiB runs: 1.32x, 1.77x the FIFO, 1.00x, 1.14x NIXL; a 4 MiB
 * threshold left 1 MiB runs on the FIFO at 0.75x NIXL; benchmarks/README.md). */
#define KVR_CMA_DEFAULT_BYTES (1u << 20)
/* Default cross_memory_readers: the handling thread and one helper read
 * (readers.h; benchmarks/README.md). */
#define KVR_CMA_DEFAULT_READERS 2u
#define KVR_POLL_PROGRESS_NS (10 * 1000) /* poll(): at most one UCX progress per */
#define KVR_STAGE_NAP_NS (10 * 1000)  /* between polls of staging copies */
/* A busy engine thread waits this long at most, between two passes, for
 * the threads blocked on the engine lock to take it (engine.c). */
#define KVR_LOCK_HANDOFF_NS (200 * 1000)
#define KVR_EP_ERR_GRACE_NS (100 * KVR_MS) /* an endpoint error waits for a BYE (peer.c) */

typedef struct kvr_peer {
    int kind;
    int state;
    uint64_t epoch;             /* remote instance epoch; 0 before known */
    int remote_rank;
    char key[192];              /* decode: bootstrap addr and suffixes; prefill: routing id */
    char name[160];             /* "host:port" for reasons and logs */
    kvr_ctl_conn_t *bs_conn;    /* decode: to the bootstrap server */
    kvr_ctl_conn_t *conn;       /* decode: to the prefill's ROUTER */
    char conn_ep[KVR_WIRE_MAX_STR + 1]; /* decode: the ROUTER's endpoint */
    unsigned char ident[KVR_IDENT_MAX];
    size_t ident_len;           /* prefill: the decode's routing id */
    kvr_tp_worker_t *worker;    /* our UCX worker for this peer (see transport.h) */
    kvr_tp_ep_t *ep;            /* endpoint from it to the peer's worker */
    kvr_ctl_conn_t *vconn;      /* decode: re-checking the bootstrap registration */
    int verifying;
    uint64_t verified_ns;
    uint64_t verify_deadline_ns;
    void *worker_addr;          /* prefill: the decode's worker address */
    size_t worker_addr_len;
    uint64_t last_heard_ns;
    uint64_t last_data_ns;      /* a data operation with this peer completed */
    uint64_t next_ping_ns;
    uint64_t next_try_ns;
    uint64_t resolve_deadline_ns;
    uint32_t nrooms;            /* prefill: requests of this decode pending or bound */
    int ep_err;                 /* its endpoint failed; the engine thread fails it */
    kvr_tp_ep_t *ep_err_ep;     /* that endpoint */
    uint64_t ep_err_ns;         /* when */
    char ep_err_text[128];
    /* Head layouts (group.c): which rows of our pages and of the peer's
     * the link carries; heads 0: whole pages, rank to rank. */
    kvr_slice_t slice, peer_slice;
    /* What the link carries of the state rows (state.c, stateslice.h). */
    kvr_state_link_t slink;
    int query_rank;             /* decode: the prefill rank asked for (-1: ours) */
    uint32_t query_dp;          /* decode: the prefill DP group asked in */
    uint32_t want_tp;           /* decode: the prefill TP size rooms asked for (0: none) */
    uint32_t links;             /* prefill: decode ranks a room of ours goes to */
    /* Layers (group.c): the peer's, from its HELLO or HELLO_OK; decode:
     * the PP stage asked for (-1: no PP room) and the PP size rooms asked
     * for (0: none). */
    kvr_layers_t layers;
    int query_pp;
    uint32_t want_pp;
    /* Cross-memory reads (cma.c): prefill: the decode takes descriptors;
     * decode: we read from pid cma_pid; cma_refused: our probe failed,
     * offer no more. */
    int cma, cma_refused;
    uint32_t cma_pid;
    /* Decode: connecting, its tcp lane (lane.h) in its handshake until
     * lane_wait_until_ns: the rooms wait, so that the first goes over it. */
    int lane_wait;
    uint64_t lane_wait_until_ns;
    struct kvr_peer *next;      /* e->peers */
    struct kvr_peer *hnext;     /* same hash of (kind, key) in e->peer_index */
} kvr_peer_t;

/* Every change of a peer's state goes through here. */
static inline void kvr_peer_set_state(kvr_peer_t *p, int state)
{
    KVR_ASSERT(kvr_peer_state_legal(p->kind, p->state, state));
    p->state = state;
}

/* A pinned host buffer that device memory is staged through. */
typedef struct kvr_slot {
    char *buf;
    struct kvr_slot *next;
} kvr_slot_t;

/* Where a staged operation is (kvr_op_t.stage). */
enum {
    KVR_STAGE_NONE = 0, /* not staged: UCX reads/writes the pieces themselves */
    KVR_STAGE_D2H = 1,  /* prefill: device pieces -> slot copy in flight */
    KVR_STAGE_XFER = 2, /* the slot is with UCX (send or receive) */
    KVR_STAGE_H2D = 3,  /* decode: slot -> device pieces copy in flight */
    KVR_STAGE_READ = 4, /* decode: a reader thread reads the pieces (cma.c) */
};

typedef struct kvr_op {
    kvr_tp_op_t base; /* first: the transport hands this pointer back */
    kvr_room_t *room;
    uint64_t len;
    struct kvr_op *prev, *next; /* the room's operations in flight */
    /* staging (device memory without UCX support for it) */
    int stage;                  /* KVR_STAGE_* */
    int mixed;                  /* decode: pieces of several buffers, host or device */
    kvr_slot_t *slot;           /* the pinned slot, or */
    void *bounce;               /* a heap buffer (decode, no slot fit) */
    void *event;                /* recorded after the copy */
    struct kvr_op *stage_next;  /* the engine's FIFO of copies in flight */
    kvr_tp_iov_t siov;          /* the contiguous staging piece UCX sees */
    /* UCX 1.13 reads an AM header until the send completes: it lives here. */
    unsigned char hdr[KVR_AM_HEADER_LEN];
    uint32_t niov;
    /* The pieces of the message: the sender's source runs, or the
     * receiver's destination runs (UCX reads them until completion). */
    kvr_tp_iov_t iov[];
} kvr_op_t;

/*
 * The engine's room: the pure room (room.h) first, then what the engine
 * keeps about it.  Every kvr_room_t the engine handles is the start of one
 * (kvr_room_new(sizeof(kvr_eroom_t), ...)); kvr_eroom() gets it back.
 */
typedef struct kvr_eroom {
    kvr_room_t room;        /* first */
    kvr_engine_t *owner;
    kvr_op_t *ops;          /* operations in flight, linked through prev/next */
    kvr_failure_t *notice;  /* failure to tell the peer, sent by the engine thread */
    kvr_plan_cursor_t post; /* prefill: how far posting got (plan.h) */
    uint32_t leg_heads;     /* decode leg: heads it reads (group.c) */
    uint32_t leg_stage;     /* decode leg: the prefill PP stage it reads */
    uint32_t pp_stages;     /* decode lead: prefill PP stages (0: not a PP room) */
    int layers_checked;     /* decode lead: the stages' layers cover ours */
    uint64_t lease;         /* prefill: the decode's tag while it may read our pages (cma.c) */
    int done_pending;       /* decode: ROOM_DONE for the engine thread to send */
    /* the lists the room is on; each holds a reference (kvr_room_list_push) */
    struct kvr_room *work_next; /* the work list (work.c) */
    int on_work;
    struct kvr_room *slot_next; /* rooms waiting for a staging slot (stage.c) */
    int slot_waiting;
    struct kvr_room *drain_next; /* failing rooms with operations in flight (timer.c) */
    int draining;
    /* in e->deadlines while it has a deadline or a rejection to time out
     * and is an open room (timer.c); no reference */
    kvr_heap_node_t timer;
} kvr_eroom_t;

static inline kvr_eroom_t *kvr_eroom(kvr_room_t *r)
{
    return (kvr_eroom_t *)r;
}

/* Sockets, endpoints or workers to close outside callbacks
 * (kvr_reap_locked); grows as needed. */
typedef struct {
    void **v;
    size_t n, cap;
} kvr_deadlist_t;

/* A decode request that reached the prefill before its KVSender. */
typedef struct kvr_pending {
    kvr_peer_t *peer;
    uint64_t tag;
    int64_t aux_index;
    int64_t states[KVR_MAX_STATES];
    kvr_slot_lists_t lists; /* of the list components (state.c) */
    uint32_t npages;
    int32_t *pages;
    uint32_t prefix_len;
    uint64_t arrived_ns;
    /* Head layouts (group.c): the requests of other decode ranks for the
     * same room, each a leg to come. */
    struct kvr_pending *next;
} kvr_pending_t;

/* Rate limit of one kind of WARNING. */
typedef struct {
    uint64_t last_ns;
    uint64_t held;
} kvr_ratelog_t;

/* Who answers at a configured sibling endpoint (its PONG on the
 * connection we opened there): a SIB_FAIL is taken only from that
 * instance.  One per e->sib_conns[i]. */
typedef struct {
    uint64_t epoch; /* 0: not answered yet */
    uint32_t rank;
    int answered;   /* since the last round of PINGs */
} kvr_sib_id_t;

/* A SIB_FAIL from an instance not known as a sibling yet, held until the
 * siblings answered (a sibling's first message may beat its PONG). */
typedef struct kvr_sib_held {
    uint64_t room;
    uint64_t epoch;
    unsigned char ident[KVR_IDENT_MAX];
    size_t ident_len;
    uint64_t arrived_ns;
    kvr_failure_t f;
    struct kvr_sib_held *next;
} kvr_sib_held_t;

/* A root cause waiting to be published to the siblings. */
typedef struct kvr_sib_out {
    uint64_t room;
    kvr_failure_t f;
    struct kvr_sib_out *next;
} kvr_sib_out_t;

struct kvr_engine {
    int mode;
    int rank;
    uint32_t dp_rank;    /* prefill: the DP group registered with the rank */
    uint64_t epoch;
    kvr_config_t cfg;
    char host[128];
    char bootstrap_addr[128];
    uint32_t page_size;
    kvr_heads_t heads;   /* this rank's head layout (heads 0: none given) */
    kvr_layers_t layers; /* the layers of its KV buffers (plan.h) */
    uint32_t nkv, naux;
    uint64_t *kv_ptrs, *kv_lens, *kv_item;
    uint64_t kv_item_max; /* the widest KV item */
    uint64_t *aux_ptrs, *aux_lens, *aux_item;
    uint64_t aux_item_max; /* the widest aux item */
    int64_t min_pages;   /* pages every KV buffer has */
    int64_t aux_rows;    /* rows every aux buffer has */
    uint64_t page_bytes; /* sum of kv item lengths */
    uint64_t aux_bytes;  /* sum of aux item lengths */
    unsigned char *layout_kv; /* little-endian copies for the wire */
    unsigned char *layout_aux;
    /* State buffers (state.c): the last nstate of the naux row buffers
     * above (aux_rows and aux_bytes count the aux buffers before them). */
    uint32_t nstate, nstates;           /* buffers, components */
    uint32_t *state_comp;               /* component of each state buffer */
    int64_t state_rows[KVR_MAX_STATES]; /* slots every buffer of a component has */
    uint64_t state_bytes[KVR_MAX_STATES]; /* sum of its item lengths */
    uint32_t state_list;                /* bit c: component c takes a list of slots */
    /* Their slicing over TP ranks (stateslice.h), when given: the flat
     * rules, each buffer's offset in them, 1 per replicated buffer, and
     * the most pieces a row of one buffer is cut into. */
    uint32_t nstate_rules;
    uint32_t *state_rules, *state_rule_at;
    unsigned char *state_replicated;
    uint32_t state_pieces_max;

    pthread_mutex_t lock;   /* kvr_engine_lock / kvr_engine_unlock */
    atomic_int lock_waiters; /* threads blocked in kvr_engine_lock */
#ifdef KVRECV_DEBUG
    pthread_t lock_owner;   /* for KVR_ASSERT_LOCKED */
    int lock_held;
#endif
    pthread_t thread;
    int thread_started;
    int wake_fd;
    int stopping;
    int closed;

    kvr_registry_t registry;
    kvr_transport_t *tp;
    kvr_ctl_t *ctl;
    kvr_table_t rooms;   /* id -> room (open rooms) */
    kvr_table_t tags;    /* tag -> room (rooms alive, for data lookup) */
    kvr_table_t pending; /* room id -> kvr_pending_t* (prefill) */
    uint64_t pending_pages; /* pages the pending requests hold */
    kvr_room_t *work_head;
    kvr_room_t *draining;   /* failing rooms with operations in flight */
    kvr_heap_t deadlines;   /* open rooms by their next deadline (timer.c) */
    kvr_peer_t *peers;
    kvr_table_t peer_index; /* hash of (kind, key) -> peers with it, through hnext */
    /* decode: poll() progressing UCX from the caller's thread */
    int off_thread;               /* set while it does (under the lock) */
    int ep_err_pending;           /* a peer has ep_err set (kvr_ep_errors_locked) */
    _Atomic uint64_t poll_progress_ns; /* when it last did */

    /* prefill registration with the bootstrap server */
    kvr_ctl_conn_t *bs_conn;
    int registered;
    uint64_t next_register_ns;

    /* sibling ranks of this instance */
    char **sib_eps;
    int nsib;
    int sib_dirty;
    kvr_ctl_conn_t **sib_conns;
    kvr_sib_id_t *sib_ids;  /* who answered on each */
    int nsib_conns;
    uint64_t sib_ping_ns;   /* the last round of PINGs to them */
    kvr_sib_held_t *sib_held; /* oldest first */
    int nsib_held;
    kvr_sib_out_t *sib_out; /* failures to publish */
    int sib_pending;

    /* closed outside callbacks by kvr_reap_locked */
    kvr_deadlist_t dead_conns;   /* kvr_ctl_conn_t */
    kvr_deadlist_t dead_eps;     /* kvr_tp_ep_t */
    kvr_deadlist_t dead_workers; /* kvr_tp_worker_t, destroyed after dead_eps are closed */

    kvr_log_t log;
    uint64_t next_scan_ns; /* next timer scan over the rooms */
    uint64_t drop_log_ns;  /* last time dropped messages were logged */
    uint64_t drop_log_n;   /* dropped since then */
    kvr_ratelog_t auth_log;    /* refused by authentication */
    kvr_ratelog_t size_log;    /* oversized */
    kvr_ratelog_t data_log;    /* foreign data messages */
    kvr_ratelog_t refuse_log;  /* refused requests */
    kvr_ratelog_t sib_log;     /* SIB_FAIL from no sibling */
    char reg_auth_error[KVR_WIRE_MAX_STR + 1]; /* prefill: why the bootstrap server refused us */

    uint64_t tag_pool[64]; /* random room tags, drawn in batches */
    int tag_pool_n;

    kvr_wbuf_t wbuf;
    struct kvr_readers *readers; /* decode: threads for its cross-memory reads (readers.h) */
    kvr_stats_t stats; /* counters (room gauges are computed on demand) */

    /* device memory */
    uint8_t *kv_dev, *aux_dev; /* 1: the buffer is device memory */
    uint32_t ndev;             /* how many are */
    int cuda_device;           /* the device they live on */
    int gpu_path;              /* KVR_GPU_* */
    char gpu_why[320];
    void *stream;              /* staging copies, in order */
    char *pool;                /* pinned slots, staging_slot_bytes each */
    uint32_t nslots;
    kvr_slot_t *slots, *slot_free;
    void **events;             /* free events */
    uint32_t nevents, events_cap;
    kvr_op_t *stage_head, *stage_tail; /* copies in flight, in stream order */
    kvr_room_t *slot_waiters;  /* prefill rooms waiting for a free slot */

    int test_corrupt;          /* KVR_TEST_CORRUPT_*: tests only (testhook.h) */
    uint64_t test_forge_tag;   /* tests only: kvr_engine_test_forge */
    uint64_t test_forge_epoch;

    /* Copied at creation: readable without the lock while close() frees
     * the transport and the control layer. */
    char endpoint[128];
    char transport[256];
};

/* ------------------------------------------------------------------ */
/* engine.c: helpers                                                   */
/* ------------------------------------------------------------------ */
/*
 * Logs a WARNING at most once a second per kind; the lines held back in
 * between are counted and reported with the next one.
 */
void kvr_warn_limited(kvr_engine_t *e, kvr_ratelog_t *rl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
uint64_t kvr_new_tag_locked(kvr_engine_t *e);
int kvr_err(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void kvr_wake(kvr_engine_t *e);
/* The engine lock.  Debug builds remember its holder: KVR_ASSERT_LOCKED(e)
 * at the entry of a _locked function checks the caller holds it. */
void kvr_engine_lock(kvr_engine_t *e);
void kvr_engine_unlock(kvr_engine_t *e);
/* 0 if it took the lock, -1 if the lock is held elsewhere. */
int kvr_engine_trylock(kvr_engine_t *e);
#ifdef KVRECV_DEBUG
#define KVR_ASSERT_LOCKED(e) \
    KVR_ASSERT((e)->lock_held && pthread_equal((e)->lock_owner, pthread_self()))
#else
#define KVR_ASSERT_LOCKED(e) ((void)(e))
#endif
/* Our routing id on the peers' and siblings' ROUTERs: epoch, then rank. */
#define KVR_ENGINE_IDENT_LEN 12
void kvr_engine_ident(const kvr_engine_t *e, unsigned char ident[KVR_ENGINE_IDENT_LEN]);
/* Room deadlines (the one formula): start + deadline_base_ms + the time
 * bytes take at deadline_floor_bps; kvr_floor_ns is that last term. */
uint64_t kvr_deadline_ns(const kvr_engine_t *e, uint64_t start_ns, uint64_t bytes);
uint64_t kvr_floor_ns(const kvr_engine_t *e, uint64_t bytes);
const char *kvr_side(const kvr_engine_t *e);

/* ------------------------------------------------------------------ */
/* work.c: references, the work list, failing and succeeding           */
/* ------------------------------------------------------------------ */
/* Rooms are freed when the last reference goes (table, handle, operations,
 * the work list, the slot-wait list).  Any thread, lock held. */
void kvr_room_ref(kvr_room_t *r);
void kvr_room_unref_locked(kvr_engine_t *e, kvr_room_t *r);
/* Frees the room and what the engine kept with it; its references are gone. */
void kvr_eroom_free(kvr_room_t *r);
void kvr_work_push_locked(kvr_engine_t *e, kvr_room_t *r);
/* Takes r off the work list if it is its head (an API call did its work
 * already); 1 if it did. */
int kvr_work_drop_head_locked(kvr_engine_t *e, kvr_room_t *r);
/* Puts r at the head of the list *head, linked through *next, unless *on
 * says it is there already; the list holds a reference to each room. */
void kvr_room_list_push(kvr_room_t **head, kvr_room_t *r, int *on, kvr_room_t **next);
int kvr_room_fail_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_failure_t *f,
                         int notify);
int kvr_room_failf_locked(kvr_engine_t *e, kvr_room_t *r, int code, int notify,
                                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));
void kvr_room_succeeded_locked(kvr_engine_t *e, kvr_room_t *r);
void kvr_failure_from_msg(kvr_failure_t *f, const kvr_msg_t *m, const char *peer);
void kvr_service_peer_rooms_locked(kvr_engine_t *e, kvr_peer_t *p);
void kvr_drain_work_locked(kvr_engine_t *e);

/* ------------------------------------------------------------------ */
/* peer.c                                                              */
/* ------------------------------------------------------------------ */
/* Encode m with our epoch and send it to peer p (its connection, or our
 * ROUTER for a decode peer); a lost message is covered by heartbeats and
 * deadlines.  Engine thread. */
void kvr_send_ctrl_to_peer(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m);
void kvr_send_conn_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, const kvr_msg_t *m);
void kvr_fill_layout(kvr_engine_t *e, kvr_wire_layout_t *l);
int kvr_layout_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n);
/* The peer of that kind and key, or NULL: a lookup in e->peer_index, which
 * follows every peer's key (kvr_peer_new, kvr_peer_rekey). */
kvr_peer_t *kvr_peer_find(kvr_engine_t *e, int kind, const char *key);
kvr_peer_t *kvr_peer_new(kvr_engine_t *e, int kind, const char *key);
/* Decode: the peer for prefill rank `rank` (-1: ours) of DP group dp, PP
 * stage pp (-1: a room that names no PP stage; asks for stage 0), at the
 * bootstrap server addr, made (to be resolved by the engine thread) if
 * new; NULL if memory ran out. */
kvr_peer_t *kvr_prefill_peer_get(kvr_engine_t *e, const char *addr, uint32_t dp, int rank,
                                 int pp);
/* Gives peer p a new key (a recycled decode peer); -1 if memory ran out
 * (p then has no key and is found by no lookup). */
int kvr_peer_rekey(kvr_engine_t *e, kvr_peer_t *p, const char *key);
void kvr_peer_disconnect(kvr_engine_t *e, kvr_peer_t *p);
/* Retires only p's connection to the prefill's ROUTER (kvr_reap_locked
 * closes it); p->conn is NULL after, unless the dead list is full. */
void kvr_peer_retire_conn(kvr_engine_t *e, kvr_peer_t *p);
int kvr_peer_worker(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen);
void kvr_reap_locked(kvr_engine_t *e);
/* Frees the dead lists themselves (kvr_engine_free, after the last reap). */
void kvr_dead_free(kvr_engine_t *e);
void kvr_tell_room_failed(kvr_engine_t *e, kvr_peer_t *p, kvr_room_t *r, int code);
void kvr_peer_fail_locked(kvr_engine_t *e, kvr_peer_t *p, int code, const char *what);
uint64_t kvr_peer_silence_limit_ns(const kvr_engine_t *e, const kvr_peer_t *p);
int kvr_peer_silent(const kvr_engine_t *e, const kvr_peer_t *p, uint64_t now);
int kvr_peers_silent_locked(const kvr_engine_t *e, uint64_t now);
int kvr_peer_resolve(kvr_engine_t *e, kvr_peer_t *p, char *err, size_t errlen);
void kvr_bs_query(kvr_engine_t *e, const kvr_peer_t *p, kvr_ctl_conn_t *conn);
void kvr_peer_hello(kvr_engine_t *e, kvr_peer_t *p);
void kvr_peer_verify_locked(kvr_engine_t *e, kvr_peer_t *p);
void kvr_peer_verified_locked(kvr_engine_t *e, kvr_peer_t *p, int found, uint64_t epoch);
void kvr_on_ep_error(void *arg, void *ep_ctx, kvr_tp_ep_t *ep, const char *status_text);
void kvr_ep_errors_locked(kvr_engine_t *e);

/* ------------------------------------------------------------------ */
/* sibling.c: engine thread                                            */
/* ------------------------------------------------------------------ */
void kvr_siblings_locked(kvr_engine_t *e);
/* A SIB_FAIL on our ROUTER from routing id ident. */
void kvr_on_sib_fail_locked(kvr_engine_t *e, const void *ident, size_t ident_len,
                            const kvr_msg_t *m);
/* 1 if conn is one of our connections to the siblings; the message on it
 * is then handled. */
int kvr_on_sib_conn_msg_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, const kvr_msg_t *m);
/* Frees what the engine keeps about its siblings (kvr_engine_free). */
void kvr_siblings_free(kvr_engine_t *e);

/* ------------------------------------------------------------------ */
/* op.c: operations in flight                                          */
/* ------------------------------------------------------------------ */
/* kvr_on_recv_done / kvr_on_send_done are the transport's completion
 * callbacks: they run inside kvr_tp_progress, under the lock, on the
 * engine thread or (decode) poll()'s caller. */
kvr_op_t *kvr_op_new(kvr_room_t *r, uint64_t len, uint32_t niov);
void kvr_op_end_locked(kvr_engine_t *e, kvr_op_t *op, int failed, const char *status_text);
void kvr_on_recv_done(void *arg, kvr_tp_op_t *tp_op, size_t len, int failed,
                      const char *status_text);
void kvr_on_send_done(void *arg, kvr_tp_op_t *op, int failed, const char *status_text);
uint32_t kvr_msg_pieces(const kvr_engine_t *e, const kvr_am_header_t *h,
                        const int32_t *pages, int64_t aux, const int64_t *states,
                        const kvr_slot_lists_t *lists, const kvr_slice_t *s,
                        const kvr_state_link_t *sl, kvr_tp_iov_t *out, uint64_t *bytes);
void kvr_op_send_locked(kvr_engine_t *e, kvr_room_t *r, kvr_op_t *op,
                        const kvr_tp_iov_t *iov, uint32_t niov, int host);

/* ------------------------------------------------------------------ */
/* stage.c: device memory                                              */
/* ------------------------------------------------------------------ */
/* kvr_gpu_setup runs in kvr_engine_create before the thread starts (no
 * lock needed), kvr_gpu_free in kvr_engine_free after it stopped. */
kvr_slot_t *kvr_slot_get(kvr_engine_t *e);
void kvr_slot_put(kvr_engine_t *e, kvr_slot_t *s);
void kvr_slot_wait(kvr_engine_t *e, kvr_room_t *r);
void kvr_op_unstage(kvr_engine_t *e, kvr_op_t *op);
int kvr_stage_copy_locked(kvr_engine_t *e, kvr_op_t *op, int d2h, char *err,
                          size_t errlen);
unsigned kvr_stage_poll_locked(kvr_engine_t *e);
void kvr_stage_finish_locked(kvr_engine_t *e);
int kvr_gpu_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen);
void kvr_gpu_free(kvr_engine_t *e);

/* ------------------------------------------------------------------ */
/* proto_prefill.c: messages on our ROUTER; engine thread              */
/* ------------------------------------------------------------------ */
void kvr_rejected_fail_locked(kvr_engine_t *e, kvr_room_t *r);
void kvr_check_prefill_done_locked(kvr_engine_t *e, kvr_room_t *r);
void kvr_bind_request_locked(kvr_engine_t *e, kvr_room_t *r, kvr_peer_t *p, uint64_t tag,
                             int64_t aux_index, const int64_t *states,
                             kvr_slot_lists_t *lists, uint32_t npages, int32_t *pages);
void kvr_pending_free(kvr_engine_t *e, kvr_pending_t *pd);
/* Prefill: decode p failed with code: the rooms it asked for whose sender
 * is not created yet fail with that cause when it is (kvr_handle_open). */
void kvr_pending_peer_failed_locked(kvr_engine_t *e, const kvr_peer_t *p, int code,
                                    const char *what);
/* A message from peer p (a decode on our ROUTER, or the prefill on our
 * connection) that either side may get: ROOM_FAIL, BYE; anything else is
 * counted as dropped.  The dispatchers of both sides end here. */
void kvr_on_peer_msg_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m);
void kvr_drop_locked(kvr_engine_t *e, size_t len, const char *why);
void kvr_on_refused(kvr_engine_t *e, int kind, kvr_ctl_conn_t *conn, void *conn_ctx,
                    const void *ident, size_t ident_len, const char *from, size_t len,
                    const char *why);
void kvr_on_router_msg(void *arg, const void *ident, size_t ident_len, const void *data,
                       size_t len);
void kvr_register_tick_locked(kvr_engine_t *e, uint64_t now);

/* ------------------------------------------------------------------ */
/* proto_decode.c: messages on our connections, data arriving          */
/* ------------------------------------------------------------------ */
/* kvr_on_data is the transport's data callback (under the lock, inside
 * kvr_tp_progress): it accepts a message into the room's pages, or rejects
 * it. */
void kvr_send_done_locked(kvr_engine_t *e, kvr_room_t *r);
void kvr_on_data(void *arg, kvr_tp_worker_t *w, const void *hdr, size_t hdr_len, size_t len,
                 int rndv, kvr_tp_accept_t *acc);
void kvr_decode_send_req_locked(kvr_engine_t *e, kvr_room_t *r);
/* Decode: (re)connects to prefill peer p's ROUTER at p->conn_ep and says
 * HELLO; a HELLO unanswered for heartbeat_timeout_ms is said again on a
 * fresh connection (timer.c). */
void kvr_decode_hello_locked(kvr_engine_t *e, kvr_peer_t *p);
/* Decode: p's tcp lane came up, failed, or was waited for long enough
 * (timer.c): the peer is ready, with or without it. */
void kvr_decode_lane_settled_locked(kvr_engine_t *e, kvr_peer_t *p, uint64_t now);
void kvr_on_conn_msg(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx, const void *data,
                     size_t len);

/* ------------------------------------------------------------------ */
/* group.c: head layouts, links and the legs of a room                 */
/* ------------------------------------------------------------------ */
/* Checks a head layout at creation (no engine yet). */
/* state.c: per-request state buffers (any thread; engine description
 * only).  Setup at creation (ValueError text); the row of row buffer b
 * (aux, then state) for aux row `aux` and per-component slots `states`
 * (-1: none); the bytes of the rows asked for (a list component's: its
 * list's); slots copied (the rest
 * -1); 1 if any slot is asked for. */
int kvr_state_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen);
int64_t kvr_state_row(const kvr_engine_t *e, uint32_t b, int64_t aux, const int64_t *states);
uint64_t kvr_state_bytes(const kvr_engine_t *e, int64_t aux, const int64_t *states,
                         const kvr_slot_lists_t *lists);
void kvr_state_copy(int64_t *dst, const int64_t *src, uint32_t n);
int kvr_state_any(const int64_t *states);
/* List components (state.c).  kvr_state_take: a caller's state_indices
 * (states, n entries, and those given as lists) checked against the
 * registration, into a room's slots (out: list components 0 when their
 * list is not empty, else -1) and lists (allocated; NULL slots when
 * none).  kvr_state_list_of: the list component of row buffer b, or -1.
 * kvr_state_lists_copy: a deep copy (0, or -1 out of memory);
 * kvr_state_lists_free.  kvr_state_list_bit: the first claim bit of row
 * buffer b of a list component, counted from the first after the aux
 * bits; with b == naux, all of them. */
int kvr_state_take(const kvr_engine_t *e, const int64_t *states, uint32_t n,
                   const kvr_state_in_t *in, int64_t *out, kvr_slot_lists_t *lists, char *err,
                   size_t errlen);
int kvr_state_list_of(const kvr_engine_t *e, uint32_t b);
int kvr_state_lists_copy(kvr_slot_lists_t *dst, const kvr_slot_lists_t *src);
void kvr_state_lists_free(kvr_slot_lists_t *l);
uint64_t kvr_state_list_bit(const kvr_engine_t *e, const kvr_slot_lists_t *l, uint32_t b);
/* State rows across TP sizes (stateslice.h).  kvr_state_link_set: peer
 * p's link from the prefill's and the decode's head layouts ph, dh and
 * the peer's layout l; -1 with why (LAYOUT_MISMATCH) when the state
 * buffers cannot move between them.  kvr_room_state_link: room r's link
 * when it moves rows in chunks, else NULL (whole rows).  The bytes of the
 * rows asked for that link sl carries; 1 if it carries nothing of state
 * buffer i; the pieces of row `row` of state buffer i it carries, written
 * to out unless NULL, their count returned and their bytes added to
 * *bytes. */
int kvr_state_link_set(kvr_engine_t *e, kvr_peer_t *p, const kvr_wire_layout_t *l,
                       const kvr_heads_t *ph, const kvr_heads_t *dh, char *why, size_t n);
const kvr_state_link_t *kvr_room_state_link(const kvr_room_t *r);
uint64_t kvr_state_link_bytes(const kvr_engine_t *e, const kvr_state_link_t *sl, int64_t aux,
                              const int64_t *states, const kvr_slot_lists_t *lists);
int kvr_state_skip(const kvr_engine_t *e, const kvr_state_link_t *sl, uint32_t i);
uint32_t kvr_state_pieces(const kvr_engine_t *e, const kvr_state_link_t *sl, uint32_t i,
                          int64_t row, kvr_tp_iov_t *out, uint64_t *bytes);

int kvr_heads_params_check(const kvr_engine_params_t *p, char *err, size_t errlen);
/* A peer's layers as its layout l says (one stage, all layers, when it
 * gave none). */
kvr_layers_t kvr_wire_layers(const kvr_wire_layout_t *l);
/* Compares the KV buffers of a peer's layout with ours, each prefill
 * buffer with the decode buffer it lands in (layers compatible), by head
 * layouts where both gave one, else equal item lengths: 0, or -1 with the
 * difference naming both sides' numbers. */
int kvr_layout_kv_diff(kvr_engine_t *e, const kvr_wire_layout_t *l, char *why, size_t n);
/* Sets peer p's slices from its layout l (its HELLO or HELLO_OK); -1 with
 * why if our ranks have no link that one room can use. */
int kvr_peer_link(kvr_engine_t *e, kvr_peer_t *p, const kvr_wire_layout_t *l, char *why,
                  size_t n);
/* Room r's slice of its own pages (peer_side 0) or its peer's (1); NULL
 * for whole pages. */
const kvr_slice_t *kvr_room_slice(const kvr_room_t *r, int peer_side);
/* Decode: room h reads from prefill_tp prefill ranks (0: the rank of our
 * number, whole pages) of each of prefill_pp PP stages (0: a room that
 * names no PP stage) of DP group prefill_dp: one leg per link and stage. */
int kvr_group_open_locked(kvr_engine_t *e, kvr_room_t *h, uint32_t prefill_dp,
                          uint32_t prefill_tp, uint32_t prefill_pp, char *err, size_t errlen);
/* Decode: the bytes leg r reads (its pages of its stage's buffers, its
 * rows). */
uint64_t kvr_group_leg_bytes(const kvr_engine_t *e, const kvr_room_t *r);
/* Decode: 1 if leg r may send its request: not a PP room, or every
 * stage's layers are known and cover ours (checked once; a room whose
 * stages do not fails with LAYOUT_MISMATCH). */
int kvr_group_may_request_locked(kvr_engine_t *e, kvr_room_t *r);
/* Decode: h's pages and aux row, handed to its legs; -1 out of memory. */
int kvr_group_meta_locked(kvr_engine_t *e, kvr_room_t *h);
/* Room r (a lead or a leg) failed with f: its lead and legs fail with it. */
void kvr_group_fail_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_failure_t *f);
/* The lead h leaves the table: its references to its legs go. */
void kvr_group_drop_locked(kvr_engine_t *e, kvr_room_t *h);
/* Prefill: the leg of lead h that decode peer p's request (tag) binds,
 * made now; NULL if p has one already (p is told) or out of memory. */
kvr_room_t *kvr_group_leg_locked(kvr_engine_t *e, kvr_room_t *h, kvr_peer_t *p, uint64_t tag);
/* Prefill: what init() and send() gave lead h, handed to its legs. */
void kvr_group_sync_locked(kvr_engine_t *e, kvr_room_t *h);
/* Room id's room that peer p's messages are about: the room, or its leg
 * bound to p. */
kvr_room_t *kvr_group_room_for_peer(kvr_engine_t *e, uint64_t id, const kvr_peer_t *p);

/* ------------------------------------------------------------------ */
/* cma.c: cross-memory reads on one host                               */
/* ------------------------------------------------------------------ */
/* Decode: fills HELLO m's offer to peer p. */
void kvr_cma_offer(kvr_engine_t *e, const kvr_peer_t *p, kvr_msg_t *m);
/* Prefill: takes decode p's offer in its HELLO or not; fills HELLO_OK ok. */
void kvr_cma_accept(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *hello, kvr_msg_t *ok);
/* Decode: checks prefill p's HELLO_OK offer by reading its epoch; -1 if
 * the read failed (p will be offered nothing: say HELLO again). */
int kvr_cma_probe(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *ok);
/* Prefill: 1 if op (niov source pieces, header *wire) goes as a read
 * descriptor: its iov and *wire are rewritten for that. */
int kvr_cma_post_locked(kvr_engine_t *e, kvr_room_t *r, kvr_op_t *op, kvr_am_header_t *wire,
                        uint32_t niov);
/* Prefill: room r's pages are no longer its own to be read. */
void kvr_cma_lease_end(kvr_room_t *r);
/* Decode: read descriptor h (checked as data by kvr_on_data; want bytes
 * in the room's pages) with payload desc of len bytes: reads it, or fails
 * the room.  Returns why it is a protocol error, or NULL. */
const char *kvr_cma_read_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_am_header_t *h,
                                const kvr_slice_t *s, uint64_t want, const void *desc,
                                size_t len);
/* Decode: ends the ops of the reads the helper threads finished; how many. */
unsigned kvr_cma_poll_locked(kvr_engine_t *e);
/* Decode: whether a reader thread is reading into r's pages. */
int kvr_cma_reading(const kvr_room_t *r);

/* ------------------------------------------------------------------ */
/* post.c: engine thread, or send()'s caller holding the lock          */
/* ------------------------------------------------------------------ */
void kvr_post_locked(kvr_engine_t *e, kvr_room_t *r);

/* ------------------------------------------------------------------ */
/* timer.c: engine thread, once per loop pass                          */
/* ------------------------------------------------------------------ */
void kvr_timers_locked(kvr_engine_t *e);
void kvr_timer_silences_locked(kvr_engine_t *e);
/* Puts room r in the deadline heap at its earliest due time (its deadline,
 * or the time its unexplained rejection fails it), or takes it out if it
 * has none or left the open rooms.  Called whenever r->deadline_ns or
 * r->rejected_ns change, and when r leaves the open rooms.  Any thread,
 * lock held. */
void kvr_timer_arm_locked(kvr_engine_t *e, kvr_room_t *r);
/* A failing room with operations in flight: the force-drain timer watches
 * it (a reference is held while it does). */
void kvr_timer_watch_drain_locked(kvr_engine_t *e, kvr_room_t *r);

#endif
