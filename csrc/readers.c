/*
 * readers: helper threads for cross-memory reads (readers.h).
 *
 * The queue, the done list and the count of jobs the helpers have (busy)
 * are under mu; `queued` and `ndone` mirror the queue's and the done list's
 * lengths for lock-free checks (a spinning helper, the engine's poll).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include "readers.h"
#include "registry.h" /* kvr_now_ns */

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#define KVR_READ_BATCH 64 /* iovecs per process_vm_readv */

struct kvr_readers {
    pthread_mutex_t mu;
    pthread_cond_t go; /* helpers wait for a job */
    kvr_read_job_t *head, *tail;
    kvr_read_job_t *done;
    unsigned busy;   /* jobs queued or running */
    unsigned queued; /* atomic */
    unsigned ndone;  /* atomic */
    int stop;        /* atomic */
    void (*notify)(void *);
    void *arg;
    unsigned nhelpers;
    pthread_t th[KVR_READERS_MAX - 1];
};

static void kvr_readers_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A position in an array of pieces. */
typedef struct {
    const struct iovec *v;
    unsigned long n, i; /* pieces, the current one */
    size_t off;         /* bytes of v[i] already passed */
} kvr_rcur_t;

/* Up to max pieces from c on into out; how many. */
static unsigned long kvr_rcur_fill(const kvr_rcur_t *c, struct iovec *out, unsigned long max)
{
    unsigned long k = 0;
    size_t off = c->off;
    for (unsigned long i = c->i; i < c->n && k < max; i++, off = 0) {
        if (c->v[i].iov_len > off) {
            out[k].iov_base = (char *)c->v[i].iov_base + off;
            out[k].iov_len = c->v[i].iov_len - off;
            k++;
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

static size_t kvr_iov_total(const struct iovec *v, unsigned long n)
{
    size_t t = 0;
    for (unsigned long i = 0; i < n; i++) {
        t += v[i].iov_len;
    }
    return t;
}

/* Reads rem[0..nr) of pid into loc[0..nl) (equal totals): 0 or an errno. */
static int kvr_read_all(pid_t pid, const struct iovec *loc, unsigned long nl,
                        const struct iovec *rem, unsigned long nr)
{
    size_t bytes = kvr_iov_total(loc, nl);
    if (bytes != kvr_iov_total(rem, nr)) {
        return EINVAL;
    }
    kvr_rcur_t l = {loc, nl, 0, 0}, r = {rem, nr, 0, 0};
    struct iovec lb[KVR_READ_BATCH], rb[KVR_READ_BATCH];
    while (bytes > 0) {
        unsigned long nlb = kvr_rcur_fill(&l, lb, KVR_READ_BATCH);
        unsigned long nrb = kvr_rcur_fill(&r, rb, KVR_READ_BATCH);
        ssize_t got = process_vm_readv(pid, lb, nlb, rb, nrb, 0);
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

void kvr_read_job_run(kvr_read_job_t *j)
{
    j->lease = 0;
    j->err = kvr_read_all(j->pid, j->loc, j->nl, j->rem, j->nr);
    if (j->err == 0 && j->lease_addr != 0) {
        struct iovec lw = {&j->lease, sizeof(j->lease)};
        struct iovec lr = {(void *)(uintptr_t)j->lease_addr, sizeof(j->lease)};
        j->err = kvr_read_all(j->pid, &lw, 1, &lr, 1);
    }
}

/* A helper's next job, after spinning and then sleeping for it; NULL when
 * the pool stops and the queue is empty. */
static kvr_read_job_t *kvr_readers_next(kvr_readers_t *rd)
{
    uint64_t since = kvr_now_ns();
    for (unsigned spins = 0; __atomic_load_n(&rd->queued, __ATOMIC_ACQUIRE) == 0 &&
                             !__atomic_load_n(&rd->stop, __ATOMIC_ACQUIRE);
         spins++) {
        if (spins % 64 == 63 && kvr_now_ns() - since > KVR_READERS_SPIN_NS) {
            break;
        }
        kvr_readers_relax();
    }
    pthread_mutex_lock(&rd->mu);
    while (rd->head == NULL && !__atomic_load_n(&rd->stop, __ATOMIC_ACQUIRE)) {
        pthread_cond_wait(&rd->go, &rd->mu);
    }
    kvr_read_job_t *j = rd->head;
    if (j != NULL) {
        rd->head = j->next;
        if (rd->head == NULL) {
            rd->tail = NULL;
        }
        __atomic_store_n(&rd->queued, rd->queued - 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&rd->mu);
    return j;
}

static void *kvr_readers_main(void *arg)
{
    kvr_readers_t *rd = arg;
    kvr_read_job_t *j;
    while ((j = kvr_readers_next(rd)) != NULL) {
        kvr_read_job_run(j);
        j->by_helper = 1;
        pthread_mutex_lock(&rd->mu);
        j->next = rd->done;
        rd->done = j;
        rd->busy--;
        __atomic_store_n(&rd->ndone, rd->ndone + 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&rd->mu);
        rd->notify(rd->arg);
    }
    return NULL;
}

kvr_readers_t *kvr_readers_new(unsigned nhelpers, void (*notify)(void *), void *arg)
{
    if (nhelpers == 0 || nhelpers >= KVR_READERS_MAX || notify == NULL) {
        return NULL;
    }
    kvr_readers_t *rd = calloc(1, sizeof(*rd));
    if (rd == NULL) {
        return NULL;
    }
    pthread_mutex_init(&rd->mu, NULL);
    pthread_cond_init(&rd->go, NULL);
    rd->notify = notify;
    rd->arg = arg;
    for (unsigned i = 0; i < nhelpers; i++) {
        if (pthread_create(&rd->th[i], NULL, kvr_readers_main, rd) != 0) {
            kvr_readers_free(rd);
            return NULL;
        }
        pthread_setname_np(rd->th[i], "kvr-reader");
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
    pthread_cond_destroy(&rd->go);
    pthread_mutex_destroy(&rd->mu);
    free(rd);
}

int kvr_readers_submit(kvr_readers_t *rd, kvr_read_job_t *j)
{
    pthread_mutex_lock(&rd->mu);
    if (rd->busy >= rd->nhelpers) {
        pthread_mutex_unlock(&rd->mu);
        return -1;
    }
    rd->busy++;
    j->next = NULL;
    j->by_helper = 0;
    if (rd->tail != NULL) {
        rd->tail->next = j;
    } else {
        rd->head = j;
    }
    rd->tail = j;
    __atomic_store_n(&rd->queued, rd->queued + 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&rd->go);
    pthread_mutex_unlock(&rd->mu);
    return 0;
}

kvr_read_job_t *kvr_readers_done(kvr_readers_t *rd)
{
    if (rd == NULL || __atomic_load_n(&rd->ndone, __ATOMIC_ACQUIRE) == 0) {
        return NULL;
    }
    pthread_mutex_lock(&rd->mu);
    kvr_read_job_t *list = rd->done;
    rd->done = NULL;
    __atomic_store_n(&rd->ndone, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&rd->mu);
    return list;
}
