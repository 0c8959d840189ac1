/*
 * The packed UCX worker address (what ucp_worker_get_address gives and a
 * peer sends in HELLO / HELLO_OK), checked against its own length before
 * UCX sees it: ucp_ep_create takes no length, and UCX 1.13 reads as far as
 * the address's fields say.  Pure: no UCX call; any thread.
 */
#ifndef KVR_UCXADDR_H
#define KVR_UCXADDR_H

#include <stddef.h>

/* 0 if addr[0..len) is a complete worker address of address version
 * `version` (the low nibble of its first byte: 0 = v1, 1 = v2), in UCX
 * 1.13's non-unified format, whose every field lies inside len bytes and
 * carries a value UCX can use; else -1 with the reason in err. */
int kvr_ucxaddr_check(const void *addr, size_t len, unsigned version, char *err, size_t errlen);

#endif
