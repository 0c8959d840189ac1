#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int kvr_log_init(kvr_log_t *log)
{
    memset(log, 0, sizeof(*log));
    log->ring = calloc(KVR_LOG_CAPACITY, sizeof(*log->ring));
    if (log->ring == NULL) {
        return -1;
    }
    pthread_mutex_init(&log->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&log->cond, &attr);
    pthread_condattr_destroy(&attr);
    const char *dbg = getenv("KVRECV_DEBUG");
    log->echo = dbg != NULL && dbg[0] != '\0' && strcmp(dbg, "0") != 0;
    log->min_level = KVR_LOG_DEBUG;
    return 0;
}

void kvr_log_destroy(kvr_log_t *log)
{
    if (log->ring == NULL) {
        return;
    }
    pthread_cond_destroy(&log->cond);
    pthread_mutex_destroy(&log->lock);
    free(log->ring);
    log->ring = NULL;
}

void kvr_utf8_trim(char *s)
{
    size_t n = strlen(s);
    /* The last sequence starts at most 3 bytes before the end. */
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xC0) == 0x80) {
            continue; /* a continuation byte: look further back */
        }
        size_t want = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3
                                   : (c & 0xF8) == 0xF0 ? 4 : 1;
        if (want > back) {
            s[n - back] = '\0';
        }
        return;
    }
}

void kvr_log_write(kvr_log_t *log, int level, const char *fmt, ...)
{
    char text[KVR_LOG_TEXT];
    va_list ap;
    va_start(ap, fmt);
    int full = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (full >= (int)sizeof(text)) {
        kvr_utf8_trim(text);
    }
    if (log->echo) {
        fprintf(stderr, "kvrecv[%d]: %s\n", level, text);
    }
    if (level < log->min_level || log->ring == NULL) {
        return;
    }
    pthread_mutex_lock(&log->lock);
    if (log->count == KVR_LOG_CAPACITY) {
        log->head = (log->head + 1) % KVR_LOG_CAPACITY;
        log->count--;
        log->dropped++;
    }
    kvr_log_rec_t *r = &log->ring[(log->head + log->count) % KVR_LOG_CAPACITY];
    r->level = level;
    memcpy(r->text, text, sizeof(text));
    log->count++;
    pthread_cond_signal(&log->cond);
    pthread_mutex_unlock(&log->lock);
}

int kvr_log_read(kvr_log_t *log, kvr_log_rec_t *out, int max, int timeout_ms)
{
    struct timespec until;
    if (timeout_ms < 0) {
        timeout_ms = 0;
    }
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&log->lock);
    while (log->count == 0 && !log->closed) {
        if (pthread_cond_timedwait(&log->cond, &log->lock, &until) == ETIMEDOUT) {
            break;
        }
    }
    int n = 0;
    while (n < max && log->count > 0) {
        out[n++] = log->ring[log->head];
        log->head = (log->head + 1) % KVR_LOG_CAPACITY;
        log->count--;
    }
    if (n == 0 && log->closed) {
        n = -1;
    }
    pthread_mutex_unlock(&log->lock);
    return n;
}

void kvr_log_close(kvr_log_t *log)
{
    pthread_mutex_lock(&log->lock);
    log->closed = 1;
    pthread_cond_broadcast(&log->cond);
    pthread_mutex_unlock(&log->lock);
}

uint64_t kvr_log_dropped(kvr_log_t *log)
{
    pthread_mutex_lock(&log->lock);
    uint64_t d = log->dropped;
    pthread_mutex_unlock(&log->lock);
    return d;
}
