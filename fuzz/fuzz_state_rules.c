/*
 * libFuzzer target for a peer's state slicing rules (stateslice.h), which
 * arrive in its HELLO: arbitrary rules and item lengths are refused or
 * accepted by kvr_state_rules_check; accepted ones are compatible with
 * themselves, and the pieces of a row every link carries lie inside the
 * row, in order, without overlap, and cover each sliced row once over the
 * links of one rank.
 *
 * Input: the other side's TP size (1 byte), this side's TP size and rank
 * (1 byte each), the number of state buffers (1 byte), then per buffer an
 * item length (u32), then the rules (u32 each, little-endian).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "stateslice.h"

#define MAXBUF 16
#define MAXRULES 4096

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Pieces of buffer i of this side over its links with every rank of the
 * other side: in bounds, ordered, and (sliced) covering the row once. */
static void check_pieces(const uint32_t *rule, uint64_t item, uint32_t tp, uint32_t rank,
                         uint32_t other)
{
    static kvr_state_chunk_t c[KVR_STATE_MAX_PIECES];
    uint64_t covered = 0;
    for (uint32_t o = 0; o < other; o++) {
        /* This side as the prefill: links to every decode rank. */
        kvr_state_link_t l = kvr_state_link(tp, rank, other, o);
        uint64_t bytes = 0, sum = 0;
        uint32_t k = kvr_state_chunks(rule, item, tp, rank, &l, c, &bytes);
        CHECK(k <= (rule[1] ? rule[0] * rule[1] : 1));
        for (uint32_t j = 0; j < k; j++) {
            CHECK(c[j].len > 0 && c[j].off + c[j].len <= item);
            CHECK(j == 0 || c[j].off > c[j - 1].off + c[j - 1].len - 1);
            sum += c[j].len;
        }
        CHECK(sum == bytes);
        covered += bytes;
    }
    if (!kvr_state_rule_replicated(rule) && tp != other) {
        CHECK(covered == item);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 4) {
        return 0;
    }
    uint32_t other = data[0] % 8 + 1, tp = data[1] % 8 + 1, rank = data[2] % tp;
    uint32_t nstate = data[3] % MAXBUF + 1;
    data += 4;
    size -= 4;
    if (size < (size_t)nstate * 4) {
        return 0;
    }
    uint64_t items[MAXBUF];
    for (uint32_t i = 0; i < nstate; i++) {
        items[i] = rd32(data + 4 * i);
    }
    data += 4 * nstate;
    size -= 4 * nstate;
    uint32_t n = (uint32_t)(size / 4 > MAXRULES ? MAXRULES : size / 4);
    static uint32_t rules[MAXRULES];
    uint32_t at[MAXBUF];
    for (uint32_t i = 0; i < n; i++) {
        rules[i] = rd32(data + 4 * i);
    }
    char why[256] = "";
    if (kvr_state_rules_check(rules, n, items, nstate, NULL, at, why, sizeof(why)) != 0) {
        CHECK(why[0] != '\0');
        if (expect_valid()) {
            fprintf(stderr, "valid rules rejected: %s\n", why);
            abort();
        }
        return 0;
    }
    CHECK(kvr_state_rules_compat(rules, items, tp, rules, items, tp, nstate, NULL, why,
                                 sizeof(why)) == 0);
    for (uint32_t i = 0; i < nstate; i++) {
        const uint32_t *r = rules + at[i];
        int whole = 1; /* the other side's share is whole units of every group */
        for (uint32_t g = 0; g < r[1]; g++) {
            whole &= (uint64_t)r[2 + g] * tp % other == 0;
        }
        if (whole) {
            check_pieces(r, items[i], tp, rank, other);
        }
    }
    return 0;
}
