/*
 * sibling: the other ranks of this instance.  A root cause recorded here is
 * published to them (SIB_FAIL), and theirs fail our rooms, so every rank of
 * a room reports the same cause.
 *
 * A SIB_FAIL is taken only from a configured sibling: the instance that
 * answers our PING on the connection we opened to a configured endpoint
 * (its PONG names its epoch and rank, sealed when a secret is set), and
 * only under its routing id (epoch, rank).  One from an instance not known
 * yet is held until every sibling answered a round of PINGs, then applied
 * or refused (counted in sib_fail_refused, logged).
 */
#include "engine_int.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* SIB_FAILs held at most; past it the oldest is refused. */
#define KVR_SIB_HELD_MAX 1024

static void kvr_sib_ping_locked(kvr_engine_t *e)
{
    kvr_msg_t m = kvr_msg_rank(KVR_MSG_PING, (uint32_t)e->rank);
    for (int i = 0; i < e->nsib_conns; i++) {
        e->sib_ids[i].answered = 0;
        kvr_send_conn_locked(e, e->sib_conns[i], &m);
    }
    e->sib_ping_ns = kvr_now_ns();
}

/* 1 if every sibling answered the last round of PINGs. */
static int kvr_sib_round_done(const kvr_engine_t *e)
{
    for (int i = 0; i < e->nsib_conns; i++) {
        if (!e->sib_ids[i].answered) {
            return 0;
        }
    }
    return 1;
}

/* 1 if (ident, epoch) is the instance that answered at a configured
 * sibling endpoint. */
static int kvr_sib_known(const kvr_engine_t *e, const void *ident, size_t ident_len,
                         uint64_t epoch)
{
    for (int i = 0; i < e->nsib_conns; i++) {
        const kvr_sib_id_t *s = &e->sib_ids[i];
        unsigned char want[KVR_ENGINE_IDENT_LEN];
        memcpy(want, &s->epoch, 8);
        memcpy(want + 8, &s->rank, 4);
        if (s->epoch != 0 && s->epoch == epoch && ident_len == sizeof(want) &&
            memcmp(ident, want, sizeof(want)) == 0) {
            return 1;
        }
    }
    return 0;
}

static void kvr_sib_refuse_locked(kvr_engine_t *e, const kvr_sib_held_t *h)
{
    e->stats.sib_fail_refused++;
    e->stats.ctrl_dropped++;
    kvr_warn_limited(e, &e->sib_log,
                     "%s rank %d: refused a SIB_FAIL for room %" PRIu64 " from epoch %016" PRIx64
                     ": not one of the %d configured siblings",
                     kvr_side(e), e->rank, h->room, h->epoch, e->nsib);
}

/* Engine thread: (re)connects to the siblings and publishes root causes. */
void kvr_siblings_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    if (e->sib_dirty) {
        e->sib_dirty = 0;
        for (int i = 0; i < e->nsib_conns; i++) {
            kvr_ctl_conn_close(e->ctl, e->sib_conns[i]);
        }
        free(e->sib_conns);
        e->nsib_conns = 0;
        e->sib_conns = calloc(e->nsib ? (size_t)e->nsib : 1, sizeof(*e->sib_conns));
        unsigned char ident[KVR_ENGINE_IDENT_LEN];
        kvr_engine_ident(e, ident);
        for (int i = 0; e->sib_conns && i < e->nsib; i++) {
            char err[256];
            if (kvr_ctl_connect(e->ctl, e->sib_eps[i], ident, sizeof(ident), NULL,
                                &e->sib_conns[e->nsib_conns], err, sizeof(err)) == 0) {
                e->nsib_conns++;
            } else {
                kvr_log_write(&e->log, KVR_LOG_WARNING, "%s rank %d: sibling %s: %s",
                              kvr_side(e), e->rank, e->sib_eps[i], err);
            }
        }
        free(e->sib_ids);
        e->sib_ids = calloc(e->nsib ? (size_t)e->nsib : 1, sizeof(*e->sib_ids));
        if (e->sib_ids == NULL) {
            e->nsib_conns = 0; /* nothing is taken from siblings not identified */
        }
        kvr_sib_ping_locked(e);
    }
    while (e->sib_out) {
        kvr_sib_out_t *o = e->sib_out;
        e->sib_out = o->next;
        kvr_msg_t m = kvr_msg_fail(KVR_MSG_SIB_FAIL, o->room, 0, o->f.code,
                                   o->f.origin_rank >= 0 ? o->f.origin_rank : e->rank,
                                   o->f.reason, o->f.peer);
        m.epoch = e->epoch;
        if (kvr_wire_encode(&e->wbuf, &m) == 0) {
            for (int i = 0; i < e->nsib_conns; i++) {
                kvr_ctl_send_conn(e->sib_conns[i], e->wbuf.data, e->wbuf.len);
            }
        }
        free(o);
    }
    e->sib_pending = 0;
}

/* A sibling's root cause for a room: it becomes this rank's record too, and
 * the room here fails with it (telling our own peer to stop). */
static void kvr_sib_apply_locked(kvr_engine_t *e, uint64_t room, const kvr_failure_t *f)
{
    KVR_ASSERT_LOCKED(e);
    kvr_room_t *r = kvr_table_get(&e->rooms, room);
    if (r != NULL && !kvr_room_terminal(r) && !r->failing) {
        kvr_room_fail_locked(e, r, f, 1);
    } else if (r == NULL) {
        /* Kept for a room this rank has not opened yet (see kvr_handle_open). */
        kvr_registry_record_early(&e->registry, room, f);
    } else {
        /* A room already terminal or failing here: a room whose part
         * succeeded on this rank still fails as a whole (the schedulers
         * MIN-reduce their ranks' polls), and failure_exception() must raise
         * the origin's cause.  A record of this rank's own stays first;
         * clearing the room drops the record. */
        kvr_registry_record(&e->registry, room, f);
    }
}

/*
 * The held SIB_FAILs after a sibling answered: those of a sibling now known
 * are applied; once every sibling answered, those that arrived before the
 * round of PINGs are refused, and a later one starts a new round.
 */
static void kvr_sib_settle_locked(kvr_engine_t *e)
{
    KVR_ASSERT_LOCKED(e);
    int done = kvr_sib_round_done(e), again = 0;
    kvr_sib_held_t **pp = &e->sib_held;
    while (*pp) {
        kvr_sib_held_t *h = *pp;
        int known = kvr_sib_known(e, h->ident, h->ident_len, h->epoch);
        int refused = !known && (e->nsib_conns == 0 || (done && h->arrived_ns <= e->sib_ping_ns));
        if (!known && !refused) {
            again |= done;
            pp = &h->next;
            continue;
        }
        *pp = h->next;
        e->nsib_held--;
        if (known) {
            kvr_sib_apply_locked(e, h->room, &h->f);
        } else {
            kvr_sib_refuse_locked(e, h);
        }
        free(h);
    }
    if (again) {
        kvr_sib_ping_locked(e);
    }
}

void kvr_on_sib_fail_locked(kvr_engine_t *e, const void *ident, size_t ident_len,
                            const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    kvr_failure_t f;
    kvr_failure_from_msg(&f, m, NULL);
    f.from_sibling = 1;
    if (kvr_sib_known(e, ident, ident_len, m->epoch)) {
        kvr_sib_apply_locked(e, m->room, &f);
        return;
    }
    kvr_sib_held_t *h = calloc(1, sizeof(*h));
    if (h == NULL || ident_len > sizeof(h->ident)) {
        kvr_sib_held_t bad = {.room = m->room, .epoch = m->epoch};
        kvr_sib_refuse_locked(e, &bad);
        free(h);
        return;
    }
    h->room = m->room;
    h->epoch = m->epoch;
    memcpy(h->ident, ident, ident_len);
    h->ident_len = ident_len;
    h->arrived_ns = kvr_now_ns();
    h->f = f;
    kvr_sib_held_t **pp = &e->sib_held;
    while (*pp) {
        pp = &(*pp)->next;
    }
    *pp = h;
    if (++e->nsib_held > KVR_SIB_HELD_MAX) {
        kvr_sib_held_t *old = e->sib_held;
        e->sib_held = old->next;
        e->nsib_held--;
        kvr_sib_refuse_locked(e, old);
        free(old);
    }
    /* A round of PINGs settles it: the one in progress, unless it has
     * gone on longer than a live sibling takes to answer (a sibling that
     * does not answer is not waited for again). */
    if (h->arrived_ns - e->sib_ping_ns > e->cfg.heartbeat_timeout_ms * KVR_MS) {
        for (int i = 0; i < e->nsib_conns; i++) {
            e->sib_ids[i].answered = 1;
        }
    }
    if (kvr_sib_round_done(e)) {
        kvr_sib_settle_locked(e); /* refuses the older ones, starts a round for h */
    }
}

int kvr_on_sib_conn_msg_locked(kvr_engine_t *e, kvr_ctl_conn_t *conn, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    for (int i = 0; i < e->nsib_conns; i++) {
        if (e->sib_conns[i] != conn) {
            continue;
        }
        if (m->type != KVR_MSG_PONG || m->epoch == 0) {
            e->stats.ctrl_dropped++;
            return 1;
        }
        e->sib_ids[i].epoch = m->epoch;
        e->sib_ids[i].rank = m->rank;
        e->sib_ids[i].answered = 1;
        kvr_sib_settle_locked(e);
        return 1;
    }
    return 0;
}

void kvr_siblings_free(kvr_engine_t *e)
{
    for (int i = 0; i < e->nsib; i++) {
        free(e->sib_eps[i]);
    }
    free(e->sib_eps);
    free(e->sib_conns);
    free(e->sib_ids);
    while (e->sib_out) {
        kvr_sib_out_t *o = e->sib_out;
        e->sib_out = o->next;
        free(o);
    }
    while (e->sib_held) {
        kvr_sib_held_t *h = e->sib_held;
        e->sib_held = h->next;
        free(h);
    }
}

int kvr_engine_set_siblings(kvr_engine_t *e, const char *const *endpoints, int n, char *err,
                            size_t errlen)
{
    char **eps = calloc(n > 0 ? (size_t)n : 1, sizeof(char *));
    if (eps == NULL) {
        return kvr_err(err, errlen, KVR_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        const char *hp = endpoints[i] + 6;
        const char *colon = strncmp(endpoints[i], "tcp://", 6) == 0 ? strrchr(hp, ':') : NULL;
        int ok = colon != NULL && colon > hp && colon[1] != '\0' &&
                 strspn(colon + 1, "0123456789") == strlen(colon + 1) && atoi(colon + 1) > 0 &&
                 atoi(colon + 1) < 65536 && strlen(colon + 1) <= 5;
        if (!ok) {
            for (int j = 0; j < i; j++) {
                free(eps[j]);
            }
            free(eps);
            return kvr_err(err, errlen, KVR_EVALUE, "sibling endpoint '%s' is not tcp://host:port",
                           endpoints[i]);
        }
        eps[i] = strdup(endpoints[i]);
    }
    kvr_engine_lock(e);
    if (e->closed) {
        kvr_engine_unlock(e);
        for (int i = 0; i < n; i++) {
            free(eps[i]);
        }
        free(eps);
        return kvr_err(err, errlen, KVR_ERUNTIME, "the manager is closed");
    }
    for (int i = 0; i < e->nsib; i++) {
        free(e->sib_eps[i]);
    }
    free(e->sib_eps);
    e->sib_eps = eps;
    e->nsib = n;
    e->sib_dirty = 1;
    kvr_engine_unlock(e);
    kvr_wake(e);
    return 0;
}
