/*
 * transport_int: the transport's records, shared by transport.c (UCX) and
 * tplane.c (kvrecv's tcp lanes beside it).  Nothing else includes this.
 */
#ifndef KVR_TRANSPORT_INT_H
#define KVR_TRANSPORT_INT_H

#include <stdint.h>

#include <ucp/api/ucp.h>

#include "lane.h"
#include "lanelisten.h"
#include "transport.h"
#include "ucxaddr.h"
#include "ucxtune.h"

/* Freed bounce buffers kept for reuse (at most pack_max bytes of them, so
 * never more than packing already holds in flight): a fresh buffer costs a
 * page fault per 4 KiB at its first copy, which made packed sends of 1 MiB
 * 1.5-2x slower when most buffers were fresh.  The cache is freed when no
 * packed message was in flight for KVR_TP_PACK_IDLE_NS. */
#define KVR_TP_PACK_CACHE 512
#define KVR_TP_PACK_IDLE_NS (1000ull * 1000 * 1000)

typedef struct {
    void *addr;
    size_t len;
    ucp_mem_h memh;
} kvr_tp_region_t;

struct kvr_tp_worker {
    kvr_transport_t *tp;
    uint64_t id;              /* unique in tp (operations name their worker by it) */
    ucp_worker_h worker;
    ucp_address_t *address;
    size_t address_len;
    int efd;
    int retired;              /* its peer is gone: never progressed again */
    struct kvr_tp_worker *prev, *next;
    /* kvrecv's tcp lane to the peer (lane.h), and the endpoint whose
     * errors it reports; a prefill's offer: the token it waits for. */
    kvr_lane_t *lane;
    struct kvr_tp_ep *lane_ep;
    uint32_t lane_events; /* registered in tp->epfd (0: not registered) */
    int lane_offered;
    unsigned char lane_token[KVR_TP_LANE_TOKEN_LEN];
};

struct kvr_transport {
    ucp_context_h context;
    kvr_tp_worker_t *workers; /* every worker alive */
    unsigned nworkers;
    uint64_t workers_created; /* for peers */
    kvr_tp_worker_t *spare;   /* made by kvr_tp_create, for the first peer */
    int epfd;                 /* epoll set of the workers' event fds */
    kvr_ucxaddr_ref_t addr_ref; /* this UCX's address version and transports */
    kvr_tp_callbacks_t cb;
    kvr_tp_region_t *regions;
    size_t nregions;
    unsigned eps_without_peer_errors;
    int said_lanes[2];        /* the INFO line on endpoints [without, with] peer errors was logged */
    char describe[256];
    char tuned[192];                   /* UCX settings kvrecv changed (ucxtune.c) */
    size_t tuned_bytes[KVR_TUNE_N];    /* their values in effect (0: not known) */
    size_t pack_max;                   /* most bytes of bounce buffers in flight */
    size_t pack_inflight;              /* bytes of bounce buffers in flight */
    uint64_t packed;                   /* messages sent packed */
    void *pack_cache[KVR_TP_PACK_CACHE]; /* freed bounce buffers, for reuse */
    size_t pack_cache_cap[KVR_TP_PACK_CACHE];
    int npack_cache;
    size_t pack_cached;                /* bytes in pack_cache */
    uint64_t pack_busy_ns;             /* last time a packed message was in flight */
    int pack_used;                     /* a buffer was taken since the last trim */
    kvr_lane_listener_t *lanes;        /* prefill: where decodes connect lanes */
    uint64_t lane_frames;              /* data messages sent or accepted over lanes */
    size_t lane_budget;                /* kvr_tp_lane_budget */
    int test_bad_frames;               /* kvr_tp_test_bad_frames */
};

struct kvr_tp_ep {
    kvr_transport_t *tp;
    kvr_tp_worker_t *w;
    ucp_ep_h ep;
    void *ep_ctx;
    int failed;
    int no_peer_errors; /* created without peer-failure handling */
    size_t tcp_eager;   /* kvr_tp_ep_tcp_eager() */
};

/* tplane.c: the lanes' part of the transport's functions. */
unsigned kvr_tp_lanes_progress(kvr_transport_t *tp);
void kvr_tp_lane_retire(kvr_tp_worker_t *w);
void kvr_tp_lane_drop(kvr_tp_worker_t *w, const kvr_tp_ep_t *ep);
/* The lane a host message to ep goes over, or NULL (UCX). */
kvr_lane_t *kvr_tp_lane_for(kvr_tp_ep_t *ep);
void kvr_tp_lane_sync(kvr_tp_worker_t *w);

#endif
