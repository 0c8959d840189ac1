#include "ucxlog.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <stdlib.h>

#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include "log.h"

static pthread_once_t kvr_ucxlog_once = PTHREAD_ONCE_INIT;
static __thread int kvr_ucxlog_refusal;
static __thread int kvr_ucxlog_unreturned;

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
    if (kvr_ucxlog_unreturned && level == UCS_LOG_LEVEL_WARN &&
        strstr(text, " was not returned to mpool ") != NULL) {
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

void kvr_ucxlog_expect_unreturned(int on)
{
    kvr_ucxlog_unreturned = on;
}

/* The transports of ep's lanes ("sysv/memory, cma/memory"), from UCX's
 * description of the endpoint; "" if it cannot be had. */
static void kvr_ucxlog_lanes(ucp_ep_h ep, char *out, size_t len)
{
    char *text = NULL;
    size_t text_len = 0;
    out[0] = '\0';
    FILE *f = open_memstream(&text, &text_len);
    if (f == NULL) {
        return;
    }
    ucp_ep_print_info(ep, f);
    fclose(f);
    size_t n = 0;
    for (const char *p = text; p != NULL && (p = strstr(p, "lane[")) != NULL; p++) {
        /* "lane[0]:  1:sysv/memory.0 md[1] ..." */
        const char *name = strchr(p, ':');
        name = name ? strchr(name + 1, ':') : NULL;
        if (name == NULL) {
            break;
        }
        name++;
        size_t nl = strcspn(name, ". \n");
        char one[64];
        snprintf(one, sizeof(one), "%.*s", (int)(nl < 63 ? nl : 63), name);
        if (strstr(out, one) == NULL && n + nl + 3 < len) {
            n += (size_t)snprintf(out + n, len - n, "%s%s", n ? ", " : "", one);
        }
    }
    free(text);
}

int kvr_ucxlog_ep_tcp_only(void *ep)
{
    char lanes[256];
    kvr_ucxlog_lanes(ep, lanes, sizeof(lanes));
    const char *p = lanes;
    if (*p == '\0') {
        return 0;
    }
    while (*p != '\0') {
        /* "tcp/eth0, tcp/lo" */
        if (strncmp(p, "tcp/", 4) != 0) {
            return 0;
        }
        p += strcspn(p, ",");
        p += strspn(p, ", ");
    }
    return 1;
}

void kvr_ucxlog_say_endpoint(void *ep, int peer_errors)
{
    char lanes[256];
    kvr_ucxlog_lanes(ep, lanes, sizeof(lanes));
    const char *tls = getenv("UCX_TLS");
    if (peer_errors) {
        kvr_log_write_shared(KVR_LOG_INFO,
                             "UCX connects to peers over %s (UCX_TLS=%s), with UCX's "
                             "peer-failure handling: a dead peer is reported at once",
                             lanes[0] ? lanes : "?", tls ? tls : "all");
    } else {
        kvr_log_write_shared(KVR_LOG_INFO,
                             "UCX connects to peers over %s (UCX_TLS=%s): shared memory, "
                             "where UCX %s has no peer-failure handling, so heartbeats "
                             "detect a dead peer",
                             lanes[0] ? lanes : "?", tls ? tls : "all",
                             ucp_get_version_string());
    }
}
