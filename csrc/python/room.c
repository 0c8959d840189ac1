#include "module.h"
#include "../wire.h" /* KVR_MAX_STATES */

#include <string.h>

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    kvr_handle_t *handle;
    PyObject *manager; /* keeps the engine alive while the room exists */
    PyObject *dict;    /* so Python subclasses can carry attributes */
    uint64_t room;
} kvr_py_room_t;

static int kvr_room_pyinit(PyObject *op, PyObject *args, PyObject *kwds)
{
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    static char *kwlist[] = {"manager", "bootstrap_addr", "bootstrap_room", NULL};
    PyObject *mgr, *room_obj;
    const char *addr = "";
    kvr_py_state_t *st = kvr_py_state_of_type(Py_TYPE(op));
    if (st == NULL) {
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!zO", kwlist, st->manager_type, &mgr, &addr,
                                     &room_obj)) {
        return -1;
    }
    if (self->handle != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the room is already open");
        return -1;
    }
    /* A bool is an int to Python, but True as a room id is a mistake. */
    PyObject *idx = PyBool_Check(room_obj) ? NULL : PyNumber_Index(room_obj);
    if (idx == NULL) {
        PyErr_Format(PyExc_TypeError, "bootstrap_room must be an integer, not %.100s",
                     Py_TYPE(room_obj)->tp_name);
        return -1;
    }
    unsigned long long room = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (room == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "bootstrap_room=%S must be in [0, 2**64)", room_obj);
        return -1;
    }
    kvr_py_manager_t *m = (kvr_py_manager_t *)mgr;
    if (m->engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the manager is not initialised");
        return -1;
    }
    char err[512] = "";
    kvr_handle_t *h = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_handle_open(m->engine, room, addr ? addr : "", &h, err, sizeof(err));
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        kvr_py_raise(rc, err);
        return -1;
    }
    self->handle = h;
    self->room = room;
    Py_INCREF(mgr);
    Py_XSETREF(self->manager, mgr);
    return 0;
}

static int kvr_room_traverse(PyObject *op, visitproc visit, void *arg)
{
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->manager);
    Py_VISIT(self->dict);
    return 0;
}

static int kvr_room_pyclear(PyObject *op)
{
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    Py_CLEAR(self->dict);
    return 0;
}

static void kvr_room_dealloc(PyObject *op)
{
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    if (self->handle) {
        kvr_handle_t *h = self->handle;
        self->handle = NULL;
        Py_BEGIN_ALLOW_THREADS
        kvr_handle_release(h);
        Py_END_ALLOW_THREADS
    }
    Py_CLEAR(self->dict);
    Py_CLEAR(self->manager); /* after the release: the engine must outlive it */
    tp->tp_free(op);
    Py_DECREF(tp);
}

static kvr_handle_t *kvr_room_handle(kvr_py_room_t *self)
{
    if (self->handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the room is not open (init was not called)");
    }
    return self->handle;
}

/*
 * Converts an index argument to a new int32 array.  Accepts numpy arrays
 * (or any 1-D buffer of integers) and sequences of Python ints.  TypeError
 * for non-integers, ValueError for values outside int32.
 */
static int kvr_py_indices(PyObject *obj, const char *name, int32_t **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a sequence or array of integers, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: cannot read the array's buffer", name);
            return -1;
        }
        const char *fmt = view.format ? view.format : "B";
        while (*fmt == '@' || *fmt == '=' || *fmt == '<' || *fmt == '!') {
            fmt++;
        }
        char f = fmt[0];
        int is_signed = strchr("bhilq", f) != NULL;
        int is_unsigned = strchr("BHILQ", f) != NULL;
        if (fmt[0] == '\0' || fmt[1] != '\0' || (!is_signed && !is_unsigned)) {
            PyErr_Format(PyExc_TypeError, "%s must hold integers, got buffer format '%s'", name,
                         view.format ? view.format : "B");
            PyBuffer_Release(&view);
            return -1;
        }
        if (view.ndim != 1) {
            PyErr_Format(PyExc_ValueError, "%s must be one-dimensional, got %d dimensions", name,
                         view.ndim);
            PyBuffer_Release(&view);
            return -1;
        }
        size_t count = (size_t)view.shape[0];
        Py_ssize_t stride = view.strides ? view.strides[0] : view.itemsize;
        int32_t *a = PyMem_Malloc((count ? count : 1) * sizeof(int32_t));
        if (a == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        const char *p = view.buf;
        for (size_t i = 0; i < count; i++, p += stride) {
            long long v = 0;
            unsigned long long u = 0;
            switch (view.itemsize) {
            case 1: v = is_signed ? *(const int8_t *)p : *(const uint8_t *)p; break;
            case 2: v = is_signed ? *(const int16_t *)p : *(const uint16_t *)p; break;
            case 4: v = is_signed ? *(const int32_t *)p : (long long)*(const uint32_t *)p; break;
            case 8:
                if (is_signed) {
                    v = *(const int64_t *)p;
                } else {
                    u = *(const uint64_t *)p;
                    v = u > INT32_MAX ? (long long)INT32_MAX + 1 : (long long)u;
                }
                break;
            default:
                PyMem_Free(a);
                PyBuffer_Release(&view);
                PyErr_Format(PyExc_TypeError, "%s has an unsupported item size", name);
                return -1;
            }
            if (v < INT32_MIN || v > INT32_MAX) {
                PyMem_Free(a);
                PyBuffer_Release(&view);
                PyErr_Format(PyExc_ValueError, "%s[%zu]=%lld does not fit a page index (int32)",
                             name, i, v);
                return -1;
            }
            a[i] = (int32_t)v;
        }
        PyBuffer_Release(&view);
        *out = a;
        *n = count;
        return 0;
    }
    PyObject *fast = PySequence_Fast(obj, "");
    if (fast == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence or array of integers, not %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    int32_t *a = PyMem_Malloc((count ? (size_t)count : 1) * sizeof(int32_t));
    if (a == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(fast, i);
        if (PyBool_Check(it) || !PyIndex_Check(it)) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be an integer, not %.100s", name, i,
                         Py_TYPE(it)->tp_name);
            goto fail;
        }
        int overflow = 0;
        PyObject *idx = PyNumber_Index(it);
        if (idx == NULL) {
            goto fail;
        }
        long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] does not fit a page index (int32)", name, i);
            goto fail;
        }
        a[i] = (int32_t)v;
    }
    Py_DECREF(fast);
    *out = a;
    *n = (size_t)count;
    return 0;
fail:
    Py_DECREF(fast);
    PyMem_Free(a);
    return -1;
}

/* aux_index: None -> -1, else a non-negative int. */
static int kvr_py_aux(PyObject *obj, int64_t *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = -1;
        return 0;
    }
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "aux_index must be an integer or None, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow || v < 0) {
        PyErr_SetString(PyExc_ValueError, "aux_index must be a non-negative integer or None");
        return -1;
    }
    *out = v;
    return 0;
}

/* state_indices parsed: per entry its slot (-1: None), or, for an entry
 * given as a list (bit c of in.seq), the list in slots; in points there. */
typedef struct {
    int64_t states[KVR_MAX_STATES];
    uint32_t nstates;
    uint32_t n[KVR_MAX_STATES];
    int64_t *slots; /* PyMem */
    size_t nslots, cap;
    kvr_state_in_t in;
} kvr_py_states_t;

/* One slot: a non-negative int (entry c, list position i or -1). */
static int kvr_py_slot(PyObject *v, uint32_t c, Py_ssize_t i, int64_t *out)
{
    long long s = -1;
    int overflow = 0;
    if (!PyBool_Check(v) && PyIndex_Check(v)) {
        PyObject *idx = PyNumber_Index(v);
        if (idx == NULL) {
            return -1;
        }
        s = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
        if (s == -1 && PyErr_Occurred()) {
            return -1;
        }
    } else {
        PyErr_Format(PyExc_TypeError, "state_indices[%u] must be an integer, a list of slots, "
                     "or None, not %.100s", c, Py_TYPE(v)->tp_name);
        return -1;
    }
    if (overflow || s < 0 || s > INT32_MAX) {
        if (i < 0) {
            PyErr_Format(PyExc_ValueError, "state_indices[%u] must be a non-negative slot", c);
        } else {
            PyErr_Format(PyExc_ValueError,
                         "state_indices[%u][%zd] must be a non-negative slot below 2**31", c, i);
        }
        return -1;
    }
    *out = s;
    return 0;
}

/* Entry c given as a sequence (sglang's Mamba slot list, a window's pages):
 * appended to st->slots. */
static int kvr_py_slot_list(PyObject *v, uint32_t c, kvr_py_states_t *st)
{
    PyObject *seq = PySequence_Fast(v, "state_indices entries must be sequences");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if ((size_t)len > st->cap - st->nslots) {
        size_t cap = st->nslots + (size_t)len + 16;
        int64_t *grown = PyMem_Realloc(st->slots, cap * sizeof(int64_t));
        if (grown == NULL) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        st->slots = grown;
        st->cap = cap;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < len; i++) {
        rc = kvr_py_slot(PySequence_Fast_GET_ITEM(seq, i), c, i, &st->slots[st->nslots + i]);
    }
    Py_DECREF(seq);
    if (rc == 0) {
        st->nslots += (size_t)len;
        st->n[c] = (uint32_t)len;
        st->in.seq |= 1u << c;
    }
    return rc;
}

/* state_indices: None (no state), or one entry per state component: None
 * (not asked for), a slot, or a list of slots (state.c says which
 * components take which).  Returns 0, or -1 with the error set (free
 * st->slots with PyMem_Free either way). */
static int kvr_py_states(PyObject *obj, kvr_py_states_t *st)
{
    memset(st, 0, sizeof(*st));
    st->in.n = st->n;
    if (obj == NULL || obj == Py_None) {
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "state_indices must be a list or None");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    int rc = 0;
    if (len > KVR_MAX_STATES) {
        PyErr_Format(PyExc_ValueError, "state_indices has %zd components, at most %d", len,
                     KVR_MAX_STATES);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < len; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(seq, i);
        st->states[i] = -1;
        if (v == Py_None) {
            continue;
        }
        /* A sequence before an int: a numpy array has __index__. */
        rc = PySequence_Check(v) ? kvr_py_slot_list(v, (uint32_t)i, st)
                                 : kvr_py_slot(v, (uint32_t)i, -1, &st->states[i]);
    }
    Py_DECREF(seq);
    st->nstates = rc == 0 ? (uint32_t)len : 0;
    st->in.slots = st->slots;
    return rc;
}

#define KVR_CALL(expr)                                                                        \
    do {                                                                                      \
        char err_[512] = "";                                                                  \
        int rc_;                                                                              \
        char *err = err_;                                                                     \
        size_t errlen = sizeof(err_);                                                         \
        Py_BEGIN_ALLOW_THREADS                                                                \
        rc_ = (expr);                                                                         \
        Py_END_ALLOW_THREADS                                                                  \
        if (rc_ != 0) {                                                                       \
            return kvr_py_raise(rc_, err_);                                                   \
        }                                                                                     \
    } while (0)

/* The decode-side and prefill-side calls refuse a room of the other side. */
static int kvr_room_role_check(kvr_handle_t *h, int mode, const char *what)
{
    if (kvr_handle_role(h) != mode) {
        PyErr_Format(PyExc_RuntimeError, "%s() on a %s room", what,
                     mode == KVR_MODE_DECODE ? "prefill" : "decode");
        return -1;
    }
    return 0;
}

static PyObject *kvr_room_recv_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prefill_dp_rank", "bootstrap_addr", "prefill_tp_size",
                             "prefill_pp_size", NULL};
    int dp = 0;
    unsigned int tp = 0, pp = 0;
    const char *addr = NULL;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "|izII", kwlist, &dp, &addr, &tp, &pp)) {
        return NULL;
    }
    if (kvr_room_role_check(h, KVR_MODE_DECODE, "recv_init") < 0) {
        return NULL;
    }
    KVR_CALL(kvr_handle_recv_init(h, dp, addr, tp, pp, err, errlen));
    Py_RETURN_NONE;
}

static PyObject *kvr_room_send_metadata(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"kv_indices", "aux_index", "decode_prefix_len", "state_indices",
                             NULL};
    PyObject *ind, *aux = Py_None, *prefix = Py_None, *st = Py_None;
    int64_t auxv;
    kvr_py_states_t sts;
    uint32_t prefix_len = 0;
    int32_t *pages;
    size_t n;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "O|OOO", kwlist, &ind, &aux, &prefix, &st) ||
        kvr_room_role_check(h, KVR_MODE_DECODE, "send_metadata") < 0) {
        return NULL;
    }
    if (prefix != Py_None) {
        if (PyBool_Check(prefix) || !PyIndex_Check(prefix)) {
            PyErr_Format(PyExc_TypeError, "decode_prefix_len must be an integer, not %s",
                         Py_TYPE(prefix)->tp_name);
            return NULL;
        }
        long long v = PyLong_AsLongLong(prefix);
        if (v == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return NULL;
            }
            PyErr_Clear();
            v = -1;
        }
        if (v < 0 || v > (long long)UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "decode_prefix_len=%S must be in [0, 2**32)", prefix);
            return NULL;
        }
        prefix_len = (uint32_t)v;
    }
    if (kvr_py_aux(aux, &auxv) < 0) {
        return NULL;
    }
    if (kvr_py_states(st, &sts) < 0 || kvr_py_indices(ind, "kv_indices", &pages, &n) < 0) {
        PyMem_Free(sts.slots);
        return NULL;
    }
    char errbuf[512] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_handle_send_metadata(h, pages, n, auxv, sts.states, sts.nstates, &sts.in,
                                  prefix_len, errbuf, sizeof(errbuf));
    Py_END_ALLOW_THREADS
    PyMem_Free(pages);
    PyMem_Free(sts.slots);
    if (rc != 0) {
        return kvr_py_raise(rc, errbuf);
    }
    Py_RETURN_NONE;
}

static PyObject *kvr_room_send_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_kv_indices", "aux_index", NULL};
    PyObject *num, *aux = Py_None;
    int64_t auxv;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL || !PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &num, &aux) ||
        kvr_room_role_check(h, KVR_MODE_PREFILL, "send_init") < 0) {
        return NULL;
    }
    if (PyBool_Check(num) || !PyIndex_Check(num)) {
        PyErr_Format(PyExc_TypeError, "num_kv_indices must be an integer, not %.100s",
                     Py_TYPE(num)->tp_name);
        return NULL;
    }
    PyObject *idx = PyNumber_Index(num);
    if (idx == NULL) {
        return NULL;
    }
    int overflow = 0;
    long long nv = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "num_kv_indices is out of range");
        return NULL;
    }
    if (kvr_py_aux(aux, &auxv) < 0) {
        return NULL;
    }
    KVR_CALL(kvr_handle_send_init(h, nv, auxv, err, errlen));
    Py_RETURN_NONE;
}

static PyObject *kvr_room_send(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"kv_indices", "state_indices", NULL};
    PyObject *ind, *st = Py_None;
    int32_t *pages;
    size_t n;
    kvr_py_states_t sts;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL || !PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &ind, &st) ||
        kvr_room_role_check(h, KVR_MODE_PREFILL, "send") < 0) {
        return NULL;
    }
    if (kvr_py_states(st, &sts) < 0 || kvr_py_indices(ind, "kv_indices", &pages, &n) < 0) {
        PyMem_Free(sts.slots);
        return NULL;
    }
    char errbuf[512] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_handle_send(h, pages, n, sts.states, sts.nstates, &sts.in, errbuf, sizeof(errbuf));
    Py_END_ALLOW_THREADS
    PyMem_Free(pages);
    PyMem_Free(sts.slots);
    if (rc != 0) {
        return kvr_py_raise(rc, errbuf);
    }
    Py_RETURN_NONE;
}

/* poll(): an atomic read; never raises once the room is open. */
static PyObject *kvr_room_poll(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    int v = self->handle ? kvr_handle_poll(self->handle) : 0;
    kvr_py_state_t *st = kvr_py_state_of_type(Py_TYPE(op));
    if (st != NULL && st->poll_values[v] != NULL) {
        return Py_NewRef(st->poll_values[v]);
    }
    PyErr_Clear();
    return PyLong_FromLong(v);
}

/*
 * failure_record(pop=False) -> None or
 *   (code, reason, origin_rank or None, peer or None, from_remote, from_sibling)
 */
static PyObject *kvr_room_failure_record(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pop", NULL};
    int pop = 0;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL || !PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &pop)) {
        return NULL;
    }
    kvr_failure_t f;
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = kvr_handle_failure(h, &f, pop, 0);
    Py_END_ALLOW_THREADS
    if (!found) {
        Py_RETURN_NONE;
    }
    PyObject *origin = f.origin_rank >= 0 ? PyLong_FromLong(f.origin_rank) : Py_NewRef(Py_None);
    PyObject *peer = f.peer[0] ? PyUnicode_FromString(f.peer) : Py_NewRef(Py_None);
    PyObject *out = NULL;
    if (origin && peer) {
        out = Py_BuildValue("(ssOOOO)", kvr_status_name(f.code), f.reason, origin, peer,
                            f.from_remote ? Py_True : Py_False,
                            f.from_sibling ? Py_True : Py_False);
    }
    Py_XDECREF(origin);
    Py_XDECREF(peer);
    return out;
}

/*
 * failure_exception(generic_reason): pops the record and raises it as the
 * KVTransferError subclass of its code; without a record raises
 * KVTransferError(room, generic_reason, is_from_another_rank=True).
 */
static PyObject *kvr_room_failure_exception(PyObject *op, PyObject *args)
{
    kvr_py_room_t *self = (kvr_py_room_t *)op;
    const char *generic = "KV transfer failed";
    if (!PyArg_ParseTuple(args, "|s", &generic)) {
        return NULL;
    }
    kvr_py_state_t *st = kvr_py_state_of_type(Py_TYPE(op));
    if (st == NULL) {
        return NULL;
    }
    kvr_failure_t f;
    int found = 0;
    if (self->handle) {
        kvr_handle_t *h = self->handle;
        Py_BEGIN_ALLOW_THREADS
        /* Without a record of its own, a rank waits (bounded) for the
         * sibling that saw the failure to publish its cause. */
        found = kvr_handle_failure(h, &f, 1, kvr_handle_sibling_wait_ms(h));
        Py_END_ALLOW_THREADS
    }
    PyObject *exc;
    if (found) {
        exc = kvr_py_error_new(st, self->room, &f, f.from_sibling);
    } else {
        exc = PyObject_CallFunction(st->error_base, "KsO", (unsigned long long)self->room,
                                    generic, Py_True);
    }
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *kvr_room_abort(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_handle_t *h = ((kvr_py_room_t *)op)->handle;
    if (h != NULL) {
        KVR_CALL(kvr_handle_abort(h, err, errlen));
    }
    Py_RETURN_NONE;
}

static PyObject *kvr_room_clear(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_handle_t *h = ((kvr_py_room_t *)op)->handle;
    if (h != NULL) {
        KVR_CALL(kvr_handle_clear(h, err, errlen));
    }
    Py_RETURN_NONE;
}

static PyObject *kvr_room_get_room(PyObject *op, void *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLongLong(((kvr_py_room_t *)op)->room);
}

static PyMethodDef kvr_room_methods[] = {
    {"recv_init", (PyCFunction)(void (*)(void))kvr_room_recv_init, METH_VARARGS | METH_KEYWORDS,
     "Decode: start resolving the prefill peer."},
    {"send_metadata", (PyCFunction)(void (*)(void))kvr_room_send_metadata,
     METH_VARARGS | METH_KEYWORDS, "Decode: destination pages and aux row."},
    {"send_init", (PyCFunction)(void (*)(void))kvr_room_send_init, METH_VARARGS | METH_KEYWORDS,
     "Prefill: announce the number of pages and the aux row."},
    {"send", (PyCFunction)(void (*)(void))kvr_room_send, METH_VARARGS | METH_KEYWORDS,
     "Prefill: hand over a chunk of source pages."},
    {"poll", kvr_room_poll, METH_NOARGS, "The room's KVPoll state; never blocks or raises."},
    {"failure_record", (PyCFunction)(void (*)(void))kvr_room_failure_record,
     METH_VARARGS | METH_KEYWORDS, "The failure record as a tuple, or None."},
    {"_raise_failure", kvr_room_failure_exception, METH_VARARGS, "Raise the failure."},
    {"abort", kvr_room_abort, METH_NOARGS, "Abort the transfer."},
    {"clear", kvr_room_clear, METH_NOARGS, "Free the room; the id may be reused."},
    {NULL, NULL, 0, NULL},
};

static PyObject *kvr_room_get_prefix_len(PyObject *op, void *unused)
{
    (void)unused;
    kvr_handle_t *h = kvr_room_handle((kvr_py_room_t *)op);
    if (h == NULL) {
        return NULL;
    }
    uint32_t n;
    Py_BEGIN_ALLOW_THREADS
    n = kvr_handle_prefix_len(h);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(n);
}

static PyGetSetDef kvr_room_getset[] = {
    {"bootstrap_room", kvr_room_get_room, NULL, "The room id.", NULL},
    {"decode_prefix_len", kvr_room_get_prefix_len, NULL,
     "Tokens of the request the decode already holds: given to send_metadata() on the decode, "
     "received with its request on the prefill (0 until then).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef kvr_room_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(kvr_py_room_t, dict), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot kvr_room_slots[] = {
    {Py_tp_init, kvr_room_pyinit},
    {Py_tp_dealloc, kvr_room_dealloc},
    {Py_tp_traverse, kvr_room_traverse},
    {Py_tp_clear, kvr_room_pyclear},
    {Py_tp_methods, kvr_room_methods},
    {Py_tp_getset, kvr_room_getset},
    {Py_tp_members, kvr_room_members},
    {Py_tp_doc, "One room of a manager (base of KVSender and KVReceiver)."},
    {0, NULL},
};

static PyType_Spec kvr_room_spec = {
    "kvrecv._core.Room",
    sizeof(kvr_py_room_t),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    kvr_room_slots,
};

int kvr_py_add_room(PyObject *m, kvr_py_state_t *st)
{
    st->room_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvr_room_spec, NULL);
    if (st->room_type == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(m, "Room", (PyObject *)st->room_type);
}
