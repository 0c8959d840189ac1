#include "wire.h"

#include <stdlib.h>
#include <string.h>

/* ---- writer ---- */

void kvr_wbuf_init(kvr_wbuf_t *b)
{
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->oom = 0;
}

void kvr_wbuf_free(kvr_wbuf_t *b)
{
    free(b->data);
    kvr_wbuf_init(b);
}

static void kvr_wbuf_put(kvr_wbuf_t *b, const void *p, size_t n)
{
    if (b->oom) {
        return;
    }
    if (b->len + n > b->cap) {
        size_t ncap = b->cap ? b->cap : 256;
        while (ncap < b->len + n) {
            ncap *= 2;
        }
        unsigned char *nd = realloc(b->data, ncap);
        if (nd == NULL) {
            b->oom = 1;
            return;
        }
        b->data = nd;
        b->cap = ncap;
    }
    if (n) {
        memcpy(b->data + b->len, p, n);
    }
    b->len += n;
}

static void kvr_put_u8(kvr_wbuf_t *b, uint8_t v) { kvr_wbuf_put(b, &v, 1); }

static void kvr_put_u16(kvr_wbuf_t *b, uint16_t v)
{
    unsigned char x[2] = {(unsigned char)v, (unsigned char)(v >> 8)};
    kvr_wbuf_put(b, x, 2);
}

static void kvr_put_u32(kvr_wbuf_t *b, uint32_t v)
{
    unsigned char x[4];
    for (int i = 0; i < 4; i++) {
        x[i] = (unsigned char)(v >> (8 * i));
    }
    kvr_wbuf_put(b, x, 4);
}

static void kvr_put_u64(kvr_wbuf_t *b, uint64_t v)
{
    unsigned char x[8];
    for (int i = 0; i < 8; i++) {
        x[i] = (unsigned char)(v >> (8 * i));
    }
    kvr_wbuf_put(b, x, 8);
}

static void kvr_put_str(kvr_wbuf_t *b, const char *s, size_t n)
{
    if (n > KVR_WIRE_MAX_STR) {
        n = KVR_WIRE_MAX_STR;
    }
    kvr_put_u16(b, (uint16_t)n);
    kvr_wbuf_put(b, s, n);
}

static void kvr_put_layout(kvr_wbuf_t *b, const kvr_wire_layout_t *l)
{
    kvr_put_u32(b, l->page_size);
    kvr_put_u32(b, l->nkv);
    kvr_wbuf_put(b, l->kv_item_lens, (size_t)l->nkv * 8);
    kvr_put_u32(b, l->naux);
    kvr_wbuf_put(b, l->aux_item_lens, (size_t)l->naux * 8);
}

/* The messages whose code names a failure (a kvr_status_t other than OK). */
static int kvr_wire_carries_failure(uint16_t type)
{
    return type == KVR_MSG_HELLO_REJECT || type == KVR_MSG_ROOM_FAIL || type == KVR_MSG_SIB_FAIL;
}

/* The optional fields after a HELLO's or HELLO_OK's worker address: a
 * byte of KVR_HELLO_* flags naming those present, then each in flag order.
 * No fields: no byte (one encoding per message). */
enum {
    KVR_HELLO_TCP_RX = 1,
    KVR_HELLO_SHM = 2,
    KVR_HELLO_HEADS = 4,
    KVR_HELLO_CMA = 8,
    KVR_HELLO_LAYERS = 16,
    KVR_HELLO_STATE_RULES = 32,
    KVR_HELLO_STATE_LISTS = 64,
    KVR_HELLO_LANE = 128,
};

static void kvr_put_hello_fields(kvr_wbuf_t *b, const kvr_msg_t *m)
{
    int hello = m->type == KVR_MSG_HELLO;
    unsigned x = (hello && m->tcp_rx_seg ? KVR_HELLO_TCP_RX : 0) |
                 (hello && m->has_shm ? KVR_HELLO_SHM : 0) |
                 (m->layout.heads ? KVR_HELLO_HEADS : 0) | (m->has_cma ? KVR_HELLO_CMA : 0) |
                 (m->layout.layers ? KVR_HELLO_LAYERS : 0) |
                 (m->layout.nrules ? KVR_HELLO_STATE_RULES : 0) |
                 (m->layout.state_lists ? KVR_HELLO_STATE_LISTS : 0) |
                 (m->has_lane ? KVR_HELLO_LANE : 0);
    if (x == 0) {
        return;
    }
    kvr_put_u8(b, (uint8_t)x);
    if (x & KVR_HELLO_TCP_RX) {
        kvr_put_u32(b, m->tcp_rx_seg);
    }
    if (x & KVR_HELLO_SHM) {
        kvr_put_u32(b, m->shm_seg);
        kvr_put_u32(b, m->shm_fifo);
    }
    if (x & KVR_HELLO_HEADS) {
        kvr_put_u32(b, m->layout.tp_size);
        kvr_put_u32(b, m->layout.tp_rank);
        kvr_put_u32(b, m->layout.heads);
        kvr_put_u32(b, m->layout.total_heads);
    }
    if (x & KVR_HELLO_CMA) {
        kvr_wbuf_put(b, m->boot_id, sizeof(m->boot_id));
        if (!hello) {
            kvr_put_u32(b, m->pid);
            kvr_put_u64(b, m->probe_addr);
        }
    }
    if (x & KVR_HELLO_LAYERS) {
        kvr_put_u32(b, m->layout.pp_size);
        kvr_put_u32(b, m->layout.pp_rank);
        kvr_put_u32(b, m->layout.start_layer);
        kvr_put_u32(b, m->layout.layers);
    }
    if (x & KVR_HELLO_STATE_RULES) {
        kvr_put_u32(b, m->layout.nrules);
        kvr_wbuf_put(b, m->layout.rules, (size_t)m->layout.nrules * 4);
    }
    if (x & KVR_HELLO_STATE_LISTS) {
        kvr_put_u8(b, (uint8_t)m->layout.state_lists);
    }
    if ((x & KVR_HELLO_LANE) && !hello) {
        kvr_put_u16(b, m->lane_port);
        kvr_wbuf_put(b, m->lane_token, sizeof(m->lane_token));
    }
}

/* BS_REGISTER's and BS_QUERY's DP and PP ranks, when either is > 0. */
static void kvr_put_dp_pp(kvr_wbuf_t *b, const kvr_msg_t *m)
{
    if (m->dp_rank || m->pp_rank) {
        kvr_put_u32(b, m->dp_rank);
        kvr_put_u32(b, m->pp_rank);
    }
}

int kvr_wire_encode(kvr_wbuf_t *b, const kvr_msg_t *m)
{
    /* Never send what the decoder would refuse. */
    if (((m->type == KVR_MSG_HELLO || m->type == KVR_MSG_HELLO_OK) &&
         (m->addr_len == 0 || m->addr_len > KVR_WIRE_MAX_ADDR)) ||
        m->layout.nkv > KVR_WIRE_MAX_BUFFERS || m->layout.naux > KVR_WIRE_MAX_BUFFERS ||
        m->npages > KVR_WIRE_MAX_PAGES || (kvr_wire_carries_failure(m->type) && m->code == 0) ||
        m->dp_rank > KVR_WIRE_MAX_DP_PP || m->pp_rank > KVR_WIRE_MAX_DP_PP) {
        return -1;
    }
    b->len = 0;
    b->oom = 0;
    kvr_put_u32(b, KVR_WIRE_MAGIC);
    kvr_put_u16(b, KVR_WIRE_VERSION);
    kvr_put_u16(b, m->type);
    kvr_put_u64(b, m->epoch);
    switch (m->type) {
    case KVR_MSG_BS_REGISTER:
        kvr_put_u32(b, m->rank);
        kvr_put_str(b, m->str, m->str_len);
        kvr_put_dp_pp(b, m);
        break;
    case KVR_MSG_BS_QUERY:
        kvr_put_u32(b, m->rank);
        kvr_put_dp_pp(b, m);
        break;
    case KVR_MSG_BS_REGISTER_OK:
    case KVR_MSG_PING:
    case KVR_MSG_PONG:
    case KVR_MSG_BYE:
    case KVR_MSG_PATH_LOST:
        kvr_put_u32(b, m->rank);
        break;
    case KVR_MSG_BS_QUERY_REPLY:
        kvr_put_u32(b, m->rank);
        kvr_put_u8(b, m->found);
        kvr_put_u64(b, m->peer_epoch);
        kvr_put_str(b, m->str, m->str_len);
        break;
    case KVR_MSG_HELLO:
    case KVR_MSG_HELLO_OK:
        kvr_put_u32(b, m->rank);
        kvr_put_layout(b, &m->layout);
        kvr_put_u32(b, m->addr_len);
        kvr_wbuf_put(b, m->addr, m->addr_len);
        kvr_put_hello_fields(b, m);
        break;
    case KVR_MSG_HELLO_REJECT:
        kvr_put_u32(b, m->rank);
        kvr_put_u16(b, m->code);
        kvr_put_str(b, m->str, m->str_len);
        break;
    case KVR_MSG_AUTH_REJECT:
        kvr_put_str(b, m->str, m->str_len);
        break;
    case KVR_MSG_ROOM_REQ:
        kvr_put_u64(b, m->room);
        kvr_put_u64(b, m->tag);
        kvr_put_u64(b, (uint64_t)m->aux_index);
        kvr_put_u32(b, m->npages);
        kvr_wbuf_put(b, m->pages, (size_t)m->npages * 4);
        if (m->prefix_len || m->nstates) {
            kvr_put_u32(b, m->prefix_len);
        }
        if (m->nstates) {
            kvr_put_u16(b, (uint16_t)m->nstates);
            kvr_wbuf_put(b, m->states, (size_t)m->nstates * 8);
            if (m->nslots) {
                kvr_put_u32(b, m->nslots);
                kvr_wbuf_put(b, m->slots, (size_t)m->nslots * 4);
            }
        }
        break;
    case KVR_MSG_ROOM_DONE:
        kvr_put_u64(b, m->room);
        kvr_put_u64(b, m->tag);
        break;
    case KVR_MSG_ROOM_FAIL:
    case KVR_MSG_SIB_FAIL:
        kvr_put_u64(b, m->room);
        kvr_put_u64(b, m->tag);
        kvr_put_u16(b, m->code);
        kvr_put_u32(b, (uint32_t)m->origin_rank);
        kvr_put_str(b, m->str, m->str_len);
        kvr_put_str(b, m->peer, m->peer_len);
        break;
    default:
        return -1;
    }
    return b->oom ? -1 : 0;
}

/* ---- reader ---- */

typedef struct {
    const unsigned char *p;
    size_t left;
    const char *why; /* first failure */
} kvr_rd_t;

static int kvr_rd_take(kvr_rd_t *r, size_t n, const unsigned char **out, const char *what)
{
    if (r->why) {
        return -1;
    }
    if (n > r->left) {
        r->why = what;
        return -1;
    }
    *out = r->p;
    r->p += n;
    r->left -= n;
    return 0;
}

static uint64_t kvr_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static uint64_t kvr_rd_int(kvr_rd_t *r, int n, const char *what)
{
    const unsigned char *p;
    if (kvr_rd_take(r, (size_t)n, &p, what) != 0) {
        return 0;
    }
    return kvr_le(p, n);
}

static void kvr_rd_str(kvr_rd_t *r, const char **s, uint16_t *n, const char *what)
{
    const unsigned char *p = NULL;
    uint16_t len = (uint16_t)kvr_rd_int(r, 2, what);
    if (!r->why && len > KVR_WIRE_MAX_STR) {
        r->why = what;
        return;
    }
    if (kvr_rd_take(r, len, &p, what) == 0) {
        *s = (const char *)p;
        *n = len;
    }
}

static void kvr_rd_layout(kvr_rd_t *r, kvr_wire_layout_t *l)
{
    l->page_size = (uint32_t)kvr_rd_int(r, 4, "truncated layout");
    l->nkv = (uint32_t)kvr_rd_int(r, 4, "truncated layout");
    if (!r->why && l->nkv > KVR_WIRE_MAX_BUFFERS) {
        r->why = "too many KV buffers in layout";
        return;
    }
    kvr_rd_take(r, (size_t)l->nkv * 8, &l->kv_item_lens, "truncated KV item lengths");
    l->naux = (uint32_t)kvr_rd_int(r, 4, "truncated layout");
    if (!r->why && l->naux > KVR_WIRE_MAX_BUFFERS) {
        r->why = "too many aux buffers in layout";
        return;
    }
    kvr_rd_take(r, (size_t)l->naux * 8, &l->aux_item_lens, "truncated aux item lengths");
}

static void kvr_rd_hello_fields(kvr_rd_t *r, kvr_msg_t *m)
{
    if (r->why || r->left == 0) {
        return;
    }
    unsigned x = (unsigned)kvr_rd_int(r, 1, "truncated HELLO fields");
    unsigned known = KVR_HELLO_HEADS | KVR_HELLO_CMA | KVR_HELLO_LAYERS | KVR_HELLO_STATE_RULES |
                     KVR_HELLO_STATE_LISTS | KVR_HELLO_LANE |
                     (m->type == KVR_MSG_HELLO ? KVR_HELLO_TCP_RX | KVR_HELLO_SHM : 0);
    if (x == 0 || (x & ~known)) {
        r->why = x == 0 ? "explicit empty HELLO fields" : "unknown HELLO fields";
        return;
    }
    if (x & KVR_HELLO_TCP_RX) {
        m->tcp_rx_seg = (uint32_t)kvr_rd_int(r, 4, "truncated tcp receive size");
        if (!r->why && m->tcp_rx_seg == 0) {
            r->why = "explicit zero tcp receive size";
        }
    }
    if (x & KVR_HELLO_SHM) {
        m->has_shm = 1;
        m->shm_seg = (uint32_t)kvr_rd_int(r, 4, "truncated shared-memory sizes");
        m->shm_fifo = (uint32_t)kvr_rd_int(r, 4, "truncated shared-memory sizes");
    }
    if (x & KVR_HELLO_HEADS) {
        m->layout.tp_size = (uint32_t)kvr_rd_int(r, 4, "truncated head layout");
        m->layout.tp_rank = (uint32_t)kvr_rd_int(r, 4, "truncated head layout");
        m->layout.heads = (uint32_t)kvr_rd_int(r, 4, "truncated head layout");
        m->layout.total_heads = (uint32_t)kvr_rd_int(r, 4, "truncated head layout");
        if (!r->why && m->layout.heads == 0) {
            r->why = "explicit zero heads";
        }
    }
    if (x & KVR_HELLO_CMA) {
        m->has_cma = 1;
        const unsigned char *id = NULL;
        if (kvr_rd_take(r, sizeof(m->boot_id), &id, "truncated cross-memory offer") == 0) {
            memcpy(m->boot_id, id, sizeof(m->boot_id));
        }
        if (m->type == KVR_MSG_HELLO_OK) {
            m->pid = (uint32_t)kvr_rd_int(r, 4, "truncated cross-memory offer");
            m->probe_addr = kvr_rd_int(r, 8, "truncated cross-memory offer");
        }
    }
    if (x & KVR_HELLO_LAYERS) {
        kvr_wire_layout_t *l = &m->layout;
        l->pp_size = (uint32_t)kvr_rd_int(r, 4, "truncated layers");
        l->pp_rank = (uint32_t)kvr_rd_int(r, 4, "truncated layers");
        l->start_layer = (uint32_t)kvr_rd_int(r, 4, "truncated layers");
        l->layers = (uint32_t)kvr_rd_int(r, 4, "truncated layers");
        int bad = l->pp_rank >= l->pp_size || l->pp_size > KVR_WIRE_MAX_DP_PP ||
                  l->start_layer > UINT32_MAX - l->layers;
        if (!r->why && (l->layers == 0 || bad)) {
            r->why = l->layers == 0 ? "explicit zero layers" : "impossible layers";
        }
    }
    if (x & KVR_HELLO_STATE_RULES) {
        m->layout.nrules = (uint32_t)kvr_rd_int(r, 4, "truncated state slicing");
        if (!r->why && (m->layout.nrules == 0 || m->layout.nrules > KVR_WIRE_MAX_RULES)) {
            r->why = "bad state slicing length";
            return;
        }
        kvr_rd_take(r, (size_t)m->layout.nrules * 4, &m->layout.rules, "truncated state slicing");
    }
    if (x & KVR_HELLO_STATE_LISTS) {
        m->layout.state_lists = (uint32_t)kvr_rd_int(r, 1, "truncated state lists");
        if (!r->why && m->layout.state_lists == 0) {
            r->why = "explicit empty state lists";
        }
    }
    if (x & KVR_HELLO_LANE) {
        m->has_lane = 1;
        if (m->type == KVR_MSG_HELLO_OK) {
            uint64_t port = kvr_rd_int(r, 2, "truncated lane offer");
            const unsigned char *t = NULL;
            if (kvr_rd_take(r, sizeof(m->lane_token), &t, "truncated lane offer") == 0) {
                memcpy(m->lane_token, t, sizeof(m->lane_token));
            }
            if (!r->why && port == 0) {
                r->why = "explicit zero lane port";
            }
            m->lane_port = (uint16_t)port;
        }
    }
}

/* The optional DP and PP ranks (8 bytes; fewer left are trailing bytes). */
static void kvr_rd_dp_pp(kvr_rd_t *r, kvr_msg_t *m)
{
    if (r->why || r->left < 8) {
        return;
    }
    m->dp_rank = (uint32_t)kvr_rd_int(r, 4, "");
    m->pp_rank = (uint32_t)kvr_rd_int(r, 4, "");
    if (m->dp_rank == 0 && m->pp_rank == 0) {
        r->why = "explicit zero DP and PP ranks";
    } else if (m->dp_rank > KVR_WIRE_MAX_DP_PP || m->pp_rank > KVR_WIRE_MAX_DP_PP) {
        r->why = "DP or PP rank above 65535";
    }
}

int kvr_wire_decode(const void *buf, size_t len, kvr_msg_t *m, const char **why)
{
    kvr_rd_t r = {buf, len, NULL};
    memset(m, 0, sizeof(*m));
    if (len < KVR_WIRE_HEADER_LEN) {
        *why = "shorter than a header";
        return -1;
    }
    if (kvr_rd_int(&r, 4, "") != KVR_WIRE_MAGIC) {
        *why = "bad magic";
        return -1;
    }
    if (kvr_rd_int(&r, 2, "") != KVR_WIRE_VERSION) {
        *why = "unsupported protocol version";
        return -1;
    }
    m->type = (uint16_t)kvr_rd_int(&r, 2, "");
    m->epoch = kvr_rd_int(&r, 8, "");
    if (m->type & 0x8000u) {
        /* auth.h's flag: only a receiver with the secret can open it. */
        *why = "authenticated message (the sender has a secret, this side has none)";
        return -1;
    }
    switch (m->type) {
    case KVR_MSG_BS_REGISTER:
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        kvr_rd_str(&r, &m->str, &m->str_len, "bad endpoint");
        kvr_rd_dp_pp(&r, m);
        break;
    case KVR_MSG_BS_QUERY:
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        kvr_rd_dp_pp(&r, m);
        break;
    case KVR_MSG_BS_REGISTER_OK:
    case KVR_MSG_PING:
    case KVR_MSG_PONG:
    case KVR_MSG_BYE:
    case KVR_MSG_PATH_LOST:
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        break;
    case KVR_MSG_BS_QUERY_REPLY:
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        m->found = (uint8_t)kvr_rd_int(&r, 1, "truncated query reply");
        m->peer_epoch = kvr_rd_int(&r, 8, "truncated query reply");
        kvr_rd_str(&r, &m->str, &m->str_len, "bad endpoint");
        break;
    case KVR_MSG_HELLO:
    case KVR_MSG_HELLO_OK: {
        const unsigned char *p = NULL;
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        kvr_rd_layout(&r, &m->layout);
        m->addr_len = (uint32_t)kvr_rd_int(&r, 4, "truncated worker address");
        if (!r.why && (m->addr_len == 0 || m->addr_len > KVR_WIRE_MAX_ADDR)) {
            r.why = "bad worker address length";
        }
        if (kvr_rd_take(&r, m->addr_len, &p, "truncated worker address") == 0) {
            m->addr = p;
        }
        kvr_rd_hello_fields(&r, m);
        break;
    }
    case KVR_MSG_HELLO_REJECT:
        m->rank = (uint32_t)kvr_rd_int(&r, 4, "truncated rank");
        m->code = (uint16_t)kvr_rd_int(&r, 2, "truncated code");
        kvr_rd_str(&r, &m->str, &m->str_len, "bad reason");
        break;
    case KVR_MSG_AUTH_REJECT:
        kvr_rd_str(&r, &m->str, &m->str_len, "bad reason");
        break;
    case KVR_MSG_ROOM_REQ:
        m->room = kvr_rd_int(&r, 8, "truncated room");
        m->tag = kvr_rd_int(&r, 8, "truncated tag");
        m->aux_index = (int64_t)kvr_rd_int(&r, 8, "truncated aux index");
        m->npages = (uint32_t)kvr_rd_int(&r, 4, "truncated page count");
        if (!r.why && m->npages > KVR_WIRE_MAX_PAGES) {
            r.why = "too many pages";
        }
        kvr_rd_take(&r, (size_t)m->npages * 4, &m->pages, "truncated page list");
        if (!r.why && r.left >= 4) { /* the optional prefix length */
            m->prefix_len = (uint32_t)kvr_rd_int(&r, 4, "truncated prefix length");
            if (!r.why && r.left >= 2) { /* then the optional state slots */
                m->nstates = (uint32_t)kvr_rd_int(&r, 2, "truncated state count");
                if (!r.why && (m->nstates == 0 || m->nstates > KVR_MAX_STATES)) {
                    r.why = "bad state count";
                }
                kvr_rd_take(&r, (size_t)m->nstates * 8, &m->states, "truncated state slots");
                if (!r.why && r.left >= 4) { /* then the optional list slots */
                    m->nslots = (uint32_t)kvr_rd_int(&r, 4, "truncated list slot count");
                    if (!r.why && (m->nslots == 0 || m->nslots > KVR_WIRE_MAX_PAGES)) {
                        r.why = "bad list slot count";
                    }
                    kvr_rd_take(&r, (size_t)m->nslots * 4, &m->slots, "truncated list slots");
                }
            } else if (m->prefix_len == 0) {
                r.why = "explicit zero prefix length";
            }
        }
        break;
    case KVR_MSG_ROOM_DONE:
        m->room = kvr_rd_int(&r, 8, "truncated room");
        m->tag = kvr_rd_int(&r, 8, "truncated tag");
        break;
    case KVR_MSG_ROOM_FAIL:
    case KVR_MSG_SIB_FAIL:
        m->room = kvr_rd_int(&r, 8, "truncated room");
        m->tag = kvr_rd_int(&r, 8, "truncated tag");
        m->code = (uint16_t)kvr_rd_int(&r, 2, "truncated code");
        m->origin_rank = (int32_t)kvr_rd_int(&r, 4, "truncated origin rank");
        kvr_rd_str(&r, &m->str, &m->str_len, "bad reason");
        kvr_rd_str(&r, &m->peer, &m->peer_len, "bad peer");
        break;
    default:
        *why = "unknown message type";
        return -1;
    }
    if (!r.why && kvr_wire_carries_failure(m->type) && m->code == 0) {
        /* 0 is KVR_OK: a failure message that says nothing failed. */
        r.why = "failure code 0";
    }
    if (!r.why && r.left != 0) {
        r.why = "trailing bytes";
    }
    if (r.why) {
        *why = r.why;
        return -1;
    }
    return 0;
}

uint64_t kvr_wire_u64_at(const unsigned char *arr, uint32_t i)
{
    return kvr_le(arr + (size_t)i * 8, 8);
}

int32_t kvr_wire_i32_at(const unsigned char *arr, uint32_t i)
{
    return (int32_t)(uint32_t)kvr_le(arr + (size_t)i * 4, 4);
}

/* ---- data message header ---- */

void kvr_am_header_encode(unsigned char out[KVR_AM_HEADER_LEN], const kvr_am_header_t *h)
{
    kvr_wbuf_t b;
    unsigned char tmp[KVR_AM_HEADER_LEN];
    b.data = tmp;
    b.len = 0;
    b.cap = sizeof(tmp);
    b.oom = 0;
    kvr_put_u32(&b, KVR_WIRE_MAGIC);
    kvr_put_u16(&b, h->kind);
    kvr_put_u16(&b, h->buf);
    kvr_put_u16(&b, h->nbuf);
    kvr_put_u16(&b, h->flags);
    kvr_put_u32(&b, h->pos);
    kvr_put_u32(&b, h->npages);
    kvr_put_u64(&b, h->tag);
    kvr_put_u64(&b, h->epoch);
    memcpy(out, tmp, KVR_AM_HEADER_LEN);
}

int kvr_am_header_decode(const void *buf, size_t len, kvr_am_header_t *h, const char **why)
{
    const unsigned char *p = buf;
    if (len != KVR_AM_HEADER_LEN) {
        *why = "data header has the wrong length";
        return -1;
    }
    if (kvr_le(p, 4) != KVR_WIRE_MAGIC) {
        *why = "data header has a bad magic";
        return -1;
    }
    h->kind = (uint16_t)kvr_le(p + 4, 2);
    h->buf = (uint16_t)kvr_le(p + 6, 2);
    h->nbuf = (uint16_t)kvr_le(p + 8, 2);
    h->pos = (uint32_t)kvr_le(p + 12, 4);
    h->npages = (uint32_t)kvr_le(p + 16, 4);
    h->tag = kvr_le(p + 20, 8);
    h->epoch = kvr_le(p + 28, 8);
    h->flags = (uint16_t)kvr_le(p + 10, 2);
    if (h->flags & ~KVR_AM_FLAG_READ) {
        *why = "data header has unknown flags";
        return -1;
    }
    if (h->kind != KVR_AM_KIND_KV && h->kind != KVR_AM_KIND_AUX) {
        *why = "data header has an unknown kind";
        return -1;
    }
    if ((h->flags & KVR_AM_FLAG_READ) && h->kind != KVR_AM_KIND_KV) {
        *why = "data header asks to read an aux row";
        return -1;
    }
    if (h->npages == 0) {
        *why = "data header names no pages";
        return -1;
    }
    if (h->nbuf == 0) {
        *why = "data header names no buffers";
        return -1;
    }
    return 0;
}

const char *kvr_msg_type_name(int type)
{
    static const char *const names[] = {
        "?", "BS_REGISTER", "BS_REGISTER_OK", "BS_QUERY", "BS_QUERY_REPLY", "HELLO",
        "HELLO_OK", "HELLO_REJECT", "ROOM_REQ", "ROOM_DONE", "ROOM_FAIL", "PING",
        "PONG", "BYE", "SIB_FAIL", "AUTH_REJECT", "PATH_LOST"};
    _Static_assert(sizeof(names) / sizeof(names[0]) == KVR_MSG_LAST, "a name per message type");
    if (type <= 0 || type >= KVR_MSG_LAST) {
        return "?";
    }
    return names[type];
}

static uint16_t kvr_msg_strlen(const char *s)
{
    return s == NULL ? 0 : (uint16_t)strnlen(s, KVR_WIRE_MAX_STR);
}

kvr_msg_t kvr_msg_rank(int type, uint32_t rank)
{
    kvr_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = (uint16_t)type;
    m.rank = rank;
    return m;
}

kvr_msg_t kvr_msg_text(int type, uint32_t rank, int code, const char *str)
{
    kvr_msg_t m = kvr_msg_rank(type, rank);
    m.code = (uint16_t)code;
    m.str = str;
    m.str_len = kvr_msg_strlen(str);
    return m;
}

kvr_msg_t kvr_msg_bs(int type, uint32_t dp_rank, uint32_t rank, uint32_t pp_rank,
                     const char *endpoint)
{
    kvr_msg_t m = kvr_msg_text(type, rank, 0, endpoint);
    m.dp_rank = dp_rank;
    m.pp_rank = pp_rank;
    return m;
}

kvr_msg_t kvr_msg_bs_reply(uint32_t rank, int found, uint64_t peer_epoch, const char *endpoint)
{
    kvr_msg_t m = kvr_msg_text(KVR_MSG_BS_QUERY_REPLY, rank, 0, endpoint);
    m.found = (uint8_t)(found != 0);
    m.peer_epoch = peer_epoch;
    return m;
}

kvr_msg_t kvr_msg_hello(int type, uint32_t rank, const kvr_wire_layout_t *layout, const void *addr,
                        uint32_t addr_len)
{
    kvr_msg_t m = kvr_msg_rank(type, rank);
    m.layout = *layout;
    m.addr = addr;
    m.addr_len = addr_len;
    return m;
}

kvr_msg_t kvr_msg_room_req(uint64_t room, uint64_t tag, int64_t aux_index, uint32_t npages,
                           const unsigned char *pages, uint32_t prefix_len, uint32_t nstates,
                           const unsigned char *states)
{
    kvr_msg_t m = kvr_msg_room_done(room, tag);
    m.type = KVR_MSG_ROOM_REQ;
    m.aux_index = aux_index;
    m.npages = npages;
    m.pages = pages;
    m.prefix_len = prefix_len;
    m.nstates = nstates;
    m.states = states;
    return m;
}

kvr_msg_t kvr_msg_room_done(uint64_t room, uint64_t tag)
{
    kvr_msg_t m = kvr_msg_rank(KVR_MSG_ROOM_DONE, 0);
    m.room = room;
    m.tag = tag;
    return m;
}

kvr_msg_t kvr_msg_fail(int type, uint64_t room, uint64_t tag, int code, int32_t origin_rank,
                       const char *reason, const char *peer)
{
    kvr_msg_t m = kvr_msg_text(type, 0, code, reason);
    m.room = room;
    m.tag = tag;
    m.origin_rank = origin_rank;
    m.peer = peer;
    m.peer_len = kvr_msg_strlen(peer);
    return m;
}

