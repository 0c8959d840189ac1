/*
 * lanelisten: the prefill's listening socket for lanes (lane.h), and the
 * connections accepted on it until each has said its handshake
 * (KVR_LANE_MAGIC and a token).  A connection that says anything else,
 * says nothing for KVR_LANE_HANDSHAKE_NS, or arrives while
 * KVR_LANE_PENDING_MAX others are waiting, is closed; so is one whose
 * token nobody takes.  Anyone may connect; only a decode told the token
 * on the (authenticated) control channel gets a lane.
 *
 * Engine lock held for every call.
 */
#ifndef KVR_LANELISTEN_H
#define KVR_LANELISTEN_H

#include <stddef.h>
#include <stdint.h>

#include "lane.h"

#define KVR_LANE_PENDING_MAX 32
#define KVR_LANE_HANDSHAKE_NS (5ull * 1000 * 1000 * 1000)

typedef struct kvr_lane_listener kvr_lane_listener_t;

/* Listens on host (an address; "*", "0.0.0.0" or "" for all), a free
 * port, with the tcp congestion control named congestion ("": the host's
 * default), which the lanes accepted on it inherit.  NULL with err. */
kvr_lane_listener_t *kvr_lane_listen(const char *host, const char *congestion, char *err,
                                     size_t errlen);
/* Whether this host lets this process give a tcp socket the congestion
 * control named name: 0, or -1 with err naming it, why, and the ones the
 * host allows. */
int kvr_lane_congestion_check(const char *name, char *err, size_t errlen);
void kvr_lane_listener_free(kvr_lane_listener_t *ll);
/* An fd readable when something is to be done (an epoll set of its own). */
int kvr_lane_listener_fd(const kvr_lane_listener_t *ll);
uint16_t kvr_lane_listener_port(const kvr_lane_listener_t *ll);
/* 1 while connections wait in their handshake (their time runs). */
int kvr_lane_listener_waiting(const kvr_lane_listener_t *ll);
/*
 * Accepts connections and reads their handshakes; for each complete one
 * calls take(arg, token, fd): 1 if it took fd, 0 (then it is closed).
 * now_ns: a monotonic clock.  Returns the connections handled.
 */
unsigned kvr_lane_listener_progress(kvr_lane_listener_t *ll,
                                    int (*take)(void *arg, const unsigned char *token, int fd),
                                    void *arg, uint64_t now_ns);

#endif
