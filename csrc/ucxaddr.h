/*
 * The packed UCX worker address (what ucp_worker_get_address gives and a
 * peer sends in HELLO / HELLO_OK), checked against its own length before
 * UCX sees it: ucp_ep_create takes no length, and UCX 1.13 reads as far as
 * the address's fields say.  Pure: no UCX call; any thread.
 */
#ifndef KVR_UCXADDR_H
#define KVR_UCXADDR_H

#include <stddef.h>

#define KVR_UCXADDR_MAX_TLS 128 /* UCP_MAX_RESOURCES */

/* One transport of this UCX as its own address packs it: the checksum of
 * its name, its iface address length and its device's address length.
 * UCX's is_reachable reads a peer's iface and device address of a
 * transport it has as if they had its own lengths (self reads 8 bytes,
 * shared memory an 8-byte device id), so a peer's address naming one of
 * these transports must give them those lengths. */
typedef struct {
    unsigned char csum[2];
    unsigned iface_len, dev_len;
} kvr_ucxaddr_tl_t;

/* What a peer's address is checked against: this UCX's address version
 * (the low nibble of its first byte: 0 = v1, 1 = v2) and its transports. */
typedef struct {
    unsigned version;
    unsigned n;
    kvr_ucxaddr_tl_t tl[KVR_UCXADDR_MAX_TLS];
} kvr_ucxaddr_ref_t;

/* Fills ref from this UCX's own worker address (checked as below against
 * an empty list of transports); -1 with the reason in err if UCX packs it
 * in a form kvr_ucxaddr_check cannot read. */
int kvr_ucxaddr_learn(kvr_ucxaddr_ref_t *ref, const void *own, size_t len, char *err,
                      size_t errlen);

/* 0 if addr[0..len) is a complete worker address of ref's address version,
 * in UCX 1.13's non-unified format, whose every field lies inside len bytes
 * and carries a value UCX can use, and whose transports that ref knows have
 * ref's address lengths; else -1 with the reason in err. */
int kvr_ucxaddr_check(const kvr_ucxaddr_ref_t *ref, const void *addr, size_t len, char *err,
                      size_t errlen);

#endif
