#include "ucxtune.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>
#include <ucs/sys/string.h>

/* UCX settings kvrecv changes from UCX's defaults, each only where UCX_TLS
 * lets UCX use its transports and no variable of the environment sets it
 * (env: the variables that do; theirs wins).
 *
 * tcp: with peer-failure handling UCX 1.13 selects no RMA lane over tcp, so
 * rendezvous data moves as active-message fragments of at most
 * UCX_TCP_TX_SEG_SIZE (default 8 KiB), each with its own header, send call
 * and receiver-side handling.  256 KiB fragments into 512 KiB receive
 * buffers moved 16 MiB messages 1.3-1.7x faster here (ucx_perftest tag_bw
 * -e; kvrecv's 16 MiB rooms 3.4-3.6 -> 5.1-5.4 GB/s).  kvrecv's messages
 * of KV pages each fit one fragment and go eagerly (post.c), so the
 * fragment is also the most a message holds: 512 KiB fragments moved
 * random 64 KiB pages 1.1x faster and other points within noise
 * (benchmarks/README.md, tcp messages), for twice the buffer memory per
 * worker; 2 MiB ones no faster, and with 40 peers in one process built
 * with AddressSanitizer (tests/test_peer_death.py, 40 decodes) the first
 * transfers failed in 1 of 5 runs (UCX grows its tcp buffer pools 8
 * fragments at a time per worker; in a run looked into, the decodes
 * declared the prefill silent and a 5 s heartbeat timeout did not stop
 * it; none of 15 with 512 KiB).  Not explained further.
 *
 * tcp zero-copy sends: UCX 1.13 aborts the sending process (uct_iface.h
 * "Assertion `comp->count > 0' failed", status ENDPOINT_TIMEOUT) when a
 * tcp connection fails while zero-copy fragments of a request are still
 * queued on it: the failure completes the request, then the transport
 * completes its fragment once more.  A decode that closes its endpoint
 * while a prefill's data is in flight (it declared the prefill lost) took
 * the prefill down in 10 of 42 runs of
 * tests/test_netns.py's blackholed control port, and in 3 of 5 runs of its
 * test of three such decodes in a row; with UCX_ZCOPY_THRESH=inf (tcp
 * fragments copied into UCX's own buffers) in none of 34 and 6.  Only tcp
 * offers zero-copy active messages among the transports kvrecv uses, so
 * the setting changes nothing else.
 *
 * Shared memory (posix, sysv): a large message crosses UCX's receive FIFO
 * in fragments of one segment (default 8256 bytes, 64 in the FIFO), both
 * processes copying at once; with the FIFO full the sender waits for the
 * receiver, and on a loaded host each such wait is a sleep and a wake-up.
 * 32 KiB segments in a FIFO of 256 took 4-5x less CPU per byte for 16 MiB
 * runs (0.12 against 0.59 s per 512 MiB) and 1.4-2.8x less for random
 * 4-64 KiB pages, and moved them 1.3-5x faster (A/B in one script,
 * benchmarks/README.md), for 24 MiB more shared memory mapped per UCX
 * worker (33 against 9 MiB; resident only as used, 4.4 MiB idle).  Below
 * KVR_TP_SHM_SEG_LIMIT (transport.c, kvr_tp_check_env).
 *
 * ucp_config_modify() applies a name to every transport with a field of
 * that name: among UCX 1.13's transports only tcp has TX_SEG_SIZE and
 * RX_SEG_SIZE, only the mm ones (posix, sysv, xpmem) MM_SEG_SIZE and
 * MM_FIFO_SIZE (ucx_info -c).  docs/operations.md, Tuning. */
typedef struct {
    const char *names[3];   /* UCX_TLS names of the transports */
    const char *aliases[4]; /* UCX_TLS names that cover them all */
} kvr_tune_tls_t;
static const kvr_tune_tls_t kvr_tune_tcp = {{"tcp"}, {NULL}};
static const kvr_tune_tls_t kvr_tune_mm = {{"posix", "sysv"}, {"sm", "shm", "mm"}};
static const struct {
    const kvr_tune_tls_t *tls; /* the transports it is for */
    const char *env[3], *name, *value;
} kvr_tune_table[KVR_TUNE_N] = {
    [KVR_TUNE_TCP_TX_SEG] = {&kvr_tune_tcp, {"UCX_TCP_TX_SEG_SIZE"}, "TX_SEG_SIZE", "256K"},
    [KVR_TUNE_TCP_RX_SEG] = {&kvr_tune_tcp, {"UCX_TCP_RX_SEG_SIZE"}, "RX_SEG_SIZE", "512K"},
    [KVR_TUNE_TCP_ZCOPY] = {&kvr_tune_tcp, {"UCX_ZCOPY_THRESH"}, "ZCOPY_THRESH", "inf"},
    [KVR_TUNE_MM_SEG] = {&kvr_tune_mm,
                       {"UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"},
                       "MM_SEG_SIZE", "32K"},
    [KVR_TUNE_MM_FIFO] = {&kvr_tune_mm,
                        {"UCX_MM_FIFO_SIZE", "UCX_POSIX_FIFO_SIZE", "UCX_SYSV_FIFO_SIZE"},
                        "MM_FIFO_SIZE", "256"},
};

/* 1 if UCX_TLS lets UCX use one of the transports t: unset, "all", one of
 * them or an alias among the names, or a "^" list (all but those) that
 * names neither an alias nor every one of them. */
static int kvr_tune_tls_has(const char *tls, const kvr_tune_tls_t *t)
{
    if (tls == NULL || *tls == '\0') {
        return 1;
    }
    int exclude = tls[0] == '^';
    unsigned all = 0, alias = 0, named = 0, every = 0;
    for (const char *p = tls + exclude; *p;) {
        size_t n = strcspn(p, ",");
        all |= n == 3 && strncmp(p, "all", 3) == 0;
        for (unsigned i = 0; i < 4 && t->aliases[i] != NULL; i++) {
            alias |= strlen(t->aliases[i]) == n && strncmp(p, t->aliases[i], n) == 0;
        }
        for (unsigned i = 0; i < 3 && t->names[i] != NULL; i++) {
            every |= 1u << i;
            named |= (unsigned)(strlen(t->names[i]) == n && strncmp(p, t->names[i], n) == 0) << i;
        }
        p += n + (p[n] == ',');
    }
    return exclude ? !alias && named != every : named || alias || all;
}

void kvr_ucxtune_apply(void *config, const char *tls, char *tuned, size_t tuned_len,
                       size_t *values)
{
    tuned[0] = '\0';
    if (!kvr_tune_tls_has(tls, &kvr_tune_tcp)) {
        values[KVR_TUNE_TCP_RX_SEG] = SIZE_MAX; /* nothing arrives over tcp */
    }
    for (int i = 0; i < KVR_TUNE_N; i++) {
        if (!kvr_tune_tls_has(tls, kvr_tune_table[i].tls)) {
            continue;
        }
        const char *env = kvr_tune_table[i].env[0];
        const char *set = NULL;
        for (int k = 0; k < 3 && kvr_tune_table[i].env[k] != NULL && set == NULL; k++) {
            set = getenv(kvr_tune_table[i].env[k]);
        }
        if (set == NULL) {
            if (ucp_config_modify((ucp_config_t *)config, kvr_tune_table[i].name,
                                  kvr_tune_table[i].value) != UCS_OK) {
                continue; /* UCX's default, whatever it is: not known */
            }
            set = kvr_tune_table[i].value;
            size_t n = strlen(tuned);
            snprintf(tuned + n, tuned_len - n, "%s%s=%s", n ? " " : "", env, set);
        }
        size_t v = 0;
        if (ucs_str_to_memunits(set, &v) != UCS_OK || v == UCS_MEMUNITS_AUTO) {
            v = 0;
        }
        values[i] = v;
    }
}

