/*
 * log: the core's events on their way to Python's logging.
 *
 * C threads never call Python: they append records to this bounded ring
 * (the oldest record is dropped, and counted, when it is full), and a Python
 * thread of the binding waits for them with kvr_log_read and hands them to
 * the "kvrecv" logger.  Levels are Python's (10 DEBUG .. 40 ERROR).  Any
 * thread may call any function.  With KVRECV_DEBUG=1 in the environment
 * every record is also printed to stderr.
 */
#ifndef KVR_LOG_H
#define KVR_LOG_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define KVR_LOG_DEBUG 10
#define KVR_LOG_INFO 20
#define KVR_LOG_WARNING 30
#define KVR_LOG_ERROR 40

#define KVR_LOG_TEXT 448
#define KVR_LOG_CAPACITY 1024

typedef struct {
    int level;
    char text[KVR_LOG_TEXT];
} kvr_log_rec_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvr_log_rec_t *ring; /* KVR_LOG_CAPACITY records */
    size_t head;         /* next to read */
    size_t count;
    uint64_t dropped;
    int closed;
    int echo;            /* KVRECV_DEBUG */
    int min_level;       /* records below are not kept */
} kvr_log_t;

/* Returns 0, or -1 if memory ran out. */
int kvr_log_init(kvr_log_t *log);
void kvr_log_destroy(kvr_log_t *log);
/* Cuts s (NUL-terminated) before a UTF-8 sequence that a fixed-size copy
 * cut in the middle, so that a truncated text ends on a character
 * boundary.  Other invalid bytes (a peer's) stay: readers decode with
 * replacement. */
void kvr_utf8_trim(char *s);

/* Appends a record (its text cut at a character boundary); never blocks on
 * I/O, never fails. */
void kvr_log_write(kvr_log_t *log, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/*
 * Waits up to timeout_ms for records and copies up to max of them into out.
 * Returns the number copied, or -1 once the log is closed and empty.
 */
int kvr_log_read(kvr_log_t *log, kvr_log_rec_t *out, int max, int timeout_ms);
/* Wakes readers; later reads return what is left, then -1. */
void kvr_log_close(kvr_log_t *log);
uint64_t kvr_log_dropped(kvr_log_t *log);

#endif
