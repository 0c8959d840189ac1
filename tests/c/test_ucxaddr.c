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

/* Another UCX's v1 address with no transport this one has. */
static const kvr_ucxaddr_ref_t v1 = {0, 0, {{{0, 0}, 0, 0}}};
/* A worker address of UCX 1.13.1 with UCX_TLS=self. */
static const unsigned char self_v1[] = {0x20, 0x60, 0xf6, 0xe2, 0xc5, 0x60, 0xca, 0x50, 0x38, 0x20,
                                        0x80, 0x63, 0x75, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0xf8, 0xd7,
                                        0x4f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x4f, 0x03, 0x00, 0x88,
                                        0x25, 0xd9, 0xb0, 0x5d, 0xaf, 0x51, 0xfb, 0x46};
/* tcp_v1 with its second iface's checksum made self's: UCX's self
 * transport read its 2-byte (tcp port) address as 8 bytes, past the end
 * (fuzz/corpus/fuzz_worker_addr/overread_3). */
static const unsigned char overread_3[] = {
    0x20, 0x86, 0x1c, 0x70, 0x2d, 0x3b, 0xf2, 0xba, 0x73, 0x20, 0x06, 0x00, 0x02, 0xc0, 0x00, 0x02,
    0x02, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38, 0x97, 0x63, 0x34, 0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x00,
    0x13, 0x23, 0x00, 0x82, 0x8c, 0x9f, 0x20, 0x92, 0x01, 0x02, 0x38, 0x5e, 0xf3, 0xad, 0x1c, 0x7c,
    0x43, 0xaf, 0xf9, 0xff, 0xff, 0xef, 0x2f, 0x66, 0x20, 0x00, 0x63, 0x75, 0x77, 0xcc, 0x2b, 0x32,
    0x00, 0x00, 0x88, 0xfd, 0xed, 0x31, 0x56, 0x50, 0x01, 0x13, 0x23, 0x00, 0x82, 0xe1, 0x9f};

TEST_IMPL(ucxaddr_real_address_accepted)
{
    char err[256] = "";
    ASSERT_EQ(kvr_ucxaddr_check(&v1, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), 0);
    ASSERT_EQ(err[0], '\0');
    kvr_ucxaddr_ref_t own;
    ASSERT_EQ(kvr_ucxaddr_learn(&own, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), 0);
    ASSERT_EQ(own.version, 0);
    ASSERT_EQ(own.n, 2); /* two tcp devices, one iface each: the same lengths */
    ASSERT_EQ(kvr_ucxaddr_check(&own, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), 0);
}

TEST_IMPL(ucxaddr_every_truncation_refused)
{
    char err[256];
    for (size_t n = 0; n < sizeof(tcp_v1); n++) {
        err[0] = '\0';
        ASSERT_EQ(kvr_ucxaddr_check(&v1, tcp_v1, n, err, sizeof(err)), -1);
        ASSERT(strncmp(err, "malformed UCX worker address", 28) == 0);
    }
    unsigned char longer[sizeof(tcp_v1) + 1];
    memcpy(longer, tcp_v1, sizeof(tcp_v1));
    longer[sizeof(tcp_v1)] = 0;
    ASSERT_EQ(kvr_ucxaddr_check(&v1, longer, sizeof(longer), err, sizeof(err)), -1);
    ASSERT(strstr(err, "bytes after the last device at byte 79") != NULL);
}

TEST_IMPL(ucxaddr_overreads_refused)
{
    char err[256];
    ASSERT_EQ(kvr_ucxaddr_check(&v1, overread_1, sizeof(overread_1), err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (16 bytes): transport attributes past the end "
                       "at byte 13") == 0);
    ASSERT_EQ(kvr_ucxaddr_check(&v1, overread_2, sizeof(overread_2), err, sizeof(err)), -1);
    ASSERT(strstr(err, "malformed UCX worker address (87 bytes): ") == err);
    /* another address version than ours */
    kvr_ucxaddr_ref_t v2 = v1;
    v2.version = 1;
    ASSERT_EQ(kvr_ucxaddr_check(&v2, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (79 bytes, version 0, ours 1)") == 0);
}

TEST_IMPL(ucxaddr_impossible_values_refused)
{
    char err[256];
    unsigned char a[sizeof(tcp_v1)];
    memcpy(a, tcp_v1, sizeof(a));
    a[35] |= 0x40; /* the first iface's length byte: ep addresses follow */
    ASSERT_EQ(kvr_ucxaddr_check(&v1, a, sizeof(a), err, sizeof(err)), -1);
    ASSERT(strcmp(err, "malformed UCX worker address (79 bytes): endpoint addresses in a worker "
                       "address at byte 36") == 0);
    memcpy(a, tcp_v1, sizeof(a));
    memset(a + 23, 0xff, 4); /* the first iface's bandwidth: NaN */
    ASSERT_EQ(kvr_ucxaddr_check(&v1, a, sizeof(a), err, sizeof(err)), -1);
    ASSERT(strstr(err, "impossible transport attributes") != NULL);
}

TEST_IMPL(ucxaddr_own_transport_lengths_required)
{
    char err[256];
    kvr_ucxaddr_ref_t own;
    ASSERT_EQ(kvr_ucxaddr_learn(&own, self_v1, sizeof(self_v1), err, sizeof(err)), 0);
    ASSERT_EQ(own.n, 1);
    ASSERT_EQ(own.tl[0].iface_len, 8);
    /* structurally whole, and accepted by a UCX without self */
    ASSERT_EQ(kvr_ucxaddr_check(&v1, overread_3, sizeof(overread_3), err, sizeof(err)), 0);
    ASSERT_EQ(kvr_ucxaddr_check(&own, overread_3, sizeof(overread_3), err, sizeof(err)), -1);
    ASSERT(strstr(err, "malformed UCX worker address (79 bytes): transport ") == err);
    ASSERT(strstr(err, " address lengths 2 and device 18, not this UCX's at byte 77") != NULL);
    /* another device length for a transport of ours is refused too */
    kvr_ucxaddr_ref_t tcp;
    ASSERT_EQ(kvr_ucxaddr_learn(&tcp, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), 0);
    tcp.tl[0].dev_len++;
    tcp.tl[1].dev_len++;
    ASSERT_EQ(kvr_ucxaddr_check(&tcp, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), -1);
    ASSERT(strstr(err, "not this UCX's") != NULL);
    /* one of several lengths of ours is enough */
    tcp.tl[0].dev_len--;
    tcp.tl[1].dev_len--;
    tcp.tl[2] = tcp.tl[0];
    tcp.tl[2].iface_len = 3;
    tcp.n = 3;
    ASSERT_EQ(kvr_ucxaddr_check(&tcp, tcp_v1, sizeof(tcp_v1), err, sizeof(err)), 0);
}
