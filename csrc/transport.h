/*
 * transport: everything that touches UCX.
 *
 * One UCP context per manager and one worker per peer (a connection to
 * one remote manager), all progressed by the engine thread (and, on the
 * decode, by poll() callers under the same lock).  A worker per peer keeps
 * peers apart: UCX's shared-memory transports give each worker one receive
 * FIFO that every sender writes into, and a sender killed in the middle of
 * a write leaves an element that never completes, stopping the FIFO for
 * good; with its own worker, only the dead peer's FIFO stops, and it goes
 * with the peer.  Data moves as UCX active
 * messages: the sender posts (header, pages); the receiver's handler asks the
 * engine where the bytes may go and either copies eager data or starts a
 * rendezvous receive straight into the destination pages.  So the receiver
 * decides every byte it writes, in its own process: completion and abort are
 * local facts on the decode side.
 *
 * All functions here are called with the engine lock held (the worker runs
 * in serialized mode): on the engine thread, kvr_tp_send/ep_create also
 * from the prefill's send() caller, kvr_tp_progress also from the decode's
 * poll() caller; create/destroy before the thread starts
 * / after it stopped.  None blocks, except kvr_tp_destroy and
 * kvr_tp_ep_close, which drain for a bounded time.
 */
#ifndef KVR_TRANSPORT_H
#define KVR_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvr_transport kvr_transport_t;
typedef struct kvr_tp_worker kvr_tp_worker_t;
typedef struct kvr_tp_ep kvr_tp_ep_t;

/*
 * An operation in flight.  The engine embeds this as the first member of its
 * own operation record; the transport fills tp and hands the pointer back in
 * the completion callbacks.
 */
typedef struct {
    kvr_transport_t *tp;
    uint64_t worker_id; /* the worker it runs on (kvr_tp_op_cancel looks it up: it may be gone) */
    void *req; /* the UCX request while in flight, for cancelling */
    void *bounce; /* a packed copy of a scattered message (tcp), until completion */
    size_t bounce_cap;
} kvr_tp_op_t;

/* How an operation ended (the `failed` argument of the callbacks, and what
 * kvr_tp_send returns). */
enum {
    KVR_TP_OK = 0,
    KVR_TP_ERROR = 1,     /* the operation failed */
    KVR_TP_PEER_GONE = 2, /* it failed because the peer or connection is gone */
    KVR_TP_REJECTED = 3,  /* the receiver refused the data message */
    KVR_TP_PENDING = 4,   /* kvr_tp_send: in flight, on_send_done will say */
};

/* on_data's rndv for a message on a lane (lane.h). */
#define KVR_TP_LANE 2

/* One piece of a scattered buffer (laid out like UCX's ucp_dt_iov_t). */
typedef struct {
    void *buf;
    size_t len;
} kvr_tp_iov_t;

/* How the receiver's handler answers an incoming data message. */
typedef struct {
    kvr_tp_iov_t *iov; /* where the payload goes, in order; must stay valid
                        * until on_recv_done (it lives in the operation) */
    size_t iovcnt;     /* 0 rejects the message */
    kvr_tp_op_t *op;   /* passed back to on_recv_done */
    const char *reject_why; /* set with iovcnt == 0, for the counters/log */
    const void *data;  /* eager: the payload (NULL for rendezvous) */
} kvr_tp_accept_t;

typedef struct {
    void *arg;
    /* A data message arrived: fill *acc.  rndv: the payload is still at the
     * sender (a rendezvous receive into acc's pieces follows; KVR_TP_LANE:
     * it follows on kvrecv's tcp lane, read into the pieces); otherwise it
     * is here and is copied into the pieces with memcpy (host memory only).
     * w: the worker it arrived on (only the room's peer's is the room's).
     * Called on the engine thread. */
    void (*on_data)(void *arg, kvr_tp_worker_t *w, const void *hdr, size_t hdr_len, size_t len,
                    int rndv, kvr_tp_accept_t *acc);
    /* The payload of an accepted message landed (status 0) or failed. */
    void (*on_recv_done)(void *arg, kvr_tp_op_t *op, size_t len, int failed,
                         const char *status_text);
    /* A send completed (failed=0: local buffer reusable and, for rendezvous,
     * read by the peer) or failed with status_text. */
    void (*on_send_done)(void *arg, kvr_tp_op_t *op, int failed, const char *status_text);
    /* Endpoint ep failed (peer gone).  After this, every operation on the
     * endpoint completes with an error.  ep may be one its owner has
     * already replaced or retired (not yet closed). */
    void (*on_ep_error)(void *arg, void *ep_ctx, kvr_tp_ep_t *ep, const char *status_text);
} kvr_tp_callbacks_t;

/*
 * Checks the UCX settings in the environment for ones kvrecv cannot work
 * with; 0, or -1 with the cause in err.  kvr_tp_create does not repeat it.
 */
int kvr_tp_check_env(char *err, size_t errlen);
/*
 * Creates the UCP context.  pack_max: most bytes of packed copies of
 * scattered messages in flight (0: never pack).  0, or -1 (UCX or the
 * system failed) with the cause in err (errlen bytes).
 */
int kvr_tp_create(const kvr_tp_callbacks_t *cb, size_t pack_max, kvr_transport_t **tp_p, char *err,
                  size_t errlen);
/* Destroys the workers left and the context. */
void kvr_tp_destroy(kvr_transport_t *tp);

/* Creates a worker (for one peer).  -1 with err on failure. */
int kvr_tp_worker_create(kvr_transport_t *tp, kvr_tp_worker_t **w_p, char *err, size_t errlen);
/* Takes a worker whose peer is gone out of kvr_tp_progress and kvr_tp_arm
 * until it is destroyed: receives the dead peer left in flight must land
 * no byte after its rooms failed. */
void kvr_tp_worker_retire(kvr_tp_worker_t *w);
/* Destroys a worker whose endpoints are closed: UCX requests still on it
 * (a receive from a peer that died) are released with it, their callbacks
 * never called. */
void kvr_tp_worker_destroy(kvr_tp_worker_t *w);
/* Workers alive; *created: workers created for peers so far (for stats). */
unsigned kvr_tp_nworkers(const kvr_transport_t *tp, uint64_t *created);

/* The worker address to give the peer; owned by w. */
void kvr_tp_address(kvr_tp_worker_t *w, const void **addr_p, size_t *len_p);
/* The fd to poll for readiness of any worker (fixed for tp's life). */
int kvr_tp_fd(kvr_transport_t *tp);
/* Progresses every worker until idle or for a bounded number of rounds;
 * returns the number of events handled (0: idle). */
unsigned kvr_tp_progress(kvr_transport_t *tp);
/* Arms every worker: 0 armed (safe to sleep on kvr_tp_fd), 1 busy
 * (progress again). */
int kvr_tp_arm(kvr_transport_t *tp);

/* Checks that addr looks like a worker address of this UCX (UCX asserts,
 * aborting the process, on one it cannot parse).  0, or -1 with err. */
int kvr_tp_address_check(kvr_transport_t *tp, const void *addr, size_t len, char *err,
                         size_t errlen);

/* Connects w to a peer worker address.  ep_ctx is passed to on_ep_error. */
int kvr_tp_ep_create(kvr_tp_worker_t *w, const void *addr, size_t len, void *ep_ctx,
                     kvr_tp_ep_t **ep_p, char *err, size_t errlen);
/* 1 if the endpoint runs over shared memory.  UCX 1.13 cannot say which
 * transport an endpoint uses; an endpoint that had to be created without
 * peer-failure handling is one over shared memory (tcp offers it). */
int kvr_tp_ep_is_shm(const kvr_tp_ep_t *ep);
/* The largest message the endpoint sends in one UCX fragment, eagerly
 * (its tcp fragment, UCX_TCP_TX_SEG_SIZE, less KVR_TP_TCP_EAGER_HEADROOM),
 * if every lane of it is tcp; 0 otherwise. */
size_t kvr_tp_ep_tcp_eager(const kvr_tp_ep_t *ep);
/* Room left in a tcp fragment for UCX's and kvrecv's headers (under 100
 * bytes together). */
#define KVR_TP_TCP_EAGER_HEADROOM 1024u
/* Closes (force: cancels outstanding operations with an error).  The
 * endpoint must not be used afterwards. */
void kvr_tp_ep_close(kvr_tp_ep_t *ep, int force);

/* UCX's shared-memory transports carry a message of up to this many bytes
 * and kvrecv's header in one fragment of their default segment
 * (UCX_POSIX_SEG_SIZE / UCX_SYSV_SEG_SIZE 8256): kvr_tp_send sends a host
 * message this small eagerly over a shared-memory endpoint. */
#define KVR_TP_SHM_EAGER_BYTES (8u << 10)

/*
 * Sends one data message: hdr, then the iovcnt pieces of iov as one payload.
 * hdr and iov must stay valid until the send completes.  host: every piece
 * is host memory.  A host message to an endpoint with a lane up
 * (kvr_tp_ep_lane) goes over the lane as one frame, whatever its length;
 * otherwise through UCX, as follows.  One piece goes as a contiguous send (which may use the
 * registered regions), except host memory over a shared-memory endpoint:
 * that is sent as a one-piece scattered message, which UCX copies through
 * the shared segment with both processes working in a pipeline, instead of
 * one cross-memory read by the receiver (1.3-1.7x faster at 1 MiB on a
 * 2-core host; see benchmarks/README.md).  A host message of up to
 * kvr_tp_ep_tcp_eager() bytes goes eagerly as one tcp fragment, its pieces
 * copied into it by UCX.  Several pieces of host memory in a larger message
 * over any other endpoint are packed into one contiguous bounce
 * buffer first, within pack_max bytes in flight: UCX moves a
 * contiguous message over tcp 1.4-1.8x faster than its scattered form, the
 * copy included.  Returns KVR_TP_OK if it completed at once (no callback),
 * KVR_TP_PENDING if on_send_done will be called with op, or how it failed
 * at once (KVR_TP_ERROR, KVR_TP_PEER_GONE; text in *status_text, static).
 */
int kvr_tp_send(kvr_transport_t *tp, kvr_tp_ep_t *ep, const void *hdr, size_t hdr_len,
                const kvr_tp_iov_t *iov, size_t iovcnt, int host, kvr_tp_op_t *op,
                const char **status_text);

/* Asks UCX to cancel an operation in flight; its callback then reports
 * KVR_TP_PEER_GONE or KVR_TP_ERROR (or success, if it had finished).  An
 * operation whose worker was destroyed gets no callback. */
void kvr_tp_op_cancel(kvr_tp_op_t *op);

/* Registers a memory region for faster sends from it; returns 0 or -1. */
int kvr_tp_mem_map(kvr_transport_t *tp, void *addr, size_t len, char *err, size_t errlen);

/* The memory types this UCX context can move (UCP_ATTR_FIELD_MEMORY_TYPES):
 * a bit mask of KVR_TP_MEM_* and their names, comma separated, in names. */
enum { KVR_TP_MEM_HOST = 1, KVR_TP_MEM_CUDA = 2, KVR_TP_MEM_CUDA_MANAGED = 4,
       KVR_TP_MEM_ROCM = 8, KVR_TP_MEM_OTHER = 16 };
unsigned kvr_tp_memory_types(kvr_transport_t *tp, char *names, size_t len);
/* The same without a manager: creates and drops a UCP context.  -1 with err
 * if UCX cannot be initialised. */
int kvr_tp_probe_memory_types(unsigned *mask, char *names, size_t len, char *err, size_t errlen);

/* Messages sent as a packed copy so far (read under the engine lock). */
uint64_t kvr_tp_packed(kvr_transport_t *tp);
/* Bytes of idle bounce buffers kept for reuse (read under the engine lock). */
uint64_t kvr_tp_pack_cached(kvr_transport_t *tp);
/* Frees the cached bounce buffers once no packed message has been in flight
 * for a second (now_ns: a monotonic clock).  Called from the engine's
 * timers. */
void kvr_tp_pack_trim(kvr_transport_t *tp, uint64_t now_ns);

/*
 * The size of this context's tcp send fragments (UCX_TCP_TX_SEG_SIZE) and
 * receive buffers (UCX_TCP_RX_SEG_SIZE) in bytes, as set by the environment
 * or by kvrecv; 0 if not known.  Where UCX_TLS leaves tcp out, tx is 0 and
 * rx SIZE_MAX (nothing is sent or received over tcp).  UCX aborts a
 * receiver on a fragment larger than its receive buffer (an assertion in
 * tcp_ep.c), so the decode says what it can receive and the prefill refuses
 * a decode it would crash.
 */
size_t kvr_tp_tcp_tx_seg(const kvr_transport_t *tp);
size_t kvr_tp_tcp_rx_seg(const kvr_transport_t *tp);
/* UCX's own default UCX_TCP_RX_SEG_SIZE: what a decode that does not say
 * (an older build) receives into. */
#define KVR_TP_TCP_RX_SEG_UCX_DEFAULT (64u << 10)

/*
 * This context's UCX shared-memory (posix/sysv) segment size in bytes and
 * receive FIFO length, as set by the environment or by kvrecv; both 0 where
 * UCX_TLS leaves those transports out, 0 where not known.  UCX 1.13 does
 * not exchange them: a sender with a shorter FIFO than its receiver stops
 * for good (measured), one with larger segments writes past the
 * receiver's.  So the decode says its sizes and the prefill refuses a
 * decode whose differ from its own.
 */
void kvr_tp_shm_sizes(const kvr_transport_t *tp, uint32_t *seg, uint32_t *fifo);
/* UCX's own defaults: what a decode that does not say (an older build)
 * uses. */
#define KVR_TP_SHM_SEG_UCX_DEFAULT 8256u
#define KVR_TP_SHM_FIFO_UCX_DEFAULT 64u

/*
 * kvrecv's tcp lanes (lane.h): a prefill's host data messages to a decode
 * whose UCX endpoint runs over tcp go over the lane that decode connected,
 * once it is up.  Prefill: kvr_tp_lane_listen once (0, or -1 with err: no
 * lanes; congestion: the lanes' tcp congestion control, "" the host's),
 * then per decode kvr_tp_lane_offer on its worker: a token to hand
 * it with the port (0 if none or no lanes; -1 when no random token could
 * be drawn).  Decode: kvr_tp_lane_connect on its endpoint to the prefill
 * with what the prefill offered (-1 with err: no lane, data through UCX).
 */
#define KVR_TP_LANE_TOKEN_LEN 16
int kvr_tp_lane_listen(kvr_transport_t *tp, const char *host, const char *congestion, char *err,
                       size_t errlen);
uint16_t kvr_tp_lane_port(const kvr_transport_t *tp);
int kvr_tp_lane_offer(kvr_tp_worker_t *w, unsigned char token[KVR_TP_LANE_TOKEN_LEN]);
int kvr_tp_lane_connect(kvr_tp_ep_t *ep, const char *host, uint16_t port,
                        const unsigned char token[KVR_TP_LANE_TOKEN_LEN], char *err,
                        size_t errlen);
/* 1 if host data messages to ep go over a lane now (of any length: a
 * frame is not a UCX fragment). */
int kvr_tp_ep_lane(const kvr_tp_ep_t *ep);
/* Decode: ep's lane is up (1), in its handshake (0), or failed or never
 * connected (-1); kvr_tp_lane_abandon drops one still in its handshake. */
int kvr_tp_ep_lane_state(const kvr_tp_ep_t *ep);
void kvr_tp_lane_abandon(kvr_tp_ep_t *ep);
/* Data messages sent (prefill) or accepted (decode) over lanes so far. */
uint64_t kvr_tp_lane_frames(const kvr_transport_t *tp);
/* Prefill: the bytes kvr_tp_send may write to lanes from now on in the
 * calling thread (with the lock held) before it leaves the rest of the
 * messages queued for the transport's progress; set before each batch of
 * sends (an API call's, an engine pass's). */
void kvr_tp_lane_budget(kvr_transport_t *tp, size_t bytes);
/* Test suite only (testhook.h): frames sent from now on carry a wrong
 * magic while on is set. */
void kvr_tp_test_bad_frames(kvr_transport_t *tp, int on);

/* Transports in use, comma separated (for stats and logs). */
const char *kvr_tp_describe(kvr_transport_t *tp);

#endif
