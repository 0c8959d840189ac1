/*
 * engine: one manager's core.  It owns the progress thread that drives the
 * transport (UCX) and the control plane (ZMQ) and updates rooms; it is the
 * only place those parts meet.
 *
 * Threads: the kvr_engine_* and kvr_handle_* functions below are called by
 * the binding, from any thread, and take the engine lock briefly; none of
 * them waits on the network.  kvr_handle_poll never waits for the lock: it
 * reads the room's state, and for a decode room waiting for data it may
 * progress UCX itself if the lock is free (try-lock, at most every 10 us).
 * The progress thread holds the lock while it handles events and releases
 * it while it sleeps in poll.
 *
 * Errors: functions returning int return 0 on success, or a negative
 * KVR_E* code with a message naming the argument in err (errlen bytes).
 */
#ifndef KVR_ENGINE_H
#define KVR_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "hist.h"
#include "auth.h"
#include "registry.h"
#include "status.h"

#define KVR_EVALUE (-1)   /* bad argument: ValueError */
#define KVR_ERUNTIME (-2) /* bad state (closed manager, cleared room): RuntimeError */
#define KVR_ENOMEM (-3)   /* MemoryError */
#define KVR_ESYSTEM (-4)  /* the system or a library failed: RuntimeError */

enum { KVR_MODE_PREFILL = 0, KVR_MODE_DECODE = 1 };

/* Longest name of a tcp congestion control, its NUL included (the
 * kernel's TCP_CA_NAME_MAX). */
#define KVR_LANE_CC_MAX 16

typedef struct {
    uint32_t bootstrap_timeout_ms;  /* resolving and connecting a peer */
    uint32_t heartbeat_interval_ms; /* decode -> prefill pings */
    uint32_t heartbeat_timeout_ms;  /* silence that means PEER_LOST */
    uint32_t deadline_base_ms;      /* room deadline = base + bytes / floor */
    uint64_t deadline_floor_bps;    /* bytes per second */
    uint32_t max_rooms;             /* open rooms per manager */
    uint32_t max_pending;           /* requests held for senders not yet created */
    int ctrl_port;                  /* control port; 0 picks a free one */
    uint32_t sibling_wait_ms;       /* failure_exception's wait for a sibling's record */
    int register_memory;            /* ucp_mem_map the buffers up front */
    uint32_t coalesce_bytes;        /* most bytes per buffer in one coalesced message */
    uint32_t coalesce_run_bytes;    /* runs shorter than this are coalesced */
    uint64_t pack_bytes;            /* most bytes of packed scattered messages in flight (tcp) */
    uint32_t max_rooms_per_peer;    /* prefill: rooms one decode may have pending or bound */
    uint32_t max_peers;             /* prefill: decode ranks connected at once (a UCX worker each) */
    uint64_t ctrl_queue_bytes;      /* control messages queued per connection for the engine */
    /* Shared secret authenticating every control message (auth.h); none if
     * secret_len is 0. */
    unsigned char secret[KVR_AUTH_SECRET_MAX];
    size_t secret_len;
    uint32_t staging_slots;         /* pinned host slots for staging device memory */
    uint32_t staging_slot_bytes;    /* bytes per slot (and most bytes per staged message) */
    int force_staging;              /* stage device memory even where UCX could move it */
    int poll_progress;              /* decode: poll() may progress UCX (kvr_handle_poll) */
    uint32_t cross_memory_bytes;    /* same-host pieces this long go as cross-memory reads (cma.c); 0: never */
    uint32_t cross_memory_readers;  /* decode: threads making those reads, the handling one included */
    int tcp_lane;                   /* data over kvrecv's own tcp connection where UCX uses tcp (lane.h) */
    /* Prefill: the tcp congestion control of its lanes (lanelisten.h); "":
     * the host's default. */
    char lane_congestion[KVR_LANE_CC_MAX];
} kvr_config_t;

/* The defaults.  The binding hands them to Python (config_defaults), and a
 * test checks the README's configuration table against them. */
void kvr_config_default(kvr_config_t *cfg);

/* Memory kinds of the buffers (kvr_engine_params_t.kv_kinds / aux_kinds). */
enum { KVR_MEM_AUTO = 0, KVR_MEM_HOST = 1, KVR_MEM_CUDA = 2 };

/* How device memory moves (kvr_engine_gpu_path). */
enum {
    KVR_GPU_HOST = 0,   /* no buffer is device memory */
    KVR_GPU_UCX = 1,    /* UCX moves device memory itself ("ucx-cuda") */
    KVR_GPU_STAGED = 2, /* through pinned host slots and CUDA copies ("staged") */
};

typedef struct {
    int mode;                   /* KVR_MODE_* */
    int rank;                   /* engine (TP) rank */
    uint32_t dp_rank;           /* prefill: its DP group, registered with its rank */
    const char *host;           /* address to bind the control socket on */
    const char *bootstrap_addr; /* "host:port"; prefill registers there */
    uint32_t page_size;
    uint32_t nkv;
    const uint64_t *kv_ptrs, *kv_lens, *kv_item_lens;
    uint32_t naux;
    const uint64_t *aux_ptrs, *aux_lens, *aux_item_lens;
    /* Per-request state buffers (state.c): the last nstate of the naux
     * "aux" buffers, buffer naux - nstate + i of state component
     * state_comp[i] (components 0.. in order, at most KVR_MAX_STATES). */
    uint32_t nstate;
    const uint32_t *state_comp;
    /* How each state buffer's row splits over TP ranks (stateslice.h's
     * flat rules, nstate_rules u32); 0: not given (equal TP sizes only). */
    uint32_t nstate_rules;
    const uint32_t *state_rules;
    /* Bit c: state component c takes a list of slots per request (sliding-
     * window pages), not one slot; equal TP sizes only. */
    uint32_t state_list;
    /* KVR_MEM_* per buffer; NULL: every buffer auto (detected with
     * cudaPointerGetAttributes when the CUDA runtime loads, else host). */
    const uint8_t *kv_kinds, *aux_kinds;
    /* The head layout of this rank's KV pages (plan.h's kvr_heads_t):
     * heads 0 when not given. */
    uint32_t tp_size, tp_rank, heads, total_heads;
    /* The layers of this rank's KV buffers (plan.h's kvr_layers_t): a
     * prefill split into pp_size pipeline stages holds layers
     * [start_layer, start_layer + num_layers) as stage pp_rank.  num_layers
     * 0: not given (one buffer per layer, all of them, one stage). */
    uint32_t pp_size, pp_rank, start_layer, num_layers;
    kvr_config_t cfg;
} kvr_engine_params_t;

typedef struct kvr_engine kvr_engine_t;
typedef struct kvr_room kvr_handle_t; /* a room as the binding holds it */

typedef struct {
    uint64_t rooms_by_state[5];   /* indexed by KVR_POLL_* (open rooms) */
    uint64_t rooms_open;
    uint64_t rooms_draining;      /* failing, waiting for in-flight ops */
    uint64_t bytes_moved;         /* payload bytes landed (decode) or sent (prefill) */
    uint64_t ops_posted;          /* data messages posted (one per run or coalesced runs, per buffer) */
    uint64_t ctrl_dropped;        /* malformed or unexpected control messages */
    uint64_t data_rejected;       /* data messages refused by the receiver */
    uint64_t heartbeats_missed;   /* peers declared lost for silence */
    uint64_t pending_requests;    /* prefill: requests waiting for a sender */
    uint64_t peers;
    uint64_t rooms_succeeded;
    uint64_t rooms_force_drained; /* declared drained with a dead peer's ops stuck */
    uint64_t log_dropped;         /* log records lost because nobody read them */
    uint64_t data_packed;         /* prefill: scattered messages sent as a packed copy (tcp) */
    uint64_t pack_cached_bytes;   /* prefill: idle packing buffers kept for reuse */
    uint64_t poll_progressed;     /* decode: UCX events handled by poll()'s progress */
    uint64_t auth_rejected;       /* control messages refused by authentication (also in ctrl_dropped) */
    uint64_t auth_refused_by_peer; /* AUTH_REJECT answers: a peer could not authenticate us */
    uint64_t ctrl_oversized;      /* control messages over the size limit (also in ctrl_dropped) */
    uint64_t data_foreign;        /* data messages for no room of ours, or from a sender that is
                                     not the room's peer (also in data_rejected) */
    uint64_t requests_refused;    /* prefill: decode requests refused (bad indices, room caps) */
    uint64_t data_rendezvous;     /* decode: data messages accepted that came by rendezvous (the
                                     others came eagerly) */
    uint64_t ucx_workers;         /* UCX workers alive: one per connected peer */
    uint64_t ucx_workers_created; /* UCX workers created: one per connection to a peer */
    uint64_t sib_fail_refused;    /* SIB_FAIL messages not from a configured sibling (dropped) */
    uint64_t failures_by_code[KVR_STATUS_LAST];
    /* Per succeeded room (KVR_HIST_LATENCY, ns): decode, from sending the
     * request to the prefill to the last byte landed; prefill, from the
     * later of the decode's request arriving and the last page handed to
     * send() (init() for a room of no pages) to the decode's completion
     * notice.  Failed rooms are not observed. */
    kvr_hist_t transfer_latency;
    /* Per succeeded room (KVR_HIST_OPS): its data operations (prefill:
     * posted; decode: data messages accepted). */
    kvr_hist_t room_ops;
    uint64_t staged_ops;          /* messages that went through a staging copy */
    uint64_t staged_bytes;        /* bytes copied between device and staging memory */
    uint64_t staging_overflow;    /* decode: messages staged in a heap buffer (no slot fit) */
    uint64_t cma_reads;           /* decode: data pieces read from the prefill's memory (cma.c) */
    uint64_t cma_bytes;           /* decode: bytes those reads moved */
    uint64_t cma_helper_bytes;    /* decode: of those, bytes its helper threads read (readers.h) */
    uint64_t staging_waits;       /* prefill: times a room waited for a free slot */
    uint64_t lane_messages;       /* data messages sent (prefill) or accepted (decode) over
                                     kvrecv's tcp lanes (lane.h) */
    uint64_t lane_port;           /* prefill: the port decodes connect lanes to (0: none) */
} kvr_stats_t;

/* Creates the manager and starts its thread.  Blocks only for local set-up. */
int kvr_engine_create(const kvr_engine_params_t *p, kvr_engine_t **e_p, char *err, size_t errlen);
/* Stops the thread, fails open rooms (ABORTED, "manager closed"), closes
 * sockets and endpoints.  Idempotent; blocks until the thread exits. */
void kvr_engine_close(kvr_engine_t *e);
/* Frees the engine; every handle must have been released. */
void kvr_engine_free(kvr_engine_t *e);
int kvr_engine_closed(kvr_engine_t *e);
void kvr_engine_stats(kvr_engine_t *e, kvr_stats_t *s);
/*
 * Waits up to timeout_ms for log records of the core and copies up to max
 * (at most 16) of them out: Python logging levels and texts.  Returns the
 * number copied, or -1 once the engine is closed and every record was read.
 * Blocks: call without the GIL.
 */
#define KVR_ENGINE_LOG_TEXT 448
int kvr_engine_log_read(kvr_engine_t *e, int *levels, char (*texts)[KVR_ENGINE_LOG_TEXT], int max,
                        int timeout_ms);

/* The control endpoint ("tcp://host:port"), the instance epoch and the
 * transport's description: copies made at creation, the same text after
 * close(), valid until free; any thread, without the lock. */
const char *kvr_engine_endpoint(kvr_engine_t *e);
uint64_t kvr_engine_epoch(kvr_engine_t *e);
const char *kvr_engine_transport(kvr_engine_t *e);
/* KVR_GPU_* and why that path (static per engine; valid until free). */
int kvr_engine_gpu_path(kvr_engine_t *e, const char **why);
const char *kvr_gpu_path_name(int path);
/* 1 if buffer i (KV buffers first, then aux) is device memory. */
int kvr_engine_buffer_is_device(kvr_engine_t *e, uint32_t i);

/*
 * Sets the control endpoints of the other ranks of this instance (its
 * siblings).  From then on every root cause recorded here is published to
 * them, and theirs to us, so every rank of a room reports the same cause.
 * Replaces an earlier list.  Returns 0 or a KVR_E* code.
 */
int kvr_engine_set_siblings(kvr_engine_t *e, const char *const *endpoints, int n, char *err,
                            size_t errlen);

/* Opens a room of this manager's mode.  The handle holds a reference that
 * kvr_handle_release drops. */
int kvr_handle_open(kvr_engine_t *e, uint64_t room, const char *bootstrap_addr,
                    kvr_handle_t **h_p, char *err, size_t errlen);
void kvr_handle_release(kvr_handle_t *h);

/* Decode side.  prefix_len: tokens of the request this decode already holds
 * (0 for none); the pages are those of the rest.  It travels with the
 * request for the prefill's scheduler (kvr_handle_prefix_len).
 * kvr_handle_recv_init: bootstrap_addr, unless NULL or empty, replaces the
 * rendezvous named at open; prefill_dp_rank (0..65535) the prefill DP group
 * whose ranks serve the room (one server may hold several); prefill_tp_size, unless 0, the prefill's TP size: the room reads this
 * rank's heads from the prefill ranks the head layouts say (group.c);
 * prefill_pp_size, unless 0, the prefill's pipeline stages (at most
 * KVR_MAX_PP): the room reads each stage's layers from it. */
#define KVR_MAX_PP 64
int kvr_handle_recv_init(kvr_handle_t *h, int prefill_dp_rank, const char *bootstrap_addr,
                         uint32_t prefill_tp_size, uint32_t prefill_pp_size, char *err,
                         size_t errlen);
/* The entries of state_indices given as lists of slots: entry c is the
 * list of n[c] slots at slots[sum of n[0..c)] when bit c of seq is set
 * (its states[c] is then ignored).  NULL: none. */
typedef struct {
    uint32_t seq;
    const uint32_t *n;     /* per entry */
    const int64_t *slots;  /* the lists, concatenated in entry order */
} kvr_state_in_t;
/* states: the slot of each of the first nstates state components (-1:
 * none), or the lists in `lists`, checked against the registered slots
 * (state.c): a list component takes a list (an int is a list of one), a
 * one-slot component one slot (a list of one). */
int kvr_handle_send_metadata(kvr_handle_t *h, const int32_t *pages, size_t n, int64_t aux_index,
                             const int64_t *states, uint32_t nstates, const kvr_state_in_t *lists,
                             uint32_t prefix_len, char *err, size_t errlen);
/* Prefill side.  kvr_handle_prefix_len: the decode's prefix_len, once its
 * request arrived (poll() left Bootstrapping); 0 before.  (Decode: the one
 * given to send_metadata.)  Takes the lock. */
uint32_t kvr_handle_prefix_len(kvr_handle_t *h);
int kvr_handle_send_init(kvr_handle_t *h, int64_t num_pages, int64_t aux_index, char *err,
                         size_t errlen);
/* states (nstates 0: not given): this side's state slots, needed by the
 * time the last page is handed over. */
int kvr_handle_send(kvr_handle_t *h, const int32_t *pages, size_t n, const int64_t *states,
                    uint32_t nstates, const kvr_state_in_t *lists, char *err, size_t errlen);

/* Both sides.  poll never blocks and never fails.  On the decode, a room
 * waiting for data gets UCX progressed from the caller (config
 * poll_progress): sockets and endpoint failures are left to the engine
 * thread, which is woken if anything happened. */
int kvr_handle_poll(kvr_handle_t *h);
/* Copies out (pop=0) or pops (pop=1) the room's failure record; returns 1
 * if there was one.  With wait_ms > 0 and no record yet, waits that long for
 * one to arrive from a sibling (blocks; call without the GIL). */
int kvr_handle_failure(kvr_handle_t *h, kvr_failure_t *out, int pop, uint32_t wait_ms);
/* The manager's configured sibling wait (0 if it has no siblings). */
uint32_t kvr_handle_sibling_wait_ms(kvr_handle_t *h);
int kvr_handle_abort(kvr_handle_t *h, char *err, size_t errlen);
int kvr_handle_clear(kvr_handle_t *h, char *err, size_t errlen);
/* KVR_MODE_PREFILL or KVR_MODE_DECODE. */
int kvr_handle_role(kvr_handle_t *h);

/* Tests only: makes this prefill corrupt the headers of the KV data
 * messages it posts from now on (KVR_TEST_CORRUPT_*, testhook.h; 0 turns
 * it off).  Any thread. */
void kvr_engine_test_corrupt(kvr_engine_t *e, int mode);
/* Tests only (testhook.h): the data messages this prefill posts name room
 * tag `tag` and instance epoch `epoch` instead of their own (tag 0: their
 * own again), as a peer that learnt another room's tag could. */
void kvr_engine_test_forge(kvr_engine_t *e, uint64_t tag, uint64_t epoch);
/* Tests only: the tag data messages of open room `room` carry (a prefill's:
 * its decode's; 0 if none). */
uint64_t kvr_engine_test_room_tag(kvr_engine_t *e, uint64_t room);

#endif
