/*
 * proto_decode: the decode's side of the protocol -- messages on the
 * connections we opened (the bootstrap server's replies, the prefill's
 * HELLO_OK / HELLO_REJECT / ROOM_FAIL / BYE; on a prefill, the bootstrap
 * server's answer to our registration), the room request, the completion
 * notice, and where an arriving data message lands.
 */
#include "engine_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Decode: tells the room's prefill that every byte landed. */
void kvr_send_done_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    kvr_eroom(r)->done_pending = 0;
    if (r->peer != NULL) {
        kvr_msg_t m = kvr_msg_room_done(r->id, r->tag);
        kvr_send_ctrl_to_peer(e, r->peer, &m);
    }
}

/* Why KV message h does not fit room r (positions, and buffers of its
 * prefill's PP stage, of one K or V group), or NULL. */
static const char *kvr_kv_range_why(const kvr_engine_t *e, const kvr_room_t *r,
                                    const kvr_am_header_t *h)
{
    if ((uint32_t)h->buf + h->nbuf > e->nkv || h->npages == 0 || h->pos >= r->npages ||
        h->npages > r->npages - h->pos) {
        return "run outside the room";
    }
    const kvr_layers_t *y = &r->peer->layers, *ours = &e->layers;
    uint32_t last = (uint32_t)h->buf + h->nbuf - 1u;
    if (!kvr_layers_identity(y, ours) &&
        (!kvr_layers_holds(y, ours, h->buf) || !kvr_layers_holds(y, ours, last) ||
         h->buf / ours->layers != last / ours->layers)) {
        return "buffers outside the sender's PP stage";
    }
    return NULL;
}

/* Why rows of list component buffers [buf, buf + nbuf) at list positions
 * [pos, pos + npages) are not the room's (NULL: they are). */
static const char *kvr_list_range_why(const kvr_engine_t *e, const kvr_room_t *r,
                                      const kvr_am_header_t *h)
{
    int c = kvr_state_list_of(e, h->buf);
    if (kvr_state_list_of(e, (uint32_t)h->buf + h->nbuf - 1) != c) {
        return "a message mixes a list component's rows with other rows";
    }
    uint32_t n = r->lists.n[c];
    if (r->states[c] < 0 || h->npages == 0 || h->pos > n || h->npages > n - h->pos) {
        return "state list positions outside the room's list";
    }
    return NULL;
}

/* Why the positions and buffers data message h names are not room r's
 * (NULL: they are). */
static const char *kvr_data_range_why(const kvr_engine_t *e, const kvr_room_t *r,
                                      const kvr_am_header_t *h)
{
    if (h->kind == KVR_AM_KIND_KV) {
        return kvr_kv_range_why(e, r, h);
    }
    if ((uint32_t)h->buf + h->nbuf > e->naux) {
        return "aux row does not match the room";
    }
    if (kvr_state_list_of(e, h->buf) >= 0) {
        return kvr_list_range_why(e, r, h);
    }
    if (h->npages != 1) {
        return "aux row does not match the room";
    }
    for (uint32_t b = h->buf; b < (uint32_t)h->buf + h->nbuf; b++) {
        if (kvr_state_list_of(e, b) >= 0) {
            return "a message mixes a list component's rows with other rows";
        }
        if (kvr_state_row(e, b, r->aux_index, r->states) < 0 ||
            (b >= e->naux - e->nstate &&
             kvr_state_skip(e, kvr_room_state_link(r), b - (e->naux - e->nstate)))) {
            return b < e->naux - e->nstate ? "aux row does not match the room"
                                           : "state row the room did not ask for";
        }
    }
    return NULL;
}

/* Decode: a data message arrived; decide where (if anywhere) it lands. */
void kvr_on_data(void *arg, kvr_tp_worker_t *w, const void *hdr, size_t hdr_len, size_t len,
                 int rndv, kvr_tp_accept_t *acc)
{
    kvr_engine_t *e = arg;
    kvr_am_header_t h;
    const char *why = NULL;
    if (kvr_am_header_decode(hdr, hdr_len, &h, &why) != 0) {
        goto reject;
    }
    kvr_room_t *r = kvr_table_get(&e->tags, h.tag);
    if (r == NULL || r->role != KVR_ROLE_DECODE) {
        why = "no such room";
        goto foreign;
    }
    if (r->peer == NULL || w != r->peer->worker) {
        /* Each peer has its own worker: data for a room on any other one
         * is not from the room's prefill (whatever epoch it names), and a
         * sender that is not the room's prefill cannot fail it. */
        why = "sender is not the room's prefill";
        goto foreign;
    }
    if (r->failing || kvr_room_terminal(r) || !r->meta_set) {
        why = "room is not receiving";
        goto reject;
    }
    if (kvr_peer_silent(e, r->peer, kvr_now_ns())) {
        /* Declared lost by the engine thread's next pass; the prefill may
         * already have failed the room. */
        why = "prefill silent past the heartbeat timeout";
        goto reject;
    }
    if (r->peer->epoch != h.epoch) {
        /* Only the instance the request went to knows the room's tag. */
        why = "sender epoch is not the room's prefill's";
        goto protocol;
    }
    /* The message covers positions [pos, pos + npages) of buffers
     * [buf, buf + nbuf); the destination is what this room asked for there,
     * never an address the sender names: one piece per buffer and run of
     * consecutive destination pages. */
    if ((why = kvr_data_range_why(e, r, &h)) != NULL) {
        goto protocol;
    }
    uint64_t want = 0;
    const kvr_slice_t *s = h.kind == KVR_AM_KIND_KV ? kvr_room_slice(r, 0) : NULL;
    const kvr_state_link_t *sl = kvr_room_state_link(r);
    if (s != NULL && s->n == 0) {
        why = "KV data for a link that carries none";
        goto protocol;
    }
    uint32_t niov =
        kvr_msg_pieces(e, &h, r->pages, r->aux_index, r->states, &r->lists, s, sl, NULL, &want);
    if (h.flags & KVR_AM_FLAG_READ) {
        /* Read by the decode, now, under the lock: the room is receiving. */
        why = kvr_cma_read_locked(e, r, &h, s, want, acc->data, len);
        if (why != NULL) {
            goto protocol;
        }
        acc->iovcnt = 0; /* nothing more for the transport to do */
        return;
    }
    if ((uint64_t)len != want) {
        why = h.kind == KVR_AM_KIND_KV ? "run length does not match item_len"
                                       : "aux row does not match the room";
        goto protocol;
    }
    /* Counted when accepted, not when landed: a repeated rendezvous would
     * otherwise be accepted again while the first copy is in flight. */
    int lc = h.kind == KVR_AM_KIND_AUX ? kvr_state_list_of(e, h.buf) : -1;
    int claim = lc >= 0 ? kvr_room_claim_list(r, e->nkv, e->naux,
                                              kvr_state_list_bit(e, &r->lists, h.buf),
                                              r->lists.n[lc], h.nbuf, h.pos, h.npages)
                        : kvr_room_claim(r, h.kind == KVR_AM_KIND_AUX, e->nkv, e->naux, h.buf,
                                         h.nbuf, h.pos, h.npages);
    if (claim == KVR_CLAIM_REPEATED) {
        why = "data for positions already received";
        goto protocol;
    }
    kvr_op_t *op = claim == KVR_CLAIM_OK ? kvr_op_new(r, len, niov) : NULL;
    if (op == NULL) {
        why = "out of memory";
        kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory receiving data");
        goto reject;
    }
    kvr_msg_pieces(e, &h, r->pages, r->aux_index, r->states, &r->lists, s, sl, op->iov, &want);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING); /* first byte */
    r->peer->last_data_ns = kvr_now_ns();
    e->stats.data_rendezvous += rndv == 1;
    int dev = 0;
    for (uint32_t b = h.buf; b < (uint32_t)h.buf + h.nbuf; b++) {
        dev |= h.kind == KVR_AM_KIND_KV ? e->kv_dev[b] : e->aux_dev[b];
    }
    op->mixed = h.nbuf > 1;
    /* Device pages are staged unless UCX moves device memory itself; even
     * then eager data (copied here with memcpy) and scattered pieces (UCX's
     * iov datatype is for host memory) go through a staging buffer. */
    if (dev && (e->gpu_path == KVR_GPU_STAGED || !rndv || niov > 1)) {
        if (len <= e->cfg.staging_slot_bytes && (op->slot = kvr_slot_get(e)) != NULL) {
            op->siov.buf = op->slot->buf;
        } else if ((op->bounce = malloc(len ? len : 1)) != NULL) {
            op->siov.buf = op->bounce;
            e->stats.staging_overflow++;
        } else {
            why = "out of memory";
            kvr_room_failf_locked(e, r, KVR_TRANSPORT, 1, "out of memory staging data");
            kvr_op_end_locked(e, op, KVR_TP_ERROR, why);
            goto reject;
        }
        op->siov.len = len;
        op->stage = KVR_STAGE_XFER;
        acc->iov = &op->siov;
        acc->iovcnt = 1;
    } else {
        acc->iov = op->iov;
        acc->iovcnt = niov;
    }
    acc->op = &op->base;
    return;

protocol:
    kvr_room_failf_locked(e, r, KVR_PROTOCOL, 1, "%s sent a bad data message: %s",
                          r->peer ? r->peer->name : "?", why);
    goto reject;
foreign:
    e->stats.data_foreign++;
    kvr_warn_limited(e, &e->data_log,
                     "decode rank %d: refused a data message (%zu bytes, room tag %016" PRIx64
                     ", sender epoch %016" PRIx64 "): %s",
                     e->rank, len, h.tag, h.epoch, why);
reject:
    e->stats.data_rejected++;
    kvr_log_write(&e->log, KVR_LOG_DEBUG, "decode rank %d: rejected a data message: %s", e->rank,
                  why);
    acc->iovcnt = 0;
    acc->reject_why = why;
}

void kvr_decode_send_req_locked(kvr_engine_t *e, kvr_room_t *r)
{
    KVR_ASSERT_LOCKED(e);
    int64_t states[KVR_MAX_STATES]; /* a list component's: its length */
    for (uint32_t c = 0; c < KVR_MAX_STATES; c++) {
        states[c] = (e->state_list >> c & 1u) && r->states[c] >= 0 ? r->lists.n[c] : r->states[c];
    }
    kvr_msg_t m = kvr_msg_room_req(r->id, r->tag, r->aux_index, r->npages,
                                   (const unsigned char *)r->pages, /* little-endian host */
                                   r->prefix_len, kvr_state_any(r->states) ? e->nstates : 0,
                                   (const unsigned char *)states);
    m.nslots = kvr_state_any(r->states) ? r->lists.total : 0;
    m.slots = (const unsigned char *)r->lists.slots;
    kvr_send_ctrl_to_peer(e, r->peer, &m);
    r->req_sent = 1;
    if (r->lead != NULL) {
        r->expected = kvr_group_leg_bytes(e, r); /* its prefill's layers are known now */
    }
    r->started_ns = kvr_now_ns();
    r->deadline_ns = kvr_deadline_ns(e, r->started_ns, r->expected);
    kvr_timer_arm_locked(e, r);
    kvr_room_advance(r, KVR_POLL_TRANSFERRING);
    if (r->expected == 0 && kvr_room_succeed(r)) {
        /* A leg that reads nothing (group.c): the request told the prefill
         * rank it is not needed, which ends there once its sender handed
         * over every page. */
        kvr_room_succeeded_locked(e, r);
    }
}

/*
 * A server we connected to could not authenticate our messages (its secret
 * differs from ours, or one side has none).  Rooms that depend on it fail
 * now with BOOTSTRAP and the server's reason, rather than at the bootstrap
 * timeout.
 */
static void kvr_on_auth_reject_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, kvr_peer_t *p,
                                      const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    char reason[KVR_WIRE_MAX_STR + 1];
    snprintf(reason, sizeof(reason), "%.*s", (int)m->str_len, m->str);
    e->stats.auth_refused_by_peer++;
    if (e->mode == KVR_MODE_PREFILL) {
        if (conn != e->bs_conn) {
            kvr_warn_limited(e, &e->auth_log, "prefill rank %d: a sibling rank refused our "
                             "messages: %s", e->rank, reason);
            return;
        }
        snprintf(e->reg_auth_error, sizeof(e->reg_auth_error), "%s", reason);
        kvr_warn_limited(e, &e->auth_log,
                         "prefill rank %d cannot register with the bootstrap server %s: %s",
                         e->rank, e->bootstrap_addr, reason);
        kvr_room_t *r;
        for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->rooms, &it, NULL)) != NULL;) {
            if (r != NULL && !r->bound && !r->failing && !kvr_room_terminal(r)) {
                kvr_room_failf_locked(e, r, KVR_BOOTSTRAP, 0,
                                      "this rank cannot register with the bootstrap server %s: %s",
                                      e->bootstrap_addr, reason);
            }
        }
        return;
    }
    if (p == NULL) {
        kvr_warn_limited(e, &e->auth_log, "decode rank %d: a sibling rank refused our messages: %s",
                         e->rank, reason);
        return;
    }
    if (conn == p->vconn) {
        kvr_warn_limited(e, &e->auth_log, "decode rank %d: the bootstrap server %s refused our "
                         "check of %s: %s", e->rank, p->key, p->name, reason);
        if (p->verifying) {
            kvr_peer_verified_locked(e, p, 0, 0);
        }
        return;
    }
    if (conn != p->bs_conn && conn != p->conn) {
        return;
    }
    char what[KVR_WIRE_MAX_STR + 64];
    snprintf(what, sizeof(what), "refused our control messages: %s", reason);
    kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, what);
}

/* Prefill: the bootstrap server's answer to our registration. */
static void kvr_on_registered_locked(kvr_engine_t *e, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    if (m->type != KVR_MSG_BS_REGISTER_OK) {
        e->stats.ctrl_dropped++;
        return;
    }
    e->reg_auth_error[0] = '\0';
    if (!e->registered) {
        kvr_log_write(&e->log, KVR_LOG_INFO,
                      "prefill rank %d of DP group %u registered with the bootstrap server %s "
                      "as %s",
                      e->rank, e->dp_rank, e->bootstrap_addr, kvr_ctl_endpoint(e->ctl));
    }
    e->registered = 1;
}

/* Decode: the bootstrap server named the prefill instance serving our rank
 * (or none yet): connect to it and say HELLO. */
static void kvr_on_bs_reply_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    char err[256];
    if (m->type != KVR_MSG_BS_QUERY_REPLY || p->state != KVR_PEER_RESOLVING) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (!m->found) {
        return; /* not registered yet: the timer asks again */
    }
    memcpy(p->conn_ep, m->str, m->str_len);
    p->conn_ep[m->str_len] = '\0';
    kvr_peer_disconnect(e, p); /* retires the bootstrap connection */
    p->epoch = m->peer_epoch;
    char dp[24] = "", pp[24] = ""; /* all fit the name: its endpoint up to 80 */
    if (p->query_dp > 0) {
        snprintf(dp, sizeof(dp), " of DP group %u", p->query_dp);
    }
    if (p->query_pp >= 0) {
        snprintf(pp, sizeof(pp), " of PP stage %d", p->query_pp);
    }
    snprintf(p->name, sizeof(p->name), "prefill rank %u%s%s at %.80s", m->rank, dp, pp,
             strncmp(p->conn_ep, "tcp://", 6) == 0 ? p->conn_ep + 6 : p->conn_ep);
    if (kvr_peer_worker(e, p, err, sizeof(err)) != 0) {
        char what[400];
        snprintf(what, sizeof(what), "cannot be reached: %s", err);
        kvr_peer_fail_locked(e, p, KVR_TRANSPORT, what);
        return;
    }
    kvr_peer_set_state(p, KVR_PEER_CONNECTING);
    kvr_decode_hello_locked(e, p);
}

void kvr_decode_hello_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    KVR_ASSERT_LOCKED(e);
    char err[256];
    unsigned char ident[KVR_ENGINE_IDENT_LEN];
    kvr_engine_ident(e, ident);
    /* The prefill may not hear the connection we have: its ROUTER may still
     * hold our routing id for one of ours that died unseen. */
    kvr_peer_retire_conn(e, p);
    if (p->conn == NULL && kvr_ctl_connect(e->ctl, p->conn_ep, ident, sizeof(ident), p,
                                           &p->conn, err, sizeof(err)) != 0) {
        kvr_peer_fail_locked(e, p, KVR_BOOTSTRAP, err);
        return;
    }
    kvr_peer_hello(e, p);
    p->next_try_ns = kvr_now_ns() + e->cfg.heartbeat_timeout_ms * KVR_MS;
}

/* Decode: p's handshake is done (and its lane settled): rooms may go. */
static void kvr_decode_peer_ready_locked(kvr_engine_t *e, kvr_peer_t *p)
{
    KVR_ASSERT_LOCKED(e);
    kvr_peer_set_state(p, KVR_PEER_READY);
    p->verified_ns = kvr_now_ns();
    kvr_log_write(&e->log, KVR_LOG_INFO, "decode rank %d connected to %s%s", e->rank, p->name,
                  kvr_tp_ep_lane_state(p->ep) == 1 ? " (data over a tcp lane)" : "");
    p->next_ping_ns = kvr_now_ns() + e->cfg.heartbeat_interval_ms * KVR_MS;
    kvr_service_peer_rooms_locked(e, p);
}

void kvr_decode_lane_settled_locked(kvr_engine_t *e, kvr_peer_t *p, uint64_t now)
{
    KVR_ASSERT_LOCKED(e);
    int st = kvr_tp_ep_lane_state(p->ep);
    if (st == 0 && now < p->lane_wait_until_ns) {
        return;
    }
    p->lane_wait = 0;
    if (st != 1) {
        kvr_tp_lane_abandon(p->ep);
        kvr_log_write(&e->log, KVR_LOG_WARNING,
                      "decode rank %d: the tcp lane to %s %s; its data comes through UCX",
                      e->rank, p->name,
                      st == 0 ? "did not answer its handshake in time" : "was refused or closed");
    }
    kvr_decode_peer_ready_locked(e, p);
}

/* Decode: connects the tcp lane prefill p offered (lane.h), if our UCX
 * endpoint to it runs over tcp; 1 if its handshake is under way (without
 * one the data comes through UCX). */
static int kvr_decode_lane_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    if (!m->has_lane || !e->cfg.tcp_lane || e->ndev > 0 || kvr_tp_ep_tcp_eager(p->ep) == 0) {
        return 0;
    }
    /* Its host is the one its control endpoint has: tcp://host:port. */
    char host[KVR_WIRE_MAX_STR + 1], err[256];
    const char *h = strncmp(p->conn_ep, "tcp://", 6) == 0 ? p->conn_ep + 6 : p->conn_ep;
    const char *colon = strrchr(h, ':');
    size_t n = colon != NULL ? (size_t)(colon - h) : strlen(h);
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    snprintf(host, sizeof(host), "%.*s", (int)n, h);
    if (kvr_tp_lane_connect(p->ep, host, m->lane_port, m->lane_token, err, sizeof(err)) != 0) {
        kvr_log_write(&e->log, KVR_LOG_WARNING,
                      "decode rank %d: no tcp lane to %s (%s); its data comes through UCX",
                      e->rank, p->name, err);
        return 0;
    }
    return 1;
}

/* Decode: the prefill accepted our HELLO: check its layout, connect our
 * endpoint to its worker, and the peer is ready. */
static void kvr_on_hello_ok_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    if (p->state != KVR_PEER_CONNECTING || p->lane_wait) {
        return; /* (a second answer, to a HELLO said again) */
    }
    char diff[320];
    if (kvr_layout_diff(e, &m->layout, diff, sizeof(diff)) != 0 ||
        kvr_peer_link(e, p, &m->layout, diff, sizeof(diff)) != 0) {
        char what[400];
        snprintf(what, sizeof(what), "has a different layout: %.320s", diff);
        kvr_peer_fail_locked(e, p, KVR_LAYOUT_MISMATCH, what);
        return;
    }
    if (kvr_cma_probe(e, p, m) != 0) {
        /* It offered reads we cannot do: HELLO again, offering none. */
        kvr_decode_hello_locked(e, p);
        return;
    }
    /*
     * The decode holds an endpoint to the prefill's worker too.  UCX
     * pairs it with the prefill's own endpoint to us, so the prefill's
     * data arrives on it: closing it when the prefill is lost cancels
     * the receives the dead peer left hanging, and on transports with
     * peer-failure support its error reports a dead prefill at once.
     */
    char eperr[256];
    if (kvr_tp_ep_create(p->worker, m->addr, m->addr_len, p, &p->ep, eperr, sizeof(eperr)) != 0) {
        char what[400];
        snprintf(what, sizeof(what), "cannot be reached: %s", eperr);
        kvr_peer_fail_locked(e, p, KVR_TRANSPORT, what);
        return;
    }
    if (kvr_decode_lane_locked(e, p, m)) {
        /* No PING goes meanwhile: the prefill must not find us silent. */
        uint64_t wait_ms = e->cfg.heartbeat_timeout_ms / 2;
        p->lane_wait = 1;
        p->lane_wait_until_ns =
            kvr_now_ns() + (wait_ms < KVR_LANE_WAIT_MS ? wait_ms : KVR_LANE_WAIT_MS) * KVR_MS;
        return; /* kvr_decode_lane_settled_locked, from the timers */
    }
    kvr_decode_peer_ready_locked(e, p);
}

/* Decode: the prefill refused our HELLO: every room bound to it fails with
 * its reason. */
static void kvr_on_hello_reject_locked(kvr_engine_t *e, kvr_peer_t *p, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    kvr_failure_t f;
    kvr_failure_fill(&f, m->code < KVR_STATUS_LAST ? m->code : KVR_REMOTE, (int)m->rank,
                     p->name, "%.*s", (int)m->str_len, m->str);
    f.from_remote = 1;
    kvr_room_t *r;
    for (kvr_table_iter_t it = {0}; (r = kvr_table_next(&e->tags, &it, NULL)) != NULL;) {
        if (r && r->peer == p && !kvr_room_terminal(r)) {
            kvr_failure_t fr = f;
            snprintf(fr.reason, sizeof(fr.reason), "room %" PRIu64 ": %.*s", r->id,
                     (int)m->str_len, m->str);
            kvr_room_fail_locked(e, r, &fr, 0);
            /* The prefill rejected us before any request: tell it which
             * rooms this was about, so its senders fail now too. */
            kvr_tell_room_failed(e, p, r, fr.code);
        }
    }
    kvr_peer_set_state(p, KVR_PEER_FAILED);
    kvr_peer_disconnect(e, p);
}

/* Decode: a message from the bootstrap server or a prefill. */
void kvr_on_conn_msg(void *arg, kvr_ctl_conn_t *conn, void *conn_ctx, const void *data,
                     size_t len)
{
    kvr_engine_t *e = arg;
    kvr_peer_t *p = conn_ctx;
    kvr_msg_t m;
    const char *why;
    if (kvr_wire_decode(data, len, &m, &why) != 0) {
        kvr_drop_locked(e, len, why);
        return;
    }
    if (m.type == KVR_MSG_AUTH_REJECT) {
        kvr_on_auth_reject_locked(e, conn, p, &m);
        return;
    }
    if (p == NULL && kvr_on_sib_conn_msg_locked(e, conn, &m)) {
        return;
    }
    if (e->mode == KVR_MODE_PREFILL) {
        kvr_on_registered_locked(e, &m); /* our registration with the bootstrap server */
        return;
    }
    if (p == NULL) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (conn == p->vconn) {
        if (m.type != KVR_MSG_BS_QUERY_REPLY || !p->verifying) {
            e->stats.ctrl_dropped++;
            return;
        }
        kvr_peer_verified_locked(e, p, m.found, m.peer_epoch);
        return;
    }
    if (conn == p->bs_conn) {
        kvr_on_bs_reply_locked(e, p, &m);
        return;
    }
    if (conn != p->conn) {
        e->stats.ctrl_dropped++;
        return;
    }
    if (m.epoch != p->epoch) {
        /* A different instance answers at the address we bound rooms to. */
        char what[200];
        snprintf(what, sizeof(what), "restarted (epoch %016" PRIx64 " replaced by %016" PRIx64 ")",
                 p->epoch, m.epoch);
        kvr_peer_fail_locked(e, p, KVR_PEER_RESTARTED, what);
        return;
    }
    p->last_heard_ns = kvr_now_ns();
    switch (m.type) {
    case KVR_MSG_HELLO_OK:
        kvr_on_hello_ok_locked(e, p, &m);
        break;
    case KVR_MSG_HELLO_REJECT:
        kvr_on_hello_reject_locked(e, p, &m);
        break;
    case KVR_MSG_PONG:
        break;
    default:
        kvr_on_peer_msg_locked(e, p, &m);
    }
}
