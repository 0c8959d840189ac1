/*
 * pagecopy: copying an eager data message's payload into the destination
 * pages.  Pure (no I/O, no UCX); any thread.
 *
 * The pieces of an eager message of at most KVR_TP_SHM_EAGER_BYTES (a
 * small room's, over shared memory) that are at least KVR_PAGE_COPY_STREAM_MIN
 * long are copied with streaming (non-temporal) stores: KV pages land in a
 * large pool whose lines are not in the cache, and a plain copy first reads
 * every destination line in.  64 scattered 4 KiB pages, cold: 25-32 us
 * streamed against 36-48 us with memcpy (C loop, this 2-core host); the
 * 64-buffer one-page room over shared memory, spinning: p50 92-102 against
 * 96-140 us (one A/B script).  Larger messages (tcp's, up to 256 KiB) are
 * copied with memcpy: streamed, random 64 KiB pages over tcp moved about
 * 10 % slower (3.13 against 3.45 GB/s, medians of 10 rounds each).
 */
#ifndef KVR_PAGECOPY_H
#define KVR_PAGECOPY_H

#include <stddef.h>

#define KVR_PAGE_COPY_STREAM_MIN 1024

/* Copies len bytes; stream: with streaming stores where the CPU has them
 * and len is at least KVR_PAGE_COPY_STREAM_MIN (then kvr_page_copy_fence
 * before the copy is published). */
void kvr_page_copy(void *dst, const void *src, size_t len, int stream);
/* Orders streamed stores before what follows (the room's completion, which
 * another thread reads). */
void kvr_page_copy_fence(void);

#endif
