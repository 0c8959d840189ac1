#include "testhook.h"

void kvr_test_corrupt_header(kvr_am_header_t *h, int mode, uint32_t room_pages, uint32_t nkv,
                             uint32_t naux)
{
    if (mode == KVR_TEST_CORRUPT_STATE) {
        if (h->kind == KVR_AM_KIND_AUX) {
            h->buf = (uint16_t)(naux - 1);
            h->nbuf = 1;
        }
        return;
    }
    if (h->kind != KVR_AM_KIND_KV) {
        return;
    }
    switch (mode) {
    case KVR_TEST_CORRUPT_POS:
        h->pos = room_pages;
        break;
    case KVR_TEST_CORRUPT_BUF:
        h->buf = (uint16_t)(nkv - h->nbuf + 1);
        break;
    case KVR_TEST_CORRUPT_BYTES:
        /* The payload still carries every position the message was cut
         * for: one position more than the header now says (or, for a
         * one-position message, a buffer more). */
        if (h->npages > 1) {
            h->npages--;
        } else if (h->nbuf > 1) {
            h->nbuf--;
        } else {
            h->pos = room_pages; /* nothing smaller to claim */
        }
        break;
    case KVR_TEST_CORRUPT_EPOCH:
        h->epoch ^= 0x5a5a5a5a5a5a5a5aULL;
        break;
    case KVR_TEST_CORRUPT_FLAG:
        h->flags |= KVR_AM_FLAG_READ;
        break;
    case KVR_TEST_CORRUPT_STAGE:
        h->buf = (uint16_t)(h->buf + h->nbuf);
        break;
    default:
        break;
    }
}
