/*
 * libFuzzer target for a peer's UCX worker address (HELLO and HELLO_OK
 * carry one): arbitrary bytes go through kvr_tp_address_check and, if it
 * accepts them, to kvr_tp_ep_create on a real UCX worker, as the engine
 * does with a peer's address; the endpoint is closed again.  Neither may
 * crash, hang or read out of bounds.  Seeds are real addresses of this
 * UCX (FUZZ_WRITE_SEED=file writes one; UCX_TLS then says which
 * transports it names); FUZZ_EXPECT_VALID=1 requires kvr_tp_address_check
 * to accept every input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "transport.h"

static void no_data(void *arg, kvr_tp_worker_t *w, const void *hdr, size_t hdr_len, size_t len,
                    int rndv, kvr_tp_accept_t *acc)
{
    (void)arg, (void)w, (void)hdr, (void)hdr_len, (void)len, (void)rndv;
    acc->iovcnt = 0;
}

static void no_recv_done(void *arg, kvr_tp_op_t *op, size_t len, int failed, const char *text)
{
    (void)arg, (void)op, (void)len, (void)failed, (void)text;
}

static void no_send_done(void *arg, kvr_tp_op_t *op, int failed, const char *text)
{
    (void)arg, (void)op, (void)failed, (void)text;
}

static void no_ep_error(void *arg, void *ep_ctx, kvr_tp_ep_t *ep, const char *text)
{
    (void)arg, (void)ep_ctx, (void)ep, (void)text;
}

static kvr_transport_t *tp;
static kvr_tp_worker_t *worker;

/* UCX is not built with AddressSanitizer, and ucp_ep_create takes no
 * length: it reads as far as the address's own fields say.  Each input is
 * placed to end where an inaccessible page begins, so that a read past its
 * end faults at once, whatever the heap holds. */
static unsigned char *guarded;
static size_t guarded_len;

static const unsigned char *guard_copy(const uint8_t *data, size_t size)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t need = (size + page - 1) / page * page + page;
    if (need > guarded_len) {
        if (guarded != NULL) {
            munmap(guarded, guarded_len);
        }
        guarded = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(guarded != MAP_FAILED);
        guarded_len = need;
        CHECK(mprotect(guarded + need - page, page, PROT_NONE) == 0);
    }
    unsigned char *at = guarded + guarded_len - page - size;
    memcpy(at, data, size);
    return at;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    char err[256];
    /* UCX parses the whole address whatever transports it has; with only
     * "self" it connects to nothing an input names (no socket, no shared
     * memory segment of another process). */
    if (getenv("FUZZ_WRITE_SEED") == NULL) {
        setenv("UCX_TLS", "self", 1);
    }
    kvr_tp_callbacks_t cb = {NULL, no_data, no_recv_done, no_send_done, no_ep_error};
    CHECK(kvr_tp_create(&cb, 1 << 20, &tp, err, sizeof(err)) == 0);
    CHECK(kvr_tp_worker_create(tp, &worker, err, sizeof(err)) == 0);
    if (getenv("FUZZ_WRITE_SEED") != NULL) { /* writes this worker's address */
        const void *addr;
        size_t len;
        kvr_tp_address(worker, &addr, &len);
        FILE *f = fopen(getenv("FUZZ_WRITE_SEED"), "wb");
        CHECK(f != NULL && fwrite(addr, 1, len, f) == len && fclose(f) == 0);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    err[0] = '\0';
    if (kvr_tp_address_check(tp, data, size, err, sizeof(err)) != 0) {
        CHECK(err[0] != '\0');
        CHECK(!expect_valid());
        return 0;
    }
    kvr_tp_ep_t *ep = NULL;
    if (kvr_tp_ep_create(worker, guard_copy(data, size), size, NULL, &ep, err, sizeof(err)) != 0) {
        CHECK(err[0] != '\0');
        return 0;
    }
    kvr_tp_ep_close(ep, 1);
    return 0;
}
