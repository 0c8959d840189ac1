#include "status.h"

#include <string.h>

static const char *const kvr_status_names[] = {
#define KVR_STATUS_NAME(name, str, pyclass, msg) str,
    KVR_STATUS_MAP(KVR_STATUS_NAME)
#undef KVR_STATUS_NAME
};

static const char *const kvr_status_messages[] = {
#define KVR_STATUS_MSG(name, str, pyclass, msg) msg,
    KVR_STATUS_MAP(KVR_STATUS_MSG)
#undef KVR_STATUS_MSG
};

const char *kvr_status_name(int status)
{
    if (status < 0 || status >= KVR_STATUS_LAST) {
        return "UNKNOWN";
    }
    return kvr_status_names[status];
}

const char *kvr_status_message(int status)
{
    if (status < 0 || status >= KVR_STATUS_LAST) {
        return "unknown status";
    }
    return kvr_status_messages[status];
}

int kvr_status_from_name(const char *name)
{
    for (int i = 0; i < KVR_STATUS_LAST; i++) {
        if (strcmp(kvr_status_names[i], name) == 0) {
            return i;
        }
    }
    return -1;
}
