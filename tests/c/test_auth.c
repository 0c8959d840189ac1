#include "runner.h"

#include <stdlib.h>
#include <string.h>

#include "../../csrc/auth.h"
#include "../../csrc/wire.h"

static const char key[] = "a shared secret";

/* A sealed PING from sender epoch `epoch` with sequence number taken from
 * the sender's own counter; returns its length. */
static size_t sealed_ping(kvr_auth_t *sender, uint64_t epoch, unsigned char *out)
{
    kvr_msg_t m;
    kvr_wbuf_t b;
    memset(&m, 0, sizeof(m));
    m.type = KVR_MSG_PING;
    m.epoch = epoch;
    m.rank = 7;
    kvr_wbuf_init(&b);
    ASSERT_EQ(kvr_wire_encode(&b, &m), 0);
    ASSERT_EQ(kvr_auth_seal(sender, b.data, b.len, out), 0);
    size_t n = b.len + KVR_AUTH_TRAILER_LEN;
    kvr_wbuf_free(&b);
    return n;
}

TEST_IMPL(auth_seal_open_round_trip)
{
    kvr_auth_t *tx, *rx;
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 1, &tx), 0);
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 2, &rx), 0);
    unsigned char buf[128];
    size_t n = sealed_ping(tx, 1, buf);
    ASSERT_EQ(n, KVR_WIRE_HEADER_LEN + 4 + KVR_AUTH_TRAILER_LEN);
    ASSERT(kvr_auth_is_sealed(buf, n));
    ASSERT_EQ(kvr_auth_peek_type(buf, n), KVR_MSG_PING);
    size_t body = 0;
    const char *why = NULL;
    ASSERT_EQ(kvr_auth_open(rx, buf, n, &body, &why), KVR_AUTH_OK);
    ASSERT_EQ(body, KVR_WIRE_HEADER_LEN + 4);
    kvr_msg_t d;
    ASSERT_EQ(kvr_wire_decode(buf, body, &d, &why), 0);
    ASSERT_EQ(d.type, KVR_MSG_PING);
    ASSERT_EQ(d.rank, 7);
    kvr_auth_destroy(tx);
    kvr_auth_destroy(rx);
}

TEST_IMPL(auth_every_bit_flip_rejected)
{
    kvr_auth_t *tx, *rx;
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 1, &tx), 0);
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 2, &rx), 0);
    unsigned char good[128], x[128];
    size_t n = sealed_ping(tx, 1, good);
    for (size_t i = 0; i < n; i++) {
        for (int bit = 0; bit < 8; bit++) {
            memcpy(x, good, n);
            x[i] ^= (unsigned char)(1u << bit);
            size_t body;
            const char *why = NULL;
            int rc = kvr_auth_open(rx, x, n, &body, &why);
            ASSERT(rc == KVR_AUTH_BAD_TAG || rc == KVR_AUTH_UNSEALED);
            ASSERT(why != NULL && why[0] != '\0');
        }
    }
    /* every truncation too */
    for (size_t len = 0; len < n; len++) {
        memcpy(x, good, n);
        size_t body;
        const char *why = NULL;
        ASSERT(kvr_auth_open(rx, x, len, &body, &why) != KVR_AUTH_OK);
    }
    /* the untouched message still opens (no state was changed above) */
    size_t body;
    const char *why;
    ASSERT_EQ(kvr_auth_open(rx, good, n, &body, &why), KVR_AUTH_OK);
    kvr_auth_destroy(tx);
    kvr_auth_destroy(rx);
}

TEST_IMPL(auth_other_key_and_unsealed)
{
    kvr_auth_t *tx, *rx;
    ASSERT_EQ(kvr_auth_create("another", 7, 1, &tx), 0);
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 2, &rx), 0);
    unsigned char buf[128];
    size_t n = sealed_ping(tx, 1, buf), body;
    const char *why;
    ASSERT_EQ(kvr_auth_open(rx, buf, n, &body, &why), KVR_AUTH_BAD_TAG);
    ASSERT(strstr(why, "does not verify") != NULL);
    /* a plain message */
    buf[7] &= 0x7f;
    ASSERT_EQ(kvr_auth_open(rx, buf, n - KVR_AUTH_TRAILER_LEN, &body, &why), KVR_AUTH_UNSEALED);
    /* an empty or over-long secret is refused */
    kvr_auth_t *t2 = NULL;
    ASSERT_EQ(kvr_auth_create("", 0, 1, &t2), -1);
    char big[KVR_AUTH_SECRET_MAX + 1];
    memset(big, 'k', sizeof(big));
    ASSERT_EQ(kvr_auth_create(big, sizeof(big), 1, &t2), -1);
    ASSERT(t2 == NULL);
    kvr_auth_destroy(tx);
    kvr_auth_destroy(rx);
}

TEST_IMPL(auth_replay_window)
{
    kvr_auth_t *tx, *rx;
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 1, &tx), 0);
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 2, &rx), 0);
    enum { N = 200 };
    static unsigned char msgs[N][128];
    size_t len[N];
    for (int i = 0; i < N; i++) {
        len[i] = sealed_ping(tx, 1, msgs[i]); /* seq i + 1 */
    }
    unsigned char x[128];
    size_t body;
    const char *why;
#define OPEN(i) (memcpy(x, msgs[i], len[i]), kvr_auth_open(rx, x, len[i], &body, &why))
    ASSERT_EQ(OPEN(0), KVR_AUTH_OK);
    ASSERT_EQ(OPEN(0), KVR_AUTH_REPLAY);
    ASSERT(strstr(why, "already seen") != NULL);
    ASSERT_EQ(OPEN(10), KVR_AUTH_OK);
    /* out of order inside the window: each once */
    for (int i = 9; i >= 1; i--) {
        ASSERT_EQ(OPEN(i), KVR_AUTH_OK);
        ASSERT_EQ(OPEN(i), KVR_AUTH_REPLAY);
    }
    ASSERT_EQ(OPEN(150), KVR_AUTH_OK);
    ASSERT_EQ(OPEN(150 - KVR_AUTH_WINDOW + 1), KVR_AUTH_OK); /* the oldest in the window */
    ASSERT_EQ(OPEN(150 - KVR_AUTH_WINDOW), KVR_AUTH_REPLAY); /* just below it */
    ASSERT(strstr(why, "older than the window") != NULL);
    ASSERT_EQ(OPEN(11), KVR_AUTH_REPLAY);
#undef OPEN
    /* reflected: a message carrying the receiver's own epoch */
    kvr_auth_t *self;
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 1, &self), 0);
    size_t n = sealed_ping(tx, 1, x);
    ASSERT_EQ(kvr_auth_open(self, x, n, &body, &why), KVR_AUTH_REPLAY);
    ASSERT(strstr(why, "reflected") != NULL);
    kvr_auth_destroy(self);
    kvr_auth_destroy(tx);
    kvr_auth_destroy(rx);
}

TEST_IMPL(auth_many_senders_bounded)
{
    kvr_auth_t *tx, *rx;
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 1, &tx), 0);
    ASSERT_EQ(kvr_auth_create(key, strlen(key), 2, &rx), 0);
    unsigned char x[128];
    size_t body;
    const char *why;
    /* more sender epochs than are remembered: each is accepted, the table
     * stays bounded, and a recent sender's replay is still refused */
    for (uint64_t ep = 100; ep < 100 + KVR_AUTH_MAX_SENDERS + 50; ep++) {
        size_t n = sealed_ping(tx, ep, x);
        ASSERT_EQ(kvr_auth_open(rx, x, n, &body, &why), KVR_AUTH_OK);
    }
    size_t n = sealed_ping(tx, 100 + KVR_AUTH_MAX_SENDERS + 49, x);
    unsigned char y[128];
    memcpy(y, x, n);
    ASSERT_EQ(kvr_auth_open(rx, x, n, &body, &why), KVR_AUTH_OK);
    ASSERT_EQ(kvr_auth_open(rx, y, n, &body, &why), KVR_AUTH_REPLAY);
    kvr_auth_destroy(tx);
    kvr_auth_destroy(rx);
}
