/*
 * stateslice: how per-request state rows split over TP ranks, pure logic,
 * no I/O.  A state buffer's row (one slot) on a rank holds that rank's
 * share of the state (sglang slices Mamba conv and ssm state by heads or
 * channels).  Each buffer has a slicing rule (KVArgs state_slicing):
 *
 *   replicated   every rank holds the whole row; a decode rank reads it from
 *                one prefill rank (the one holding the start of its share).
 *   sliced       the row is `outer` repetitions of ngroups groups, group g
 *                holding units[g] units (heads, channels) of this rank, each
 *                of unit bytes; the model has units[g] x tp_size units of
 *                group g, rank r holding [r x units[g], (r + 1) x units[g]).
 *                Groups are sliced independently (a GDN conv state is
 *                [q | k | v], each split over the ranks).
 *
 * Rules travel flat, as u32: per buffer outer, ngroups, units[ngroups];
 * replicated is outer 1, ngroups 0.  A pair of a prefill rank and a decode
 * rank (a link) carries the same share of every group of every sliced
 * buffer: the overlap of the two ranks' shares.
 *
 * Thread: any; the functions touch only their arguments.
 */
#ifndef KVR_STATESLICE_H
#define KVR_STATESLICE_H

#include <stddef.h>
#include <stdint.h>

/* Most pieces (outer x groups) one row of one buffer is cut into. */
#define KVR_STATE_MAX_PIECES 1024

/* What a link carries of the state rows. */
typedef struct {
    uint32_t pre_tp, pre_rank, dec_tp, dec_rank; /* the two ranks */
    int sliced;                                  /* 1: the TP sizes differ, rows move as chunks */
    int rep; /* 1: it carries the replicated rows (and whole rows when not sliced) */
} kvr_state_link_t;

/* A piece of a row: bytes [off, off + len) of the row. */
typedef struct {
    uint64_t off, len;
} kvr_state_chunk_t;

/*
 * Checks flat rules (nrules u32) for nstate buffers of item lengths items:
 * well formed, items, outer and units > 0, outer x ngroups <= KVR_STATE_MAX_PIECES,
 * the item a multiple of outer x the sum of the units.  comp (component of
 * each buffer, may be NULL) names buffers as [component][index].  Fills
 * at[i] (may be NULL) with buffer i's offset into rules.  0, or -1 with
 * the first problem in why.
 */
int kvr_state_rules_check(const uint32_t *rules, uint32_t nrules, const uint64_t *items,
                          uint32_t nstate, const uint32_t *comp, uint32_t *at, char *why, size_t n);
/*
 * Compatibility of the prefill's rules (pre, items pre_items, TP pre_tp)
 * and the decode's, both checked, for nstate buffers: per buffer, both
 * replicated with equal items, or both sliced with equal outer, groups,
 * units x tp_size per group and bytes per unit.  0, or -1 with the first
 * difference, naming both sides' numbers, in why.
 */
int kvr_state_rules_compat(const uint32_t *pre, const uint64_t *pre_items, uint32_t pre_tp,
                           const uint32_t *dec, const uint64_t *dec_items, uint32_t dec_tp,
                           uint32_t nstate, const uint32_t *comp, char *why, size_t n);
/* The link of prefill rank pre_rank of pre_tp and decode rank dec_rank of
 * dec_tp (sliced when the sizes differ; rep: the prefill rank holds the
 * start of the decode rank's share). */
kvr_state_link_t kvr_state_link(uint32_t pre_tp, uint32_t pre_rank, uint32_t dec_tp,
                                uint32_t dec_rank);
/* 1 if the rule at `rule` is replicated. */
int kvr_state_rule_replicated(const uint32_t *rule);
/*
 * The pieces of one row of a buffer of rule `rule` and item length item,
 * on the side of TP size tp, rank rank, that link l carries, in order
 * (outer, then group), adjacent pieces joined; writes them to out (at
 * least outer x ngroups entries, or 1) unless NULL.  Returns the count;
 * *bytes gets their total.
 */
uint32_t kvr_state_chunks(const uint32_t *rule, uint64_t item, uint32_t tp, uint32_t rank,
                          const kvr_state_link_t *l, kvr_state_chunk_t *out, uint64_t *bytes);

#endif
