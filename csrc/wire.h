/*
 * The kvrecv wire format: control messages (carried by ZMQ) and the header of
 * every data message (carried by UCX active messages).
 *
 * Every control message starts with a 16-byte header: magic "KVRW", version,
 * type and the sender's instance epoch (a random 64-bit id chosen when the
 * sender started), so a restarted peer is recognised on its first message.
 * With a shared secret configured, every message is sealed as auth.h
 * describes (a flag in the type field and a trailer of sequence number and
 * HMAC); kvr_wire_decode sees messages only after the trailer was verified
 * and removed.  Integers are little-endian.  Decoders are pure functions over a byte
 * buffer: they check every length against the buffer before reading it, never
 * allocate, and point into the buffer for variable-length fields.  They are
 * what the fuzz targets call.
 */
#ifndef KVR_WIRE_H
#define KVR_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define KVR_WIRE_MAGIC 0x5752564bu /* "KVRW" */
#define KVR_WIRE_VERSION 1
#define KVR_WIRE_HEADER_LEN 16
#define KVR_WIRE_MAX_BUFFERS 4096
#define KVR_WIRE_MAX_PAGES (1u << 24)
#define KVR_WIRE_MAX_STR 1024
#define KVR_WIRE_MAX_ADDR 65536
#define KVR_WIRE_MAX_DP_PP 65535
/* Most per-request state components (state.c) a room names a slot of. */
#define KVR_MAX_STATES 8

typedef enum {
    KVR_MSG_BS_REGISTER = 1,  /* prefill -> bootstrap: rank, endpoint[, dp, pp] */
    KVR_MSG_BS_REGISTER_OK,   /* bootstrap -> prefill: rank */
    KVR_MSG_BS_QUERY,         /* decode -> bootstrap: rank[, dp, pp] */
    KVR_MSG_BS_QUERY_REPLY,   /* bootstrap -> decode: rank, found, peer_epoch, endpoint */
    KVR_MSG_HELLO,            /* decode -> prefill: rank, layout, worker address[, fields] */
    KVR_MSG_HELLO_OK,         /* prefill -> decode: rank, layout, worker address[, fields] */
    KVR_MSG_HELLO_REJECT,     /* prefill -> decode: rank, code, reason */
    KVR_MSG_ROOM_REQ,         /* decode -> prefill: room, tag, aux_index, pages[,
                               * prefix_len[, state slots]] */
    KVR_MSG_ROOM_DONE,        /* decode -> prefill: room, tag */
    KVR_MSG_ROOM_FAIL,        /* either way: room, tag, code, origin_rank, reason, peer */
    KVR_MSG_PING,             /* decode -> prefill: rank */
    KVR_MSG_PONG,             /* prefill -> decode: rank */
    KVR_MSG_BYE,              /* either way: rank; the sender is closing */
    KVR_MSG_SIB_FAIL,         /* rank -> sibling ranks of one instance: as ROOM_FAIL */
    KVR_MSG_AUTH_REJECT,      /* any receiver -> a sender it could not authenticate: reason.
                               * Never sealed (the two sides share no key). */
    KVR_MSG_PATH_LOST,        /* either way: rank; the sender found its data path to the
                               * receiver stalled and dropped that connection */
    KVR_MSG_LAST
} kvr_msg_type_t;

/* A KV layout as it travels: item lengths are little-endian u64 arrays.
 * The optional fields after a HELLO's or HELLO_OK's worker address are a
 * flags byte naming those present, then each in this order: a HELLO's
 * tcp_rx_seg (u32), a HELLO's shared-memory sizes (2 u32), the head
 * layout (plan.h's kvr_heads_t, only when heads > 0: 4 u32 tp_size,
 * tp_rank, heads, total_heads), the cross-memory offer (when has_cma: the
 * host's 16-byte boot id; a HELLO_OK adds the prefill's pid u32 and the
 * address of its epoch u64, which the decode reads to check it may), the
 * layers (only when layers > 0: 4 u32 pp_size, pp_rank, start_layer,
 * layers); state slicing rules (when nrules > 0: u32 nrules, then nrules
 * u32); the list components (when state_lists > 0: one byte, bit c for
 * component c); the tcp lane (when has_lane: nothing in a HELLO; a
 * HELLO_OK's port u16 and 16-byte token).
 * None: no flags byte. */
typedef struct {
    uint32_t page_size;
    uint32_t nkv;
    const unsigned char *kv_item_lens; /* nkv x u64 */
    uint32_t naux;
    const unsigned char *aux_item_lens; /* naux x u64 */
    uint32_t tp_size, tp_rank, heads, total_heads; /* heads 0: none given */
    /* plan.h's kvr_layers_t; layers 0: none given (one stage, one buffer
     * per layer). */
    uint32_t pp_size, pp_rank, start_layer, layers;
    /* How the state buffers' rows split over TP ranks (stateslice.h's flat
     * rules, little-endian u32), at most KVR_WIRE_MAX_RULES; 0: none. */
    uint32_t nrules;
    const unsigned char *rules;
    /* Bit c: state component c takes a list of slots per request (state.c);
     * on the wire (one byte, HELLO flag 64) only when not 0. */
    uint32_t state_lists;
} kvr_wire_layout_t;

#define KVR_WIRE_MAX_RULES (1u << 20)

/* A decoded control message; pointers point into the decoded buffer. */
typedef struct {
    uint16_t type;
    uint64_t epoch;
    uint32_t rank;
    /* BS_REGISTER, BS_QUERY: the DP group and PP stage of the (TP) rank
     * registered or asked for, each at most KVR_WIRE_MAX_DP_PP.  On the
     * wire (two u32 after the rest) only when either is > 0, so a message
     * of DP 0, PP 0 is encoded as before. */
    uint32_t dp_rank, pp_rank;
    uint64_t room;
    uint64_t tag;
    int64_t aux_index;
    uint32_t npages;
    const unsigned char *pages; /* npages x little-endian int32 */
    /* ROOM_REQ: tokens of the request the decode already holds (a radix
     * cache prefix), for the prefill's scheduler; the pages cover the rest.
     * On the wire only when > 0 (so a request without one is encoded as
     * before, and there is still one encoding per message). */
    uint32_t prefix_len;
    /* ROOM_REQ: the decode's slot per state component (state.c), -1 for a
     * component it does not ask for; on the wire only when nstates > 0
     * (then prefix_len is there too, 0 allowed). */
    uint32_t nstates;
    const unsigned char *states; /* nstates x little-endian int64 */
    /* ROOM_REQ: the slots of the list components (state.c), whose entries
     * in states are their list lengths (-1: none), concatenated in
     * component order; on the wire (u32 count, then the slots) only when
     * nslots > 0, after the states. */
    uint32_t nslots;
    const unsigned char *slots; /* nslots x little-endian int32 */
    /* HELLO: the decode's UCX tcp receive buffer size in bytes (0: not
     * known, UINT32_MAX: no tcp); on the wire only when > 0, like
     * prefix_len. */
    uint32_t tcp_rx_seg;
    /* HELLO: the decode's UCX shared-memory segment size in bytes and
     * receive FIFO length (0: no posix/sysv transport, or not known); on
     * the wire when has_shm (set by the sender, and by the decoder when
     * they were there). */
    uint32_t shm_seg, shm_fifo;
    uint8_t has_shm;
    /* HELLO, HELLO_OK: cross-memory reads offered (cma.c): boot id; a
     * HELLO_OK's pid and probe address (where its epoch is). */
    uint8_t has_cma;
    unsigned char boot_id[16];
    uint32_t pid;
    uint64_t probe_addr;
    /* HELLO: the decode takes a tcp lane (lane.h); HELLO_OK: the prefill
     * offers one: its port and the token the decode says on it. */
    uint8_t has_lane;
    uint16_t lane_port;
    unsigned char lane_token[16];
    uint8_t found;
    uint64_t peer_epoch;
    uint16_t code;
    int32_t origin_rank;
    const char *str;   /* endpoint or reason, not NUL terminated */
    uint16_t str_len;
    const char *peer;  /* peer text of ROOM_FAIL */
    uint16_t peer_len;
    const void *addr;  /* UCX worker address of HELLO and HELLO_OK */
    uint32_t addr_len;
    kvr_wire_layout_t layout;
} kvr_msg_t;

/*
 * Constructors: each returns a message of its type with the fields that
 * type carries set and every other field zero (epoch included: the sender
 * sets it).  Strings and arrays are not copied; they must outlive the
 * encoding.  A string counts up to KVR_WIRE_MAX_STR bytes (the encoder's
 * limit).  Pure; any thread.
 */
/* PING, PONG, BYE, BS_QUERY, BS_REGISTER_OK: the sender's rank only. */
kvr_msg_t kvr_msg_rank(int type, uint32_t rank);
/* BS_REGISTER (endpoint: ours) and BS_QUERY (endpoint NULL): TP rank
 * `rank` of DP group dp_rank, PP stage pp_rank. */
kvr_msg_t kvr_msg_bs(int type, uint32_t dp_rank, uint32_t rank, uint32_t pp_rank,
                     const char *endpoint);
/* BS_REGISTER (str: our endpoint), HELLO_REJECT (code, str: the reason),
 * AUTH_REJECT (str: the reason). */
kvr_msg_t kvr_msg_text(int type, uint32_t rank, int code, const char *str);
/* BS_QUERY_REPLY. */
kvr_msg_t kvr_msg_bs_reply(uint32_t rank, int found, uint64_t peer_epoch, const char *endpoint);
/* HELLO and HELLO_OK (a HELLO's tcp_rx_seg is set by the caller). */
kvr_msg_t kvr_msg_hello(int type, uint32_t rank, const kvr_wire_layout_t *layout, const void *addr,
                        uint32_t addr_len);
/* ROOM_REQ: pages is npages little-endian int32. */
kvr_msg_t kvr_msg_room_req(uint64_t room, uint64_t tag, int64_t aux_index, uint32_t npages,
                           const unsigned char *pages, uint32_t prefix_len, uint32_t nstates,
                           const unsigned char *states);
/* ROOM_DONE. */
kvr_msg_t kvr_msg_room_done(uint64_t room, uint64_t tag);
/* ROOM_FAIL and SIB_FAIL: a room's root cause; peer may be NULL (""). */
kvr_msg_t kvr_msg_fail(int type, uint64_t room, uint64_t tag, int code, int32_t origin_rank,
                       const char *reason, const char *peer);

/* A growable output buffer for the encoders. */
typedef struct {
    unsigned char *data;
    size_t len;
    size_t cap;
    int oom; /* set when an append failed; the buffer is then unusable */
} kvr_wbuf_t;

void kvr_wbuf_init(kvr_wbuf_t *b);
void kvr_wbuf_free(kvr_wbuf_t *b);

/*
 * Encodes msg (fields used by msg->type) after a header carrying msg->epoch.
 * Returns 0, or -1 if memory ran out.  b is reset first.
 */
int kvr_wire_encode(kvr_wbuf_t *b, const kvr_msg_t *msg);

/*
 * Decodes one control message.  Returns 0 on success; on failure returns -1
 * and sets *why to a static string naming the first check that failed.
 */
int kvr_wire_decode(const void *buf, size_t len, kvr_msg_t *out, const char **why);

/* Reads entry i of a little-endian u64 array (layout item lengths). */
uint64_t kvr_wire_u64_at(const unsigned char *arr, uint32_t i);
/* Reads entry i of a little-endian int32 array (page indices). */
int32_t kvr_wire_i32_at(const unsigned char *arr, uint32_t i);

/* Header of a data message (UCX active message), fixed size. */
#define KVR_AM_KIND_KV 1
#define KVR_AM_KIND_AUX 2
#define KVR_AM_HEADER_LEN 36

/*
 * A data message carries positions [pos, pos + npages) of the buffers
 * [buf, buf + nbuf) of one kind, buffer after buffer (aux: one row each,
 * npages 1).  Wire layout, little-endian: magic u32, kind u16, buf u16,
 * nbuf u16, flags u16, pos u32, npages u32, tag u64, epoch u64.  Flags:
 * KVR_AM_FLAG_READ (KV only): the payload is a read descriptor (cma.c),
 * the bytes stay in the prefill's pages.
 */
#define KVR_AM_FLAG_READ 1
typedef struct {
    uint16_t kind;     /* KVR_AM_KIND_* */
    uint16_t buf;      /* first buffer index of that kind */
    uint32_t pos;      /* first position in the room's page list */
    uint32_t npages;   /* positions in this message (1 for aux) */
    uint64_t tag;      /* the receiving room's tag */
    uint64_t epoch;    /* the sender's instance epoch */
    uint16_t nbuf;     /* buffers in this message (>= 1) */
    uint16_t flags;    /* KVR_AM_FLAG_* */
} kvr_am_header_t;

void kvr_am_header_encode(unsigned char out[KVR_AM_HEADER_LEN], const kvr_am_header_t *h);
/* Returns 0, or -1 with *why set. */
int kvr_am_header_decode(const void *buf, size_t len, kvr_am_header_t *h, const char **why);

const char *kvr_msg_type_name(int type);

#endif
