/*
 * libFuzzer target for kvr_am_header_decode: arbitrary bytes are rejected
 * or decoded; a decoded header re-encodes to the same 36 bytes and decodes
 * to the same fields.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvr_am_header_t h, h2;
    const char *why = NULL;
    if (kvr_am_header_decode(data, size, &h, &why) != 0) {
        CHECK(why != NULL && why[0] != '\0');
        if (expect_valid()) {
            fprintf(stderr, "valid input rejected: %s\n", why);
            abort();
        }
        return 0;
    }
    CHECK(size == KVR_AM_HEADER_LEN);
    CHECK(h.kind == KVR_AM_KIND_KV || h.kind == KVR_AM_KIND_AUX);
    CHECK(h.npages != 0 && h.nbuf != 0);
    unsigned char out[KVR_AM_HEADER_LEN];
    kvr_am_header_encode(out, &h);
    CHECK(memcmp(out, data, KVR_AM_HEADER_LEN) == 0);
    why = NULL;
    CHECK(kvr_am_header_decode(out, sizeof(out), &h2, &why) == 0);
    CHECK(h.kind == h2.kind && h.buf == h2.buf && h.pos == h2.pos && h.npages == h2.npages &&
          h.tag == h2.tag && h.epoch == h2.epoch && h.nbuf == h2.nbuf);
    return 0;
}
