/*
 * lane: kvrecv's own tcp connection for data messages, beside UCX's.
 *
 * UCX 1.13 has no tcp RMA lane (a put over tcp is "software emulation"),
 * so over its tcp transport a data message is copied into a UCX fragment
 * by the sender, out of the socket into a receive buffer and from there
 * into the pages by the receiver: four copies of each byte with the
 * kernel's two, where a put-based library moves it with the kernel's two
 * alone.  A lane is one tcp connection from a decode to its prefill that
 * carries frames: a prefix (magic, header length, payload length), the
 * data message's header as UCX would carry it, then the payload, written
 * by the prefill with sendmsg straight from its pages and read by the
 * decode with readv straight into the pages its handler chose.  The
 * decode decides every byte it writes exactly as for a UCX message
 * (transport.h: on_data), and a frame it refuses is read and dropped.
 *
 * Setup (transport.c): the prefill listens (lanelisten.c) and offers the
 * lane in HELLO_OK with a random token; the decode, when its UCX endpoint
 * to the prefill runs over tcp, connects and sends KVR_LANE_MAGIC and the
 * token; the prefill answers KVR_LANE_MAGIC and from then on sends its
 * data messages to that decode over the lane.  A lane that never came up
 * costs nothing: the data goes through UCX.  A lane that fails after it
 * came up fails its endpoint, as UCX's own errors do.
 *
 * Not thread safe: the engine lock is held for every call (engine thread,
 * the prefill's send() caller, the decode's poll() caller).
 */
#ifndef KVR_LANE_H
#define KVR_LANE_H

#include <stddef.h>
#include <stdint.h>

#include "transport.h"

#define KVR_LANE_TOKEN_LEN KVR_TP_LANE_TOKEN_LEN
/* The handshake's magic (decode -> prefill, then the prefill's answer). */
#define KVR_LANE_MAGIC "KVRLANE1"
#define KVR_LANE_MAGIC_LEN 8
/* The most bytes of a data message's header in a frame. */
#define KVR_LANE_HDR_MAX 256u

typedef struct kvr_lane kvr_lane_t;

typedef struct {
    void *arg;
    /* Decode: a frame's header arrived; fill acc as transport.h's on_data
     * (iovcnt 0: its payload is read and dropped). */
    void (*on_frame)(void *arg, const void *hdr, size_t hdr_len, size_t len,
                     kvr_tp_accept_t *acc);
    void (*on_recv_done)(void *arg, kvr_tp_op_t *op, size_t len, int failed, const char *text);
    void (*on_send_done)(void *arg, kvr_tp_op_t *op, int failed, const char *text);
    /* The lane failed (text: why); was_up: after its handshake.  Called
     * before the operations queued on it complete with KVR_TP_PEER_GONE. */
    void (*on_error)(void *arg, const char *text, int was_up);
} kvr_lane_cb_t;

/* Prefill: a lane on socket fd (it is the lane's) whose handshake was
 * read: answers it and sends.  NULL when memory ran out (fd closed). */
kvr_lane_t *kvr_lane_accepted(int fd, const kvr_lane_cb_t *cb);
/* Decode: connects to host:port (without waiting) and says token.  NULL
 * with err when no socket could be made. */
kvr_lane_t *kvr_lane_connect(const char *host, uint16_t port,
                             const unsigned char token[KVR_LANE_TOKEN_LEN],
                             const kvr_lane_cb_t *cb, char *err, size_t errlen);
/* Frees the lane and closes its socket; what is queued on it gets no
 * callback (as with UCX requests of a destroyed worker). */
void kvr_lane_free(kvr_lane_t *l);

/* The socket (-1 once the lane failed: then closed) and the epoll events
 * to wait for (EPOLLOUT while anything is queued). */
int kvr_lane_fd(const kvr_lane_t *l);
uint32_t kvr_lane_events(const kvr_lane_t *l);
/* 1 while the lane carries data: handshake done, not failed. */
int kvr_lane_up(const kvr_lane_t *l);

/* Prefill: sends hdr then the pieces of iov as one frame (hdr and iov valid
 * until the send completes; bad_magic: the test suite's malformed frame).
 * With nothing queued before it, the frame is written at once, up to
 * *budget bytes, which are taken from *budget (at 0 it is queued whole for
 * kvr_lane_progress).  KVR_TP_OK: written at once (no callback);
 * KVR_TP_PENDING: on_send_done follows; KVR_TP_PEER_GONE or KVR_TP_ERROR
 * (*text): failed. */
int kvr_lane_send(kvr_lane_t *l, const void *hdr, size_t hdr_len, const kvr_tp_iov_t *iov,
                  size_t iovcnt, int bad_magic, size_t *budget, kvr_tp_op_t *op,
                  const char **text);
/* Writes what is queued and reads what arrived, each up to a bound; the
 * number of frames and handshake steps finished (0: nothing to do). */
unsigned kvr_lane_progress(kvr_lane_t *l);

#endif
