#define _GNU_SOURCE
#include "lane.h"

#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "registry.h" /* kvr_now_ns */

/* A frame's prefix: magic u32, header length u32, payload length u64,
 * little-endian. */
#define KVR_LANE_PREFIX 16u
#define KVR_LANE_FRAME_MAGIC 0x314c564bu /* "KVL1" */
/* Most pieces per sendmsg/readv, and most bytes one progress call moves
 * each way (the engine lock is released between calls). */
#define KVR_LANE_IOV 256
#define KVR_LANE_ROUND_BYTES (8u << 20)
#define KVR_LANE_SCRATCH (64u << 10)
/* Most bytes one read puts in pages, and the time between two reads that
 * means the process was suspended (SIGSTOP) or starved: the read that was
 * under way finishes, nothing more is read in that call, so that the
 * engine looks at its peers' silence first (transport.c does the same
 * between UCX progress rounds). */
#define KVR_LANE_READ_MAX (256u << 10)
#define KVR_LANE_STALL_NS (20ull * 1000 * 1000)

enum { KVR_LANE_CONNECTING, KVR_LANE_WAIT_ACK, KVR_LANE_UP, KVR_LANE_FAILED };
enum { KVR_RX_ACK, KVR_RX_PREFIX, KVR_RX_HDR, KVR_RX_BODY, KVR_RX_DISCARD, KVR_RX_NONE };

typedef struct kvr_lane_tx {
    struct kvr_lane_tx *next;
    kvr_tp_op_t *op; /* NULL: the handshake */
    const kvr_tp_iov_t *iov;
    size_t iovcnt;
    size_t len;  /* prefix, header and payload */
    size_t done; /* of len, written */
    uint32_t nhead;
    unsigned char head[KVR_LANE_PREFIX + KVR_LANE_HDR_MAX];
} kvr_lane_tx_t;

struct kvr_lane {
    int fd;
    int state;
    int sending;  /* prefill side */
    int flushing; /* inside kvr_lane_flush (a callback may send) */
    kvr_lane_cb_t cb;
    kvr_lane_tx_t *tx_head, *tx_tail;
    /* receiving (decode): the frame being read */
    int rx;
    unsigned char rx_buf[KVR_LANE_PREFIX + KVR_LANE_HDR_MAX];
    size_t rx_have, rx_need;
    uint32_t hdr_len;
    uint64_t body_len, body_left;
    kvr_tp_accept_t acc;
    size_t iov_i, iov_off;
    char *scratch;
    char why[160];
};

static void kvr_put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static uint64_t kvr_get_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

static kvr_lane_t *kvr_lane_alloc(int fd, const kvr_lane_cb_t *cb, int sending)
{
    kvr_lane_t *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return NULL;
    }
    l->fd = fd;
    l->cb = *cb;
    l->sending = sending;
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return l;
}

static int kvr_lane_queue_magic(kvr_lane_t *l, const unsigned char *token)
{
    kvr_lane_tx_t *tx = calloc(1, sizeof(*tx));
    if (tx == NULL) {
        return -1;
    }
    memcpy(tx->head, KVR_LANE_MAGIC, KVR_LANE_MAGIC_LEN);
    tx->nhead = KVR_LANE_MAGIC_LEN;
    if (token != NULL) {
        memcpy(tx->head + tx->nhead, token, KVR_LANE_TOKEN_LEN);
        tx->nhead += KVR_LANE_TOKEN_LEN;
    }
    tx->len = tx->nhead;
    l->tx_head = l->tx_tail = tx;
    return 0;
}

kvr_lane_t *kvr_lane_accepted(int fd, const kvr_lane_cb_t *cb)
{
    kvr_lane_t *l = kvr_lane_alloc(fd, cb, 1);
    if (l == NULL || kvr_lane_queue_magic(l, NULL) != 0) {
        free(l);
        close(fd);
        return NULL;
    }
    l->state = KVR_LANE_UP;
    l->rx = KVR_RX_NONE; /* the decode says nothing more: only its close is read */
    return l;
}

kvr_lane_t *kvr_lane_connect(const char *host, uint16_t port,
                             const unsigned char token[KVR_LANE_TOKEN_LEN],
                             const kvr_lane_cb_t *cb, char *err, size_t errlen)
{
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    char service[8];
    snprintf(service, sizeof(service), "%u", (unsigned)port);
    int rc = getaddrinfo(host, service, &hints, &ai);
    if (rc != 0 || ai == NULL) {
        snprintf(err, errlen, "%s: %s", host, gai_strerror(rc));
        return NULL;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        freeaddrinfo(ai);
        return NULL;
    }
    rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    int cerr = errno;
    freeaddrinfo(ai);
    if (rc != 0 && cerr != EINPROGRESS) {
        snprintf(err, errlen, "connect to %s:%u: %s", host, (unsigned)port, strerror(cerr));
        close(fd);
        return NULL;
    }
    kvr_lane_t *l = kvr_lane_alloc(fd, cb, 0);
    if (l == NULL || kvr_lane_queue_magic(l, token) != 0) {
        snprintf(err, errlen, "out of memory");
        free(l);
        close(fd);
        return NULL;
    }
    l->state = KVR_LANE_CONNECTING;
    l->rx = KVR_RX_ACK;
    l->rx_need = KVR_LANE_MAGIC_LEN;
    return l;
}

void kvr_lane_free(kvr_lane_t *l)
{
    if (l == NULL) {
        return;
    }
    while (l->tx_head != NULL) {
        kvr_lane_tx_t *tx = l->tx_head;
        l->tx_head = tx->next;
        free(tx);
    }
    if (l->fd >= 0) {
        close(l->fd);
    }
    free(l->scratch);
    free(l);
}

int kvr_lane_fd(const kvr_lane_t *l)
{
    return l->fd;
}

uint32_t kvr_lane_events(const kvr_lane_t *l)
{
    if (l->state == KVR_LANE_FAILED) {
        return 0;
    }
    return EPOLLIN | (l->tx_head != NULL ? EPOLLOUT : 0);
}

int kvr_lane_up(const kvr_lane_t *l)
{
    return l->state == KVR_LANE_UP;
}

/* The lane fails: everything queued on it completes with KVR_TP_PEER_GONE,
 * after on_error. */
static void kvr_lane_fail(kvr_lane_t *l, const char *detail)
{
    if (l->state == KVR_LANE_FAILED) {
        return;
    }
    int was_up = l->state == KVR_LANE_UP;
    l->state = KVR_LANE_FAILED;
    snprintf(l->why, sizeof(l->why), "tcp data connection: %s", detail);
    close(l->fd); /* out of the epoll set with it */
    l->fd = -1;
    kvr_lane_tx_t *q = l->tx_head;
    l->tx_head = l->tx_tail = NULL;
    kvr_tp_op_t *rx_op = l->rx == KVR_RX_BODY ? l->acc.op : NULL;
    l->rx = KVR_RX_NONE;
    l->cb.on_error(l->cb.arg, l->why, was_up);
    while (q != NULL) {
        kvr_lane_tx_t *tx = q;
        q = tx->next;
        if (tx->op != NULL) {
            l->cb.on_send_done(l->cb.arg, tx->op, KVR_TP_PEER_GONE, l->why);
        }
        free(tx);
    }
    if (rx_op != NULL) {
        l->cb.on_recv_done(l->cb.arg, rx_op, 0, KVR_TP_PEER_GONE, l->why);
    }
}

/* ---- sending ---- */

/* The unwritten parts of the queued frames, from the head, into v: about
 * max bytes (a piece is cut there; a frame's head is not). */
static int kvr_lane_gather(const kvr_lane_t *l, struct iovec *v, size_t max, size_t *want)
{
    int n = 0;
    *want = 0;
    for (const kvr_lane_tx_t *tx = l->tx_head; tx != NULL && n < KVR_LANE_IOV && *want < max;
         tx = tx->next) {
        size_t off = tx->done;
        if (off < tx->nhead) {
            v[n].iov_base = (void *)(tx->head + off);
            v[n].iov_len = tx->nhead - off;
            *want += v[n++].iov_len;
            off = 0;
            if (*want >= max) {
                return n;
            }
        } else {
            off -= tx->nhead;
        }
        for (size_t i = 0; i < tx->iovcnt && n < KVR_LANE_IOV; i++) {
            if (off >= tx->iov[i].len) {
                off -= tx->iov[i].len;
                continue;
            }
            v[n].iov_base = (char *)tx->iov[i].buf + off;
            v[n].iov_len = tx->iov[i].len - off;
            if (v[n].iov_len > max - *want) {
                v[n].iov_len = max - *want; /* the rest goes in a later call */
            }
            *want += v[n++].iov_len;
            off = 0;
            if (*want >= max) {
                return n;
            }
        }
    }
    return n;
}

/* Writes from the queue until it is empty, the socket is full or about max
 * bytes went (*sent: how many); completes the frames written.  Returns the
 * frames done. */
static unsigned kvr_lane_flush(kvr_lane_t *l, size_t max, size_t *sent)
{
    unsigned done = 0;
    size_t round = 0;
    l->flushing = 1;
    while (l->tx_head != NULL && l->state != KVR_LANE_FAILED && round < max) {
        struct iovec v[KVR_LANE_IOV];
        size_t want;
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = v;
        mh.msg_iovlen = (size_t)kvr_lane_gather(l, v, max - round, &want);
        ssize_t k = sendmsg(l->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                kvr_lane_fail(l, strerror(errno));
            }
            break; /* full, or (the decode's) not connected yet */
        }
        if (l->state == KVR_LANE_CONNECTING) {
            l->state = KVR_LANE_WAIT_ACK;
        }
        round += (size_t)k;
        size_t left = (size_t)k;
        while (l->tx_head != NULL) {
            kvr_lane_tx_t *tx = l->tx_head;
            size_t t = tx->len - tx->done < left ? tx->len - tx->done : left;
            tx->done += t;
            left -= t;
            if (tx->done < tx->len) {
                break;
            }
            l->tx_head = tx->next;
            if (l->tx_head == NULL) {
                l->tx_tail = NULL;
            }
            if (tx->op != NULL) {
                l->cb.on_send_done(l->cb.arg, tx->op, KVR_TP_OK, NULL);
            }
            free(tx);
            done++;
        }
        if ((size_t)k < want) {
            break; /* the socket is full */
        }
    }
    l->flushing = 0;
    *sent = round;
    return done;
}

int kvr_lane_send(kvr_lane_t *l, const void *hdr, size_t hdr_len, const kvr_tp_iov_t *iov,
                  size_t iovcnt, int bad_magic, size_t *budget, kvr_tp_op_t *op,
                  const char **text)
{
    if (l->state == KVR_LANE_FAILED) {
        *text = l->why;
        return KVR_TP_PEER_GONE;
    }
    kvr_lane_tx_t *tx = hdr_len <= KVR_LANE_HDR_MAX ? malloc(sizeof(*tx)) : NULL;
    if (tx == NULL) {
        *text = hdr_len <= KVR_LANE_HDR_MAX ? "out of memory" : "message header too long";
        return KVR_TP_ERROR;
    }
    size_t total = 0;
    for (size_t i = 0; i < iovcnt; i++) {
        total += iov[i].len;
    }
    tx->next = NULL;
    tx->op = op;
    tx->iov = iov;
    tx->iovcnt = iovcnt;
    tx->done = 0;
    tx->nhead = KVR_LANE_PREFIX + (uint32_t)hdr_len;
    kvr_put_le(tx->head, bad_magic ? ~KVR_LANE_FRAME_MAGIC : KVR_LANE_FRAME_MAGIC, 4);
    kvr_put_le(tx->head + 4, hdr_len, 4);
    kvr_put_le(tx->head + 8, total, 8);
    memcpy(tx->head + KVR_LANE_PREFIX, hdr, hdr_len);
    tx->len = tx->nhead + total;
    int alone = l->tx_head == NULL;
    if (l->tx_tail != NULL) {
        l->tx_tail->next = tx;
    } else {
        l->tx_head = tx;
    }
    l->tx_tail = tx;
    if (!alone || l->flushing || *budget == 0) {
        return KVR_TP_PENDING;
    }
    /* Try it now: written whole, it needs no callback. */
    tx->op = NULL;
    size_t sent;
    kvr_lane_flush(l, *budget, &sent);
    *budget -= sent < *budget ? sent : *budget;
    if (l->state == KVR_LANE_FAILED) { /* tx went with the queue */
        *text = l->why;
        return KVR_TP_PEER_GONE;
    }
    if (l->tx_head == NULL) { /* it was alone: written whole */
        return KVR_TP_OK;
    }
    tx->op = op;
    return KVR_TP_PENDING;
}

/* ---- receiving ---- */

/* Reads into the small buffer until rx_need bytes are there: 1 when they
 * are, 0 when the socket has no more now, -1 when the lane failed. */
static int kvr_lane_read_small(kvr_lane_t *l)
{
    while (l->rx_have < l->rx_need) {
        ssize_t k = recv(l->fd, l->rx_buf + l->rx_have, l->rx_need - l->rx_have, MSG_DONTWAIT);
        if (k > 0) {
            l->rx_have += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return 0;
        }
        kvr_lane_fail(l, k == 0 ? "closed by the peer" : strerror(errno));
        return -1;
    }
    return 1;
}

/* A frame's prefix and header are in: ask where its payload goes. */
static void kvr_lane_frame_head(kvr_lane_t *l)
{
    memset(&l->acc, 0, sizeof(l->acc));
    l->cb.on_frame(l->cb.arg, l->rx_buf + KVR_LANE_PREFIX, l->hdr_len, (size_t)l->body_len,
                   &l->acc);
    l->body_left = l->body_len;
    l->iov_i = 0;
    l->iov_off = 0;
    l->rx = l->acc.iovcnt > 0 ? KVR_RX_BODY : KVR_RX_DISCARD;
}

/* What a read of a payload returned: k bytes (taken off body_left), 0
 * (nothing there now), or -1 (the lane failed: closed, or an error). */
static ssize_t kvr_lane_read_done(kvr_lane_t *l, ssize_t k)
{
    if (k > 0) {
        l->body_left -= (uint64_t)k;
        return k;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return 0;
    }
    kvr_lane_fail(l, k == 0 ? "closed by the peer" : strerror(errno));
    return -1;
}

/* The payload into the accepted pieces: bytes read, 0, or -1 (failed). */
static ssize_t kvr_lane_read_body(kvr_lane_t *l)
{
    struct iovec v[KVR_LANE_IOV];
    int n = 0;
    size_t want = 0;
    uint64_t most = l->body_left < KVR_LANE_READ_MAX ? l->body_left : KVR_LANE_READ_MAX;
    for (size_t i = l->iov_i, off = l->iov_off;
         i < l->acc.iovcnt && n < KVR_LANE_IOV && want < most; i++) {
        size_t len = l->acc.iov[i].len - off;
        if (len > most - want) {
            len = (size_t)(most - want); /* never into the next frame */
        }
        v[n].iov_base = (char *)l->acc.iov[i].buf + off;
        v[n].iov_len = len;
        want += v[n++].iov_len;
        off = 0;
    }
    if (want < most && n < KVR_LANE_IOV) {
        kvr_lane_fail(l, "a frame longer than its pieces");
        return -1;
    }
    ssize_t k = readv(l->fd, v, n);
    if (k > 0) {
        size_t left = (size_t)k;
        while (left > 0) {
            size_t r = l->acc.iov[l->iov_i].len - l->iov_off;
            size_t t = r < left ? r : left;
            l->iov_off += t;
            left -= t;
            if (l->iov_off == l->acc.iov[l->iov_i].len) {
                l->iov_i++;
                l->iov_off = 0;
            }
        }
    }
    return kvr_lane_read_done(l, k);
}

/* A refused frame's payload, read and dropped: bytes read, or -1. */
static ssize_t kvr_lane_read_discard(kvr_lane_t *l)
{
    if (l->scratch == NULL && (l->scratch = malloc(KVR_LANE_SCRATCH)) == NULL) {
        kvr_lane_fail(l, "out of memory");
        return -1;
    }
    size_t want = l->body_left < KVR_LANE_SCRATCH ? (size_t)l->body_left : KVR_LANE_SCRATCH;
    return kvr_lane_read_done(l, recv(l->fd, l->scratch, want, MSG_DONTWAIT));
}

/* Checks a frame's prefix; 0, or -1 (the lane failed). */
static int kvr_lane_prefix(kvr_lane_t *l)
{
    uint32_t magic = (uint32_t)kvr_get_le(l->rx_buf, 4);
    l->hdr_len = (uint32_t)kvr_get_le(l->rx_buf + 4, 4);
    l->body_len = kvr_get_le(l->rx_buf + 8, 8);
    if (magic != KVR_LANE_FRAME_MAGIC || l->hdr_len > KVR_LANE_HDR_MAX ||
        l->body_len > SSIZE_MAX) {
        kvr_lane_fail(l, "a malformed frame");
        return -1;
    }
    l->rx = KVR_RX_HDR;
    l->rx_need = KVR_LANE_PREFIX + l->hdr_len;
    return 0;
}

/* Reads frames until the socket is empty, a round's bytes came, or the
 * process was found suspended. */
static unsigned kvr_lane_recv(kvr_lane_t *l)
{
    unsigned done = 0;
    size_t round = 0;
    uint64_t last = kvr_now_ns();
    while (l->state != KVR_LANE_FAILED && round < KVR_LANE_ROUND_BYTES) {
        uint64_t now = kvr_now_ns();
        if (now - last > KVR_LANE_STALL_NS) {
            break;
        }
        last = now;
        if (l->rx == KVR_RX_ACK || l->rx == KVR_RX_PREFIX || l->rx == KVR_RX_HDR) {
            int got = kvr_lane_read_small(l);
            if (got <= 0) {
                break;
            }
            if (l->rx == KVR_RX_ACK) {
                if (memcmp(l->rx_buf, KVR_LANE_MAGIC, KVR_LANE_MAGIC_LEN) != 0) {
                    kvr_lane_fail(l, "a bad handshake answer");
                    break;
                }
                l->state = KVR_LANE_UP;
                l->rx = KVR_RX_PREFIX;
            } else if (l->rx == KVR_RX_PREFIX) {
                if (kvr_lane_prefix(l) != 0) {
                    break;
                }
                continue;
            } else {
                kvr_lane_frame_head(l);
            }
            l->rx_have = 0;
            l->rx_need = KVR_LANE_PREFIX;
            done++;
        } else if (l->rx == KVR_RX_BODY || l->rx == KVR_RX_DISCARD) {
            if (l->body_left > 0) {
                ssize_t k = l->rx == KVR_RX_BODY ? kvr_lane_read_body(l) : kvr_lane_read_discard(l);
                if (k <= 0) {
                    break;
                }
                round += (size_t)k;
            }
            if (l->body_left == 0) {
                int accepted = l->rx == KVR_RX_BODY;
                l->rx = KVR_RX_PREFIX;
                if (accepted) {
                    l->cb.on_recv_done(l->cb.arg, l->acc.op, (size_t)l->body_len, KVR_TP_OK, NULL);
                }
                done++;
            }
        } else { /* KVR_RX_NONE: the prefill reads only the decode's close */
            char c;
            ssize_t k = recv(l->fd, &c, 1, MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                kvr_lane_fail(l, k == 0 ? "closed by the peer" : strerror(errno));
            } else if (k > 0) {
                kvr_lane_fail(l, "bytes from the receiving side");
            }
            break;
        }
    }
    return done;
}

unsigned kvr_lane_progress(kvr_lane_t *l)
{
    if (l->state == KVR_LANE_FAILED) {
        return 0;
    }
    unsigned n = 0;
    if (l->tx_head != NULL) {
        size_t sent;
        n += kvr_lane_flush(l, KVR_LANE_ROUND_BYTES, &sent);
    }
    if (l->state != KVR_LANE_FAILED && l->state != KVR_LANE_CONNECTING) {
        n += kvr_lane_recv(l);
    }
    return n;
}
