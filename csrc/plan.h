/*
 * plan: the prefill's posting plan, pure logic, no I/O.  Given a room's
 * page lists, the buffers' item lengths and the coalescing limits, it says
 * which data messages carry the room: one message at a time, from a cursor
 * the room keeps, so that posting can stop (no free staging slot, more
 * pages not handed to send() yet) and resume where it stopped.
 *
 * Messages: a run of positions consecutive on both sides whose bytes (in
 * the widest KV buffer) reach run_bytes, or max_pages positions, goes alone,
 * as one contiguous message per buffer; shorter runs in a row are coalesced
 * into one scattered message per buffer of at most cap bytes.  Buffers
 * share a message while it stays within merge bytes and KVR_MAX_IOV pieces.
 * After the last position, the aux rows (if the decode asked for one).
 *
 * Thread: any; the functions touch only their arguments.
 */
#ifndef KVR_PLAN_H
#define KVR_PLAN_H

#include <stdint.h>

#include "wire.h"

/* Most pieces in one coalesced data message. */
#define KVR_MAX_IOV 1024

typedef struct {
    const int32_t *src_pages;   /* the prefill's pages, by position */
    const int32_t *dst_pages;   /* the decode's pages, by position */
    uint32_t given;             /* positions handed to send() so far */
    uint32_t total_pages;       /* positions of the room */
    int aux;                    /* the decode asked for an aux row */
    uint32_t nkv, naux;
    const uint64_t *kv_item, *aux_item; /* item lengths per buffer */
    uint64_t kv_item_max;       /* the widest KV item (> 0) */
    uint64_t run_bytes;         /* a run this long goes alone */
    uint64_t cap;               /* most bytes per buffer of a coalesced message */
    uint64_t merge;             /* buffers share a message within this many bytes */
    uint32_t max_pages;         /* most positions in one message (> 0) */
} kvr_plan_t;

/* Where posting stands; all zero before the first message. */
typedef struct {
    uint32_t posted;  /* positions whose messages were all planned */
    uint32_t end;     /* end of the position range in progress (0: none) */
    uint32_t buf;     /* next KV buffer of that range */
    uint32_t aux_buf; /* next aux buffer */
    int aux_done;     /* the aux rows are planned (or none was asked for) */
} kvr_plan_cursor_t;

/*
 * Plans the next message after *c: fills h's kind, buf, nbuf, pos and
 * npages (not tag or epoch), moves *c past it and returns 1; returns 0 (and
 * leaves *c unless the aux part is found empty) when nothing more can go
 * until more positions are given.  A caller that cannot post the message
 * keeps its old cursor and asks again later; kvr_plan_hold records in it
 * the range the message opened, so the retry plans the same message.
 */
int kvr_post_plan(const kvr_plan_t *p, kvr_plan_cursor_t *c, kvr_am_header_t *h);
void kvr_plan_hold(kvr_plan_cursor_t *c, const kvr_am_header_t *h);

/*
 * How many buffers from b on (of n, item lengths items) share one message of
 * npages pages with `pieces` pieces per buffer: at least one; more while the
 * message stays within `merge` bytes and KVR_MAX_IOV pieces.
 */
uint16_t kvr_plan_buf_group(const uint64_t *items, uint32_t n, uint32_t b, uint32_t npages,
                            uint32_t pieces, uint64_t merge);

#endif
