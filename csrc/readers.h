/*
 * readers: a cross-memory read (process_vm_readv) shared out between the
 * calling thread and a few helper threads.
 *
 * One thread copying cold memory across processes moves about 5 GB/s here;
 * the kernel copies in parallel for several threads (two: 2x).  A read of
 * at least 2 x KVR_READ_SHARE_BYTES is cut into shares of about that many
 * bytes (page-aligned cuts); the caller and the helpers take shares in turn
 * until none is left, and the call returns when every share is done.  So
 * the read is exactly as synchronous as a single process_vm_readv: nothing
 * lands after it returned (cma.c relies on it, under the engine lock).
 *
 * A helper that finished a share spins for KVR_READERS_SPIN_NS waiting for
 * the next read (a large room arrives as many reads back to back; waking a
 * sleeping thread costs tens of microseconds on a virtual machine) and then
 * sleeps; an idle pool costs nothing.  The caller never waits for a helper
 * to wake: a share no helper took is the caller's.
 *
 * Pure logic over pthreads and process_vm_readv: no engine, no UCX (tested
 * in tests/c/test_readers.c, also under TSan).
 */
#ifndef KVR_READERS_H
#define KVR_READERS_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define KVR_READERS_MAX 16               /* threads per read, the caller included */
#define KVR_READ_SHARE_BYTES (256u << 10) /* a share's size (the last may be larger) */
#define KVR_READ_SHARES_MAX 64           /* shares per read (larger reads: larger shares) */
#define KVR_READERS_SPIN_NS (200 * 1000ull)

typedef struct kvr_readers kvr_readers_t;

/* A pool in which nthreads threads copy a read, the caller included (so
 * nthreads - 1 helper threads, started here); nthreads 1: the caller
 * alone, no thread.  NULL if out of memory or a thread cannot start. */
kvr_readers_t *kvr_readers_new(unsigned nthreads);

/* Stops and joins the helpers; no read may be running.  NULL is a no-op. */
void kvr_readers_free(kvr_readers_t *rd);

/* Reads the pieces rem[0..nr) of process pid, in order, into the pieces
 * loc[0..nl) (the same number of bytes in all); neither array is changed.
 * rd NULL: the caller alone.  One read at a time per pool (the caller
 * serialises).  0, or the errno of the first share that failed (EFAULT for
 * a read that stopped at an unmapped page, EINVAL for unequal totals).
 * *helper_bytes (if not NULL) gets the bytes the helpers read. */
int kvr_readers_read(kvr_readers_t *rd, pid_t pid, const struct iovec *loc, unsigned long nl,
                     const struct iovec *rem, unsigned long nr, uint64_t *helper_bytes);

#endif
