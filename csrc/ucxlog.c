#include "ucxlog.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <ucs/debug/log_def.h>

#include "log.h"

static pthread_once_t kvr_ucxlog_once = PTHREAD_ONCE_INIT;
static __thread int kvr_ucxlog_refusal;

static int kvr_ucxlog_level(ucs_log_level_t level)
{
    switch (level) {
    case UCS_LOG_LEVEL_FATAL:
    case UCS_LOG_LEVEL_ERROR:
        return KVR_LOG_ERROR;
    case UCS_LOG_LEVEL_WARN:
        return KVR_LOG_WARNING;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO:
    case UCS_LOG_LEVEL_PRINT:
        return KVR_LOG_INFO;
    default:
        return KVR_LOG_DEBUG;
    }
}

static ucs_log_func_rc_t kvr_ucxlog_handler(const char *file, unsigned line, const char *function,
                                            ucs_log_level_t level,
                                            const ucs_log_component_config_t *comp,
                                            const char *fmt, va_list ap)
{
    (void)function;
    if (!ucs_log_component_is_enabled(level, comp)) {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    char text[KVR_LOG_TEXT];
    vsnprintf(text, sizeof(text), fmt, ap);
    const char *base = strrchr(file, '/');
    int kvr_level = kvr_ucxlog_level(level);
    if (kvr_ucxlog_refusal && kvr_level == KVR_LOG_ERROR && level != UCS_LOG_LEVEL_FATAL) {
        kvr_level = KVR_LOG_DEBUG;
    }
    int taken = kvr_log_write_shared(kvr_level, "UCX: %s (%s:%u)", text, base ? base + 1 : file,
                                     line);
    return taken && level != UCS_LOG_LEVEL_FATAL ? UCS_LOG_FUNC_RC_STOP
                                                 : UCS_LOG_FUNC_RC_CONTINUE;
}

static void kvr_ucxlog_push(void)
{
    ucs_log_push_handler(kvr_ucxlog_handler);
}

void kvr_ucxlog_install(void)
{
    pthread_once(&kvr_ucxlog_once, kvr_ucxlog_push);
}

void kvr_ucxlog_expect_refusal(int on)
{
    kvr_ucxlog_refusal = on;
}
