#include "runner.h"

#include <stdio.h>
#include <string.h>

#include "../../csrc/stateslice.h"

/*
 * Moves one state row of rule `rule` (this rank's units and outer per side
 * derived from `model_units` and each TP size) from every prefill rank of
 * pre_tp to every decode rank of dec_tp, as the links say, and checks that
 * every decode byte holds the model byte it should, each written once.
 * Elements are one byte per unit (unit = 1), outer rows of the model
 * numbered o * total + unit index of the group's block.
 */
/* The row of rank `rank` of a rule by model coordinates: each byte is
 * its (outer, unit of the model, byte) number.  Returns its length. */
static uint64_t rank_row(const uint32_t *rule, const uint32_t *model_units, uint32_t total,
                         uint32_t rank, uint32_t unit, uint16_t *row)
{
    uint64_t at = 0;
    for (uint32_t o = 0; o < rule[0]; o++) {
        uint32_t goff = 0;
        for (uint32_t g = 0; g < rule[1]; g++) {
            uint32_t u = rule[2 + g];
            for (uint32_t x = rank * u; x < (rank + 1) * u; x++) {
                for (uint32_t b = 0; b < unit; b++) {
                    row[at++] = (uint16_t)(((o * total + goff + x) * unit + b) & 0x7fff);
                }
            }
            goff += model_units[g];
        }
    }
    return at;
}

static void move_and_check(uint32_t outer, const uint32_t *model_units, uint32_t ngroups,
                           uint32_t pre_tp, uint32_t dec_tp, uint32_t unit)
{
    uint32_t pre_rule[2 + 8], dec_rule[2 + 8];
    uint32_t total = 0;
    pre_rule[0] = dec_rule[0] = outer;
    pre_rule[1] = dec_rule[1] = ngroups;
    for (uint32_t g = 0; g < ngroups; g++) {
        pre_rule[2 + g] = model_units[g] / pre_tp;
        dec_rule[2 + g] = model_units[g] / dec_tp;
        total += model_units[g];
    }
    uint64_t pre_item = (uint64_t)outer * total / pre_tp * unit;
    uint64_t dec_item = (uint64_t)outer * total / dec_tp * unit;
    char why[256];
    ASSERT_EQ(
        kvr_state_rules_check(pre_rule, 2 + ngroups, &pre_item, 1, NULL, NULL, why, sizeof(why)),
        0);
    ASSERT_EQ(kvr_state_rules_compat(pre_rule, &pre_item, pre_tp, dec_rule, &dec_item, dec_tp, 1,
                                     NULL, why, sizeof(why)),
              0);
    for (uint32_t d = 0; d < dec_tp; d++) {
        uint16_t got[4096];
        ASSERT(dec_item <= 4096);
        for (uint64_t i = 0; i < dec_item; i++) {
            got[i] = 0xffff;
        }
        for (uint32_t p = 0; p < pre_tp; p++) {
            if (pre_tp == dec_tp && p != d) {
                continue; /* equal sizes: rank to rank, one link */
            }
            kvr_state_link_t l = kvr_state_link(pre_tp, p, dec_tp, d);
            kvr_state_chunk_t src[1024], dst[1024];
            uint64_t sb = 0, db = 0;
            uint32_t ns = kvr_state_chunks(pre_rule, pre_item, pre_tp, p, &l, src, &sb);
            uint32_t nd = kvr_state_chunks(dec_rule, dec_item, dec_tp, d, &l, dst, &db);
            ASSERT_U64_EQ(sb, db);
            uint16_t row[4096];
            ASSERT_U64_EQ(rank_row(pre_rule, model_units, total, p, unit, row), pre_item);
            /* The stream: src pieces in order into dst pieces in order. */
            uint32_t si = 0, di = 0;
            uint64_t so = 0, dof = 0;
            while (si < ns && di < nd) {
                ASSERT(got[dst[di].off + dof] == 0xffff); /* written once */
                got[dst[di].off + dof] = row[src[si].off + so];
                if (++so == src[si].len) {
                    si++, so = 0;
                }
                if (++dof == dst[di].len) {
                    di++, dof = 0;
                }
            }
            ASSERT(si == ns && di == nd);
        }
        uint16_t want[4096];
        ASSERT_U64_EQ(rank_row(dec_rule, model_units, total, d, unit, want), dec_item);
        for (uint64_t i = 0; i < dec_item; i++) {
            ASSERT_EQ(got[i], want[i]);
        }
    }
}

TEST_IMPL(stateslice_moves_every_byte_once)
{
    uint32_t one[1] = {8}, gdn[3] = {4, 4, 8};
    uint32_t sizes[][2] = {{2, 1}, {1, 2}, {4, 2}, {2, 4}, {1, 4}, {4, 1}, {2, 2}};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        move_and_check(1, one, 1, sizes[i][0], sizes[i][1], 3);
        move_and_check(1, gdn, 3, sizes[i][0], sizes[i][1], 2);
        move_and_check(3, gdn, 3, sizes[i][0], sizes[i][1], 1);
    }
    uint32_t six[2] = {6, 12};
    move_and_check(2, six, 2, 2, 3, 2); /* shares that cut ranks on both sides */
    move_and_check(2, six, 2, 3, 2, 2);
}

TEST_IMPL(stateslice_pieces_joined_and_replicated)
{
    /* TP 2 -> 1, one group: each prefill rank sends its row whole into
     * its half of the decode's row. */
    uint32_t rule_p[3] = {1, 1, 4}, rule_d[3] = {1, 1, 8}, rep[2] = {1, 0};
    kvr_state_chunk_t c[4];
    uint64_t bytes;
    kvr_state_link_t l = kvr_state_link(2, 1, 1, 0);
    ASSERT(l.sliced && !l.rep);
    ASSERT_EQ(kvr_state_chunks(rule_p, 16, 2, 1, &l, c, &bytes), 1u);
    ASSERT_U64_EQ(c[0].off, 0);
    ASSERT_U64_EQ(c[0].len, 16);
    ASSERT_EQ(kvr_state_chunks(rule_d, 32, 1, 0, &l, c, &bytes), 1u);
    ASSERT_U64_EQ(c[0].off, 16);
    /* Replicated: only over the link of the decode's first unit. */
    ASSERT_EQ(kvr_state_chunks(rep, 40, 2, 1, &l, c, &bytes), 0u);
    ASSERT_U64_EQ(bytes, 0);
    l = kvr_state_link(2, 0, 1, 0);
    ASSERT(l.rep);
    ASSERT_EQ(kvr_state_chunks(rep, 40, 2, 0, &l, c, &bytes), 1u);
    ASSERT_U64_EQ(bytes, 40);
    /* TP 1 -> 2: the prefill rank is every decode rank's first. */
    ASSERT(kvr_state_link(1, 0, 2, 1).rep);
    /* Equal TP: whole rows, not sliced. */
    l = kvr_state_link(2, 1, 2, 1);
    ASSERT(!l.sliced && l.rep);
    ASSERT_EQ(kvr_state_chunks(rule_p, 16, 2, 1, &l, c, &bytes), 1u);
    ASSERT_U64_EQ(c[0].len, 16);
    /* GDN-like groups, TP 1 -> 2: a piece per group on the prefill, one
     * whole row on the decode. */
    uint32_t g1[5] = {1, 3, 4, 4, 8}, g2[5] = {1, 3, 2, 2, 4};
    l = kvr_state_link(1, 0, 2, 1);
    ASSERT_EQ(kvr_state_chunks(g1, 16, 1, 0, &l, c, &bytes), 3u);
    ASSERT_U64_EQ(c[0].off, 2);
    ASSERT_U64_EQ(c[1].off, 6);
    ASSERT_U64_EQ(c[2].off, 12);
    ASSERT_U64_EQ(bytes, 8);
    ASSERT_EQ(kvr_state_chunks(g2, 8, 2, 1, &l, c, &bytes), 1u);
    ASSERT_U64_EQ(c[0].len, 8);
}

static void check_why(const uint32_t *rules, uint32_t n, const uint64_t *items, uint32_t nstate,
                      const char *want)
{
    char why[256] = "";
    uint32_t comp[4] = {0, 0, 1, 1};
    ASSERT_EQ(kvr_state_rules_check(rules, n, items, nstate, comp, NULL, why, sizeof(why)), -1);
    if (strcmp(why, want) != 0) {
        fprintf(stderr, "got  '%s'\nwant '%s'\n", why, want);
        ASSERT(0);
    }
}

TEST_IMPL(stateslice_bad_rules)
{
    uint64_t items[3] = {48, 200, 72};
    uint32_t ok[] = {1, 1, 4, 1, 0, 2, 2, 3, 6};
    uint32_t at[3];
    char why[256];
    ASSERT_EQ(kvr_state_rules_check(ok, 9, items, 3, NULL, at, why, sizeof(why)), 0);
    ASSERT_EQ(at[2], 5u);
    uint32_t notdiv[] = {1, 1, 5, 1, 0, 2, 2, 3, 6};
    check_why(notdiv, 9, items, 3,
              "state buffer [0][0]: item_len 48 is not outer 1 x 5 units x bytes per unit");
    uint32_t zero[] = {1, 1, 4, 1, 0, 2, 2, 0, 6};
    check_why(zero, 9, items, 3, "state_slicing of state buffer [1][0]: group 0 has no units");
    check_why(ok, 7, items, 3, "state_slicing ends before state buffer [1][0]");
    check_why(ok, 9, items, 2, "state_slicing has 9 numbers, 5 describe the 2 state buffers");
    uint32_t outer0[] = {0, 1, 4};
    check_why(outer0, 3, items, 1,
              "state_slicing of state buffer [0][0]: outer 0 x 1 groups must be 1 to 1024 "
              "pieces");
    uint64_t zero_item = 0;
    check_why(ok, 3, &zero_item, 1, "state buffer [0][0]: item_len 0");
    uint32_t rep2[] = {2, 0};
    check_why(rep2, 2, items, 1, "state_slicing of state buffer [0][0]: replicated with outer 2");
}

TEST_IMPL(stateslice_compat_names_both_sides)
{
    uint32_t pre[] = {1, 1, 4, 1, 0}, dec[] = {1, 1, 8, 1, 0};
    uint64_t pi[2] = {16, 40}, di[2] = {32, 40};
    char why[256] = "";
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec, di, 1, 2, NULL, why, sizeof(why)), 0);
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec, di, 2, 2, NULL, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "state buffer 0, group 0: 4 units x TP 2 on the prefill, 8 units x TP 2 "
                       "on the decode") == 0);
    uint64_t di2[2] = {64, 40};
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec, di2, 1, 2, NULL, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "state buffer 0: 4 bytes per unit on the prefill (item_len 16), 8 on the "
                       "decode (item_len 64)") == 0);
    uint64_t di3[2] = {32, 48};
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec, di3, 1, 2, NULL, why, sizeof(why)), -1);
    ASSERT(
        strcmp(why, "state buffer 1 (replicated): item_len 40 on the prefill, 48 on the decode") ==
        0);
    uint32_t dec_rep[] = {1, 0, 1, 0};
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec_rep, di, 1, 2, NULL, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "state buffer 0: sliced on the prefill, replicated on the decode") == 0);
    uint32_t dec_outer[] = {2, 1, 4, 1, 0};
    ASSERT_EQ(kvr_state_rules_compat(pre, pi, 2, dec_outer, di, 1, 2, NULL, why, sizeof(why)), -1);
    ASSERT(strcmp(why, "state buffer 0: outer 1 x 1 groups on the prefill, outer 2 x 1 groups on "
                       "the decode") == 0);
}
