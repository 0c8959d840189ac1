#include "runner.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../csrc/readers.h"

/* Cuts [base, base + total) into n random pieces (some empty) in v. */
static unsigned long cut(uint64_t *seed, char *base, size_t total, struct iovec *v,
                         unsigned long max)
{
    unsigned long n = 0;
    size_t off = 0;
    while (off < total && n + 1 < max) {
        size_t len = test_rand(seed) % 5 == 0 ? 0 : 1 + test_rand(seed) % (300u << 10);
        len = len < total - off ? len : total - off;
        v[n].iov_base = base + off;
        v[n].iov_len = len;
        off += len;
        n++;
    }
    v[n].iov_base = base + off;
    v[n].iov_len = total - off;
    return n + 1;
}

/* Reads of random sizes and random piece layouts on both sides, from this
 * process, by pools of 1, 2 and 4 threads (and no pool): the bytes equal a
 * memcpy's, the arrays are left as they were, and the helpers took a part
 * of the large reads. */
TEST_IMPL(readers_random_vs_memcpy)
{
    uint64_t seed = test_seed();
    size_t cap = 3u << 20;
    char *src = malloc(cap), *dst = malloc(cap);
    struct iovec *lv = calloc(512, sizeof(*lv)), *rv = calloc(512, sizeof(*rv));
    struct iovec *lcopy = calloc(512, sizeof(*lcopy));
    ASSERT(src && dst && lv && rv && lcopy);
    for (size_t i = 0; i < cap; i++) {
        src[i] = (char)test_rand(&seed);
    }
    unsigned sizes[] = {0, 1, 2, 4};
    for (unsigned t = 0; t < 4; t++) {
        kvr_readers_t *rd = sizes[t] ? kvr_readers_new(sizes[t]) : NULL;
        ASSERT(sizes[t] == 0 || rd != NULL);
        uint64_t helped_all = 0;
        for (int round = 0; round < 40; round++) {
            size_t total = round % 4 == 0 ? test_rand(&seed) % (600u << 10)
                                          : (1u << 20) + test_rand(&seed) % (2u << 20);
            size_t soff = test_rand(&seed) % (cap - total + 1);
            unsigned long nl = cut(&seed, dst, total, lv, 512);
            unsigned long nr = cut(&seed, src + soff, total, rv, 512);
            memcpy(lcopy, lv, nl * sizeof(*lv));
            memset(dst, 0x5a, total + 1);
            uint64_t helped = 99;
            ASSERT_EQ(kvr_readers_read(rd, getpid(), lv, nl, rv, nr, &helped), 0);
            ASSERT(memcmp(dst, src + soff, total) == 0);
            ASSERT_EQ(dst[total], 0x5a);
            ASSERT(memcmp(lcopy, lv, nl * sizeof(*lv)) == 0);
            ASSERT(helped <= total);
            ASSERT(sizes[t] > 1 || helped == 0);
            helped_all += helped;
        }
        if (sizes[t] > 1) {
            ASSERT(helped_all > 0);
        }
        kvr_readers_free(rd);
    }
    kvr_readers_free(NULL);
    ASSERT(kvr_readers_new(0) == NULL);
    ASSERT(kvr_readers_new(KVR_READERS_MAX + 1) == NULL);
    free(src);
    free(dst);
    free(lv);
    free(rv);
    free(lcopy);
}

/* Errors: unequal totals, a share over an unmapped page, a process that
 * is gone; the pool serves the next read after each. */
TEST_IMPL(readers_errors)
{
    size_t total = 2u << 20;
    char *src = malloc(total), *dst = malloc(total);
    ASSERT(src && dst);
    memset(src, 7, total);
    kvr_readers_t *rd = kvr_readers_new(2);
    ASSERT(rd != NULL);
    struct iovec l = {dst, total}, r = {src, total - 1};
    ASSERT_EQ(kvr_readers_read(rd, getpid(), &l, 1, &r, 1, NULL), EINVAL);
    /* The last third of the source is not mapped. */
    struct iovec r3[2] = {{src, total - (700u << 10)}, {(void *)4096, 700u << 10}};
    ASSERT_EQ(kvr_readers_read(rd, getpid(), &l, 1, r3, 2, NULL), EFAULT);
    pid_t child = fork();
    if (child == 0) {
        _exit(0);
    }
    ASSERT(child > 0);
    ASSERT_EQ(waitpid(child, NULL, 0), child);
    r.iov_len = total;
    ASSERT_EQ(kvr_readers_read(rd, child, &l, 1, &r, 1, NULL), ESRCH);
    memset(dst, 0, total);
    ASSERT_EQ(kvr_readers_read(rd, getpid(), &l, 1, &r, 1, NULL), 0);
    ASSERT(memcmp(dst, src, total) == 0);
    kvr_readers_free(rd);
    free(src);
    free(dst);
}
