/*
 * libFuzzer target for kvr_auth_open: arbitrary bytes are refused or opened
 * without reading outside the buffer, and nothing is interpreted before the
 * tag verified; what opens must decode or be refused by kvr_wire_decode
 * like any message.  Then the input is taken as a message to seal: sealing
 * and opening it gives the message back (flag cleared), and a second open
 * of the same sealed bytes is refused as a replay.
 *
 * The key is "kvrecv-fuzz-key" (fuzz/gen_seeds.py seals the seeds with it).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth.h"
#include "fuzz_util.h"
#include "wire.h"

static const char key[] = "kvrecv-fuzz-key";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvr_auth_t *rx, *tx;
    CHECK(kvr_auth_create(key, strlen(key), 0x5eed, &rx) == 0);
    CHECK(kvr_auth_create(key, strlen(key), 0x5eee, &tx) == 0);

    /* 1. arbitrary bytes in, from a private copy of exactly that size */
    unsigned char *buf = malloc(size ? size : 1);
    memcpy(buf, data, size);
    size_t body = 0;
    const char *why = NULL;
    int rc = kvr_auth_open(rx, buf, size, &body, &why);
    if (rc == KVR_AUTH_OK) {
        CHECK(body + KVR_AUTH_TRAILER_LEN == size);
        CHECK(!kvr_auth_is_sealed(buf, body));
        kvr_msg_t m;
        if (kvr_wire_decode(buf, body, &m, &why) != 0) {
            CHECK(why != NULL && why[0] != '\0');
        }
    } else {
        CHECK(rc == KVR_AUTH_UNSEALED || rc == KVR_AUTH_BAD_TAG || rc == KVR_AUTH_REPLAY);
        CHECK(why != NULL && why[0] != '\0');
        if (expect_valid()) {
            fprintf(stderr, "seed refused: %s\n", why);
            abort();
        }
    }
    free(buf);

    /* 2. the input as a message to seal (senders seal only encoded
     * messages: a header with the magic) */
    if (size >= KVR_WIRE_HEADER_LEN && size < (1u << 20) && kvr_auth_peek_type(data, size) >= 0) {
        unsigned char *sealed = malloc(size + KVR_AUTH_TRAILER_LEN);
        CHECK(kvr_auth_seal(tx, data, size, sealed) == 0);
        unsigned char *again = malloc(size + KVR_AUTH_TRAILER_LEN);
        memcpy(again, sealed, size + KVR_AUTH_TRAILER_LEN);
        kvr_auth_t *rx2;
        CHECK(kvr_auth_create(key, strlen(key), 0x5eed, &rx2) == 0);
        size_t n = size + KVR_AUTH_TRAILER_LEN;
        uint64_t epoch = 0;
        for (int i = 7; i >= 0; i--) {
            epoch = (epoch << 8) | data[8 + i];
        }
        int r1 = kvr_auth_open(rx2, sealed, n, &body, &why);
        if (epoch == 0x5eed) {
            CHECK(r1 == KVR_AUTH_REPLAY); /* reflected */
        } else {
            CHECK(r1 == KVR_AUTH_OK);
            CHECK(body == size);
            CHECK(memcmp(sealed + 8, data + 8, size - 8) == 0);
            CHECK(memcmp(sealed, data, 6) == 0);
            CHECK(sealed[6] == data[6] && sealed[7] == (data[7] & 0x7f));
            CHECK(kvr_auth_open(rx2, again, n, &body, &why) == KVR_AUTH_REPLAY);
        }
        kvr_auth_destroy(rx2);
        free(sealed);
        free(again);
    }
    kvr_auth_destroy(rx);
    kvr_auth_destroy(tx);
    return 0;
}
