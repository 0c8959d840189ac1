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
 * After the last position, the rows of the row buffers the decode asked
 * for: the aux row, and the slot of each state component it named.
 *
 * Thread: any; the functions touch only their arguments.
 */
#ifndef KVR_PLAN_H
#define KVR_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

/* Most pieces in one coalesced data message. */
#define KVR_MAX_IOV 1024

/*
 * The slot lists of a room's list components (state.c: sliding-window
 * pages and other state named by a list of slots per request): component
 * c's slots are slots[at[c], at[c] + n[c]); n[c] is 0 for a component not
 * asked for and for one-slot components.  Owned by the room.
 */
typedef struct {
    int32_t *slots;
    uint32_t at[KVR_MAX_STATES], n[KVR_MAX_STATES];
    uint32_t total;
} kvr_slot_lists_t;

/*
 * Heads: how one side's ranks hold the KV heads (MHA/GQA), or one latent
 * cache (MLA, total 1 head held whole by every rank).  A rank of tp_size
 * over total heads holds, when tp_size <= total, the total / tp_size heads
 * from tp_rank * heads; when tp_size > total (replicated heads, and MLA),
 * the one head tp_rank / (tp_size / total), replica tp_rank % (tp_size /
 * total).  A page of a KV buffer is [page_size tokens][heads][bytes per
 * head], so a rank's page holds page_size rows of heads * head bytes.
 * heads == 0: no head layout given (each decode rank talks to the prefill
 * rank of its own number, layouts equal).
 */
typedef struct {
    uint32_t tp_size, tp_rank;
    uint32_t heads;       /* KV heads in this rank's pages */
    uint32_t total_heads; /* KV heads of the model (1 for MLA) */
} kvr_heads_t;

/* One link of a prefill and a decode rank: the heads [head, head + nheads)
 * go from prefill rank `prefill` to decode rank `decode`.  nheads 0: the
 * decode rank only tells a prefill rank nobody reads from that the room
 * needs nothing from it. */
typedef struct {
    uint32_t prefill, decode;
    uint32_t head, nheads;
} kvr_link_t;

/* Where one link's heads sit in one side's page rows: from head `first` of
 * the row, n heads, of a row of `heads` heads.  n == heads: whole rows
 * (the page is contiguous); n == 0: nothing. */
typedef struct {
    uint32_t first, n, heads;
} kvr_slice_t;

/* 0 if h is a layout its side can have, else -1 with why ("prefill" or
 * "decode" in side). */
int kvr_heads_check(const kvr_heads_t *h, const char *side, char *why, size_t n);
/* The first head rank r of h holds. */
uint32_t kvr_heads_first(const kvr_heads_t *h, uint32_t rank);
/*
 * The links of prefill rank `rank` (decode == 0) or decode rank `rank`
 * (decode == 1) between a prefill of layout pre and a decode of layout dec
 * (both checked, same total), in order: each decode head is read from
 * exactly one prefill rank (among replicas, the one of the decode rank's
 * number modulo the replicas, so the prefill ranks share the work); a
 * prefill rank no decode rank reads from is linked with nheads 0 to decode
 * rank prefill % dec->tp_size.  Writes at most max links into out and
 * returns how many there are.
 */
uint32_t kvr_heads_links(const kvr_heads_t *pre, const kvr_heads_t *dec, int decode,
                         uint32_t rank, kvr_link_t *out, uint32_t max);
/* The slice of link l in the pages of the side of layout h, rank rank. */
kvr_slice_t kvr_link_slice(const kvr_link_t *l, const kvr_heads_t *h, uint32_t rank);
/*
 * Compatibility of a prefill's and a decode's layouts: equal page size,
 * KV buffer count and total heads, and per KV buffer equal bytes per head
 * (item / (page_size * heads), which must divide).  0, or -1 with the
 * first difference, naming both sides' numbers, in why.
 */
int kvr_heads_compat(const kvr_heads_t *pre, const uint64_t *pre_items, const kvr_heads_t *dec,
                     const uint64_t *dec_items, uint32_t nkv, uint32_t page_size, char *why,
                     size_t n);

/*
 * Layers: which layers one rank's KV buffers hold.  The nkv buffers are
 * nkv / layers groups (sglang's MHA pools: K then V, 2 groups; MLA: 1) of
 * `layers` buffers each, in layer order; the rank holds layers [start,
 * start + layers) of the model.  A pipeline-parallel prefill stage
 * pp_rank of pp_size holds a contiguous range; a decode (and a prefill of
 * one stage) holds them all from 0.  Buffer b of a prefill stage lands in
 * decode buffer (b / pre.layers) * dec.layers + pre.start + b % pre.layers.
 */
typedef struct {
    uint32_t pp_size, pp_rank;
    uint32_t start, layers;
    uint32_t nkv;
} kvr_layers_t;

/* 0 if l is a layer layout its side can have, else -1 with why. */
int kvr_layers_check(const kvr_layers_t *l, const char *side, char *why, size_t n);
/* 1 if prefill buffer b lands in decode buffer b (start 0, equal layers). */
int kvr_layers_identity(const kvr_layers_t *pre, const kvr_layers_t *dec);
/* The decode buffer prefill buffer b lands in. */
uint32_t kvr_layers_map(const kvr_layers_t *pre, const kvr_layers_t *dec, uint32_t b);
/* 1 if decode buffer b is one of prefill stage pre's. */
int kvr_layers_holds(const kvr_layers_t *pre, const kvr_layers_t *dec, uint32_t b);
/* Compatibility of a prefill stage's layers with a decode's: equal
 * buffers per layer, the stage's range inside the decode's layers, and a
 * prefill of one stage holding them all.  0, or -1 naming both sides'
 * numbers. */
int kvr_layers_compat(const kvr_layers_t *pre, const kvr_layers_t *dec, char *why, size_t n);
/* The ranges of stages[0..n) (stage s at index s) cover [0, total) once
 * each: 0, or -1 naming the first layer in no stage or in two. */
int kvr_layers_cover(const kvr_layers_t *stages, uint32_t n, uint32_t total, char *why,
                     size_t len);

typedef struct {
    const int32_t *src_pages;   /* the prefill's pages, by position */
    const int32_t *dst_pages;   /* the decode's pages, by position */
    uint32_t given;             /* positions handed to send() so far */
    uint32_t total_pages;       /* positions of the room */
    int aux;                    /* the decode asked for an aux row */
    uint32_t nkv, naux;         /* naux: row buffers, aux then state */
    /* State buffers (state.c): the last nstate row buffers, of components
     * state_comp; the decode asked for those whose dst_states slot >= 0. */
    uint32_t nstate;
    const uint32_t *state_comp;
    const int64_t *dst_states;
    /* State rows in chunks (stateslice.h): pieces per row buffer at most
     * (0: 1), and per state buffer 1 if this link carries none of it
     * (NULL: none skipped). */
    uint32_t row_pieces;
    const unsigned char *state_skip;
    /* List components (bit c of state_list): their buffers' rows are the
     * slots of src_lists and dst_lists (equal lengths, checked before),
     * moved like pages: a message per range of list positions and group of
     * the component's buffers, one piece per run of slots consecutive on
     * both sides. */
    uint32_t state_list;
    const kvr_slot_lists_t *src_lists, *dst_lists;
    /* Device buffers: most bytes per buffer of a list message (a staging
     * slot; 0: no limit), and 1 for one run per message (UCX moves device
     * memory contiguous only). */
    uint64_t row_cap;
    int row_run_alone;
    const uint64_t *kv_item, *aux_item; /* item lengths per buffer */
    uint64_t kv_item_max;       /* the widest KV item (> 0) */
    uint64_t run_bytes;         /* a run this long goes alone */
    uint64_t cap;               /* most bytes per buffer of a coalesced message */
    uint64_t merge;             /* buffers share a message within this many bytes */
    uint32_t max_pages;         /* most positions in one message (> 0) */
    /* Layers (kvr_layers_t): buffers land in groups of `group` buffers
     * that are contiguous on the decode, so a message stays inside one
     * (0: no limit). */
    uint32_t group;
    /* Head slices (kvr_slice_t): pieces per page on each side, 1 for whole
     * pages, page_size for a slice of the rows; kv_none: the slice is
     * empty (no KV message, only the aux rows). */
    uint32_t src_rows, dst_rows;
    int kv_none;
} kvr_plan_t;

/* Where posting stands; all zero before the first message. */
typedef struct {
    uint32_t posted;  /* positions whose messages were all planned */
    uint32_t end;     /* end of the position range in progress (0: none) */
    uint32_t buf;     /* next KV buffer of that range */
    uint32_t aux_buf; /* next row buffer (aux, then state) */
    uint32_t row_pos; /* list components: first list position of the range in progress */
    uint32_t row_end; /* its end (0: none) */
    int aux_done;     /* the rows are planned (or none was asked for) */
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
/* 1 if the decode asked for a row of row buffer b (aux or state). */
int kvr_plan_row_wanted(const kvr_plan_t *p, uint32_t b);

uint16_t kvr_plan_buf_group(const uint64_t *items, uint32_t n, uint32_t b, uint32_t npages,
                            uint32_t pieces, uint64_t merge);
/* As kvr_plan_buf_group, never past the end of b's group of `group`
 * buffers (0: no groups). */
uint16_t kvr_plan_kv_group(const kvr_plan_t *p, uint32_t b, uint32_t npages, uint32_t pieces);

#endif
