#include "runner.h"

#include <string.h>

#include "../../csrc/status.h"

TEST_IMPL(status_names)
{
    ASSERT_EQ(KVR_OK, 0);
    ASSERT(strcmp(kvr_status_name(KVR_OK), "OK") == 0);
    ASSERT(strcmp(kvr_status_name(KVR_PEER_LOST), "PEER_LOST") == 0);
    ASSERT(strcmp(kvr_status_name(KVR_PROTOCOL), "PROTOCOL") == 0);
    for (int i = 0; i < KVR_STATUS_LAST; i++) {
        const char *n = kvr_status_name(i);
        ASSERT(n != NULL && n[0] != '\0');
        ASSERT(strcmp(n, "UNKNOWN") != 0);
        ASSERT_EQ(kvr_status_from_name(n), i);
        const char *m = kvr_status_message(i);
        ASSERT(m != NULL && m[0] != '\0');
        /* names are unique */
        for (int j = 0; j < i; j++) {
            ASSERT(strcmp(kvr_status_name(j), n) != 0);
        }
    }
    int bad[] = {-1, KVR_STATUS_LAST, KVR_STATUS_LAST + 1, 1 << 30, -2147483647 - 1};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ASSERT(strcmp(kvr_status_name(bad[i]), "UNKNOWN") == 0);
        ASSERT(kvr_status_message(bad[i]) != NULL);
    }
    ASSERT_EQ(kvr_status_from_name("UNKNOWN"), -1);
    ASSERT_EQ(kvr_status_from_name(""), -1);
    ASSERT_EQ(kvr_status_from_name("peer_lost"), -1);
    ASSERT_EQ(kvr_status_from_name("PEER_LOST "), -1);
}
