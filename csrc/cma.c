/*
 * cma: cross-memory reads between a prefill and a decode on one host.
 *
 * Over UCX's shared-memory FIFO every byte of a large piece is copied
 * twice, once by each process.  When both sides set cross_memory_bytes and
 * share a host, a message of at least that many bytes in at most
 * KVR_READ_PIECES_MAX source pieces goes as a read descriptor instead: a
 * small eager data message (KVR_AM_FLAG_READ) whose payload names the
 * room's lease word in the prefill and the source pieces; the decode checks the header exactly as for data (kvr_on_data:
 * positions inside the room, each (buffer, position) claimed once, the
 * room receiving) and reads the bytes into its own pages with
 * process_vm_readv: one kernel copy, made by a free reader thread while the
 * handler goes on (readers.h; the op stays in flight until
 * kvr_cma_poll_locked ends it), or by the handler itself when every reader
 * has a read.  Every error of the read is the
 * decode's to report (never UCX's, which aborts the process on a dead
 * peer): the room fails with PEER_LOST (the prefill is gone) or TRANSPORT.
 *
 * The offer, at HELLO: the decode offers when it sets cross_memory_bytes,
 * has host buffers only and knows the host's boot id; the prefill accepts
 * when it does too and the boot ids are equal, and answers with its pid
 * and the address of its epoch.  The decode reads that epoch from that
 * pid: only if it reads the value it knows does it take descriptors;
 * otherwise (another pid namespace, ptrace rules) it says HELLO again
 * without the offer, and the data comes as bytes.
 *
 * The source pages: the prefill keeps them until ROOM_DONE (its room's
 * Success) or until its room fails, when the caller may reuse them.  A
 * read may still be queued then (a descriptor waiting in a frozen decode's
 * FIFO), so each descriptor also names the room's lease, a word in the
 * prefill that holds the decode room's tag while the pages are the room's
 * and is cleared, under the engine lock, before the room can be seen as
 * failed or is freed.  The decode reads the lease after the bytes: a
 * cleared lease means the bytes may be from reused pages, and the room
 * fails.  (A store to the pages after the failure follows the clearing,
 * and the read of the lease follows the read of the bytes.)
 *
 * Trust: descriptors are taken only on the worker of the room's prefill,
 * with its epoch, and the pid came on the (authenticated) control
 * connection; the source address is the prefill's word, like the bytes it
 * would otherwise send: it selects only what of the prefill's memory lands
 * in the room's own pages.
 *
 * Engine lock held throughout (engine thread, or poll()'s caller inside
 * UCX progress for the decode's reads), except by the reader threads,
 * which touch only their read (readers.h).
 */
#define _GNU_SOURCE /* process_vm_readv */
#include "engine_int.h"
#include "readers.h"
#include "testhook.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* A descriptor's payload: the lease's address u64, then per source piece
 * its address u64 and length u64 (host order: one host).  At most 1 KiB,
 * so that UCX always sends it eagerly (the decode reads it in its
 * handler). */
#define KVR_CMA_DESC_MAX (8 + 16 * KVR_READ_PIECES_MAX)

/* The host's boot id (16 bytes); -1 if it cannot be read. */
static int kvr_cma_boot_id(unsigned char out[16])
{
    char text[64];
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL) {
        return -1;
    }
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    unsigned k = 0;
    for (size_t i = 0; i < n && k < 32; i++) {
        char c = text[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) {
            continue; /* the dashes */
        }
        if (k % 2 == 0) {
            out[k / 2] = (unsigned char)(v << 4);
        } else {
            out[k / 2] |= (unsigned char)v;
        }
        k++;
    }
    return k == 32 ? 0 : -1;
}

/* Whether this side may take part at all. */
static int kvr_cma_enabled(const kvr_engine_t *e)
{
    return e->cfg.cross_memory_bytes > 0 && e->ndev == 0;
}

/* A reader thread finished a read: the engine ends its op. */
static void kvr_cma_notify(void *e)
{
    kvr_wake(e);
}

/* The reader threads of the decode, once a prefill accepted its reads
 * (none while every prefill is on another host). */
static void kvr_cma_readers_start(kvr_engine_t *e)
{
    if (e->readers != NULL || e->cfg.cross_memory_readers < 2) {
        return;
    }
    e->readers = kvr_readers_new(e->cfg.cross_memory_readers - 1, kvr_cma_notify, e);
    if (e->readers == NULL) {
        kvr_log_write(&e->log, KVR_LOG_WARNING,
                      "decode rank %d could not start %u cross-memory reader threads: its "
                      "reads are made by one thread",
                      e->rank, e->cfg.cross_memory_readers - 1);
        e->cfg.cross_memory_readers = 1; /* not tried again */
    }
}

void kvr_cma_offer(kvr_engine_t *e, const kvr_peer_t *p, kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    m->has_cma = kvr_cma_enabled(e) && !p->cma_refused && kvr_cma_boot_id(m->boot_id) == 0;
}

void kvr_cma_accept(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *hello, kvr_msg_t *ok)
{
    KVR_ASSERT_LOCKED(e);
    p->cma = 0;
    if (!hello->has_cma || !kvr_cma_enabled(e) || kvr_cma_boot_id(ok->boot_id) != 0 ||
        memcmp(ok->boot_id, hello->boot_id, sizeof(ok->boot_id)) != 0) {
        return;
    }
    p->cma = 1;
    ok->has_cma = 1;
    ok->pid = (uint32_t)getpid();
    ok->probe_addr = (uint64_t)(uintptr_t)&e->epoch;
}

int kvr_cma_probe(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *ok)
{
    KVR_ASSERT_LOCKED(e);
    p->cma = 0;
    if (!ok->has_cma) {
        return 0;
    }
    uint64_t v = 0;
    struct iovec loc = {&v, sizeof(v)}, rem = {(void *)(uintptr_t)ok->probe_addr, sizeof(v)};
    kvr_read_job_t probe = {.pid = (pid_t)ok->pid, .loc = &loc, .nl = 1, .nr = 1};
    probe.rem[0] = rem;
    kvr_read_job_run(&probe);
    int err = probe.err;
    if (err == 0 && v == p->epoch) {
        p->cma = 1;
        p->cma_pid = ok->pid;
        kvr_cma_readers_start(e);
        return 0;
    }
    p->cma_refused = 1;
    kvr_log_write(&e->log, KVR_LOG_WARNING,
                  "decode rank %d cannot read the memory of %s (pid %" PRIu32 "): %s; its "
                  "data comes through UCX",
                  e->rank, p->name, ok->pid, err ? strerror(err) : "another process answered");
    return -1;
}

int kvr_cma_post_locked(kvr_engine_t *e, kvr_room_t *r, kvr_op_t *op, kvr_am_header_t *wire,
                        uint32_t niov)
{
    KVR_ASSERT_LOCKED(e);
    /* Reads stand in for UCX's shared memory: where UCX_TLS leaves it out
     * (the endpoint goes over tcp) the bytes go that way too. */
    if (!r->peer->cma || !kvr_cma_enabled(e) || !kvr_tp_ep_is_shm(r->peer->ep) ||
        niov > KVR_READ_PIECES_MAX ||
        wire->kind != KVR_AM_KIND_KV || op->len < e->cfg.cross_memory_bytes ||
        (op->bounce = malloc(8 + 16 * (size_t)niov)) == NULL) {
        return 0; /* sent as bytes */
    }
    kvr_eroom_t *x = kvr_eroom(r);
    x->lease = r->dst_tag;
    wire->flags |= KVR_AM_FLAG_READ;
    uint64_t *d = op->bounce; /* freed with the op (kvr_op_unstage) */
    d[0] = e->test_corrupt == KVR_TEST_CORRUPT_LEASE ? (uint64_t)(uintptr_t)&e->epoch
                                                      : (uint64_t)(uintptr_t)&x->lease;
    for (uint32_t i = 0; i < niov; i++) {
        d[1 + 2 * i] = e->test_corrupt == KVR_TEST_CORRUPT_SRC ? 4096 /* never mapped */
                                                               : (uint64_t)(uintptr_t)op->iov[i].buf;
        d[2 + 2 * i] = op->iov[i].len;
    }
    /* UCX reads the iov until the send completes: it lives in the op. */
    op->iov[0].buf = d;
    op->iov[0].len = 8 + 16 * (size_t)niov;
    return 1;
}

void kvr_cma_lease_end(kvr_room_t *r)
{
    /* A volatile store: the clearing must reach memory before anything
     * the caller does to the pages after this (the lock's release orders
     * it; volatile keeps the compiler from dropping a store to a room
     * about to be freed). */
    *(volatile uint64_t *)&kvr_eroom(r)->lease = 0;
}

/* Ends a read's op: the bytes landed, unless the read failed or the lease
 * was no longer the room's. */
static void kvr_cma_read_end_locked(kvr_engine_t *e, kvr_op_t *op)
{
    kvr_room_t *r = op->room;
    kvr_read_job_t *j = op->bounce; /* freed with the op */
    r->peer->last_data_ns = kvr_now_ns();
    if (j->err == 0 && j->lease != r->tag && !r->failing) {
        /* The prefill's room failed (or went) before the read ended: the
         * pages may hold someone else's bytes by now. */
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1,
                              "%s released the pages before they were read", r->peer->name);
    } else if (j->err == ESRCH) {
        kvr_room_failf_locked(e, r, KVR_PEER_LOST, 1, "%s lost: cross-memory read: %s",
                              r->peer->name, strerror(j->err));
    } else if (j->err != 0) {
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "cross-memory read from %s failed: %s",
                              r->peer->name, strerror(j->err));
    } else if (!r->failing) {
        e->stats.cma_reads++;
        e->stats.cma_bytes += op->len;
        e->stats.cma_helper_bytes += j->by_helper ? op->len : 0;
    }
    /* A failed read ends as failed (the room's first failure stands). */
    kvr_op_end_locked(e, op, r->failing ? KVR_TP_ERROR : KVR_TP_OK, "cross-memory read");
}

unsigned kvr_cma_poll_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    unsigned n = 0;
    for (kvr_read_job_t *j = kvr_readers_done(e->readers); j != NULL; n++) {
        kvr_read_job_t *next = j->next;
        kvr_cma_read_end_locked(e, j->arg);
        j = next;
    }
    return n;
}

int kvr_cma_reading(const kvr_room_t *r)
{
    for (const kvr_op_t *op = kvr_eroom((kvr_room_t *)r)->ops; op != NULL; op = op->next) {
        if (op->stage == KVR_STAGE_READ) {
            return 1;
        }
    }
    return 0;
}

const char *kvr_cma_read_locked(kvr_engine_t *e, kvr_room_t *r, const kvr_am_header_t *h,
                                const kvr_slice_t *s, uint64_t want, const void *desc,
                                size_t len)
{
    KVR_ASSERT_LOCKED(e);
    if (!r->peer->cma || !kvr_cma_enabled(e)) {
        return "read descriptor not offered";
    }
    if (desc == NULL || len < 8 + 16 || len > KVR_CMA_DESC_MAX || (len - 8) % 16 != 0) {
        return "read descriptor has the wrong length";
    }
    uint64_t d[KVR_CMA_DESC_MAX / 8];
    memcpy(d, desc, len);
    unsigned long nr = (unsigned long)(len - 8) / 16;
    uint64_t total = 0;
    for (unsigned long i = 0; i < nr; i++) {
        if (d[2 + 2 * i] == 0 || d[2 + 2 * i] > want - total) {
            return "read descriptor's pieces do not match the run length";
        }
        total += d[2 + 2 * i];
    }
    if (total != want) {
        return "read descriptor's pieces do not match the run length";
    }
    int claim = kvr_room_claim(r, 0, e->nkv, e->naux, h->buf, h->nbuf, h->pos, h->npages);
    if (claim == KVR_CLAIM_REPEATED) {
        return "data for positions already received";
    }
    uint32_t niov =
        kvr_msg_pieces(e, h, r->pages, r->aux_index, r->states, &r->lists, s, NULL, NULL, &want);
    kvr_op_t *op = claim == KVR_CLAIM_OK ? kvr_op_new(r, want, niov) : NULL;
    kvr_read_job_t *j = op != NULL ? calloc(1, sizeof(*j)) : NULL;
    if (j == NULL) {
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory receiving data");
        if (op != NULL) {
            kvr_op_end_locked(e, op, KVR_TP_ERROR, "out of memory");
        }
        return NULL;
    }
    kvr_msg_pieces(e, h, r->pages, r->aux_index, r->states, &r->lists, s, NULL, op->iov, &want);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING); /* first byte */
    op->bounce = j;
    j->pid = (pid_t)r->peer->cma_pid;
    j->loc = (const struct iovec *)op->iov; /* kvr_tp_iov_t is laid out as struct iovec */
    j->nl = niov;
    for (unsigned long i = 0; i < nr; i++) {
        j->rem[i].iov_base = (void *)(uintptr_t)d[1 + 2 * i];
        j->rem[i].iov_len = (size_t)d[2 + 2 * i];
    }
    j->nr = nr;
    j->lease_addr = d[0];
    j->arg = op;
    if (e->readers != NULL && kvr_readers_submit(e->readers, j) == 0) {
        /* A helper reads it; the op ends in kvr_cma_poll_locked.  Until
         * then the room cannot be seen as failed (the op is in flight)
         * nor be drained by force (kvr_cma_reading). */
        op->stage = KVR_STAGE_READ;
        return NULL;
    }
    kvr_read_job_run(j);
    kvr_cma_read_end_locked(e, op);
    return NULL;
}
