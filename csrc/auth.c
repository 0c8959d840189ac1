#include "auth.h"

#include <stdlib.h>
#include <string.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include "table.h"
#include "wire.h"

/* Freshness state of one sender instance (epoch). */
typedef struct {
    uint64_t highest; /* highest seq accepted */
    uint64_t seen;    /* bit i: highest - i was accepted */
    uint64_t used;    /* a.tick when last heard, for eviction */
} kvr_auth_sender_t;

struct kvr_auth {
    EVP_MAC *mac;
    EVP_MAC_CTX *ctx;
    uint64_t self_epoch;
    uint64_t next_seq;
    uint64_t tick;
    kvr_table_t senders; /* epoch -> kvr_auth_sender_t* */
};

static uint64_t kvr_auth_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

int kvr_auth_create(const void *secret, size_t len, uint64_t self_epoch, kvr_auth_t **a_p)
{
    if (len == 0 || len > KVR_AUTH_SECRET_MAX) {
        return -1;
    }
    kvr_auth_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        return -1;
    }
    a->self_epoch = self_epoch;
    a->next_seq = 1;
    kvr_table_init(&a->senders);
    a->mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    if (a->mac == NULL || (a->ctx = EVP_MAC_CTX_new(a->mac)) == NULL) {
        goto err;
    }
    OSSL_PARAM params[2];
    params[0] = OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, (char *)"SHA256", 0);
    params[1] = OSSL_PARAM_construct_end();
    /* The key is set once; later inits with a NULL key reuse it. */
    if (EVP_MAC_init(a->ctx, secret, len, params) != 1) {
        goto err;
    }
    *a_p = a;
    return 0;
err:
    kvr_auth_destroy(a);
    return -1;
}

void kvr_auth_destroy(kvr_auth_t *a)
{
    if (a == NULL) {
        return;
    }
    void *s;
    for (kvr_table_iter_t it = {0}; (s = kvr_table_next(&a->senders, &it, NULL)) != NULL;) {
        free(s);
    }
    kvr_table_destroy(&a->senders);
    EVP_MAC_CTX_free(a->ctx);
    EVP_MAC_free(a->mac);
    free(a);
}

/* HMAC-SHA256 of buf[0..len) into out. */
static int kvr_auth_mac(kvr_auth_t *a, const unsigned char *buf, size_t len,
                        unsigned char out[KVR_AUTH_MAC_LEN])
{
    size_t outl = 0;
    if (EVP_MAC_init(a->ctx, NULL, 0, NULL) != 1 || EVP_MAC_update(a->ctx, buf, len) != 1 ||
        EVP_MAC_final(a->ctx, out, &outl, KVR_AUTH_MAC_LEN) != 1 || outl != KVR_AUTH_MAC_LEN) {
        return -1;
    }
    return 0;
}

int kvr_auth_seal(kvr_auth_t *a, const void *msg, size_t len, unsigned char *out)
{
    if (len < KVR_WIRE_HEADER_LEN) {
        return -1;
    }
    if (out != msg) {
        memmove(out, msg, len);
    }
    out[7] |= (unsigned char)(KVR_AUTH_FLAG >> 8);
    uint64_t seq = a->next_seq++;
    for (int i = 0; i < 8; i++) {
        out[len + (size_t)i] = (unsigned char)(seq >> (8 * i));
    }
    return kvr_auth_mac(a, out, len + 8, out + len + 8);
}

int kvr_auth_is_sealed(const void *buf, size_t len)
{
    const unsigned char *p = buf;
    return len >= KVR_WIRE_HEADER_LEN && kvr_auth_le(p, 4) == KVR_WIRE_MAGIC &&
           (kvr_auth_le(p + 6, 2) & KVR_AUTH_FLAG) != 0;
}

int kvr_auth_peek_type(const void *buf, size_t len)
{
    const unsigned char *p = buf;
    if (len < KVR_WIRE_HEADER_LEN || kvr_auth_le(p, 4) != KVR_WIRE_MAGIC) {
        return -1;
    }
    return (int)(kvr_auth_le(p + 6, 2) & ~KVR_AUTH_FLAG);
}

/* Forgets the sender heard least recently (the table is full). */
static void kvr_auth_evict(kvr_auth_t *a)
{
    uint64_t oldest = UINT64_MAX, key, victim = 0;
    int found = 0;
    kvr_auth_sender_t *s;
    for (kvr_table_iter_t it = {0}; (s = kvr_table_next(&a->senders, &it, &key)) != NULL;) {
        if (s->used < oldest) {
            oldest = s->used;
            victim = key;
            found = 1;
        }
    }
    if (found) {
        free(kvr_table_remove(&a->senders, victim));
    }
}

/* Accepts (epoch, seq) once; returns 0, or -1 with why. */
static int kvr_auth_fresh(kvr_auth_t *a, uint64_t epoch, uint64_t seq, const char **why)
{
    if (epoch == a->self_epoch) {
        *why = "the message carries this instance's own epoch (reflected)";
        return -1;
    }
    if (seq == 0) {
        *why = "sequence number 0";
        return -1;
    }
    kvr_auth_sender_t *s = kvr_table_get(&a->senders, epoch);
    if (s == NULL) {
        if (a->senders.count >= KVR_AUTH_MAX_SENDERS) {
            kvr_auth_evict(a);
        }
        s = calloc(1, sizeof(*s));
        if (s == NULL || kvr_table_put(&a->senders, epoch, s) != 0) {
            free(s);
            *why = "out of memory";
            return -1;
        }
        s->highest = seq;
        s->seen = 1;
        s->used = ++a->tick;
        return 0;
    }
    if (seq > s->highest) {
        uint64_t shift = seq - s->highest;
        s->seen = shift >= KVR_AUTH_WINDOW ? 1 : (s->seen << shift) | 1;
        s->highest = seq;
    } else {
        uint64_t back = s->highest - seq;
        if (back >= KVR_AUTH_WINDOW) {
            *why = "replayed or stale message (sequence number older than the window)";
            return -1;
        }
        if (s->seen & ((uint64_t)1 << back)) {
            *why = "replayed message (sequence number already seen)";
            return -1;
        }
        s->seen |= (uint64_t)1 << back;
    }
    s->used = ++a->tick;
    return 0;
}

int kvr_auth_open(kvr_auth_t *a, unsigned char *buf, size_t len, size_t *body_len,
                  const char **why)
{
    unsigned char mac[KVR_AUTH_MAC_LEN];
    if (!kvr_auth_is_sealed(buf, len)) {
        *why = "unauthenticated message (the sender has no secret, or another protocol)";
        return KVR_AUTH_UNSEALED;
    }
    if (len < KVR_WIRE_HEADER_LEN + KVR_AUTH_TRAILER_LEN) {
        *why = "sealed message shorter than header and trailer";
        return KVR_AUTH_BAD_TAG;
    }
    size_t n = len - KVR_AUTH_TRAILER_LEN;
    if (kvr_auth_mac(a, buf, n + 8, mac) != 0) {
        *why = "HMAC computation failed";
        return KVR_AUTH_BAD_TAG;
    }
    if (CRYPTO_memcmp(mac, buf + n + 8, KVR_AUTH_MAC_LEN) != 0) {
        *why = "authentication tag does not verify (a different secret, or a forged or "
               "altered message)";
        return KVR_AUTH_BAD_TAG;
    }
    /* Authentic: only now are header fields read. */
    uint64_t epoch = kvr_auth_le(buf + 8, 8);
    uint64_t seq = kvr_auth_le(buf + n, 8);
    if (kvr_auth_fresh(a, epoch, seq, why) != 0) {
        return KVR_AUTH_REPLAY;
    }
    buf[7] &= (unsigned char)~(KVR_AUTH_FLAG >> 8);
    *body_len = n;
    return KVR_AUTH_OK;
}
