#include "pagecopy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define KVR_PAGE_COPY_STREAM 1
#endif

void kvr_page_copy(void *dst, const void *src, size_t len, int stream)
{
#ifdef KVR_PAGE_COPY_STREAM
    if (stream && len >= KVR_PAGE_COPY_STREAM_MIN) {
        char *d = dst;
        const char *s = src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        len -= head;
        for (; len >= 64; d += 64, s += 64, len -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, len);
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, len);
}

void kvr_page_copy_fence(void)
{
#ifdef KVR_PAGE_COPY_STREAM
    _mm_sfence();
#endif
}
