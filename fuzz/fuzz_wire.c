/*
 * libFuzzer target for kvr_wire_decode: arbitrary bytes must be rejected or
 * decoded without reading outside the buffer; whatever decodes must
 * re-encode to the same bytes, and those must decode to the same fields.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "wire.h"

static int same_bytes(const void *a, const void *b, size_t n)
{
    return n == 0 || (a != NULL && b != NULL && memcmp(a, b, n) == 0);
}

static int inside(const void *p, size_t n, const unsigned char *lo, size_t len)
{
    const unsigned char *q = p;
    return n == 0 || (q != NULL && q >= lo && q <= lo + len && n <= (size_t)(lo + len - q));
}

static void check_same(const kvr_msg_t *a, const kvr_msg_t *b)
{
    CHECK(a->type == b->type);
    CHECK(a->epoch == b->epoch);
    CHECK(a->rank == b->rank);
    CHECK(a->room == b->room);
    CHECK(a->tag == b->tag);
    CHECK(a->aux_index == b->aux_index);
    CHECK(a->npages == b->npages);
    CHECK(a->prefix_len == b->prefix_len);
    CHECK(same_bytes(a->pages, b->pages, (size_t)a->npages * 4));
    CHECK(a->found == b->found);
    CHECK(a->peer_epoch == b->peer_epoch);
    CHECK(a->code == b->code);
    CHECK(a->origin_rank == b->origin_rank);
    CHECK(a->dp_rank == b->dp_rank && a->pp_rank == b->pp_rank);
    CHECK(a->str_len == b->str_len);
    CHECK(same_bytes(a->str, b->str, a->str_len));
    CHECK(a->peer_len == b->peer_len);
    CHECK(same_bytes(a->peer, b->peer, a->peer_len));
    CHECK(a->addr_len == b->addr_len);
    CHECK(same_bytes(a->addr, b->addr, a->addr_len));
    CHECK(a->layout.page_size == b->layout.page_size);
    CHECK(a->layout.nkv == b->layout.nkv);
    CHECK(same_bytes(a->layout.kv_item_lens, b->layout.kv_item_lens, (size_t)a->layout.nkv * 8));
    CHECK(a->layout.naux == b->layout.naux);
    CHECK(same_bytes(a->layout.aux_item_lens, b->layout.aux_item_lens, (size_t)a->layout.naux * 8));
    CHECK(a->layout.nrules == b->layout.nrules);
    CHECK(same_bytes(a->layout.rules, b->layout.rules, (size_t)a->layout.nrules * 4));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvr_msg_t m, m2;
    const char *why = NULL;
    if (kvr_wire_decode(data, size, &m, &why) != 0) {
        CHECK(why != NULL && why[0] != '\0');
        if (expect_valid()) {
            fprintf(stderr, "valid input rejected: %s\n", why);
            abort();
        }
        return 0;
    }
    CHECK(m.type >= KVR_MSG_BS_REGISTER && m.type < KVR_MSG_LAST);
    CHECK(m.str_len <= KVR_WIRE_MAX_STR && m.peer_len <= KVR_WIRE_MAX_STR);
    CHECK(m.npages <= KVR_WIRE_MAX_PAGES);
    CHECK(m.layout.nkv <= KVR_WIRE_MAX_BUFFERS && m.layout.naux <= KVR_WIRE_MAX_BUFFERS);
    CHECK(m.addr_len <= KVR_WIRE_MAX_ADDR);
    CHECK(m.dp_rank <= KVR_WIRE_MAX_DP_PP && m.pp_rank <= KVR_WIRE_MAX_DP_PP);
    CHECK(inside(m.str, m.str_len, data, size));
    CHECK(inside(m.peer, m.peer_len, data, size));
    CHECK(inside(m.addr, m.addr_len, data, size));
    CHECK(inside(m.pages, (size_t)m.npages * 4, data, size));
    CHECK(inside(m.layout.kv_item_lens, (size_t)m.layout.nkv * 8, data, size));
    CHECK(inside(m.layout.aux_item_lens, (size_t)m.layout.naux * 8, data, size));
    CHECK(m.layout.nrules <= KVR_WIRE_MAX_RULES);
    CHECK(inside(m.layout.rules, (size_t)m.layout.nrules * 4, data, size));
    /* the reader helpers over the decoded arrays stay in bounds */
    for (uint32_t i = 0; i < m.npages; i++) {
        (void)kvr_wire_i32_at(m.pages, i);
    }
    for (uint32_t i = 0; i < m.layout.nkv; i++) {
        (void)kvr_wire_u64_at(m.layout.kv_item_lens, i);
    }
    (void)kvr_msg_type_name(m.type);

    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    CHECK(kvr_wire_encode(&b, &m) == 0);
    /* the format has one encoding per message: decode then encode is exact */
    CHECK(b.len == size);
    CHECK(memcmp(b.data, data, size) == 0);
    why = NULL;
    CHECK(kvr_wire_decode(b.data, b.len, &m2, &why) == 0);
    check_same(&m, &m2);
    kvr_wbuf_free(&b);
    return 0;
}
