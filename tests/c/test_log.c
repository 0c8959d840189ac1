#include "runner.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../csrc/log.h"

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void init_quiet(kvr_log_t *log)
{
    unsetenv("KVRECV_DEBUG");
    ASSERT_EQ(kvr_log_init(log), 0);
    ASSERT_EQ(log->echo, 0);
}

TEST_IMPL(log_basic)
{
    kvr_log_t log;
    init_quiet(&log);
    kvr_log_rec_t out[8];
    kvr_log_write(&log, KVR_LOG_INFO, "hello %d", 1);
    kvr_log_write(&log, KVR_LOG_ERROR, "%s", "boom");
    kvr_log_write(&log, KVR_LOG_DEBUG, "d");
    ASSERT_EQ(kvr_log_read(&log, out, 2, 0), 2);
    ASSERT_EQ(out[0].level, KVR_LOG_INFO);
    ASSERT(strcmp(out[0].text, "hello 1") == 0);
    ASSERT_EQ(out[1].level, KVR_LOG_ERROR);
    ASSERT(strcmp(out[1].text, "boom") == 0);
    ASSERT_EQ(kvr_log_read(&log, out, 8, 0), 1);
    ASSERT(strcmp(out[0].text, "d") == 0);
    ASSERT_EQ(kvr_log_read(&log, out, 8, 0), 0);
    ASSERT_U64_EQ(kvr_log_dropped(&log), 0);
    kvr_log_destroy(&log);
    kvr_log_destroy(&log); /* second destroy is a no-op */
    /* KVRECV_DEBUG turns on echo; "0" does not */
    setenv("KVRECV_DEBUG", "0", 1);
    ASSERT_EQ(kvr_log_init(&log), 0);
    ASSERT_EQ(log.echo, 0);
    kvr_log_destroy(&log);
    setenv("KVRECV_DEBUG", "1", 1);
    ASSERT_EQ(kvr_log_init(&log), 0);
    ASSERT_EQ(log.echo, 1);
    kvr_log_write(&log, KVR_LOG_WARNING, "echoed to stderr by design");
    ASSERT_EQ(kvr_log_read(&log, out, 8, 0), 1);
    kvr_log_destroy(&log);
    unsetenv("KVRECV_DEBUG");
}

TEST_IMPL(log_truncation)
{
    kvr_log_t log;
    init_quiet(&log);
    char big[2000];
    memset(big, 'y', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    kvr_log_write(&log, KVR_LOG_INFO, "%s", big);
    kvr_log_rec_t out;
    ASSERT_EQ(kvr_log_read(&log, &out, 1, 0), 1);
    ASSERT_EQ(strlen(out.text), KVR_LOG_TEXT - 1);
    kvr_log_destroy(&log);
}

TEST_IMPL(log_min_level)
{
    kvr_log_t log;
    init_quiet(&log);
    log.min_level = KVR_LOG_WARNING;
    kvr_log_write(&log, KVR_LOG_DEBUG, "no");
    kvr_log_write(&log, KVR_LOG_INFO, "no");
    kvr_log_write(&log, KVR_LOG_WARNING, "yes1");
    kvr_log_write(&log, KVR_LOG_ERROR, "yes2");
    kvr_log_rec_t out[4];
    ASSERT_EQ(kvr_log_read(&log, out, 4, 0), 2);
    ASSERT(strcmp(out[0].text, "yes1") == 0);
    ASSERT(strcmp(out[1].text, "yes2") == 0);
    ASSERT_U64_EQ(kvr_log_dropped(&log), 0); /* filtered is not dropped */
    kvr_log_destroy(&log);
}

TEST_IMPL(log_overflow_dropped)
{
    kvr_log_t log;
    init_quiet(&log);
    enum { EXTRA = 37 };
    for (int i = 0; i < KVR_LOG_CAPACITY + EXTRA; i++) {
        kvr_log_write(&log, KVR_LOG_INFO, "%d", i);
    }
    ASSERT_U64_EQ(kvr_log_dropped(&log), EXTRA);
    ASSERT_EQ(log.count, KVR_LOG_CAPACITY);
    /* the oldest were dropped: the survivors are EXTRA.., in order */
    kvr_log_rec_t *out = malloc(sizeof(*out) * (KVR_LOG_CAPACITY + 1));
    int got = 0;
    for (;;) {
        int n = kvr_log_read(&log, out + got, 100, 0);
        ASSERT(n >= 0);
        if (n == 0) {
            break;
        }
        got += n;
        ASSERT(got <= KVR_LOG_CAPACITY);
    }
    ASSERT_EQ(got, KVR_LOG_CAPACITY);
    for (int i = 0; i < got; i++) {
        ASSERT_EQ(atoi(out[i].text), EXTRA + i);
    }
    /* wrap-around after partial reads keeps order */
    for (int i = 0; i < 10; i++) {
        kvr_log_write(&log, KVR_LOG_INFO, "w%d", i);
    }
    ASSERT_EQ(kvr_log_read(&log, out, 3, 0), 3);
    ASSERT(strcmp(out[0].text, "w0") == 0);
    for (int i = 10; i < KVR_LOG_CAPACITY + 10; i++) {
        kvr_log_write(&log, KVR_LOG_INFO, "w%d", i);
    }
    ASSERT_U64_EQ(kvr_log_dropped(&log), EXTRA + 7);
    ASSERT_EQ(kvr_log_read(&log, out, 1, 0), 1);
    ASSERT(strcmp(out[0].text, "w10") == 0);
    free(out);
    kvr_log_destroy(&log);
}

TEST_IMPL(log_read_timeout)
{
    kvr_log_t log;
    init_quiet(&log);
    kvr_log_rec_t out;
    double t0 = mono_ms();
    ASSERT_EQ(kvr_log_read(&log, &out, 1, 150), 0);
    double dt = mono_ms() - t0;
    ASSERT(dt >= 140);
    ASSERT(dt < 5000);
    t0 = mono_ms();
    ASSERT_EQ(kvr_log_read(&log, &out, 1, 0), 0);
    ASSERT(mono_ms() - t0 < 1000);
    /* timeouts with a whole-second part */
    t0 = mono_ms();
    ASSERT_EQ(kvr_log_read(&log, &out, 1, 1100), 0);
    dt = mono_ms() - t0;
    ASSERT(dt >= 1090);
    ASSERT(dt < 6000);
    kvr_log_destroy(&log);
}

TEST_IMPL(log_close_semantics)
{
    kvr_log_t log;
    init_quiet(&log);
    kvr_log_rec_t out[4];
    kvr_log_write(&log, KVR_LOG_INFO, "a");
    kvr_log_write(&log, KVR_LOG_INFO, "b");
    kvr_log_write(&log, KVR_LOG_INFO, "c");
    kvr_log_close(&log);
    /* what is left is still read, then -1, without waiting */
    ASSERT_EQ(kvr_log_read(&log, out, 2, 10000), 2);
    ASSERT(strcmp(out[0].text, "a") == 0);
    ASSERT_EQ(kvr_log_read(&log, out, 2, 10000), 1);
    ASSERT(strcmp(out[0].text, "c") == 0);
    double t0 = mono_ms();
    ASSERT_EQ(kvr_log_read(&log, out, 2, 10000), -1);
    ASSERT_EQ(kvr_log_read(&log, out, 2, 10000), -1);
    ASSERT(mono_ms() - t0 < 2000);
    kvr_log_close(&log); /* twice is fine */
    ASSERT_EQ(kvr_log_read(&log, out, 2, 0), -1);
    kvr_log_destroy(&log);
}

static kvr_log_t g_log;
static atomic_int g_reader_ret;

static void *blocked_reader(void *arg)
{
    (void)arg;
    kvr_log_rec_t out;
    atomic_store(&g_reader_ret, kvr_log_read(&g_log, &out, 1, 20000));
    return NULL;
}

TEST_IMPL(log_close_wakes_reader)
{
    init_quiet(&g_log);
    atomic_store(&g_reader_ret, 99);
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, blocked_reader, NULL), 0);
    usleep(100 * 1000);
    ASSERT_EQ(atomic_load(&g_reader_ret), 99); /* still waiting */
    double t0 = mono_ms();
    kvr_log_close(&g_log);
    ASSERT_EQ(pthread_join(th, NULL), 0);
    ASSERT(mono_ms() - t0 < 5000);
    ASSERT_EQ(atomic_load(&g_reader_ret), -1);
    kvr_log_destroy(&g_log);
    /* and a write wakes a reader too */
    init_quiet(&g_log);
    atomic_store(&g_reader_ret, 99);
    ASSERT_EQ(pthread_create(&th, NULL, blocked_reader, NULL), 0);
    usleep(50 * 1000);
    kvr_log_write(&g_log, KVR_LOG_INFO, "wake");
    ASSERT_EQ(pthread_join(th, NULL), 0);
    ASSERT_EQ(atomic_load(&g_reader_ret), 1);
    kvr_log_destroy(&g_log);
}

/* Writers on several threads, one reader thread until close: every record
 * is either read or counted as dropped, and each writer's records arrive in
 * order. */
#define NWRITERS 4
#define PER_WRITER 20000
static atomic_int g_writers_done;
static long g_read_total;
static int g_last_seq[NWRITERS];

static void *writer(void *arg)
{
    int id = (int)(intptr_t)arg;
    for (int i = 0; i < PER_WRITER; i++) {
        kvr_log_write(&g_log, KVR_LOG_INFO + (i % 3) * 10, "%d %d", id, i);
    }
    atomic_fetch_add(&g_writers_done, 1);
    return NULL;
}

static void *reader(void *arg)
{
    (void)arg;
    kvr_log_rec_t out[16];
    for (int i = 0; i < NWRITERS; i++) {
        g_last_seq[i] = -1;
    }
    for (;;) {
        int n = kvr_log_read(&g_log, out, 16, 50);
        if (n < 0) {
            break;
        }
        for (int k = 0; k < n; k++) {
            int id = -1, seq = -1;
            ASSERT_EQ(sscanf(out[k].text, "%d %d", &id, &seq), 2);
            ASSERT(id >= 0 && id < NWRITERS);
            ASSERT(seq > g_last_seq[id]);
            ASSERT_EQ(out[k].level, KVR_LOG_INFO + (seq % 3) * 10);
            g_last_seq[id] = seq;
        }
        g_read_total += n;
    }
    return NULL;
}

TEST_IMPL(log_concurrent_writers_reader)
{
    init_quiet(&g_log);
    pthread_t w[NWRITERS], r;
    ASSERT_EQ(pthread_create(&r, NULL, reader, NULL), 0);
    for (int i = 0; i < NWRITERS; i++) {
        ASSERT_EQ(pthread_create(&w[i], NULL, writer, (void *)(intptr_t)i), 0);
    }
    for (int i = 0; i < NWRITERS; i++) {
        ASSERT_EQ(pthread_join(w[i], NULL), 0);
    }
    kvr_log_close(&g_log);
    ASSERT_EQ(pthread_join(r, NULL), 0);
    uint64_t dropped = kvr_log_dropped(&g_log);
    ASSERT_U64_EQ((uint64_t)g_read_total + dropped, (uint64_t)NWRITERS * PER_WRITER);
    for (int i = 0; i < NWRITERS; i++) {
        ASSERT(g_last_seq[i] <= PER_WRITER - 1);
    }
    kvr_log_destroy(&g_log);
}

/* Known bug: a negative timeout_ms makes the deadline's tv_nsec negative
 * for most starting times; pthread_cond_timedwait then returns EINVAL (not
 * ETIMEDOUT) and kvr_log_read spins forever on an empty log.  Expected:
 * return 0 at once (or treat it as 0).  Try several values so the result
 * does not depend on the current nanosecond. */
TEST_IMPL(log_read_negative_timeout)
{
    kvr_log_t log;
    init_quiet(&log);
    kvr_log_rec_t out;
    int vals[] = {-1, -500, -999, -1000, -1500};
    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
        double t0 = mono_ms();
        ASSERT_EQ(kvr_log_read(&log, &out, 1, vals[i]), 0);
        ASSERT(mono_ms() - t0 < 500);
    }
    kvr_log_destroy(&log);
}

TEST_IMPL(log_utf8_trim)
{
    char a[] = "ab\xc3\xa9";       /* complete: kept */
    char b[] = "ab\xc3";           /* 2-byte sequence cut after its lead */
    char c[] = "ab\xe2\x82";       /* 3-byte sequence cut after 2 */
    char d[] = "ab\xf0\x9f\x98";   /* 4-byte sequence cut after 3 */
    char f[] = "ab\xf0\x9f\x98\x80"; /* complete 4-byte: kept */
    char g[] = "\xff\xfe";         /* invalid, not cut: left for the reader */
    char h[] = "";
    kvr_utf8_trim(a);
    kvr_utf8_trim(b);
    kvr_utf8_trim(c);
    kvr_utf8_trim(d);
    kvr_utf8_trim(f);
    kvr_utf8_trim(g);
    kvr_utf8_trim(h);
    ASSERT(strcmp(a, "ab\xc3\xa9") == 0);
    ASSERT(strcmp(b, "ab") == 0);
    ASSERT(strcmp(c, "ab") == 0);
    ASSERT(strcmp(d, "ab") == 0);
    ASSERT(strcmp(f, "ab\xf0\x9f\x98\x80") == 0);
    ASSERT(strcmp(g, "\xff\xfe") == 0);
    ASSERT(strcmp(h, "") == 0);
}
