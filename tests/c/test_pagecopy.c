#include "runner.h"

#include <stdlib.h>
#include <string.h>

#include "../../csrc/pagecopy.h"

/* Every length around the streaming threshold and the 64-byte loop, at
 * every destination alignment mod 16: the bytes of a plain copy, and not
 * one byte outside [dst, dst + len). */
TEST_IMPL(pagecopy_matches_memcpy)
{
    enum { MAX = 4 * KVR_PAGE_COPY_STREAM_MIN + 200, PAD = 32 };
    unsigned char *src = malloc(MAX + PAD), *dst = malloc(MAX + 2 * PAD);
    ASSERT(src != NULL && dst != NULL);
    for (size_t i = 0; i < MAX + PAD; i++) {
        src[i] = (unsigned char)(i * 131 + 7);
    }
    size_t lens[] = {0, 1, 15, 63, 64, 65, KVR_PAGE_COPY_STREAM_MIN - 1, KVR_PAGE_COPY_STREAM_MIN,
                     KVR_PAGE_COPY_STREAM_MIN + 1, KVR_PAGE_COPY_STREAM_MIN + 63, 4096, MAX};
    for (int stream = 0; stream < 2; stream++) {
        for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++) {
            for (size_t off = 0; off < 16; off++) {
                size_t len = lens[l];
                memset(dst, 0xEE, MAX + 2 * PAD);
                kvr_page_copy(dst + PAD + off, src + off / 2, len, stream);
                kvr_page_copy_fence();
                ASSERT(memcmp(dst + PAD + off, src + off / 2, len) == 0);
                for (size_t i = 0; i < PAD + off; i++) {
                    ASSERT_EQ(dst[i], 0xEE);
                }
                for (size_t i = PAD + off + len; i < MAX + 2 * PAD; i++) {
                    ASSERT_EQ(dst[i], 0xEE);
                }
            }
        }
    }
    free(src);
    free(dst);
}
