/*
 * readers: helper threads that make cross-memory reads (process_vm_readv)
 * while the thread that handed them over goes on.
 *
 * One thread copying cold memory across processes moves about 5 GB/s
 * here, and the kernel copies for several threads at once; but two threads
 * reading one piece of a few hundred KiB contend for the source's page
 * table locks (one per 2 MiB of the source), so reads run in parallel whole:
 * a large room arrives as many read descriptors back to back, and while a
 * helper reads one, the handling thread takes the next.
 *
 * A read is a job: the caller submits it when a helper is free (never
 * queued behind another: submit refuses when every helper has one, and the
 * caller then runs it itself); the helper reads the bytes, then the lease
 * word (cma.c), puts the job on the done list and calls notify.  The caller
 * owns the job and everything it points to until it took it back from the
 * done list (kvr_readers_done) or freed the pool.
 *
 * A helper that finished a job spins for KVR_READERS_SPIN_NS waiting for
 * the next one (waking a sleeping thread costs tens of microseconds on a
 * virtual machine), then sleeps; an idle pool costs nothing.
 *
 * Pure logic over pthreads and process_vm_readv (the clock from registry.h):
 * no engine, no UCX (tested in tests/c/test_readers.c, also under TSan).
 */
#ifndef KVR_READERS_H
#define KVR_READERS_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define KVR_READERS_MAX 16 /* threads that read, the handling thread included */
#define KVR_READ_PIECES_MAX 63 /* source pieces of one read (a descriptor's) */
#define KVR_READERS_SPIN_NS (200 * 1000ull)

typedef struct kvr_read_job {
    /* in */
    pid_t pid;
    const struct iovec *loc; /* the destination pieces, nl of them */
    unsigned long nl;
    struct iovec rem[KVR_READ_PIECES_MAX]; /* the source pieces, nr */
    unsigned long nr;
    uint64_t lease_addr; /* read after the bytes into lease (0: none) */
    void *arg;           /* the caller's */
    /* out */
    int err;        /* 0, or an errno (EFAULT: stopped at an unmapped page) */
    uint64_t lease; /* the word at lease_addr once the bytes were read */
    int by_helper;  /* a helper ran it */
    struct kvr_read_job *next; /* on the done list */
} kvr_read_job_t;

typedef struct kvr_readers kvr_readers_t;

/* A pool of nhelpers threads (1..KVR_READERS_MAX - 1); notify(arg) is called
 * from a helper after it put a job on the done list.  NULL if out of memory
 * or a thread cannot start. */
kvr_readers_t *kvr_readers_new(unsigned nhelpers, void (*notify)(void *), void *arg);

/* Waits for the jobs the helpers have, stops and joins them.  Jobs done
 * and not taken back stay the caller's.  NULL is a no-op. */
void kvr_readers_free(kvr_readers_t *rd);

/* Hands j to a free helper: 0; -1 when every helper has a job (run it on
 * this thread: kvr_read_job_run). */
int kvr_readers_submit(kvr_readers_t *rd, kvr_read_job_t *j);

/* The jobs done since the last call, linked through next (NULL: none; a
 * cheap check when there are none). */
kvr_read_job_t *kvr_readers_done(kvr_readers_t *rd);

/* Runs j on this thread: the bytes, then the lease word; sets err, lease. */
void kvr_read_job_run(kvr_read_job_t *j);

#endif
