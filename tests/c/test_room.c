#include "runner.h"

#include <string.h>

#include "../../csrc/room.h"
#include "../../csrc/status.h"

#define VIS(r) atomic_load(&(r)->visible)

TEST_IMPL(room_new_defaults)
{
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 77, 5, KVR_ROLE_DECODE);
    ASSERT(r != NULL);
    ASSERT_U64_EQ(r->id, 77);
    ASSERT_U64_EQ(r->tag, 5);
    ASSERT_EQ(r->role, KVR_ROLE_DECODE);
    ASSERT_EQ(VIS(r), KVR_POLL_BOOTSTRAPPING);
    ASSERT_EQ(r->aux_index, -1);
    ASSERT_EQ(r->src_aux, -1);
    ASSERT_EQ(r->dst_aux, -1);
    ASSERT_EQ(r->failing, 0);
    ASSERT_EQ(r->inflight, 0);
    ASSERT_EQ(kvr_room_terminal(r), 0);
    ASSERT_EQ(kvr_room_complete(r), 0); /* no metadata yet */
    /* free releases the owned arrays (LSan/valgrind check) */
    r->pages = malloc(16);
    r->src_pages = malloc(16);
    r->dst_pages = malloc(16);
    r->claimed = malloc(16);
    kvr_room_free(r);
    kvr_room_free(NULL);
}

TEST_IMPL(room_advance_forward_only)
{
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 1, KVR_ROLE_PREFILL);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_BOOTSTRAPPING), 0);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_WAITING), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_WAITING);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_WAITING), 0);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_BOOTSTRAPPING), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_WAITING);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_FAILED), 0); /* only settle publishes Failed */
    ASSERT_EQ(VIS(r), KVR_POLL_WAITING);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_TRANSFERRING), 1);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_WAITING), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_TRANSFERRING);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_SUCCESS), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_SUCCESS);
    ASSERT_EQ(kvr_room_terminal(r), 1);
    kvr_room_free(r);
    /* skipping states forward is allowed */
    r = kvr_room_new(sizeof(kvr_room_t), 2, 2, KVR_ROLE_DECODE);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_TRANSFERRING), 1);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_WAITING), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_TRANSFERRING);
    kvr_room_free(r);
    /* a failing room does not advance */
    r = kvr_room_new(sizeof(kvr_room_t), 3, 3, KVR_ROLE_DECODE);
    ASSERT_EQ(kvr_room_fail(r, KVR_TIMEOUT), 1);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_WAITING), 0);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_SUCCESS), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_BOOTSTRAPPING);
    kvr_room_free(r);
}

TEST_IMPL(room_terminal_is_final)
{
    /* Success: fail, settle, force_drain, advance change nothing */
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 1, KVR_ROLE_DECODE);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_SUCCESS), 1);
    ASSERT_EQ(kvr_room_fail(r, KVR_PEER_LOST), 0);
    ASSERT_EQ(r->failing, 0);
    ASSERT_EQ(kvr_room_settle(r), 0);
    r->inflight = 2;
    ASSERT_EQ(kvr_room_force_drain(r), 0);
    r->inflight = 0;
    for (int s = KVR_POLL_FAILED; s <= KVR_POLL_SUCCESS; s++) {
        ASSERT_EQ(kvr_room_advance(r, s), 0);
    }
    ASSERT_EQ(VIS(r), KVR_POLL_SUCCESS);
    kvr_room_free(r);

    /* Failed: nothing leaves it, no second publish */
    r = kvr_room_new(sizeof(kvr_room_t), 2, 2, KVR_ROLE_PREFILL);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_TRANSFERRING), 1);
    ASSERT_EQ(kvr_room_fail(r, KVR_ABORTED), 1);
    ASSERT_EQ(kvr_room_settle(r), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    ASSERT_EQ(kvr_room_terminal(r), 1);
    for (int s = KVR_POLL_FAILED; s <= KVR_POLL_SUCCESS; s++) {
        ASSERT_EQ(kvr_room_advance(r, s), 0);
    }
    ASSERT_EQ(kvr_room_settle(r), 0);
    ASSERT_EQ(kvr_room_fail(r, KVR_TIMEOUT), 0);
    ASSERT_EQ(r->fail_code, KVR_ABORTED);
    r->inflight = 1;
    ASSERT_EQ(kvr_room_force_drain(r), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    kvr_room_free(r);
}

TEST_IMPL(room_fail_settle)
{
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 1, KVR_ROLE_DECODE);
    ASSERT_EQ(kvr_room_settle(r), 0); /* not failing */
    ASSERT_EQ(VIS(r), KVR_POLL_BOOTSTRAPPING);
    ASSERT_EQ(kvr_room_advance(r, KVR_POLL_TRANSFERRING), 1);
    r->inflight = 3;
    ASSERT_EQ(kvr_room_fail(r, KVR_TRANSPORT), 1);
    ASSERT_EQ(kvr_room_fail(r, KVR_REMOTE), 0); /* first cause wins */
    ASSERT_EQ(r->fail_code, KVR_TRANSPORT);
    ASSERT_EQ(r->failing, 1);
    /* still in flight: not visibly Failed yet, and not terminal */
    ASSERT_EQ(kvr_room_settle(r), 0);
    ASSERT_EQ(VIS(r), KVR_POLL_TRANSFERRING);
    ASSERT_EQ(kvr_room_terminal(r), 0);
    ASSERT_EQ(kvr_room_complete(r), 0);
    r->inflight = 1;
    ASSERT_EQ(kvr_room_settle(r), 0);
    r->inflight = 0;
    ASSERT_EQ(kvr_room_settle(r), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    ASSERT_EQ(kvr_room_settle(r), 0);
    ASSERT_EQ(r->drained_by_force, 0);
    kvr_room_free(r);
}

TEST_IMPL(room_force_drain)
{
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 1, KVR_ROLE_PREFILL);
    r->inflight = 4;
    ASSERT_EQ(kvr_room_force_drain(r), 0); /* not failing: refused */
    ASSERT_EQ(r->inflight, 4);
    ASSERT_EQ(r->drained_by_force, 0);
    ASSERT_EQ(kvr_room_fail(r, KVR_PEER_LOST), 1);
    ASSERT_EQ(kvr_room_force_drain(r), 1);
    ASSERT_EQ(r->drained_by_force, 1);
    ASSERT_EQ(r->inflight, 0);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    ASSERT_EQ(kvr_room_force_drain(r), 0);
    ASSERT_EQ(r->fail_code, KVR_PEER_LOST);
    kvr_room_free(r);
    /* a failing room with nothing in flight: force_drain is not needed,
     * and settle still publishes Failed afterwards */
    r = kvr_room_new(sizeof(kvr_room_t), 2, 2, KVR_ROLE_PREFILL);
    ASSERT_EQ(kvr_room_fail(r, KVR_PEER_LOST), 1);
    kvr_room_force_drain(r);
    ASSERT_EQ(r->drained_by_force, 0);
    kvr_room_settle(r);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    kvr_room_free(r);
}

TEST_IMPL(room_complete)
{
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 1, KVR_ROLE_DECODE);
    r->expected = 1000;
    ASSERT_EQ(kvr_room_complete(r), 0);
    r->meta_set = 1;
    ASSERT_EQ(kvr_room_complete(r), 0);
    r->received = 999;
    ASSERT_EQ(kvr_room_complete(r), 0);
    r->received = 1000;
    r->inflight = 1;
    ASSERT_EQ(kvr_room_complete(r), 0);
    r->inflight = 0;
    ASSERT_EQ(kvr_room_complete(r), 1);
    ASSERT_EQ(kvr_room_fail(r, KVR_ABORTED), 1);
    ASSERT_EQ(kvr_room_complete(r), 0);
    kvr_room_free(r);
    /* zero-byte room with metadata is complete */
    r = kvr_room_new(sizeof(kvr_room_t), 2, 2, KVR_ROLE_DECODE);
    r->meta_set = 1;
    ASSERT_EQ(kvr_room_complete(r), 1);
    kvr_room_free(r);
}

/* Random sequences of every operation: the visible state only grows except
 * to Failed, Failed is never published while operations are in flight
 * (unless forced), terminal states never change, the first code sticks. */
TEST_IMPL(room_random_walk)
{
    uint64_t seed = test_seed();
    for (int walk = 0; walk < 20000; walk++) {
        kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), (uint64_t)walk, 1, walk % 2);
        int first_code = -1;
        for (int step = 0; step < 24; step++) {
            int before = VIS(r);
            int was_failing = r->failing;
            int inflight_before = r->inflight;
            uint64_t x = test_rand(&seed);
            int ret = 0;
            switch (x % 7) {
            case 0:
            case 1:
                ret = kvr_room_advance(r, (int)((x >> 8) % 5)); /* KVR_POLL_FAILED..SUCCESS */
                break;
            case 2: {
                int code = 1 + (int)((x >> 8) % (KVR_STATUS_LAST - 1));
                ret = kvr_room_fail(r, code);
                if (ret) {
                    ASSERT_EQ(first_code, -1);
                    first_code = code;
                }
                break;
            }
            case 3:
                ret = kvr_room_settle(r);
                break;
            case 4:
                ret = kvr_room_force_drain(r);
                break;
            case 5:
                if (!r->failing || (x >> 8) % 2) {
                    r->inflight++;
                }
                break;
            default:
                if (r->inflight > 0) {
                    r->inflight--;
                }
            }
            int after = VIS(r);
            ASSERT(ret == 0 || ret == 1);
            ASSERT(after >= KVR_POLL_FAILED && after <= KVR_POLL_SUCCESS);
            if (before == KVR_POLL_SUCCESS || before == KVR_POLL_FAILED) {
                ASSERT_EQ(after, before);
            }
            if (after != before) {
                ASSERT(after == KVR_POLL_FAILED || after > before);
                ASSERT_EQ(ret, 1);
            }
            if (after == KVR_POLL_FAILED && before != KVR_POLL_FAILED) {
                ASSERT(r->failing);
                ASSERT(r->inflight == 0);
                ASSERT(inflight_before == 0 || r->drained_by_force);
            }
            if (was_failing) {
                ASSERT(r->failing);
            }
            if (r->failing) {
                ASSERT(after != KVR_POLL_SUCCESS);
                ASSERT_EQ(r->fail_code, first_code);
            }
            ASSERT_EQ(kvr_room_terminal(r), after == KVR_POLL_SUCCESS || after == KVR_POLL_FAILED);
        }
        kvr_room_free(r);
    }
}

TEST_IMPL(room_run_length)
{
    const int32_t IMAX = 2147483647, IMIN = -2147483647 - 1;
    int32_t dst[] = {10, 11, 12, 20, 21, 5};
    int32_t src[] = {0, 1, 9, 10, 11, 12};
    ASSERT_EQ(kvr_run_length(NULL, dst, 0, 6), 3);
    ASSERT_EQ(kvr_run_length(src, dst, 0, 6), 2);
    ASSERT_EQ(kvr_run_length(src, dst, 2, 6), 1); /* dst breaks at 3 */
    ASSERT_EQ(kvr_run_length(src, dst, 3, 6), 2);
    ASSERT_EQ(kvr_run_length(NULL, dst, 3, 6), 2);
    ASSERT_EQ(kvr_run_length(NULL, dst, 5, 6), 1);
    ASSERT_EQ(kvr_run_length(NULL, dst, 0, 2), 2); /* capped at end */
    ASSERT_EQ(kvr_run_length(NULL, dst, 0, 1), 1);
    ASSERT_EQ(kvr_run_length(src, dst, 1, 2), 1);
    /* int32 edges: no wrap from INT32_MAX to INT32_MIN */
    int32_t top[] = {IMAX - 2, IMAX - 1, IMAX, IMIN, IMIN + 1};
    ASSERT_EQ(kvr_run_length(NULL, top, 0, 5), 3);
    ASSERT_EQ(kvr_run_length(NULL, top, 2, 5), 1);
    ASSERT_EQ(kvr_run_length(NULL, top, 3, 5), 2);
    ASSERT_EQ(kvr_run_length(top, top, 0, 5), 3);
    int32_t wrap_src[] = {IMAX, IMIN};
    int32_t ok_dst[] = {0, 1};
    ASSERT_EQ(kvr_run_length(wrap_src, ok_dst, 0, 2), 1);
    int32_t neg[] = {-3, -2, -1, 0, 1};
    ASSERT_EQ(kvr_run_length(NULL, neg, 0, 5), 5);
    int32_t same[] = {4, 4, 4};
    ASSERT_EQ(kvr_run_length(NULL, same, 0, 3), 1);
    int32_t down[] = {4, 3, 2};
    ASSERT_EQ(kvr_run_length(NULL, down, 0, 3), 1);
    /* a long run, and one broken only in src */
    enum { N = 5000 };
    int32_t *a = malloc(N * sizeof(int32_t)), *b = malloc(N * sizeof(int32_t));
    for (int i = 0; i < N; i++) {
        a[i] = IMAX - N + 1 + i; /* ends exactly at INT32_MAX */
        b[i] = i;
    }
    ASSERT_EQ(kvr_run_length(a, b, 0, N), N);
    ASSERT_EQ(kvr_run_length(NULL, a, 100, N), N - 100);
    a[4000] = 0;
    ASSERT_EQ(kvr_run_length(a, b, 0, N), 4000);
    ASSERT_EQ(kvr_run_length(NULL, b, 0, N), N);
    free(a);
    free(b);
}

TEST_IMPL(room_pages_check)
{
    const int32_t IMAX = 2147483647, IMIN = -2147483647 - 1;
    int32_t p[] = {0, 1, 2, 3};
    ASSERT_EQ(kvr_pages_check(p, 0, 10), -1);
    ASSERT_EQ(kvr_pages_check(NULL, 0, 0), -1);
    ASSERT_EQ(kvr_pages_check(p, 4, 4), -1);
    ASSERT_EQ(kvr_pages_check(p, 4, 3), 3); /* limit itself is out */
    ASSERT_EQ(kvr_pages_check(p, 4, 0), 0);
    ASSERT_EQ(kvr_pages_check(p, 4, -1), 0);
    int32_t q[] = {5, -1, 99, IMIN};
    ASSERT_EQ(kvr_pages_check(q, 4, 100), 1); /* first bad one */
    ASSERT_EQ(kvr_pages_check(q, 1, 100), -1);
    int32_t e[] = {IMAX, 0, IMAX - 1};
    ASSERT_EQ(kvr_pages_check(e, 3, (int64_t)IMAX + 1), -1);
    ASSERT_EQ(kvr_pages_check(e, 3, IMAX), 0);
    ASSERT_EQ(kvr_pages_check(e, 3, INT64_MAX), -1);
    ASSERT_EQ(kvr_pages_check(e + 1, 2, IMAX), -1);
    int32_t m[] = {IMIN};
    ASSERT_EQ(kvr_pages_check(m, 1, INT64_MAX), 0);
    ASSERT_EQ(kvr_pages_check(m, 1, INT64_MIN), 0);
    int32_t z[] = {0};
    ASSERT_EQ(kvr_pages_check(z, 1, 1), -1);
    ASSERT_EQ(kvr_pages_check(z, 1, INT64_MIN), 0);
}

TEST_IMPL(room_claim_once)
{
    /* A room of 10 positions over 3 KV and 2 aux buffers. */
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t), 1, 2, KVR_ROLE_DECODE);
    r->npages = 10;
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 0, 2, 0, 4), KVR_CLAIM_OK);
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 0, 1, 3, 1), KVR_CLAIM_REPEATED); /* position 3 of buffer 0 again */
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 1, 2, 3, 2), KVR_CLAIM_REPEATED); /* buffer 1 overlaps, 2 does not */
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 2, 1, 3, 2), KVR_CLAIM_OK); /* nothing of the refused one stuck */
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 0, 3, 4, 6), KVR_CLAIM_REPEATED);
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 0, 2, 4, 6), KVR_CLAIM_OK);
    ASSERT_EQ(kvr_room_claim(r, 0, 3, 2, 2, 1, 9, 1), KVR_CLAIM_OK); /* the last bit of KV */
    ASSERT_EQ(kvr_room_claim(r, 1, 3, 2, 0, 1, 0, 1), KVR_CLAIM_OK); /* aux bits follow */
    ASSERT_EQ(kvr_room_claim(r, 1, 3, 2, 0, 2, 0, 1), KVR_CLAIM_REPEATED);
    ASSERT_EQ(kvr_room_claim(r, 1, 3, 2, 1, 1, 0, 1), KVR_CLAIM_OK);
    ASSERT_EQ(kvr_room_claim(r, 1, 3, 2, 1, 1, 0, 1), KVR_CLAIM_REPEATED);
    kvr_room_free(r);
}

/* The bookkeeping of operations, and Success / abandon per role. */
TEST_IMPL(room_ops_succeed_abandon)
{
    /* prefill: Success needs the decode's ROOM_DONE and nothing in flight */
    kvr_room_t *r = kvr_room_new(sizeof(kvr_room_t) + 64, 1, 1, KVR_ROLE_PREFILL);
    ASSERT(r != NULL);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING);
    kvr_room_op_started(r);
    kvr_room_op_started(r);
    ASSERT_EQ(r->inflight, 2);
    ASSERT_U64_EQ(r->ops_posted, 2);
    r->done_received = 1;
    ASSERT_EQ(kvr_room_succeed(r), 0);
    kvr_room_op_ended(r);
    ASSERT_EQ(kvr_room_succeed(r), 0);
    kvr_room_op_ended(r);
    ASSERT_EQ(r->inflight, 0);
    ASSERT_U64_EQ(r->ops_posted, 2); /* counts every operation ever posted */
    ASSERT_EQ(kvr_room_succeed(r), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_SUCCESS);
    ASSERT_EQ(kvr_room_succeed(r), 0); /* once */
    kvr_room_abandon(r, 5);            /* Success stays */
    ASSERT_EQ(VIS(r), KVR_POLL_SUCCESS);
    ASSERT_EQ(r->failing, 0);
    kvr_room_free(r);

    /* decode: Success iff every expected byte landed, nothing in flight */
    r = kvr_room_new(sizeof(kvr_room_t), 2, 2, KVR_ROLE_DECODE);
    r->meta_set = 1;
    r->expected = 100;
    kvr_room_advance(r, KVR_POLL_TRANSFERRING);
    kvr_room_op_started(r);
    r->received = 100;
    ASSERT_EQ(kvr_room_succeed(r), 0);
    kvr_room_op_ended(r);
    ASSERT_EQ(kvr_room_succeed(r), 1);
    kvr_room_free(r);

    /* a failing room is never a success; after a force-drain ended
     * operations are no longer counted */
    r = kvr_room_new(sizeof(kvr_room_t), 3, 3, KVR_ROLE_PREFILL);
    kvr_room_op_started(r);
    kvr_room_op_started(r);
    r->done_received = 1;
    ASSERT_EQ(kvr_room_fail(r, 7), 1);
    ASSERT_EQ(kvr_room_force_drain(r), 1);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    kvr_room_op_ended(r);
    ASSERT_EQ(r->inflight, 0);
    ASSERT_EQ(kvr_room_succeed(r), 0);
    kvr_room_free(r);

    /* abandon: in flight or not, Failed now, first cause kept */
    r = kvr_room_new(sizeof(kvr_room_t), 4, 4, KVR_ROLE_DECODE);
    kvr_room_op_started(r);
    kvr_room_abandon(r, 9);
    ASSERT_EQ(VIS(r), KVR_POLL_FAILED);
    ASSERT_EQ(r->fail_code, 9);
    ASSERT_EQ(r->inflight, 0);
    kvr_room_free(r);
}
