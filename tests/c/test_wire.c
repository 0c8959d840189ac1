#include "runner.h"

#include <string.h>

#include "../../csrc/status.h"
#include "../../csrc/wire.h"

static const unsigned char kv_lens[3 * 8] = {
    0x00, 0x10, 0,    0,    0,    0,    0,    0, /* 4096 */
    0x00, 0x20, 0,    0,    0,    0,    0,    0, /* 8192 */
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
};
static const unsigned char aux_lens[1 * 8] = {0x80, 0, 0, 0, 0, 0, 0, 0};
static const unsigned char pages_bytes[4 * 4] = {
    0,    0,    0,    0,    /* 0 */
    0xff, 0xff, 0xff, 0x7f, /* INT32_MAX */
    0,    0,    0,    0x80, /* INT32_MIN */
    0xff, 0xff, 0xff, 0xff, /* -1 */
};
static const unsigned char worker_addr[5] = {1, 2, 3, 0, 5};

/* A fully populated message of the given type. */
static kvr_msg_t sample(int type)
{
    kvr_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = (uint16_t)type;
    m.epoch = 0x0123456789abcdefULL ^ (uint64_t)type;
    switch (type) {
    case KVR_MSG_BS_REGISTER:
        m.rank = 3;
        m.str = "tcp://10.1.2.3:5555";
        m.str_len = (uint16_t)strlen(m.str);
        break;
    case KVR_MSG_BS_REGISTER_OK:
    case KVR_MSG_BS_QUERY:
    case KVR_MSG_PING:
    case KVR_MSG_PONG:
    case KVR_MSG_BYE:
    case KVR_MSG_PATH_LOST:
        m.rank = 0xfffffffeu;
        break;
    case KVR_MSG_BS_QUERY_REPLY:
        m.rank = 1;
        m.found = 1;
        m.peer_epoch = UINT64_MAX;
        m.str = "tcp://h:1";
        m.str_len = 9;
        break;
    case KVR_MSG_HELLO:
    case KVR_MSG_HELLO_OK:
        m.rank = 2;
        m.layout.page_size = 16;
        m.layout.nkv = 3;
        m.layout.kv_item_lens = kv_lens;
        m.layout.naux = 1;
        m.layout.aux_item_lens = aux_lens;
        m.addr = worker_addr; /* both carry the sender's worker address */
        m.addr_len = sizeof(worker_addr);
        break;
    case KVR_MSG_AUTH_REJECT:
        m.str = "authentication failed at the bootstrap server";
        m.str_len = (uint16_t)strlen(m.str);
        break;
    case KVR_MSG_HELLO_REJECT:
        m.rank = 4;
        m.code = 2;
        m.str = "layout mismatch: nkv 3 vs 4";
        m.str_len = (uint16_t)strlen(m.str);
        break;
    case KVR_MSG_ROOM_REQ:
        m.room = 0xfeedfacecafebeefULL;
        m.tag = 42;
        m.aux_index = -1;
        m.npages = 4;
        m.pages = pages_bytes;
        break;
    case KVR_MSG_ROOM_DONE:
        m.room = 1;
        m.tag = UINT64_MAX;
        break;
    case KVR_MSG_ROOM_FAIL:
    case KVR_MSG_SIB_FAIL:
        m.room = 99;
        m.tag = 100;
        m.code = 3;
        m.origin_rank = -1;
        m.str = "peer lost";
        m.str_len = 9;
        m.peer = "10.0.0.9:7000";
        m.peer_len = 13;
        break;
    }
    return m;
}

static int bytes_eq(const void *a, const void *b, size_t n)
{
    if (n == 0) {
        return 1;
    }
    return a != NULL && b != NULL && memcmp(a, b, n) == 0;
}

/* Every field the decoder produces, compared by value (pointers by the
 * bytes they point to). */
static void assert_same(const kvr_msg_t *a, const kvr_msg_t *b)
{
    ASSERT_EQ(a->type, b->type);
    ASSERT_U64_EQ(a->epoch, b->epoch);
    ASSERT_U64_EQ(a->rank, b->rank);
    ASSERT_U64_EQ(a->room, b->room);
    ASSERT_U64_EQ(a->tag, b->tag);
    ASSERT_EQ(a->aux_index, b->aux_index);
    ASSERT_EQ(a->npages, b->npages);
    ASSERT(bytes_eq(a->pages, b->pages, (size_t)a->npages * 4));
    ASSERT_EQ(a->prefix_len, b->prefix_len);
    ASSERT_EQ(a->nstates, b->nstates);
    ASSERT(bytes_eq(a->states, b->states, (size_t)a->nstates * 8));
    ASSERT_EQ(a->nslots, b->nslots);
    ASSERT(bytes_eq(a->slots, b->slots, (size_t)a->nslots * 4));
    ASSERT_EQ(a->found, b->found);
    ASSERT_U64_EQ(a->peer_epoch, b->peer_epoch);
    ASSERT_EQ(a->code, b->code);
    ASSERT_EQ(a->origin_rank, b->origin_rank);
    ASSERT_EQ(a->dp_rank, b->dp_rank);
    ASSERT_EQ(a->pp_rank, b->pp_rank);
    ASSERT_EQ(a->str_len, b->str_len);
    ASSERT(bytes_eq(a->str, b->str, a->str_len));
    ASSERT_EQ(a->peer_len, b->peer_len);
    ASSERT(bytes_eq(a->peer, b->peer, a->peer_len));
    ASSERT_EQ(a->addr_len, b->addr_len);
    ASSERT(bytes_eq(a->addr, b->addr, a->addr_len));
    ASSERT_EQ(a->layout.page_size, b->layout.page_size);
    ASSERT_EQ(a->layout.nkv, b->layout.nkv);
    ASSERT(bytes_eq(a->layout.kv_item_lens, b->layout.kv_item_lens, (size_t)a->layout.nkv * 8));
    ASSERT_EQ(a->layout.naux, b->layout.naux);
    ASSERT(bytes_eq(a->layout.aux_item_lens, b->layout.aux_item_lens, (size_t)a->layout.naux * 8));
}

/* Decodes from a heap copy of exactly len bytes, so ASan/valgrind catch any
 * read past the end. */
static int decode_exact(const void *buf, size_t len, kvr_msg_t *out, const char **why)
{
    unsigned char *copy = malloc(len ? len : 1);
    ASSERT(copy != NULL);
    if (len) {
        memcpy(copy, buf, len);
    }
    *why = NULL;
    int rc = kvr_wire_decode(len ? copy : copy + 1, len, out, why);
    /* pointers into the copy must stay inside it */
    if (rc == 0) {
        const unsigned char *lo = copy, *hi = copy + len;
#define INSIDE(p, n)                                                                               \
    ASSERT((n) == 0 || ((const unsigned char *)(p) >= lo && (const unsigned char *)(p) + (n) <= hi))
        INSIDE(out->str, out->str_len);
        INSIDE(out->peer, out->peer_len);
        INSIDE(out->addr, out->addr_len);
        INSIDE(out->pages, (size_t)out->npages * 4);
        INSIDE(out->layout.kv_item_lens, (size_t)out->layout.nkv * 8);
        INSIDE(out->layout.aux_item_lens, (size_t)out->layout.naux * 8);
        INSIDE(out->layout.rules, (size_t)out->layout.nrules * 4);
        INSIDE(out->slots, (size_t)out->nslots * 4);
#undef INSIDE
        /* the caller compares fields after free, so hand back stable copies */
        static unsigned char rules[4 * 64];
        if (out->layout.nrules > 0) {
            ASSERT((size_t)out->layout.nrules * 4 <= sizeof(rules));
            memcpy(rules, out->layout.rules, (size_t)out->layout.nrules * 4);
            out->layout.rules = rules;
        }
        static unsigned char slots[4 * 64];
        if (out->nslots > 0) {
            ASSERT((size_t)out->nslots * 4 <= sizeof(slots));
            memcpy(slots, out->slots, (size_t)out->nslots * 4);
            out->slots = slots;
        }
    }
    free(copy);
    return rc;
}

TEST_IMPL(wire_round_trip_all_types)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    for (int type = KVR_MSG_BS_REGISTER; type < KVR_MSG_LAST; type++) {
        kvr_msg_t m = sample(type), d;
        const char *why = NULL;
        ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
        ASSERT(b.len >= KVR_WIRE_HEADER_LEN);
        ASSERT_EQ(b.oom, 0);
        ASSERT_EQ(kvr_wire_decode(b.data, b.len, &d, &why), 0);
        assert_same(&m, &d);
        /* decoded pointers point into the buffer */
        if (d.str_len) {
            ASSERT((const unsigned char *)d.str > b.data &&
                   (const unsigned char *)d.str + d.str_len <= b.data + b.len);
        }
        /* re-encoding the decoded message gives the same bytes */
        kvr_wbuf_t b2;
        kvr_wbuf_init(&b2);
        ASSERT_EQ(kvr_wire_encode(&b2, &d), 0);
        ASSERT_EQ(b2.len, b.len);
        ASSERT(memcmp(b2.data, b.data, b.len) == 0);
        kvr_wbuf_free(&b2);
    }
    kvr_wbuf_free(&b);
    ASSERT(b.data == NULL);
}

static size_t put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
    return (size_t)n;
}

/* Bytes laid out by hand, independent of the encoder. */
TEST_IMPL(wire_golden_bytes)
{
    unsigned char g[128];
    size_t n = 0;
    n += put_le(g + n, 0x5752564b, 4);
    ASSERT(memcmp(g, "KVRW", 4) == 0);
    n += put_le(g + n, 1, 2);
    n += put_le(g + n, KVR_MSG_ROOM_FAIL, 2);
    n += put_le(g + n, 0x1122334455667788ULL, 8);
    n += put_le(g + n, 99, 8);         /* room */
    n += put_le(g + n, 100, 8);        /* tag */
    n += put_le(g + n, 3, 2);          /* code */
    n += put_le(g + n, 0xffffffff, 4); /* origin rank -1 */
    n += put_le(g + n, 9, 2);
    memcpy(g + n, "peer lost", 9);
    n += 9;
    n += put_le(g + n, 13, 2);
    memcpy(g + n, "10.0.0.9:7000", 13);
    n += 13;
    kvr_msg_t m = sample(KVR_MSG_ROOM_FAIL), d;
    m.epoch = 0x1122334455667788ULL;
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(b.len, n);
    ASSERT(memcmp(b.data, g, n) == 0);
    const char *why;
    ASSERT_EQ(decode_exact(g, n, &d, &why), 0);
    ASSERT_EQ(d.origin_rank, -1);
    ASSERT_U64_EQ(d.epoch, 0x1122334455667788ULL);
    kvr_wbuf_free(&b);

    /* ROOM_REQ with a negative aux index and page list */
    n = 0;
    n += put_le(g + n, 0x5752564b, 4);
    n += put_le(g + n, 1, 2);
    n += put_le(g + n, KVR_MSG_ROOM_REQ, 2);
    n += put_le(g + n, 7, 8);
    n += put_le(g + n, 5, 8);
    n += put_le(g + n, 6, 8);
    n += put_le(g + n, (uint64_t)-1, 8);
    n += put_le(g + n, 2, 4);
    n += put_le(g + n, 0x7fffffff, 4);
    n += put_le(g + n, 0x80000000, 4);
    unsigned char *h = malloc(n);
    memcpy(h, g, n);
    ASSERT_EQ(kvr_wire_decode(h, n, &d, &why), 0);
    ASSERT_EQ(d.aux_index, -1);
    ASSERT_EQ(d.npages, 2);
    ASSERT_EQ(kvr_wire_i32_at(d.pages, 0), 2147483647);
    ASSERT_EQ(kvr_wire_i32_at(d.pages, 1), -2147483647 - 1);
    free(h);
}

TEST_IMPL(wire_every_truncation_rejected)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    for (int type = KVR_MSG_BS_REGISTER; type < KVR_MSG_LAST; type++) {
        kvr_msg_t m = sample(type), d;
        ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
        for (size_t len = 0; len < b.len; len++) {
            const char *why = NULL;
            int rc = decode_exact(b.data, len, &d, &why);
            if (rc != -1 || why == NULL || why[0] == '\0') {
                fprintf(stderr, "type %d truncated to %zu of %zu: rc %d why %s\n", type, len, b.len,
                        rc, why ? why : "(null)");
            }
            ASSERT_EQ(rc, -1);
            ASSERT(why != NULL && why[0] != '\0');
        }
        /* and the full message still decodes from an exact-size buffer */
        const char *why;
        ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    }
    /* the same for empty variable-length parts (ROOM_REQ without pages,
     * strings of length 0) */
    kvr_msg_t m = sample(KVR_MSG_ROOM_REQ), d;
    m.npages = 0;
    m.pages = NULL;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    for (size_t len = 0; len < b.len; len++) {
        const char *why;
        ASSERT_EQ(decode_exact(b.data, len, &d, &why), -1);
    }
    m = sample(KVR_MSG_ROOM_FAIL);
    m.str_len = 0;
    m.peer_len = 0;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    for (size_t len = 0; len < b.len; len++) {
        const char *why;
        ASSERT_EQ(decode_exact(b.data, len, &d, &why), -1);
    }
    kvr_wbuf_free(&b);
}

TEST_IMPL(wire_trailing_bytes_rejected)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    for (int type = KVR_MSG_BS_REGISTER; type < KVR_MSG_LAST; type++) {
        kvr_msg_t m = sample(type), d;
        ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
        unsigned char *x = malloc(b.len + 1);
        memcpy(x, b.data, b.len);
        x[b.len] = 0;
        const char *why = NULL;
        ASSERT_EQ(decode_exact(x, b.len + 1, &d, &why), -1);
        /* after a worker address a byte is the optional fields' flags */
        int hello = type == KVR_MSG_HELLO || type == KVR_MSG_HELLO_OK;
        ASSERT(why != NULL &&
               strcmp(why, hello ? "explicit empty HELLO fields" : "trailing bytes") == 0);
        free(x);
    }
    kvr_wbuf_free(&b);
}

TEST_IMPL(wire_bad_header)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    kvr_msg_t m = sample(KVR_MSG_PING), d;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    const char *why;
    unsigned char x[64];
    memcpy(x, b.data, b.len);
    x[0] ^= 1;
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "bad magic") == 0);
    memcpy(x, b.data, b.len);
    x[4] = 2;
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "unsupported protocol version") == 0);
    uint16_t bad_types[] = {0, KVR_MSG_LAST, 0x100 | KVR_MSG_PING, 0x7fff};
    for (size_t i = 0; i < 4; i++) {
        memcpy(x, b.data, b.len);
        put_le(x + 6, bad_types[i], 2);
        ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
        ASSERT(strcmp(why, "unknown message type") == 0);
    }
    /* the authentication flag (auth.h): sealed messages never reach the
     * decoder of a side without the secret */
    uint16_t sealed_types[] = {0x8000 | KVR_MSG_PING, 0xffff};
    for (size_t i = 0; i < 2; i++) {
        memcpy(x, b.data, b.len);
        put_le(x + 6, sealed_types[i], 2);
        ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
        ASSERT(strstr(why, "authenticated message") != NULL);
    }
    /* a bare header of a type that needs a body */
    ASSERT_EQ(decode_exact(b.data, KVR_WIRE_HEADER_LEN, &d, &why), -1);
    kvr_wbuf_free(&b);
}

/* A failure message with code 0 (KVR_OK) says nothing failed: the decoder
 * refuses it and the encoder never writes it; unknown codes pass (the
 * receiver reports them as REMOTE). */
TEST_IMPL(wire_failure_code_zero)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    int types[] = {KVR_MSG_HELLO_REJECT, KVR_MSG_ROOM_FAIL, KVR_MSG_SIB_FAIL};
    for (size_t i = 0; i < 3; i++) {
        kvr_msg_t m = sample(types[i]), d;
        const char *why = NULL;
        m.code = 0xffff;
        ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
        ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
        ASSERT_EQ(d.code, 0xffff);
        /* the code sits after the rank (HELLO_REJECT) or room and tag */
        size_t at = KVR_WIRE_HEADER_LEN + (types[i] == KVR_MSG_HELLO_REJECT ? 4 : 16);
        put_le(b.data + at, 0, 2);
        ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), -1);
        ASSERT(strcmp(why, "failure code 0") == 0);
        m.code = 0;
        ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    }
    kvr_wbuf_free(&b);
}

/* Size limits: the largest legal value decodes, one more is rejected, and
 * a length field that claims more than the buffer never reads past it. */
TEST_IMPL(wire_limits)
{
    const char *why;
    kvr_msg_t d;
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    char *s = malloc(70000);
    memset(s, 'a', 70000);

    /* strings: 1024 is the limit; the encoder clips longer ones */
    kvr_msg_t m = sample(KVR_MSG_HELLO_REJECT);
    m.str = s;
    m.str_len = KVR_WIRE_MAX_STR;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.str_len, KVR_WIRE_MAX_STR);
    m.str_len = 60000;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.str_len, KVR_WIRE_MAX_STR);
    /* a string length of 1025 on the wire is rejected */
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    unsigned char *x = malloc(b.len + 1);
    memcpy(x, b.data, b.len);
    put_le(x + KVR_WIRE_HEADER_LEN + 6, KVR_WIRE_MAX_STR + 1, 2);
    x[b.len] = 'a';
    ASSERT_EQ(decode_exact(x, b.len + 1, &d, &why), -1);
    ASSERT(strcmp(why, "bad reason") == 0);
    /* a length of 0xffff with few bytes behind it */
    put_le(x + KVR_WIRE_HEADER_LEN + 6, 0xffff, 2);
    ASSERT_EQ(decode_exact(x, b.len + 1, &d, &why), -1);
    free(x);

    /* layout: 4096 buffers is the limit */
    unsigned char *lens = calloc(KVR_WIRE_MAX_BUFFERS + 1, 8);
    m = sample(KVR_MSG_HELLO_OK);
    m.layout.nkv = KVR_WIRE_MAX_BUFFERS;
    m.layout.kv_item_lens = lens;
    m.layout.naux = KVR_WIRE_MAX_BUFFERS;
    m.layout.aux_item_lens = lens;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.layout.nkv, KVR_WIRE_MAX_BUFFERS);
    /* one more is refused by the encoder, and by the decoder when a peer
     * sends it anyway (patched into a valid message) */
    m.layout.nkv = KVR_WIRE_MAX_BUFFERS + 1;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    m.layout.nkv = 1;
    m.layout.naux = 1;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    x = malloc(b.len);
    memcpy(x, b.data, b.len);
    put_le(x + KVR_WIRE_HEADER_LEN + 8, KVR_WIRE_MAX_BUFFERS + 1, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "too many KV buffers in layout") == 0);
    memcpy(x, b.data, b.len);
    put_le(x + KVR_WIRE_HEADER_LEN + 12 + 8, KVR_WIRE_MAX_BUFFERS + 1, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "too many aux buffers in layout") == 0);
    free(x);
    m.layout.naux = KVR_WIRE_MAX_BUFFERS + 1;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    /* nkv near UINT32_MAX: the length check must not wrap */
    m.layout.nkv = 1;
    m.layout.naux = 0;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    x = malloc(b.len);
    memcpy(x, b.data, b.len);
    put_le(x + KVR_WIRE_HEADER_LEN + 4 + 4, 0xffffffff, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    free(x);

    /* worker address: 1..65536 */
    m = sample(KVR_MSG_HELLO);
    unsigned char *addr = calloc(KVR_WIRE_MAX_ADDR + 1, 1);
    m.addr = addr;
    m.addr_len = KVR_WIRE_MAX_ADDR;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.addr_len, KVR_WIRE_MAX_ADDR);
    /* the address length field sits right before the address: patch it */
    size_t alen_pos = b.len - KVR_WIRE_MAX_ADDR - 4;
    x = malloc(b.len + 1);
    memcpy(x, b.data, b.len);
    put_le(x + alen_pos, KVR_WIRE_MAX_ADDR + 1, 4);
    ASSERT_EQ(decode_exact(x, b.len + 1, &d, &why), -1);
    ASSERT(strcmp(why, "bad worker address length") == 0);
    put_le(x + alen_pos, 0, 4);
    ASSERT_EQ(decode_exact(x, alen_pos + 4, &d, &why), -1);
    ASSERT(strcmp(why, "bad worker address length") == 0);
    free(x);
    /* and the encoder refuses both */
    m.addr_len = KVR_WIRE_MAX_ADDR + 1;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    m.addr_len = 0;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    free(addr);

    /* pages: the count is checked before the (huge) list is taken */
    m = sample(KVR_MSG_ROOM_REQ);
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    x = malloc(b.len);
    memcpy(x, b.data, b.len);
    size_t npos = KVR_WIRE_HEADER_LEN + 24;
    put_le(x + npos, KVR_WIRE_MAX_PAGES + 1, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "too many pages") == 0);
    put_le(x + npos, 0xffffffff, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    put_le(x + npos, KVR_WIRE_MAX_PAGES, 4);
    ASSERT_EQ(decode_exact(x, b.len, &d, &why), -1);
    ASSERT(strcmp(why, "truncated page list") == 0);
    free(x);

    free(lens);
    free(s);
    kvr_wbuf_free(&b);
}

TEST_IMPL(wire_encoder_edges)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    kvr_msg_t m = sample(KVR_MSG_PING), d;
    m.type = 0;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    m.type = KVR_MSG_LAST;
    ASSERT_EQ(kvr_wire_encode(&b, &m), -1);
    /* the buffer is reset by every encode */
    m = sample(KVR_MSG_ROOM_REQ);
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    size_t big = b.len;
    m = sample(KVR_MSG_PING);
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT(b.len < big);
    ASSERT_EQ(b.len, KVR_WIRE_HEADER_LEN + 4);
    const char *why;
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.type, KVR_MSG_PING);
    /* growing past the initial capacity many times */
    unsigned char *pages = calloc(100000, 4);
    m = sample(KVR_MSG_ROOM_REQ);
    m.npages = 100000;
    m.pages = pages;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(b.len, KVR_WIRE_HEADER_LEN + 28 + 400000);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.npages, 100000);
    free(pages);
    /* HELLO_OK with an empty layout */
    m = sample(KVR_MSG_HELLO_OK);
    m.layout.nkv = 0;
    m.layout.kv_item_lens = NULL;
    m.layout.naux = 0;
    m.layout.aux_item_lens = NULL;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT_EQ(d.layout.nkv, 0);
    kvr_wbuf_free(&b);
    kvr_wbuf_free(&b);
}

TEST_IMPL(wire_array_readers)
{
    ASSERT_U64_EQ(kvr_wire_u64_at(kv_lens, 0), 4096);
    ASSERT_U64_EQ(kvr_wire_u64_at(kv_lens, 1), 8192);
    ASSERT_U64_EQ(kvr_wire_u64_at(kv_lens, 2), UINT64_MAX);
    ASSERT_EQ(kvr_wire_i32_at(pages_bytes, 0), 0);
    ASSERT_EQ(kvr_wire_i32_at(pages_bytes, 1), 2147483647);
    ASSERT_EQ(kvr_wire_i32_at(pages_bytes, 2), -2147483647 - 1);
    ASSERT_EQ(kvr_wire_i32_at(pages_bytes, 3), -1);
}

TEST_IMPL(wire_type_names)
{
    const char *want[] = {
        "?",        "BS_REGISTER",  "BS_REGISTER_OK", "BS_QUERY",   "BS_QUERY_REPLY", "HELLO",
        "HELLO_OK", "HELLO_REJECT", "ROOM_REQ",       "ROOM_DONE",  "ROOM_FAIL",      "PING",
        "PONG",     "BYE",          "SIB_FAIL",       "AUTH_REJECT", "PATH_LOST"};
    ASSERT_EQ(sizeof(want) / sizeof(want[0]), KVR_MSG_LAST);
    for (int t = 1; t < KVR_MSG_LAST; t++) {
        ASSERT(strcmp(kvr_msg_type_name(t), want[t]) == 0);
    }
    ASSERT(strcmp(kvr_msg_type_name(0), "?") == 0);
    ASSERT(strcmp(kvr_msg_type_name(-1), "?") == 0);
    ASSERT(strcmp(kvr_msg_type_name(KVR_MSG_LAST), "?") == 0);
    ASSERT(strcmp(kvr_msg_type_name(1 << 20), "?") == 0);
}

/* ---- data message header ---- */

static void am_same(const kvr_am_header_t *a, const kvr_am_header_t *b)
{
    ASSERT_EQ(a->kind, b->kind);
    ASSERT_EQ(a->buf, b->buf);
    ASSERT_U64_EQ(a->pos, b->pos);
    ASSERT_U64_EQ(a->npages, b->npages);
    ASSERT_U64_EQ(a->tag, b->tag);
    ASSERT_U64_EQ(a->epoch, b->epoch);
    ASSERT_EQ(a->nbuf, b->nbuf);
    ASSERT_EQ(a->flags, b->flags);
}

TEST_IMPL(am_header_round_trip)
{
    kvr_am_header_t cases[] = {
        {KVR_AM_KIND_KV, 0, 0, 1, 0, 0, 1, 0},
        {KVR_AM_KIND_KV, 0xffff, 0xffffffffu, 0xffffffffu, UINT64_MAX, UINT64_MAX, 0xffff,
         KVR_AM_FLAG_READ},
        {KVR_AM_KIND_AUX, 3, 17, 1, 0x0102030405060708ULL, 0x1112131415161718ULL, 2, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        unsigned char out[KVR_AM_HEADER_LEN + 8];
        memset(out, 0xEE, sizeof(out));
        kvr_am_header_encode(out, &cases[i]);
        ASSERT_EQ(out[KVR_AM_HEADER_LEN], 0xEE); /* writes exactly 36 bytes */
        unsigned char *h = malloc(KVR_AM_HEADER_LEN);
        memcpy(h, out, KVR_AM_HEADER_LEN);
        kvr_am_header_t d;
        const char *why = NULL;
        ASSERT_EQ(kvr_am_header_decode(h, KVR_AM_HEADER_LEN, &d, &why), 0);
        am_same(&cases[i], &d);
        free(h);
    }
    /* golden layout */
    kvr_am_header_t g = {
        KVR_AM_KIND_AUX,       0x0a0b, 0x01020304, 0x05060708, 0x1112131415161718ULL,
        0x2122232425262728ULL, 0x0c0d, 0};
    unsigned char want[KVR_AM_HEADER_LEN] = {'K',  'V',  'R',  'W',  2,    0,    0x0b, 0x0a, 0x0d,
                                             0x0c, 0,    0,    4,    3,    2,    1,    8,    7,
                                             6,    5,    0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12,
                                             0x11, 0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21};
    unsigned char got[KVR_AM_HEADER_LEN];
    kvr_am_header_encode(got, &g);
    ASSERT(memcmp(got, want, sizeof(want)) == 0);
}

TEST_IMPL(am_header_rejects)
{
    kvr_am_header_t h = {KVR_AM_KIND_KV, 1, 2, 3, 4, 5, 6, 0}, d;
    unsigned char good[KVR_AM_HEADER_LEN], x[KVR_AM_HEADER_LEN + 1];
    const char *why;
    kvr_am_header_encode(good, &h);
    /* every other length, from exact-size heap buffers */
    for (size_t len = 0; len <= KVR_AM_HEADER_LEN + 1; len++) {
        if (len == KVR_AM_HEADER_LEN) {
            continue;
        }
        unsigned char *p = malloc(len ? len : 1);
        memcpy(x, good, KVR_AM_HEADER_LEN);
        x[KVR_AM_HEADER_LEN] = 0;
        memcpy(p, x, len);
        why = NULL;
        ASSERT_EQ(kvr_am_header_decode(p, len, &d, &why), -1);
        ASSERT(why != NULL);
        free(p);
    }
    memcpy(x, good, KVR_AM_HEADER_LEN);
    x[3] ^= 0x80;
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
    ASSERT(strcmp(why, "data header has a bad magic") == 0);
    uint16_t kinds[] = {0, 3, 0x101, 0xffff};
    for (size_t i = 0; i < 4; i++) {
        memcpy(x, good, KVR_AM_HEADER_LEN);
        put_le(x + 4, kinds[i], 2);
        ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
        ASSERT(strcmp(why, "data header has an unknown kind") == 0);
    }
    memcpy(x, good, KVR_AM_HEADER_LEN);
    put_le(x + 16, 0, 4);
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
    ASSERT(strcmp(why, "data header names no pages") == 0);
    memcpy(x, good, KVR_AM_HEADER_LEN);
    put_le(x + 8, 0, 2);
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
    ASSERT(strcmp(why, "data header names no buffers") == 0);
    memcpy(x, good, KVR_AM_HEADER_LEN);
    put_le(x + 10, 2, 2);
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
    ASSERT(strcmp(why, "data header has unknown flags") == 0);
    /* a read descriptor: KV only */
    memcpy(x, good, KVR_AM_HEADER_LEN);
    put_le(x + 10, KVR_AM_FLAG_READ, 2);
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), 0);
    ASSERT_EQ(d.flags, KVR_AM_FLAG_READ);
    put_le(x + 4, KVR_AM_KIND_AUX, 2);
    ASSERT_EQ(kvr_am_header_decode(x, KVR_AM_HEADER_LEN, &d, &why), -1);
    ASSERT(strcmp(why, "data header asks to read an aux row") == 0);
}

/*
 * An optional u32 at the end of a message: `without` encodes as before,
 * `with` (the same message with the field set to `value`) appends it
 * little-endian; 1..3 bytes or anything after it are trailing bytes, and an
 * explicit zero (a second encoding of "not there") is refused with
 * zero_why.  Decodes `with` into *d.
 */
static void check_optional_u32_tail(const kvr_msg_t *without, const kvr_msg_t *with, uint32_t value,
                                    const char *zero_why, kvr_msg_t *d)
{
    kvr_wbuf_t b, b0;
    kvr_wbuf_init(&b);
    kvr_wbuf_init(&b0);
    const char *why = NULL;
    ASSERT_EQ(kvr_wire_encode(&b0, without), 0);
    ASSERT_EQ(decode_exact(b0.data, b0.len, d, &why), 0);
    ASSERT_EQ(kvr_wire_encode(&b, with), 0);
    ASSERT_EQ(b.len, b0.len + 4);
    ASSERT(memcmp(b.data, b0.data, b0.len) == 0);
    ASSERT((uint32_t)kvr_wire_i32_at(b.data + b0.len, 0) == value);
    unsigned char x[512];
    ASSERT(b.len + 1 <= sizeof(x));
    for (size_t extra = 1; extra < 4; extra++) {
        ASSERT_EQ(decode_exact(b.data, b0.len + extra, d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "trailing bytes") == 0);
    }
    memcpy(x, b.data, b.len);
    x[b.len] = 0;
    ASSERT_EQ(decode_exact(x, b.len + 1, d, &why), -1);
    ASSERT(strcmp(why, "trailing bytes") == 0);
    memcpy(x, b.data, b.len);
    memset(x + b0.len, 0, 4);
    ASSERT_EQ(decode_exact(x, b.len, d, &why), -1);
    ASSERT(strcmp(why, zero_why) == 0);
    ASSERT_EQ(decode_exact(b.data, b.len, d, &why), 0);
    kvr_wbuf_free(&b);
    kvr_wbuf_free(&b0);
}

/* A type without the field does not encode it, and 4 more bytes are
 * trailing.  Decodes m's encoding into *d. */
static void check_no_u32_tail(const kvr_msg_t *m, kvr_msg_t *d)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    const char *why = NULL;
    unsigned char x[512];
    ASSERT_EQ(kvr_wire_encode(&b, m), 0);
    ASSERT(b.len + 4 <= sizeof(x));
    memcpy(x, b.data, b.len);
    memcpy(x + b.len, "\0\0\2\0", 4);
    ASSERT_EQ(decode_exact(x, b.len + 4, d, &why), -1);
    ASSERT(strcmp(why, "trailing bytes") == 0);
    ASSERT_EQ(decode_exact(b.data, b.len, d, &why), 0);
    kvr_wbuf_free(&b);
}

TEST_IMPL(wire_room_req_prefix)
{
    kvr_msg_t m = sample(KVR_MSG_ROOM_REQ), with = m, d;
    with.prefix_len = 0x01020304;
    check_optional_u32_tail(&m, &with, 0x01020304, "explicit zero prefix length", &d);
    ASSERT_U64_EQ(d.prefix_len, 0x01020304);
    ASSERT_EQ(d.npages, m.npages);
    kvr_msg_t done = sample(KVR_MSG_ROOM_DONE); /* other types ignore the field */
    done.prefix_len = 9;
    check_no_u32_tail(&done, &d);
    ASSERT_EQ(d.prefix_len, 0);
}

/* ROOM_REQ's list slots (state.c): after the states, u32 count then the
 * slots, only when there are any; a count of 0 or past the limit, or
 * fewer slots than it says, is refused. */
TEST_IMPL(wire_room_req_lists)
{
    unsigned char pages[4] = {5, 0, 0, 0};
    unsigned char states[16] = {3, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0};
    unsigned char slots[8] = {7, 0, 0, 0, 9, 0, 0, 0};
    kvr_msg_t m = kvr_msg_room_req(43, 7, 1, 1, pages, 0, 2, states), d;
    kvr_wbuf_t b0, b;
    kvr_wbuf_init(&b0);
    kvr_wbuf_init(&b);
    const char *why = NULL;
    ASSERT_EQ(kvr_wire_encode(&b0, &m), 0);
    m.nslots = 2;
    m.slots = slots;
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(b.len, b0.len + 4 + 8);
    ASSERT(memcmp(b.data, b0.data, b0.len) == 0);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT(d.nslots == 2 && memcmp(d.slots, slots, 8) == 0);
    for (size_t cut = 4; cut < 12; cut++) {
        ASSERT_EQ(decode_exact(b.data, b0.len + cut, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "truncated list slots") == 0);
    }
    unsigned char buf[256];
    ASSERT(b0.len + 4 <= sizeof(buf));
    static const uint32_t bad[] = {0, KVR_WIRE_MAX_PAGES + 1};
    for (size_t i = 0; i < 2; i++) {
        memcpy(buf, b0.data, b0.len);
        put_le(buf + b0.len, bad[i], 4);
        ASSERT_EQ(decode_exact(buf, b0.len + 4, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "bad list slot count") == 0);
    }
    kvr_wbuf_free(&b);
    kvr_wbuf_free(&b0);
}

/* BS_REGISTER's and BS_QUERY's DP and PP ranks: two u32 after the rest,
 * only when either is > 0 (DP 0, PP 0 encodes as before). */
TEST_IMPL(wire_bs_dp_pp)
{
    kvr_wbuf_t b, b0;
    kvr_wbuf_init(&b);
    kvr_wbuf_init(&b0);
    kvr_msg_t d;
    const char *why = NULL;
    /* The old encodings, byte for byte. */
    kvr_msg_t reg = kvr_msg_bs(KVR_MSG_BS_REGISTER, 0, 3, 0, "tcp://h:1");
    kvr_msg_t old_reg = kvr_msg_text(KVR_MSG_BS_REGISTER, 3, 0, "tcp://h:1");
    ASSERT_EQ(kvr_wire_encode(&b0, &old_reg), 0);
    ASSERT_EQ(kvr_wire_encode(&b, &reg), 0);
    ASSERT_EQ(b.len, KVR_WIRE_HEADER_LEN + 4 + 2 + 9);
    ASSERT(b.len == b0.len && memcmp(b.data, b0.data, b.len) == 0);
    kvr_msg_t q = kvr_msg_bs(KVR_MSG_BS_QUERY, 0, 1, 0, NULL);
    kvr_msg_t old_q = kvr_msg_rank(KVR_MSG_BS_QUERY, 1);
    ASSERT_EQ(kvr_wire_encode(&b0, &old_q), 0);
    ASSERT_EQ(kvr_wire_encode(&b, &q), 0);
    ASSERT(b.len == b0.len && memcmp(b.data, b0.data, b.len) == 0);
    /* A query of TP rank 1 in DP group 2, PP stage 1, laid out by hand. */
    unsigned char g[64];
    size_t n = 0;
    n += put_le(g + n, 0x5752564b, 4);
    n += put_le(g + n, 1, 2);
    n += put_le(g + n, KVR_MSG_BS_QUERY, 2);
    n += put_le(g + n, 0, 8);
    n += put_le(g + n, 1, 4);
    n += put_le(g + n, 2, 4);
    n += put_le(g + n, 1, 4);
    q = kvr_msg_bs(KVR_MSG_BS_QUERY, 2, 1, 1, NULL);
    ASSERT_EQ(kvr_wire_encode(&b, &q), 0);
    ASSERT(b.len == n && memcmp(b.data, g, n) == 0);
    ASSERT_EQ(decode_exact(g, n, &d, &why), 0);
    ASSERT(d.rank == 1 && d.dp_rank == 2 && d.pp_rank == 1);
    /* Each rank alone, at the limit, survives the trip. */
    reg = kvr_msg_bs(KVR_MSG_BS_REGISTER, KVR_WIRE_MAX_DP_PP, 7, 0, "tcp://h:2");
    ASSERT_EQ(kvr_wire_encode(&b, &reg), 0);
    ASSERT_EQ(kvr_wire_decode(b.data, b.len, &d, &why), 0);
    assert_same(&reg, &d);
    reg = kvr_msg_bs(KVR_MSG_BS_REGISTER, 0, 7, KVR_WIRE_MAX_DP_PP, "tcp://h:2");
    ASSERT_EQ(kvr_wire_encode(&b, &reg), 0);
    ASSERT_EQ(kvr_wire_decode(b.data, b.len, &d, &why), 0);
    assert_same(&reg, &d);
    /* Fewer than 8 bytes more are trailing; 8 zero bytes say nothing. */
    unsigned char x[64];
    memcpy(x, g, n);
    for (size_t cut = n - 7; cut < n; cut++) {
        ASSERT_EQ(decode_exact(x, cut, &d, &why), -1);
        ASSERT(strcmp(why, "trailing bytes") == 0);
    }
    memset(x + n - 8, 0, 8);
    ASSERT_EQ(decode_exact(x, n, &d, &why), -1);
    ASSERT(strcmp(why, "explicit zero DP and PP ranks") == 0);
    /* Above 16 bits: neither encoded nor decoded (the server keys on them). */
    memcpy(x, g, n);
    put_le(x + n - 8, KVR_WIRE_MAX_DP_PP + 1, 4);
    ASSERT_EQ(decode_exact(x, n, &d, &why), -1);
    ASSERT(strcmp(why, "DP or PP rank above 65535") == 0);
    memcpy(x, g, n);
    put_le(x + n - 4, 0xffffffffu, 4);
    ASSERT_EQ(decode_exact(x, n, &d, &why), -1);
    ASSERT(strcmp(why, "DP or PP rank above 65535") == 0);
    q = kvr_msg_bs(KVR_MSG_BS_QUERY, KVR_WIRE_MAX_DP_PP + 1, 1, 0, NULL);
    ASSERT_EQ(kvr_wire_encode(&b, &q), -1);
    q = kvr_msg_bs(KVR_MSG_BS_QUERY, 0, 1, KVR_WIRE_MAX_DP_PP + 1, NULL);
    ASSERT_EQ(kvr_wire_encode(&b, &q), -1);
    /* Other types neither carry nor read them. */
    kvr_msg_t ok = kvr_msg_rank(KVR_MSG_BS_REGISTER_OK, 3);
    ok.dp_rank = 2;
    ASSERT_EQ(kvr_wire_encode(&b, &ok), 0);
    ASSERT_EQ(b.len, KVR_WIRE_HEADER_LEN + 4);
    kvr_wbuf_free(&b);
    kvr_wbuf_free(&b0);
}

/* The optional fields after a HELLO's worker address: a flags byte, then
 * each field present, in flag order (tcp receive size, shared-memory sizes,
 * head layout, cross-memory offer, layers, state rules, state lists, the
 * tcp lane: nothing in a HELLO); none: no byte.  A HELLO_OK carries only
 * the head layout, the offer (with its pid and probe address), the layers,
 * the state fields and the lane (with its port and token). */
static void hello_fields(kvr_msg_t *m, unsigned x)
{
    if (x & 1) {
        m->tcp_rx_seg = 512u << 10;
    }
    if (x & 2) {
        m->has_shm = 1;
        m->shm_seg = 32u << 10;
        m->shm_fifo = 256;
    }
    if (x & 4) {
        m->layout.tp_size = 4;
        m->layout.tp_rank = 3;
        m->layout.heads = 1;
        m->layout.total_heads = 2;
    }
    if (x & 8) {
        m->has_cma = 1;
        for (unsigned i = 0; i < sizeof(m->boot_id); i++) {
            m->boot_id[i] = (unsigned char)(0xb0 + i);
        }
        m->pid = 4242;
        m->probe_addr = 0x7f0011223344ULL;
    }
    if (x & 16) {
        m->layout.pp_size = 3;
        m->layout.pp_rank = 2;
        m->layout.start_layer = 5;
        m->layout.layers = 4;
    }
    if (x & 32) {
        static const unsigned char rules[12] = {1, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0};
        m->layout.nrules = 3;
        m->layout.rules = rules;
    }
    if (x & 64) {
        m->layout.state_lists = 2;
    }
    if (x & 128) {
        m->has_lane = 1;
        m->lane_port = 4321;
        for (unsigned i = 0; i < sizeof(m->lane_token); i++) {
            m->lane_token[i] = (unsigned char)(0x70 + i);
        }
    }
}

TEST_IMPL(wire_hello_fields)
{
    kvr_msg_t base = sample(KVR_MSG_HELLO), d;
    kvr_wbuf_t b0, b;
    kvr_wbuf_init(&b0);
    const char *why = NULL;
    ASSERT_EQ(kvr_wire_encode(&b0, &base), 0);
    ASSERT_EQ(decode_exact(b0.data, b0.len, &d, &why), 0);
    ASSERT(d.tcp_rx_seg == 0 && d.has_shm == 0 && d.layout.heads == 0);
    for (unsigned x = 1; x < 256; x++) {
        kvr_msg_t m = base;
        hello_fields(&m, x);
        kvr_wbuf_init(&b);
        ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
        size_t want = 1 + (x & 1 ? 4 : 0) + (x & 2 ? 8 : 0) + (x & 4 ? 16 : 0) + (x & 8 ? 16 : 0) +
                      (x & 16 ? 16 : 0) + (x & 32 ? 16 : 0) + (x & 64 ? 1 : 0);
        ASSERT_EQ(b.len, b0.len + want);
        ASSERT(memcmp(b.data, b0.data, b0.len) == 0);
        ASSERT_EQ(b.data[b0.len], x);
        ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
        ASSERT_EQ(d.tcp_rx_seg, m.tcp_rx_seg);
        ASSERT(d.has_shm == m.has_shm && d.shm_seg == m.shm_seg && d.shm_fifo == m.shm_fifo);
        ASSERT(d.layout.tp_size == m.layout.tp_size && d.layout.tp_rank == m.layout.tp_rank &&
               d.layout.heads == m.layout.heads && d.layout.total_heads == m.layout.total_heads);
        ASSERT(d.has_cma == m.has_cma);
        ASSERT(d.layout.pp_size == m.layout.pp_size && d.layout.pp_rank == m.layout.pp_rank &&
               d.layout.start_layer == m.layout.start_layer && d.layout.layers == m.layout.layers);
        ASSERT(d.layout.nrules == m.layout.nrules &&
               (!m.layout.nrules || memcmp(d.layout.rules, m.layout.rules, 12) == 0));
        ASSERT_EQ(d.layout.state_lists, m.layout.state_lists);
        ASSERT(!m.has_cma || memcmp(d.boot_id, m.boot_id, sizeof(d.boot_id)) == 0);
        ASSERT(d.pid == 0 && d.probe_addr == 0); /* a HELLO's offer has neither */
        ASSERT(d.has_lane == m.has_lane && d.lane_port == 0); /* nor its lane a port */
        for (size_t cut = 1; cut < want; cut++) {
            ASSERT_EQ(decode_exact(b.data, b0.len + cut, &d, &why), -1);
            ASSERT(why != NULL && strncmp(why, "truncated ", 10) == 0);
        }
        unsigned char more[1024];
        ASSERT(b.len + 1 <= sizeof(more));
        memcpy(more, b.data, b.len);
        more[b.len] = 0;
        ASSERT_EQ(decode_exact(more, b.len + 1, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "trailing bytes") == 0);
        kvr_wbuf_free(&b);
    }
    /* one encoding per message: no explicit nothing, no zero size, no zero
     * heads; flags this version does not know are refused */
    static const struct {
        unsigned char x;
        size_t n;
        const char *why;
    } bad[] = {{0, 0, "explicit empty HELLO fields"},
               {128, 4, "trailing bytes"},
               {64, 1, "explicit empty state lists"},
               {16, 16, "explicit zero layers"},
               {32, 4, "bad state slicing length"},
               {1, 4, "explicit zero tcp receive size"},
               {4, 16, "explicit zero heads"}};
    unsigned char buf[1024];
    ASSERT(b0.len + 17 <= sizeof(buf));
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memcpy(buf, b0.data, b0.len);
        buf[b0.len] = bad[i].x;
        memset(buf + b0.len + 1, 0, bad[i].n);
        ASSERT_EQ(decode_exact(buf, b0.len + 1 + bad[i].n, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, bad[i].why) == 0);
    }
    /* layers that cannot be: a stage past the stages, a range past 2^32 */
    static const uint32_t impossible[][4] = {{2, 2, 0, 1}, {1, 0, 0xffffffffu, 2}};
    for (size_t i = 0; i < 2; i++) {
        memcpy(buf, b0.data, b0.len);
        buf[b0.len] = 16;
        for (int k = 0; k < 4; k++) {
            put_le(buf + b0.len + 1 + 4 * k, impossible[i][k], 4);
        }
        ASSERT_EQ(decode_exact(buf, b0.len + 17, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "impossible layers") == 0);
    }
    /* a HELLO_OK encodes only the head layout, and refuses the others */
    kvr_msg_t ok = sample(KVR_MSG_HELLO_OK), okx = ok;
    kvr_wbuf_t c0;
    kvr_wbuf_init(&c0);
    kvr_wbuf_init(&b);
    ASSERT_EQ(kvr_wire_encode(&c0, &ok), 0);
    hello_fields(&okx, 7);
    ASSERT_EQ(kvr_wire_encode(&b, &okx), 0);
    ASSERT_EQ(b.len, c0.len + 17);
    ASSERT_EQ(b.data[c0.len], 4);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT(d.tcp_rx_seg == 0 && d.has_shm == 0 && d.layout.heads == 1);
    ASSERT(c0.len + 5 <= sizeof(buf));
    memcpy(buf, c0.data, c0.len);
    buf[c0.len] = 1;
    memcpy(buf + c0.len + 1, "\0\0\2\0", 4);
    ASSERT_EQ(decode_exact(buf, c0.len + 5, &d, &why), -1);
    ASSERT(strcmp(why, "unknown HELLO fields") == 0);
    /* a HELLO_OK's offer: boot id, pid, probe address */
    kvr_msg_t okc = ok;
    hello_fields(&okc, 8);
    kvr_wbuf_free(&b);
    kvr_wbuf_init(&b);
    ASSERT_EQ(kvr_wire_encode(&b, &okc), 0);
    ASSERT_EQ(b.len, c0.len + 1 + 16 + 4 + 8);
    ASSERT_EQ(b.data[c0.len], 8);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT(d.has_cma && memcmp(d.boot_id, okc.boot_id, 16) == 0);
    ASSERT(d.pid == 4242 && d.probe_addr == 0x7f0011223344ULL);
    for (size_t cut = 1; cut < 1 + 16 + 4 + 8; cut++) {
        ASSERT_EQ(decode_exact(b.data, c0.len + cut, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "truncated cross-memory offer") == 0);
    }
    /* a HELLO_OK's lane: port and token; never port 0 */
    kvr_msg_t okl = ok;
    hello_fields(&okl, 128);
    kvr_wbuf_free(&b);
    kvr_wbuf_init(&b);
    ASSERT_EQ(kvr_wire_encode(&b, &okl), 0);
    ASSERT_EQ(b.len, c0.len + 1 + 2 + 16);
    ASSERT_EQ(b.data[c0.len], 128);
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), 0);
    ASSERT(d.has_lane && d.lane_port == 4321);
    ASSERT(memcmp(d.lane_token, okl.lane_token, sizeof(d.lane_token)) == 0);
    for (size_t cut = 1; cut < 1 + 2 + 16; cut++) {
        ASSERT_EQ(decode_exact(b.data, c0.len + cut, &d, &why), -1);
        ASSERT(why != NULL && strcmp(why, "truncated lane offer") == 0);
    }
    b.data[c0.len + 1] = b.data[c0.len + 2] = 0;
    ASSERT_EQ(decode_exact(b.data, b.len, &d, &why), -1);
    ASSERT(why != NULL && strcmp(why, "explicit zero lane port") == 0);
    kvr_wbuf_free(&b);
    kvr_wbuf_free(&c0);
    kvr_wbuf_free(&b0);
}

/* The constructors set what their type carries; it survives the wire. */
TEST_IMPL(wire_constructors)
{
    kvr_wbuf_t b;
    kvr_wbuf_init(&b);
    unsigned char lens[8] = {0, 16, 0, 0, 0, 0, 0, 0}, pages[8] = {5, 0, 0, 0, 9, 0, 0, 0};
    /* State slots 3 and -1 (component 1 not asked for). */
    unsigned char slots[16] = {3, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255};
    kvr_wire_layout_t layout = {16, 1, lens, 0, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0};
    char addr[3] = {1, 2, 3};
    kvr_msg_t ms[] = {
        kvr_msg_rank(KVR_MSG_PING, 3),
        kvr_msg_text(KVR_MSG_HELLO_REJECT, 3, KVR_LAYOUT_MISMATCH, "no"),
        kvr_msg_bs_reply(3, 1, 0xfeed, "tcp://h:1"),
        kvr_msg_hello(KVR_MSG_HELLO_OK, 3, &layout, addr, 3),
        kvr_msg_room_req(42, 7, -1, 2, pages, 11, 0, NULL),
        kvr_msg_room_req(43, 7, 1, 2, pages, 0, 2, slots),
        kvr_msg_room_done(42, 7),
        kvr_msg_fail(KVR_MSG_SIB_FAIL, 42, 0, KVR_PEER_LOST, 2, "lost", "10.0.0.1:5"),
        kvr_msg_fail(KVR_MSG_ROOM_FAIL, 42, 7, KVR_TIMEOUT, 1, "late", NULL),
        kvr_msg_bs(KVR_MSG_BS_REGISTER, 2, 3, 1, "tcp://h:1"),
        kvr_msg_bs(KVR_MSG_BS_QUERY, 2, 3, 0, NULL),
    };
    for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++) {
        kvr_msg_t d;
        const char *why = NULL;
        ASSERT_EQ(ms[i].epoch, 0);
        ms[i].epoch = 99;
        ASSERT_EQ(kvr_wire_encode(&b, &ms[i]), 0);
        ASSERT_EQ(kvr_wire_decode(b.data, b.len, &d, &why), 0);
        assert_same(&ms[i], &d);
    }
    ASSERT_EQ(ms[1].code, KVR_LAYOUT_MISMATCH);
    ASSERT_EQ(ms[1].str_len, 2);
    ASSERT_EQ(ms[2].found, 1);
    ASSERT_U64_EQ(ms[2].peer_epoch, 0xfeed);
    ASSERT_EQ(ms[4].prefix_len, 11);
    ASSERT_EQ(ms[4].aux_index, -1);
    ASSERT_EQ(ms[5].nstates, 2);
    ASSERT_EQ(ms[5].prefix_len, 0);
    ASSERT_EQ(ms[7].peer_len, 10);
    ASSERT_EQ(ms[8].peer_len, 0);
    ASSERT(ms[9].dp_rank == 2 && ms[9].rank == 3 && ms[9].pp_rank == 1 && ms[9].str_len == 9);
    ASSERT(ms[10].dp_rank == 2 && ms[10].pp_rank == 0 && ms[10].str_len == 0);
    /* A reason longer than the wire takes counts as the longest it takes. */
    static char big[KVR_WIRE_MAX_STR + 100];
    memset(big, 'x', sizeof(big) - 1);
    ASSERT_EQ(kvr_msg_text(KVR_MSG_AUTH_REJECT, 0, 0, big).str_len, KVR_WIRE_MAX_STR);
    kvr_wbuf_free(&b);
}
