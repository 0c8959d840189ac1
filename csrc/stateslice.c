#include "stateslice.h"

#include <inttypes.h>
#include <stdio.h>

/* "[c][k]" for state buffer i (its component and its index there). */
static void kvr_state_name(const uint32_t *comp, uint32_t i, char *out, size_t n)
{
    if (comp == NULL) {
        snprintf(out, n, "%u", i);
        return;
    }
    uint32_t k = 0;
    while (k < i && comp[i - k - 1] == comp[i]) {
        k++;
    }
    snprintf(out, n, "[%u][%u]", comp[i], k);
}

int kvr_state_rule_replicated(const uint32_t *rule)
{
    return rule[1] == 0;
}

/* The sum of a sliced rule's units (checked: no overflow past 2^32 x 2^10). */
static uint64_t kvr_rule_units(const uint32_t *rule)
{
    uint64_t sum = 0;
    for (uint32_t g = 0; g < rule[1]; g++) {
        sum += rule[2 + g];
    }
    return sum;
}

int kvr_state_rules_check(const uint32_t *rules, uint32_t nrules, const uint64_t *items,
                          uint32_t nstate, const uint32_t *comp, uint32_t *at, char *why, size_t n)
{
    uint32_t pos = 0;
    char name[32];
    for (uint32_t i = 0; i < nstate; i++) {
        kvr_state_name(comp, i, name, sizeof(name));
        if (nrules - pos < 2 || rules[pos + 1] > nrules - pos - 2) {
            snprintf(why, n, "state_slicing ends before state buffer %s", name);
            return -1;
        }
        const uint32_t *r = rules + pos;
        if (items[i] == 0) {
            snprintf(why, n, "state buffer %s: item_len 0", name);
            return -1;
        }
        if (at != NULL) {
            at[i] = pos;
        }
        pos += 2 + r[1];
        if (r[1] == 0) {
            if (r[0] != 1) {
                snprintf(why, n, "state_slicing of state buffer %s: replicated with outer %u", name,
                         r[0]);
                return -1;
            }
            continue;
        }
        if (r[0] == 0 || (uint64_t)r[0] * r[1] > KVR_STATE_MAX_PIECES) {
            snprintf(why, n,
                     "state_slicing of state buffer %s: outer %u x %u groups must be 1 to %d "
                     "pieces",
                     name, r[0], r[1], KVR_STATE_MAX_PIECES);
            return -1;
        }
        for (uint32_t g = 0; g < r[1]; g++) {
            if (r[2 + g] == 0) {
                snprintf(why, n, "state_slicing of state buffer %s: group %u has no units", name,
                         g);
                return -1;
            }
        }
        uint64_t per_row = (uint64_t)r[0] * kvr_rule_units(r);
        if (items[i] % per_row != 0) {
            snprintf(why, n,
                     "state buffer %s: item_len %" PRIu64 " is not outer %u x %" PRIu64
                     " units x bytes per unit",
                     name, items[i], r[0], kvr_rule_units(r));
            return -1;
        }
    }
    if (pos != nrules) {
        snprintf(why, n, "state_slicing has %u numbers, %u describe the %u state buffers", nrules,
                 pos, nstate);
        return -1;
    }
    return 0;
}

/* Advances past one rule. */
static const uint32_t *kvr_rule_next(const uint32_t *r)
{
    return r + 2 + r[1];
}

int kvr_state_rules_compat(const uint32_t *pre, const uint64_t *pre_items, uint32_t pre_tp,
                           const uint32_t *dec, const uint64_t *dec_items, uint32_t dec_tp,
                           uint32_t nstate, const uint32_t *comp, char *why, size_t n)
{
    char name[32];
    for (uint32_t i = 0; i < nstate; i++, pre = kvr_rule_next(pre), dec = kvr_rule_next(dec)) {
        kvr_state_name(comp, i, name, sizeof(name));
        int prep = kvr_state_rule_replicated(pre), drep = kvr_state_rule_replicated(dec);
        if (prep != drep) {
            snprintf(why, n, "state buffer %s: %s on the prefill, %s on the decode", name,
                     prep ? "replicated" : "sliced", drep ? "replicated" : "sliced");
            return -1;
        }
        if (prep) {
            if (pre_items[i] != dec_items[i]) {
                snprintf(why, n,
                         "state buffer %s (replicated): item_len %" PRIu64
                         " on the prefill, %" PRIu64 " on the decode",
                         name, pre_items[i], dec_items[i]);
                return -1;
            }
            continue;
        }
        if (pre[0] != dec[0] || pre[1] != dec[1]) {
            snprintf(why, n,
                     "state buffer %s: outer %u x %u groups on the prefill, outer %u x %u groups "
                     "on the decode",
                     name, pre[0], pre[1], dec[0], dec[1]);
            return -1;
        }
        for (uint32_t g = 0; g < pre[1]; g++) {
            if ((uint64_t)pre[2 + g] * pre_tp != (uint64_t)dec[2 + g] * dec_tp) {
                snprintf(why, n,
                         "state buffer %s, group %u: %u units x TP %u on the prefill, %u units x "
                         "TP %u on the decode",
                         name, g, pre[2 + g], pre_tp, dec[2 + g], dec_tp);
                return -1;
            }
        }
        uint64_t pu = pre_items[i] / (pre[0] * kvr_rule_units(pre));
        uint64_t du = dec_items[i] / (dec[0] * kvr_rule_units(dec));
        if (pu != du) {
            snprintf(why, n,
                     "state buffer %s: %" PRIu64 " bytes per unit on the prefill (item_len %" PRIu64
                     "), %" PRIu64 " on the decode (item_len %" PRIu64 ")",
                     name, pu, pre_items[i], du, dec_items[i]);
            return -1;
        }
    }
    return 0;
}

kvr_state_link_t kvr_state_link(uint32_t pre_tp, uint32_t pre_rank, uint32_t dec_tp,
                                uint32_t dec_rank)
{
    kvr_state_link_t l = {pre_tp, pre_rank, dec_tp, dec_rank, 0, 1};
    if (pre_tp == dec_tp || pre_tp == 0 || dec_tp == 0) {
        return l; /* whole rows, over the room's one link */
    }
    l.sliced = 1;
    /* The prefill rank whose share holds the start of the decode rank's. */
    l.rep = (uint64_t)dec_rank * pre_tp / dec_tp == pre_rank;
    return l;
}

uint32_t kvr_state_chunks(const uint32_t *rule, uint64_t item, uint32_t tp, uint32_t rank,
                          const kvr_state_link_t *l, kvr_state_chunk_t *out, uint64_t *bytes)
{
    uint32_t k = 0;
    uint64_t total = 0;
    if (!l->sliced || kvr_state_rule_replicated(rule)) {
        if (l->rep) {
            if (out != NULL) {
                out[0] = (kvr_state_chunk_t){0, item};
            }
            k = 1;
            total = item;
        }
        *bytes = total;
        return k;
    }
    uint64_t units = kvr_rule_units(rule), unit = item / (rule[0] * units);
    uint64_t last_end = UINT64_MAX, at = 0;
    for (uint32_t o = 0; o < rule[0]; o++) {
        for (uint32_t g = 0; g < rule[1]; g++) {
            /* Group g has all = u x tp units in the model: a prefill rank
             * holds all / pre_tp of them, a decode rank all / dec_tp (the
             * sides agree on all: kvr_state_rules_compat). */
            uint64_t u = rule[2 + g], mine = (uint64_t)rank * u, all = u * tp;
            uint64_t pu = all / l->pre_tp, du = all / l->dec_tp;
            uint64_t plo = l->pre_rank * pu, dlo = l->dec_rank * du;
            uint64_t s = plo > dlo ? plo : dlo, e = plo + pu < dlo + du ? plo + pu : dlo + du;
            s = s > mine ? s : mine;
            e = e < mine + u ? e : mine + u;
            if (e > s) {
                uint64_t off = (at + s - mine) * unit, len = (e - s) * unit;
                if (off == last_end && k > 0) {
                    if (out != NULL) {
                        out[k - 1].len += len;
                    }
                } else {
                    if (out != NULL) {
                        out[k] = (kvr_state_chunk_t){off, len};
                    }
                    k++;
                }
                last_end = off + len;
                total += len;
            }
            at += u;
        }
    }
    *bytes = total;
    return k;
}
