/*
 * testhook: a prefill that misbehaves on purpose, for the test suite only.
 *
 * The suite proves the decode's checks of incoming data (positions inside
 * the room, the buffer range, the length, one copy of each piece, the
 * sender's epoch) by making a real prefill send data headers that break
 * them.  The mode is off (KVR_TEST_CORRUPT_NONE) unless a test sets it
 * through the private kvrecv._core Manager._test_corrupt_data(); nothing in
 * the package or its configuration sets it.  Pure logic, no I/O.
 */
#ifndef KVR_TESTHOOK_H
#define KVR_TESTHOOK_H

#include <stdint.h>

#include "wire.h"

enum {
    KVR_TEST_CORRUPT_NONE = 0,
    KVR_TEST_CORRUPT_POS = 1,   /* positions past the end of the room */
    KVR_TEST_CORRUPT_BUF = 2,   /* a buffer range past the registered buffers */
    KVR_TEST_CORRUPT_BYTES = 3, /* more bytes than the header's positions cover */
    KVR_TEST_CORRUPT_DUP = 4,   /* every KV message sent twice */
    KVR_TEST_CORRUPT_EPOCH = 5, /* another instance's epoch */
    KVR_TEST_CORRUPT_STATE = 6, /* row messages name the last row buffer (a state row) */
    KVR_TEST_CORRUPT_SRC = 7,   /* read descriptors name an unmapped source (cma.c) */
    KVR_TEST_CORRUPT_LEASE = 8, /* read descriptors name a word that is not the lease */
    KVR_TEST_CORRUPT_FLAG = 9,  /* data (not a descriptor) flagged as a read descriptor */
    KVR_TEST_CORRUPT_STAGE = 10, /* KV messages name the decode's buffers after their own
                                  * (a PP stage's: those of the next layers) */
    KVR_TEST_CORRUPT_FRAME = 11, /* frames on a tcp lane with a wrong magic (lane.c) */
    KVR_TEST_CORRUPT_LAST
};

/*
 * Rewrites the header h of a KV data message the way mode says, for a room
 * of room_pages positions over nkv KV buffers (DUP leaves it as it is: the
 * caller posts the message twice).  Aux messages are left alone.
 */
void kvr_test_corrupt_header(kvr_am_header_t *h, int mode, uint32_t room_pages, uint32_t nkv,
                             uint32_t naux);

#endif
