/*
 * readers: one cross-memory read shared out between the caller and helper
 * threads (readers.h).
 *
 * A read is published as a ticket, one 64-bit word: the read's number in
 * the high 32 bits, its number of shares in bits 24-31, the next share to
 * take in the low 24.  A thread takes share i of read g with one
 * fetch-and-add; i below the count means the share is its own and read g
 * is not finished (the share is not done), so share[i] still describes
 * read g.  A helper that comes late adds to the index of a finished read or
 * of the next one, never takes a share twice.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include "readers.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KVR_READ_BATCH 64 /* iovecs per process_vm_readv */

/* A position in an array of pieces. */
typedef struct {
    const struct iovec *v;
    unsigned long n, i; /* pieces, the current one */
    size_t off;         /* bytes of v[i] already passed */
} kvr_rcur_t;

typedef struct {
    kvr_rcur_t loc, rem;
    size_t bytes;
    int err;
} kvr_share_t;

struct kvr_readers {
    pthread_mutex_t mu;
    pthread_cond_t go;   /* helpers wait for a read */
    pthread_cond_t done; /* the caller waits for the helpers' last shares */
    unsigned nhelpers;
    pthread_t th[KVR_READERS_MAX - 1];
    int stop;
    pid_t pid;
    kvr_share_t share[KVR_READ_SHARES_MAX];
    uint64_t ticket;       /* atomic: read number, shares, next share */
    unsigned left;         /* atomic: shares not done */
    uint64_t helper_bytes; /* atomic */
};

static uint64_t kvr_readers_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void kvr_readers_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Up to max pieces from c on, at most `bytes` in all, into out; how many. */
static unsigned long kvr_rcur_fill(const kvr_rcur_t *c, size_t bytes, struct iovec *out,
                                   unsigned long max)
{
    unsigned long k = 0;
    size_t off = c->off;
    for (unsigned long i = c->i; bytes > 0 && i < c->n && k < max; i++, off = 0) {
        size_t len = c->v[i].iov_len - off;
        len = len < bytes ? len : bytes;
        if (len > 0) {
            out[k].iov_base = (char *)c->v[i].iov_base + off;
            out[k].iov_len = len;
            k++;
            bytes -= len;
        }
    }
    return k;
}

static void kvr_rcur_skip(kvr_rcur_t *c, size_t bytes)
{
    while (bytes > 0 && c->i < c->n) {
        size_t len = c->v[c->i].iov_len - c->off;
        if (bytes < len) {
            c->off += bytes;
            return;
        }
        bytes -= len;
        c->i++;
        c->off = 0;
    }
}

/* Reads `bytes` from the remote position r into the local position l. */
static int kvr_read_span(pid_t pid, kvr_rcur_t l, kvr_rcur_t r, size_t bytes)
{
    struct iovec lb[KVR_READ_BATCH], rb[KVR_READ_BATCH];
    while (bytes > 0) {
        unsigned long nl = kvr_rcur_fill(&l, bytes, lb, KVR_READ_BATCH);
        unsigned long nr = kvr_rcur_fill(&r, bytes, rb, KVR_READ_BATCH);
        if (nl == 0 || nr == 0) {
            return EINVAL; /* fewer bytes on one side */
        }
        ssize_t got = process_vm_readv(pid, lb, nl, rb, nr, 0);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            return errno;
        }
        if (got == 0) {
            return EFAULT; /* a partial read stopped at an unmapped page */
        }
        kvr_rcur_skip(&l, (size_t)got);
        kvr_rcur_skip(&r, (size_t)got);
        bytes -= (size_t)got;
    }
    return 0;
}

/* Takes shares of the current read until none is left. */
static void kvr_readers_take(kvr_readers_t *rd, int helper)
{
    for (;;) {
        uint64_t t = __atomic_fetch_add(&rd->ticket, 1, __ATOMIC_ACQ_REL);
        unsigned k = (unsigned)(t >> 24) & 0xff, i = (unsigned)t & 0xffffff;
        if (i >= k) {
            return;
        }
        kvr_share_t *s = &rd->share[i];
        s->err = kvr_read_span(rd->pid, s->loc, s->rem, s->bytes);
        if (helper) {
            __atomic_add_fetch(&rd->helper_bytes, s->bytes, __ATOMIC_RELAXED);
        }
        if (__atomic_sub_fetch(&rd->left, 1, __ATOMIC_ACQ_REL) == 0 && helper) {
            pthread_mutex_lock(&rd->mu);
            pthread_cond_signal(&rd->done);
            pthread_mutex_unlock(&rd->mu);
        }
    }
}

static void *kvr_readers_main(void *arg)
{
    kvr_readers_t *rd = arg;
    uint32_t seen = 0;
    uint64_t since = kvr_readers_now();
    for (;;) {
        uint64_t t = __atomic_load_n(&rd->ticket, __ATOMIC_ACQUIRE);
        if ((uint32_t)(t >> 32) != seen) {
            seen = (uint32_t)(t >> 32);
            kvr_readers_take(rd, 1);
            since = kvr_readers_now();
            continue;
        }
        if (__atomic_load_n(&rd->stop, __ATOMIC_ACQUIRE)) {
            return NULL;
        }
        if (kvr_readers_now() - since < KVR_READERS_SPIN_NS) {
            kvr_readers_relax();
            continue;
        }
        pthread_mutex_lock(&rd->mu);
        while ((uint32_t)(__atomic_load_n(&rd->ticket, __ATOMIC_ACQUIRE) >> 32) == seen &&
               !__atomic_load_n(&rd->stop, __ATOMIC_ACQUIRE)) {
            pthread_cond_wait(&rd->go, &rd->mu);
        }
        pthread_mutex_unlock(&rd->mu);
    }
}

kvr_readers_t *kvr_readers_new(unsigned nthreads)
{
    if (nthreads == 0 || nthreads > KVR_READERS_MAX) {
        return NULL;
    }
    kvr_readers_t *rd = calloc(1, sizeof(*rd));
    if (rd == NULL) {
        return NULL;
    }
    pthread_mutex_init(&rd->mu, NULL);
    pthread_cond_init(&rd->go, NULL);
    pthread_cond_init(&rd->done, NULL);
    for (unsigned i = 0; i + 1 < nthreads; i++) {
        if (pthread_create(&rd->th[i], NULL, kvr_readers_main, rd) != 0) {
            kvr_readers_free(rd);
            return NULL;
        }
        rd->nhelpers++;
    }
    return rd;
}

void kvr_readers_free(kvr_readers_t *rd)
{
    if (rd == NULL) {
        return;
    }
    pthread_mutex_lock(&rd->mu);
    __atomic_store_n(&rd->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&rd->go);
    pthread_mutex_unlock(&rd->mu);
    for (unsigned i = 0; i < rd->nhelpers; i++) {
        pthread_join(rd->th[i], NULL);
    }
    pthread_cond_destroy(&rd->done);
    pthread_cond_destroy(&rd->go);
    pthread_mutex_destroy(&rd->mu);
    free(rd);
}

static size_t kvr_iov_total(const struct iovec *v, unsigned long n)
{
    size_t t = 0;
    for (unsigned long i = 0; i < n; i++) {
        t += v[i].iov_len;
    }
    return t;
}

/* Waits until every share of the current read is done. */
static void kvr_readers_wait(kvr_readers_t *rd)
{
    uint64_t since = kvr_readers_now();
    while (__atomic_load_n(&rd->left, __ATOMIC_ACQUIRE) != 0) {
        if (kvr_readers_now() - since < KVR_READERS_SPIN_NS) {
            kvr_readers_relax();
            continue;
        }
        pthread_mutex_lock(&rd->mu);
        while (__atomic_load_n(&rd->left, __ATOMIC_ACQUIRE) != 0) {
            pthread_cond_wait(&rd->done, &rd->mu);
        }
        pthread_mutex_unlock(&rd->mu);
    }
}

int kvr_readers_read(kvr_readers_t *rd, pid_t pid, const struct iovec *loc, unsigned long nl,
                     const struct iovec *rem, unsigned long nr, uint64_t *helper_bytes)
{
    size_t total = kvr_iov_total(loc, nl);
    if (helper_bytes != NULL) {
        *helper_bytes = 0;
    }
    if (total != kvr_iov_total(rem, nr)) {
        return EINVAL;
    }
    kvr_rcur_t l = {loc, nl, 0, 0}, r = {rem, nr, 0, 0};
    if (rd == NULL || rd->nhelpers == 0 || total < 2 * (size_t)KVR_READ_SHARE_BYTES) {
        return kvr_read_span(pid, l, r, total);
    }
    size_t k = total / KVR_READ_SHARE_BYTES;
    k = k < KVR_READ_SHARES_MAX ? k : KVR_READ_SHARES_MAX;
    size_t per = (total / k) & ~(size_t)4095; /* >= 256 KiB - 4 KiB: page-aligned cuts */
    for (size_t i = 0; i < k; i++) {
        kvr_share_t *s = &rd->share[i];
        s->loc = l;
        s->rem = r;
        s->bytes = i + 1 < k ? per : total - per * (k - 1);
        s->err = 0;
        kvr_rcur_skip(&l, s->bytes);
        kvr_rcur_skip(&r, s->bytes);
    }
    rd->pid = pid;
    __atomic_store_n(&rd->left, (unsigned)k, __ATOMIC_RELAXED);
    __atomic_store_n(&rd->helper_bytes, 0, __ATOMIC_RELAXED);
    uint64_t gen = (__atomic_load_n(&rd->ticket, __ATOMIC_RELAXED) >> 32) + 1;
    __atomic_store_n(&rd->ticket, (gen << 32) | ((uint64_t)k << 24), __ATOMIC_RELEASE);
    pthread_mutex_lock(&rd->mu);
    pthread_cond_broadcast(&rd->go);
    pthread_mutex_unlock(&rd->mu);
    kvr_readers_take(rd, 0);
    kvr_readers_wait(rd);
    if (helper_bytes != NULL) {
        *helper_bytes = __atomic_load_n(&rd->helper_bytes, __ATOMIC_RELAXED);
    }
    for (size_t i = 0; i < k; i++) {
        if (rd->share[i].err != 0) {
            return rd->share[i].err;
        }
    }
    return 0;
}
