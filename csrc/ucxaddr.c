/*
 * Walker for UCX 1.13's packed worker address (src/ucp/wireup/address.c
 * of UCX describes it; this is the project's own reading of it), in the
 * form ucp_ep_create unpacks it: flags for worker uuid, name, device,
 * iface and ep addresses, no resource index, non-unified mode.
 *
 *   header    v1: 1 byte (version | flags << 4); v2: 2 bytes (version, flags)
 *   uuid      8 bytes if flag UUID (always in v1)
 *   client id 8 bytes if flag CLIENT_ID
 *   name      1 length byte + that many bytes if flag DEBUG_INFO
 *   then 0xff alone (no device), or devices until one has LAST:
 *     md byte     0x80 empty device; index (v1 5 bits, v2 7 bits, 0x7f: next byte)
 *     len byte    0x80 last device, 0x40 paths byte follows, 0x20 system
 *                 device byte follows; length 5 bits (v2 0x1f: next byte)
 *     [paths] [sys dev] device address
 *     unless empty, ifaces until one has LAST:
 *       2 bytes name checksum, attributes (v1 16 bytes, v2 8 bytes)
 *       len byte  0x80 last iface, 0x40 ep addresses follow (only in an
 *                 endpoint's address, never a worker's); length 6 bits
 *                 (v2 0x3f: next byte)
 *       iface address
 *
 * A transport that this UCX has is read by UCX at the lengths of its own
 * address (kvr_ucxaddr_tl_t): a peer's entry for it must have them.
 */
#include "ucxaddr.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define UA_MAX_MDS 64 /* UCP_MD_INDEX_BITS: md index is a bit number */

typedef struct {
    const unsigned char *p;
    size_t len, at;
    unsigned version;
    const kvr_ucxaddr_ref_t *ref; /* transports whose lengths are known */
    kvr_ucxaddr_ref_t *learn;     /* or NULL: where this address's go */
    char *err;
    size_t errlen;
} kvr_ua_t;

static int kvr_ua_fail(kvr_ua_t *u, const char *what)
{
    snprintf(u->err, u->errlen, "malformed UCX worker address (%zu bytes): %s at byte %zu", u->len,
             what, u->at);
    return -1;
}

/* Takes n bytes (their start in *out if out); -1 if they run past len. */
static int kvr_ua_take(kvr_ua_t *u, size_t n, const unsigned char **out, const char *what)
{
    if (n > u->len - u->at) {
        return kvr_ua_fail(u, what);
    }
    if (out != NULL) {
        *out = u->p + u->at;
    }
    u->at += n;
    return 0;
}

/* A byte whose low bits (mask) are a value; in v2 a value equal to the
 * mask means the value is the next byte. */
static int kvr_ua_value(kvr_ua_t *u, unsigned mask, unsigned *flags, unsigned *value,
                        const char *what)
{
    const unsigned char *b;
    if (kvr_ua_take(u, 1, &b, what) != 0) {
        return -1;
    }
    *flags = *b & ~mask & 0xffu;
    *value = *b & mask;
    if (u->version != 0 && *value == mask) {
        if (kvr_ua_take(u, 1, &b, what) != 0) {
            return -1;
        }
        *value = *b;
    }
    return 0;
}

/* A transport of ref with this checksum and these lengths: 0; with this
 * checksum only: -1; none with this checksum: 1. */
static int kvr_ua_known(const kvr_ucxaddr_ref_t *ref, const kvr_ucxaddr_tl_t *t)
{
    int named = 0;
    for (unsigned i = 0; i < ref->n; i++) {
        const kvr_ucxaddr_tl_t *r = &ref->tl[i];
        if (memcmp(r->csum, t->csum, 2) == 0) {
            if (r->iface_len == t->iface_len && r->dev_len == t->dev_len) {
                return 0;
            }
            named = 1;
        }
    }
    return named ? -1 : 1;
}

/* Checks a transport's lengths against ref, or adds them to learn. */
static int kvr_ua_lengths(kvr_ua_t *u, const kvr_ucxaddr_tl_t *t)
{
    int known = kvr_ua_known(u->ref, t);
    if (u->learn == NULL) {
        if (known < 0) {
            char what[96];
            snprintf(what, sizeof(what),
                     "transport %02x%02x address lengths %u and device %u, not this UCX's",
                     t->csum[0], t->csum[1], t->iface_len, t->dev_len);
            return kvr_ua_fail(u, what);
        }
        return 0;
    }
    if (known != 0) {
        if (u->learn->n == KVR_UCXADDR_MAX_TLS) {
            return kvr_ua_fail(u, "too many transports");
        }
        u->learn->tl[u->learn->n++] = *t;
    }
    return 0;
}

static int kvr_ua_iface(kvr_ua_t *u, unsigned dev_len, int *last)
{
    const unsigned char *csum, *attr;
    if (kvr_ua_take(u, 2, &csum, "transport name checksum past the end") != 0 ||
        kvr_ua_take(u, u->version == 0 ? 16 : 8, &attr, "transport attributes past the end") != 0) {
        return -1;
    }
    if (u->version == 0) { /* float overhead, bandwidth, latency; u32 flags */
        float f[3];
        memcpy(f, attr, sizeof(f));
        if (!isfinite(f[0]) || !isfinite(f[1]) || !isfinite(f[2]) || f[1] == 0.0f) {
            return kvr_ua_fail(u, "impossible transport attributes");
        }
    }
    unsigned flags, n;
    if (kvr_ua_value(u, 0x3f, &flags, &n, "transport address length past the end") != 0) {
        return -1;
    }
    if (flags & 0x40) {
        return kvr_ua_fail(u, "endpoint addresses in a worker address");
    }
    *last = (flags & 0x80) != 0;
    kvr_ucxaddr_tl_t t = {{csum[0], csum[1]}, n, dev_len};
    if (kvr_ua_lengths(u, &t) != 0) {
        return -1;
    }
    return kvr_ua_take(u, n, NULL, "transport address past the end");
}

static int kvr_ua_device(kvr_ua_t *u, unsigned *addresses, int *last)
{
    unsigned md_flags, md, flags, n;
    if (kvr_ua_value(u, u->version == 0 ? 0x1f : 0x7f, &md_flags, &md,
                     "memory domain past the end") != 0) {
        return -1;
    }
    if (md >= UA_MAX_MDS) {
        return kvr_ua_fail(u, "memory domain index out of range");
    }
    if (kvr_ua_value(u, 0x1f, &flags, &n, "device address length past the end") != 0) {
        return -1;
    }
    *last = (flags & 0x80) != 0;
    const unsigned char *b;
    if (flags & 0x40) {
        if (kvr_ua_take(u, 1, &b, "path count past the end") != 0) {
            return -1;
        }
        if (*b == 0) {
            return kvr_ua_fail(u, "device with no path");
        }
    }
    if (((flags & 0x20) && kvr_ua_take(u, 1, NULL, "system device past the end") != 0) ||
        kvr_ua_take(u, n, NULL, "device address past the end") != 0) {
        return -1;
    }
    int last_iface = (md_flags & 0x80) != 0; /* an empty device has none */
    while (!last_iface) {
        if (++*addresses > KVR_UCXADDR_MAX_TLS) {
            return kvr_ua_fail(u, "too many transport addresses");
        }
        if (kvr_ua_iface(u, n, &last_iface) != 0) {
            return -1;
        }
    }
    return 0;
}

static int kvr_ua_walk(kvr_ua_t *u)
{
    size_t len = u->len;
    unsigned version = u->version;
    const unsigned char *b;
    if (version > 1) {
        return kvr_ua_fail(u, "unknown address version");
    }
    if (kvr_ua_take(u, version == 0 ? 1 : 2, &b, "header past the end") != 0) {
        return -1;
    }
    if ((b[0] & 0x0f) != version) {
        snprintf(u->err, u->errlen, "malformed UCX worker address (%zu bytes, version %u, ours %u)",
                 len, b[0] & 0x0fu, version);
        return -1;
    }
    unsigned flags = version == 0 ? b[0] >> 4 : b[1];
    if (flags & ~0x0fu) {
        return kvr_ua_fail(u, "unknown header flags");
    }
    if (((version == 0 || (flags & 0x2)) &&
         kvr_ua_take(u, 8, NULL, "worker id past the end") != 0) ||
        ((flags & 0x4) && kvr_ua_take(u, 8, NULL, "client id past the end") != 0)) {
        return -1;
    }
    if (flags & 0x1) {
        if (kvr_ua_take(u, 1, &b, "worker name past the end") != 0 ||
            kvr_ua_take(u, *b, NULL, "worker name past the end") != 0) {
            return -1;
        }
    }
    if (kvr_ua_take(u, 1, &b, "device list past the end") != 0) {
        return -1;
    }
    if (*b != 0xff) { /* 0xff alone: no device */
        u->at--;
        unsigned addresses = 0, devices = 0;
        int last = 0;
        while (!last) {
            if (++devices > KVR_UCXADDR_MAX_TLS) {
                return kvr_ua_fail(u, "too many devices");
            }
            if (kvr_ua_device(u, &addresses, &last) != 0) {
                return -1;
            }
        }
    }
    if (u->at != len) {
        return kvr_ua_fail(u, "bytes after the last device");
    }
    return 0;
}

int kvr_ucxaddr_learn(kvr_ucxaddr_ref_t *ref, const void *own, size_t len, char *err, size_t errlen)
{
    static const kvr_ucxaddr_ref_t none;
    ref->n = 0;
    ref->version = len > 0 ? ((const unsigned char *)own)[0] & 0x0fu : 0;
    kvr_ua_t u = {own, len, 0, ref->version, &none, ref, err, errlen};
    return kvr_ua_walk(&u);
}

int kvr_ucxaddr_check(const kvr_ucxaddr_ref_t *ref, const void *addr, size_t len, char *err,
                      size_t errlen)
{
    kvr_ua_t u = {addr, len, 0, ref->version, ref, NULL, err, errlen};
    return kvr_ua_walk(&u);
}
