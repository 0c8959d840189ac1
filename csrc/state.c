/*
 * state: per-request state buffers of hybrid models (Mamba conv/ssm state,
 * other buffers addressed by a request's slot rather than by its pages).
 * Each state buffer belongs to a component (sglang's state types); a room
 * names one slot per component on each side, and every buffer of the
 * component moves that slot's row, of the buffer's own item length.
 *
 * The engine keeps the state buffers after the aux buffers, as row buffers
 * of the same kind on the wire (KVR_AM_KIND_AUX): a row message covers
 * buffers [buf, buf + nbuf) of aux then state buffers, each at its own row
 * (kvr_state_row).  So state rows go with the room's last chunk like the
 * aux row, are claimed, counted and checked like it, and share the room's
 * completion, abort and failure.
 *
 * Thread: any; the functions read the engine's fixed description only.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvr_state_setup(kvr_engine_t *e, const kvr_engine_params_t *p, char *err, size_t errlen)
{
    if (p->nstate == 0) {
        return 0;
    }
    if (p->nstate > p->naux || p->state_comp == NULL) {
        return kvr_err(err, errlen, KVR_EVALUE, "%u state buffers but %u row buffers", p->nstate,
                       p->naux);
    }
    e->state_comp = malloc(p->nstate * sizeof(uint32_t));
    if (e->state_comp == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    uint32_t base = p->naux - p->nstate;
    for (uint32_t i = 0; i < p->nstate; i++) {
        uint32_t c = p->state_comp[i], prev = i ? p->state_comp[i - 1] : 0;
        if (c >= KVR_MAX_STATES || c < prev || c > prev + (i ? 1 : 0)) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "state buffer %u is of component %u: components must be 0, 1, ... "
                           "in order, at most %d",
                           i, c, KVR_MAX_STATES);
        }
        int64_t rows = (int64_t)(p->aux_lens[base + i] / p->aux_item_lens[base + i]);
        if (c >= e->nstates) {
            e->nstates = c + 1;
            e->state_rows[c] = rows;
        } else if (rows < e->state_rows[c]) {
            e->state_rows[c] = rows;
        }
        e->state_bytes[c] += p->aux_item_lens[base + i];
        e->state_comp[i] = c;
    }
    e->nstate = p->nstate;
    return 0;
}

int64_t kvr_state_row(const kvr_engine_t *e, uint32_t b, int64_t aux, const int64_t *states)
{
    uint32_t base = e->naux - e->nstate;
    return b < base ? aux : states[e->state_comp[b - base]];
}

uint64_t kvr_state_bytes(const kvr_engine_t *e, int64_t aux, const int64_t *states)
{
    uint64_t bytes = aux >= 0 ? e->aux_bytes : 0;
    for (uint32_t c = 0; c < e->nstates; c++) {
        bytes += states[c] >= 0 ? e->state_bytes[c] : 0;
    }
    return bytes;
}

int kvr_state_check(const kvr_engine_t *e, const int64_t *states, uint32_t n, char *err,
                    size_t errlen)
{
    if (n > e->nstates) {
        return kvr_err(err, errlen, KVR_EVALUE,
                       "state_indices names %u state components, %u are registered", n,
                       e->nstates);
    }
    for (uint32_t c = 0; c < n; c++) {
        if (states[c] >= e->state_rows[c]) {
            return kvr_err(err, errlen, KVR_EVALUE,
                           "state_indices[%u]=%" PRId64
                           " is outside the registered state slots [0, %" PRId64 ")",
                           c, states[c], e->state_rows[c]);
        }
    }
    return 0;
}

void kvr_state_copy(int64_t *dst, const int64_t *src, uint32_t n)
{
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        dst[c] = c < n ? src[c] : -1;
    }
}

int kvr_state_any(const int64_t *states)
{
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        if (states[c] >= 0) {
            return 1;
        }
    }
    return 0;
}
