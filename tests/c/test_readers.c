#include "runner.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../csrc/readers.h"

static unsigned notified; /* atomic */

static void count_notify(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&notified, 1, __ATOMIC_RELAXED);
}

/* Cuts [base, base + total) into at most max random pieces (some empty) of
 * at most `most` bytes but the last. */
static unsigned long cut(uint64_t *seed, char *base, size_t total, struct iovec *v,
                         unsigned long max, size_t most)
{
    unsigned long n = 0;
    size_t off = 0;
    while (off < total && n + 1 < max) {
        size_t len = test_rand(seed) % 5 == 0 ? 0 : 1 + test_rand(seed) % most;
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

#define JOBS 8
#define SLOT (3u << 20)

/* Rounds of JOBS reads of random sizes and piece layouts, from this
 * process, through pools of 1, 2 and 3 helpers: each job goes to a helper
 * when one is free and runs on this thread otherwise; every job comes back
 * once, its bytes equal a memcpy's, nothing past them is written, its
 * destination pieces are left as they were and its lease word is read. */
TEST_IMPL(readers_jobs_vs_memcpy)
{
    uint64_t seed = test_seed();
    size_t cap = 4u << 20;
    char *src = malloc(cap), *dst = malloc((size_t)JOBS * SLOT + 1);
    kvr_read_job_t *jobs = calloc(JOBS, sizeof(*jobs));
    struct iovec(*lv)[256] = calloc(JOBS, sizeof(*lv));
    struct iovec(*lcopy)[256] = calloc(JOBS, sizeof(*lcopy));
    ASSERT(src && dst && jobs && lv && lcopy);
    for (size_t i = 0; i < cap; i++) {
        src[i] = (char)test_rand(&seed);
    }
    uint64_t lease = 0x1122334455667788ull;
    for (unsigned helpers = 1; helpers <= 3; helpers++) {
        kvr_readers_t *rd = kvr_readers_new(helpers, count_notify, NULL);
        ASSERT(rd != NULL);
        unsigned by_helper = 0, submitted = 0;
        __atomic_store_n(&notified, 0, __ATOMIC_RELAXED);
        for (int round = 0; round < 6; round++) {
            size_t total[JOBS], soff[JOBS];
            unsigned back[JOBS] = {0};
            memset(dst, 0x5a, (size_t)JOBS * SLOT + 1);
            for (int k = 0; k < JOBS; k++) {
                kvr_read_job_t *j = &jobs[k];
                memset(j, 0, sizeof(*j));
                total[k] = k % 3 == 0 ? test_rand(&seed) % (600u << 10)
                                      : (1u << 20) + test_rand(&seed) % (2u << 20);
                soff[k] = test_rand(&seed) % (cap - total[k] + 1);
                j->pid = getpid();
                j->loc = lv[k];
                /* Small destination pieces in every other job: more than a
                 * batch of process_vm_readv, which then stops mid-piece. */
                j->nl = cut(&seed, dst + (size_t)k * SLOT, total[k], lv[k], 256,
                            k % 2 ? 8192 : 300u << 10);
                j->nr = cut(&seed, src + soff[k], total[k], j->rem, KVR_READ_PIECES_MAX,
                            300u << 10);
                j->lease_addr = k % 2 ? (uint64_t)(uintptr_t)&lease : 0;
                j->arg = &back[k];
                memcpy(lcopy[k], lv[k], j->nl * sizeof(struct iovec));
                if (kvr_readers_submit(rd, j) == 0) {
                    submitted++;
                } else {
                    kvr_read_job_run(j);
                    back[k]++;
                }
            }
            unsigned outstanding = 0;
            for (int k = 0; k < JOBS; k++) {
                outstanding += back[k] == 0;
            }
            while (outstanding > 0) {
                for (kvr_read_job_t *j = kvr_readers_done(rd); j != NULL; j = j->next) {
                    ASSERT(j->by_helper);
                    (*(unsigned *)j->arg)++;
                    outstanding--;
                    by_helper++;
                }
            }
            ASSERT(kvr_readers_done(rd) == NULL);
            for (int k = 0; k < JOBS; k++) {
                kvr_read_job_t *j = &jobs[k];
                ASSERT_EQ(back[k], 1u);
                ASSERT_EQ(j->err, 0);
                ASSERT(memcmp(dst + (size_t)k * SLOT, src + soff[k], total[k]) == 0);
                ASSERT_EQ(dst[(size_t)k * SLOT + total[k]], 0x5a);
                ASSERT(memcmp(lcopy[k], lv[k], j->nl * sizeof(struct iovec)) == 0);
                ASSERT_U64_EQ(j->lease, j->lease_addr ? lease : 0);
            }
        }
        ASSERT_EQ(by_helper, submitted);
        ASSERT(submitted > 0);
        ASSERT_EQ(__atomic_load_n(&notified, __ATOMIC_RELAXED), submitted);
        kvr_readers_free(rd);
    }
    kvr_readers_free(NULL);
    ASSERT(kvr_readers_done(NULL) == NULL);
    ASSERT(kvr_readers_new(0, count_notify, NULL) == NULL);
    ASSERT(kvr_readers_new(KVR_READERS_MAX, count_notify, NULL) == NULL);
    ASSERT(kvr_readers_new(1, NULL, NULL) == NULL);
    free(src);
    free(dst);
    free(jobs);
    free(lv);
    free(lcopy);
}

static int run_one(pid_t pid, void *dst, const void *src, size_t n, uint64_t lease_addr)
{
    struct iovec l = {dst, n};
    kvr_read_job_t j = {.pid = pid, .loc = &l, .nl = 1, .nr = 1, .lease_addr = lease_addr};
    j.rem[0].iov_base = (void *)src;
    j.rem[0].iov_len = n;
    kvr_read_job_run(&j);
    return j.err;
}

/* Errors: unequal totals, an unmapped source page, an unmapped lease, a
 * process that is gone; a pool with one helper refuses a second job while
 * it has one, and a pool freed with a job queued runs it first. */
TEST_IMPL(readers_errors)
{
    size_t total = 2u << 20;
    char *src = malloc(total), *dst = malloc(total);
    ASSERT(src && dst);
    memset(src, 7, total);
    struct iovec l = {dst, total};
    kvr_read_job_t j = {.pid = getpid(), .loc = &l, .nl = 1, .nr = 1};
    j.rem[0].iov_base = src;
    j.rem[0].iov_len = total - 1;
    kvr_read_job_run(&j);
    ASSERT_EQ(j.err, EINVAL);
    j.rem[0].iov_len = total - (700u << 10);
    j.rem[1].iov_base = (void *)4096; /* never mapped */
    j.rem[1].iov_len = 700u << 10;
    j.nr = 2;
    kvr_read_job_run(&j);
    ASSERT_EQ(j.err, EFAULT);
    ASSERT_EQ(run_one(getpid(), dst, src, total, 4096), EFAULT);
    pid_t child = fork();
    if (child == 0) {
        _exit(0);
    }
    ASSERT(child > 0);
    ASSERT_EQ(waitpid(child, NULL, 0), child);
    ASSERT_EQ(run_one(child, dst, src, total, 0), ESRCH);
    memset(dst, 0, total);
    ASSERT_EQ(run_one(getpid(), dst, src, total, 0), 0);
    ASSERT(memcmp(dst, src, total) == 0);

    kvr_readers_t *rd = kvr_readers_new(1, count_notify, NULL);
    ASSERT(rd != NULL);
    kvr_read_job_t a = {.pid = getpid(), .loc = &l, .nl = 1, .nr = 1};
    a.rem[0].iov_base = src;
    a.rem[0].iov_len = total;
    kvr_read_job_t b = a;
    /* While a helper has a job, a second is refused (the helper may end
     * the first before the second comes: tried a few times). */
    unsigned refused = 0;
    for (int t = 0; t < 20; t++) {
        ASSERT_EQ(kvr_readers_submit(rd, &a), 0);
        unsigned want = 1;
        if (kvr_readers_submit(rd, &b) == 0) {
            want = 2;
        } else {
            refused++;
        }
        for (unsigned got = 0; got < want;) {
            for (kvr_read_job_t *x = kvr_readers_done(rd); x != NULL; x = x->next) {
                got++;
            }
        }
    }
    ASSERT(refused > 0);
    memset(dst, 0, total);
    ASSERT_EQ(kvr_readers_submit(rd, &a), 0);
    kvr_readers_free(rd);                      /* runs a, then stops */
    ASSERT_EQ(a.err, 0);
    ASSERT(a.by_helper);
    ASSERT(memcmp(dst, src, total) == 0);
    free(src);
    free(dst);
}
