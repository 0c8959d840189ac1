/*
 * sibling: the other ranks of this instance.  A root cause recorded here is
 * published to them (SIB_FAIL), and theirs fail our rooms, so every rank of
 * a room reports the same cause.
 */
#include "engine_int.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
void kvr_on_sib_fail_locked(kvr_engine_t *e, const kvr_msg_t *m)
{
    KVR_ASSERT_LOCKED(e);
    kvr_failure_t f;
    kvr_failure_from_msg(&f, m, NULL);
    f.from_sibling = 1;
    kvr_room_t *r = kvr_table_get(&e->rooms, m->room);
    if (r != NULL && !kvr_room_terminal(r) && !r->failing) {
        kvr_room_fail_locked(e, r, &f, 1);
    } else if (r == NULL) {
        /* Kept for a room this rank has not opened yet (see kvr_handle_open). */
        kvr_registry_record_early(&e->registry, m->room, &f);
    } else {
        /* A room already terminal or failing here: a room whose part
         * succeeded on this rank still fails as a whole (the schedulers
         * MIN-reduce their ranks' polls), and failure_exception() must raise
         * the origin's cause.  A record of this rank's own stays first;
         * clearing the room drops the record. */
        kvr_registry_record(&e->registry, m->room, &f);
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
