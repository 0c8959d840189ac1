#include "runner.h"

#include <string.h>

#include "../../csrc/ucxaddr.h"

/* A worker address of UCX 1.13.1 over tcp (address version v1), as
 * ucp_worker_get_address gave it; fuzz/corpus/fuzz_worker_addr/seed_tcp. */
static const unsigned char tcp_v1[] = {
    0x20, 0x86, 0x1c, 0x70, 0x2d, 0x3b, 0xf2, 0xba, 0x73, 0x20, 0x06, 0x00, 0x02, 0xc0, 0x00, 0x02,
    0x02, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38, 0x97, 0x63, 0x34, 0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x00,
    0x13, 0x23, 0x00, 0x82, 0x8c, 0x9f, 0x20, 0x92, 0x01, 0x02, 0x38, 0x5e, 0xf3, 0xad, 0x1c, 0x7c,
    0x43, 0xaf, 0xf9, 0xff, 0xff, 0xef, 0x00, 0x00, 0x00, 0x00, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38,
    0x53, 0x9e, 0x3e, 0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x01, 0x13, 0x23, 0x00, 0x82, 0xe1, 0x9f};
/* Inputs on which UCX 1.13 read past the end (fuzz/corpus/fuzz_worker_addr/overread_*). */
static const unsigned char overread_1[] = {0x20, 0x20, 0x86, 0x1c, 0x86, 0x1c, 0x82, 0x70,
                                           0x00, 0x70, 0x00, 0x82, 0x20, 0x63, 0x01, 0x01};
static const unsigned char overread_2[] = {
    0x20, 0x86, 0x1c, 0x70, 0x2d, 0x3b, 0xf2, 0xba, 0x73, 0x20, 0x06, 0x00, 0x02, 0xc0, 0x00,
    0x02, 0x02, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38, 0x97, 0x63, 0x34, 0x4b, 0xd7, 0xe0, 0x37,
    0x37, 0x00, 0x13, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x13, 0x23, 0x00, 0x82, 0x8c,
    0x9f, 0x20, 0x92, 0x01, 0x02, 0x38, 0x5e, 0xf3, 0xad, 0x1c, 0x7c, 0x43, 0xaf, 0xf9, 0xff,
    0xff, 0xef, 0x00, 0x00, 0x00, 0x00, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38, 0x53, 0x9e, 0x3e,
    0x4b, 0xd7, 0xe0, 0x38, 0x34, 0x01, 0x13, 0x23, 0x00, 0x82, 0xe1, 0x9f};

TEST_IMPL(ucxaddr_real_address_accepted)
{
    char err[256] = "";
    ASSERT_EQ(kvr_ucxaddr_check(tcp_v1, sizeof(tcp_v1), 0, err, sizeof(err)), 0);
    ASSERT_EQ(err[0], '\0');
}

TEST_IMPL(ucxaddr_every_truncation_refused)
{
    char err[256];
    for (size_t n = 0; n < sizeof(tcp_v1); n++) {
        err[0] = '\0';
        ASSERT_EQ(kvr_ucxaddr_check(tcp_v1, n, 0, err, sizeof(err)), -1);
        ASSERT(strncmp(err, "malformed UCX worker address", 28) == 0);
    }
    unsigned char longer[sizeof(tcp_v1) + 1];
    memcpy(longer, tcp_v1, sizeof(tcp_v1));
    longer[sizeof(tcp_v1)] = 0;
    ASSERT_EQ(kvr_ucxaddr_check(longer, sizeof(longer), 0, err, sizeof(err)), -1);
    ASSERT(strstr(err, "bytes after the last device at byte 79") != NULL);
}

TEST_IMPL(ucxaddr_overreads_refused)
{
    char err[256];
    ASSERT_EQ(kvr_ucxaddr_check(overread_1, sizeof(overread_1), 0, err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (16 bytes): transport attributes past the end "
                       "at byte 13") == 0);
    ASSERT_EQ(kvr_ucxaddr_check(overread_2, sizeof(overread_2), 0, err, sizeof(err)), -1);
    ASSERT(strstr(err, "malformed UCX worker address (87 bytes): ") == err);
    /* another address version than ours */
    ASSERT_EQ(kvr_ucxaddr_check(tcp_v1, sizeof(tcp_v1), 1, err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (79 bytes, version 0, ours 1)") == 0);
}

TEST_IMPL(ucxaddr_impossible_values_refused)
{
    char err[256];
    unsigned char a[sizeof(tcp_v1)];
    memcpy(a, tcp_v1, sizeof(a));
    a[35] |= 0x40; /* the first iface's length byte: ep addresses follow */
    ASSERT_EQ(kvr_ucxaddr_check(a, sizeof(a), 0, err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (79 bytes): endpoint addresses in a worker "
                       "address at byte 36") == 0);
    memcpy(a, tcp_v1, sizeof(a));
    memset(a + 23, 0xff, 4); /* the first iface's bandwidth: NaN */
    ASSERT_EQ(kvr_ucxaddr_check(a, sizeof(a), 0, err, sizeof(err)), -1);
    ASSERT(strstr(err, "impossible transport attributes") != NULL);
}
