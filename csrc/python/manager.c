#include "module.h"
#include "../readers.h"
#include "../testhook.h"

#include <string.h>

/* Reads a sequence of ints into a new uint64 array. */
static int kvr_py_u64_list(PyObject *seq, const char *name, uint64_t **out, uint32_t *n)
{
    PyObject *fast = PySequence_Fast(seq, name);
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    *out = PyMem_Calloc(len ? (size_t)len : 1, sizeof(uint64_t));
    if (*out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *idx = PyNumber_Index(it);
        if (idx == NULL) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be an integer, not %.100s", name, i,
                         Py_TYPE(it)->tp_name);
            goto fail;
        }
        int overflow = 0;
        long long sv = PyLong_AsLongLongAndOverflow(idx, &overflow);
        int neg = overflow < 0 || (!overflow && sv < 0);
        unsigned long long v = neg ? 0 : PyLong_AsUnsignedLongLong(idx);
        Py_DECREF(idx);
        if (neg || (v == (unsigned long long)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s[%zd] must be a non-negative 64-bit integer", name,
                         i);
            goto fail;
        }
        (*out)[i] = v;
    }
    *n = (uint32_t)len;
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    PyMem_Free(*out);
    *out = NULL;
    return -1;
}

/*
 * The numeric fields of kvr_config_t that Python sets, with the largest
 * value each takes and whether Python sees it as a bool.  KVConfig's fields
 * and defaults come from here (config_defaults); the secret and the lanes'
 * congestion control (strings) are read apart.
 */
#define KVR_PY_CONFIG(X)                                                                      \
    X(bootstrap_timeout_ms, UINT32_MAX, 0)                                                    \
    X(heartbeat_interval_ms, UINT32_MAX, 0)                                                   \
    X(heartbeat_timeout_ms, UINT32_MAX, 0)                                                    \
    X(deadline_base_ms, UINT32_MAX, 0)                                                        \
    X(deadline_floor_bps, (uint64_t)1 << 62, 0)                                               \
    X(max_rooms, UINT32_MAX, 0)                                                               \
    X(max_pending, UINT32_MAX, 0)                                                             \
    X(ctrl_port, 65535, 0)                                                                    \
    X(sibling_wait_ms, UINT32_MAX, 0)                                                         \
    X(register_memory, 1, 1)                                                                  \
    X(coalesce_bytes, UINT32_MAX, 0)                                                          \
    X(coalesce_run_bytes, UINT32_MAX, 0)                                                      \
    X(pack_bytes, (uint64_t)1 << 40, 0)                                                       \
    X(max_rooms_per_peer, UINT32_MAX, 0)                                                      \
    X(max_peers, UINT32_MAX, 0)                                                               \
    X(ctrl_queue_bytes, (uint64_t)1 << 40, 0)                                                 \
    X(staging_slots, 65536, 0)                                                                \
    X(staging_slot_bytes, 1u << 30, 0)                                                        \
    X(force_staging, 1, 1)                                                                    \
    X(poll_progress, 1, 1)                                                                    \
    X(cross_memory_bytes, UINT32_MAX, 0)                                                      \
    X(cross_memory_readers, KVR_READERS_MAX, 0)                                               \
    X(tcp_lane, 1, 1)

PyObject *kvr_py_config_defaults(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    kvr_config_t c;
    kvr_config_default(&c);
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return NULL;
    }
#define KVR_CFG_DEFAULT(field, max, is_bool)                                                  \
    {                                                                                         \
        PyObject *o = (is_bool) ? PyBool_FromLong((long)c.field)                              \
                                : PyLong_FromUnsignedLongLong((unsigned long long)c.field);   \
        if (o == NULL || PyDict_SetItemString(d, #field, o) < 0) {                            \
            Py_XDECREF(o);                                                                    \
            Py_DECREF(d);                                                                     \
            return NULL;                                                                      \
        }                                                                                     \
        Py_DECREF(o);                                                                         \
    }
    KVR_PY_CONFIG(KVR_CFG_DEFAULT)
#undef KVR_CFG_DEFAULT
    PyObject *cc = PyUnicode_FromString(c.lane_congestion);
    if (cc == NULL || PyDict_SetItemString(d, "lane_congestion", cc) < 0) {
        Py_XDECREF(cc);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(cc);
    return d;
}

/* config[key], a new reference; NULL (no error set) when cfg is None or
 * has no such key. */
static PyObject *kvr_cfg_item(PyObject *cfg, const char *key)
{
    if (cfg == NULL || cfg == Py_None) {
        return NULL;
    }
    PyObject *v = PyMapping_GetItemString(cfg, key);
    if (v == NULL) {
        PyErr_Clear();
    }
    return v;
}

static int kvr_cfg_get(PyObject *cfg, const char *key, uint64_t max, uint64_t *dst)
{
    PyObject *v = kvr_cfg_item(cfg, key);
    if (v == NULL) {
        return 0;
    }
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "config[%s] must be a number", key);
        return -1;
    }
    if (d < 0) {
        PyErr_Format(PyExc_ValueError, "config[%s] must be >= 0", key);
        return -1;
    }
    if (!(d <= (double)max)) {
        PyErr_Format(PyExc_ValueError, "config[%s] must be at most %llu", key,
                     (unsigned long long)max);
        return -1;
    }
    *dst = (uint64_t)d;
    return 0;
}

/* config["secret"]: str (UTF-8), bytes or bytearray; absent, None or empty: none. */
static int kvr_cfg_secret(PyObject *cfg, kvr_config_t *c)
{
    c->secret_len = 0;
    PyObject *v = kvr_cfg_item(cfg, "secret");
    if (v == NULL) {
        return 0;
    }
    int rc = kvr_py_secret(v, "KVConfig.secret", c->secret, &c->secret_len);
    Py_DECREF(v);
    return rc;
}

/* config["lane_congestion"]: a str of at most KVR_LANE_CC_MAX - 1 ASCII
 * characters ("": the host's default); absent or None: the default.  The
 * engine asks the kernel whether the name can be used. */
static int kvr_cfg_congestion(PyObject *cfg, kvr_config_t *c)
{
    PyObject *v = kvr_cfg_item(cfg, "lane_congestion");
    if (v == NULL) {
        return 0;
    }
    int rc = 0;
    if (v != Py_None) {
        Py_ssize_t n = 0;
        const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8AndSize(v, &n) : NULL;
        if (s == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "KVConfig.lane_congestion must be a str, not %.100s",
                             Py_TYPE(v)->tp_name);
            }
            rc = -1;
        } else if (n >= KVR_LANE_CC_MAX || !PyUnicode_IS_ASCII(v) || strlen(s) != (size_t)n) {
            PyErr_Format(PyExc_ValueError,
                         "KVConfig.lane_congestion=%R is not a congestion control name (ASCII, "
                         "at most %d characters)", v, KVR_LANE_CC_MAX - 1);
            rc = -1;
        } else {
            memcpy(c->lane_congestion, s, (size_t)n + 1);
        }
    }
    Py_DECREF(v);
    return rc;
}

/* state: None, or (ptrs, lens, item lens, components[, list mask]) of the
 * state buffers (state.c), appended to the aux buffers bufs[3..5] (ns[3] of them);
 * *comp gets the components.  Returns 0, or -1 with the error set. */
static int kvr_py_state_args(PyObject *state, uint64_t **bufs, uint32_t *ns, uint32_t **comp,
                             uint32_t *nstate, uint32_t *list_mask)
{
    if (state == Py_None) {
        return 0;
    }
    static const char *names[4] = {"state_data_ptrs", "state_data_lens", "state_item_lens",
                                   "state components"};
    uint64_t *lists[4] = {NULL, NULL, NULL, NULL};
    uint32_t n[4] = {0, 0, 0, 0};
    int rc = -1;
    Py_ssize_t parts = PyTuple_Check(state) ? PyTuple_GET_SIZE(state) : 0;
    if (parts != 4 && parts != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "state must be (ptrs, lens, item_lens, components[, list mask])");
        return -1;
    }
    if (parts == 5) { /* bit c: component c takes a list of slots (state.c) */
        unsigned long mask = PyLong_AsUnsignedLongMask(PyTuple_GET_ITEM(state, 4));
        if (PyErr_Occurred()) {
            return -1;
        }
        *list_mask = (uint32_t)mask;
    }
    for (int i = 0; i < 4; i++) {
        if (kvr_py_u64_list(PyTuple_GET_ITEM(state, i), names[i], &lists[i], &n[i]) < 0) {
            goto out;
        }
    }
    if (n[0] != n[1] || n[0] != n[2] || n[0] != n[3]) {
        PyErr_Format(PyExc_ValueError,
                     "state_data_ptrs, state_data_lens and state_item_lens have different "
                     "lengths (%u, %u, %u)", n[0], n[1], n[2]);
        goto out;
    }
    *comp = PyMem_Calloc(n[0] ? n[0] : 1, sizeof(uint32_t));
    if (*comp == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (int i = 0; i < 3; i++) {
        uint64_t *grown = PyMem_Realloc(bufs[3 + i], ((size_t)ns[3] + n[0] + 1) * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        memcpy(grown + ns[3], lists[i], (size_t)n[0] * sizeof(uint64_t));
        bufs[3 + i] = grown;
    }
    for (uint32_t i = 0; i < n[0]; i++) {
        (*comp)[i] = lists[3][i] > UINT32_MAX ? UINT32_MAX : (uint32_t)lists[3][i];
    }
    ns[3] += n[0];
    *nstate = n[0];
    rc = 0;
out:
    for (int i = 0; i < 4; i++) {
        PyMem_Free(lists[i]);
    }
    return rc;
}

/* Four uint32 from the sequence obj into *out[0..3] (None: nothing). */
static int kvr_py_u32_four(PyObject *obj, const char *what, uint32_t *out[4])
{
    if (obj == Py_None) {
        return 0;
    }
    uint64_t *v = NULL;
    uint32_t n = 0;
    if (kvr_py_u64_list(obj, what, &v, &n) < 0) {
        return -1;
    }
    int ok = n == 4;
    for (uint32_t i = 0; ok && i < 4; i++) {
        ok = v[i] <= UINT32_MAX;
    }
    for (uint32_t i = 0; ok && i < 4; i++) {
        *out[i] = (uint32_t)v[i];
    }
    PyMem_Free(v);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, what);
        return -1;
    }
    return 0;
}

/* rules: None, or the state buffers' slicing rules (stateslice.h), flat,
 * into *out (PyMem); the core checks them.  Returns 0, or -1 with the
 * error set. */
static int kvr_py_state_rules(PyObject *rules, uint32_t **out, uint32_t *n)
{
    uint64_t *list = NULL;
    int rc = -1;
    if (rules == Py_None) {
        return 0;
    }
    if (kvr_py_u64_list(rules, "state_rules", &list, n) < 0) {
        return -1;
    }
    *out = PyMem_Calloc(*n ? *n : 1, sizeof(uint32_t));
    if (*out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t i = 0; i < *n; i++) {
        if (list[i] > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "state_rules[%u] is over 2^32 - 1", i);
            goto done;
        }
        (*out)[i] = (uint32_t)list[i];
    }
    rc = 0;
done:
    PyMem_Free(list);
    return rc;
}

static int kvr_manager_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    static char *kwlist[] = {"mode", "engine_rank", "kv_data_ptrs", "kv_data_lens",
                             "kv_item_lens", "aux_data_ptrs", "aux_data_lens", "aux_item_lens",
                             "page_size", "host", "bootstrap_addr", "config", "mem_kinds",
                             "heads", "dp_rank", "state", "layers", "state_rules", NULL};
    int mode, rank;
    unsigned int dp_rank = 0, page_size = 1;
    PyObject *kp, *kl, *ki, *ap, *al, *ai, *cfg = Py_None, *kinds = Py_None, *heads = Py_None;
    PyObject *state = Py_None, *layers = Py_None, *rules = Py_None;
    const char *host = "127.0.0.1", *bs = "";
    if (self->engine != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Manager is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiOOOOOO|IssOOOIOOO", kwlist, &mode, &rank,
                                     &kp, &kl, &ki, &ap, &al, &ai, &page_size, &host, &bs, &cfg,
                                     &kinds, &heads, &dp_rank, &state, &layers, &rules)) {
        return -1;
    }
    kvr_engine_params_t p;
    memset(&p, 0, sizeof(p));
    uint64_t *bufs[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    uint64_t *kind_list = NULL;
    uint8_t *kind_bytes = NULL;
    uint32_t *state_comp = NULL, *state_rules = NULL;
    uint32_t ns[6] = {0, 0, 0, 0, 0, 0};
    PyObject *lists[6] = {kp, kl, ki, ap, al, ai};
    static const char *names[6] = {"kv_data_ptrs", "kv_data_lens", "kv_item_lens",
                                   "aux_data_ptrs", "aux_data_lens", "aux_item_lens"};
    int ret = -1;
    for (int i = 0; i < 6; i++) {
        if (kvr_py_u64_list(lists[i], names[i], &bufs[i], &ns[i]) < 0) {
            goto out;
        }
    }
    if (ns[0] != ns[1] || ns[0] != ns[2]) {
        PyErr_Format(PyExc_ValueError, "kv_data_ptrs, kv_data_lens and kv_item_lens have "
                     "different lengths (%u, %u, %u)", ns[0], ns[1], ns[2]);
        goto out;
    }
    if (ns[3] != ns[4] || ns[3] != ns[5]) {
        PyErr_Format(PyExc_ValueError, "aux_data_ptrs, aux_data_lens and aux_item_lens have "
                     "different lengths (%u, %u, %u)", ns[3], ns[4], ns[5]);
        goto out;
    }
    if (kvr_py_state_args(state, bufs, ns, &state_comp, &p.nstate, &p.state_list) < 0 ||
        kvr_py_state_rules(rules, &state_rules, &p.nstate_rules) < 0) {
        goto out;
    }
    p.state_comp = state_comp;
    p.state_rules = state_rules;
    p.mode = mode;
    p.rank = rank;
    p.dp_rank = dp_rank;
    p.host = host;
    p.bootstrap_addr = bs;
    p.page_size = page_size;
    p.nkv = ns[0];
    p.kv_ptrs = bufs[0];
    p.kv_lens = bufs[1];
    p.kv_item_lens = bufs[2];
    p.naux = ns[3];
    p.aux_ptrs = bufs[3];
    p.aux_lens = bufs[4];
    p.aux_item_lens = bufs[5];
    /* (tp_size, tp_rank, heads per rank, total heads); (pp_size, pp_rank,
     * start_layer, num_layers) */
    uint32_t *four[2][4] = {{&p.tp_size, &p.tp_rank, &p.heads, &p.total_heads},
                            {&p.pp_size, &p.pp_rank, &p.start_layer, &p.num_layers}};
    if (kvr_py_u32_four(heads, "heads must be (tp_size, tp_rank, heads, total_heads) of uint32",
                        four[0]) < 0 ||
        kvr_py_u32_four(layers, "layers must be (pp_size, pp_rank, start_layer, num_layers) of "
                        "uint32", four[1]) < 0) {
        goto out;
    }
    if (kinds != Py_None) {
        /* KVR_MEM_* per buffer, KV buffers first, then aux. */
        uint32_t nk = 0;
        if (kvr_py_u64_list(kinds, "mem_kinds", &kind_list, &nk) < 0) {
            goto out;
        }
        if (nk != ns[0] + ns[3]) {
            PyErr_Format(PyExc_ValueError, "mem_kinds has %u entries for %u buffers", nk,
                         ns[0] + ns[3]);
            goto out;
        }
        kind_bytes = PyMem_Calloc(nk ? nk : 1, 1);
        if (kind_bytes == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        for (uint32_t i = 0; i < nk; i++) {
            if (kind_list[i] > KVR_MEM_CUDA) {
                PyErr_Format(PyExc_ValueError, "mem_kinds[%u] is not a memory kind", i);
                goto out;
            }
            kind_bytes[i] = (uint8_t)kind_list[i];
        }
        p.kv_kinds = kind_bytes;
        p.aux_kinds = kind_bytes + ns[0];
    }
    kvr_config_default(&p.cfg);
    uint64_t v;
#define KVR_CFG_READ(field, max, is_bool)                                                 \
    v = p.cfg.field;                                                                          \
    if (kvr_cfg_get(cfg, #field, (max), &v) < 0) {                                            \
        goto out;                                                                             \
    }                                                                                         \
    p.cfg.field = (__typeof__(p.cfg.field))v;
    KVR_PY_CONFIG(KVR_CFG_READ)
#undef KVR_CFG_READ
    if (kvr_cfg_secret(cfg, &p.cfg) < 0 || kvr_cfg_congestion(cfg, &p.cfg) < 0) {
        goto out;
    }
    char err[512] = "";
    int rc;
    kvr_engine_t *e = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_engine_create(&p, &e, err, sizeof(err));
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        kvr_py_raise(rc, err);
        goto out;
    }
    self->engine = e;
    self->mode = mode;
    ret = 0;
out:
    for (int i = 0; i < 6; i++) {
        PyMem_Free(bufs[i]);
    }
    PyMem_Free(kind_list);
    PyMem_Free(kind_bytes);
    PyMem_Free(state_comp);
    PyMem_Free(state_rules);
    return ret;
}

static void kvr_manager_dealloc(PyObject *op)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->engine) {
        kvr_engine_t *e = self->engine;
        self->engine = NULL;
        Py_BEGIN_ALLOW_THREADS
        kvr_engine_close(e);
        kvr_engine_free(e);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *kvr_manager_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (self->engine) {
        kvr_engine_t *e = self->engine;
        Py_BEGIN_ALLOW_THREADS
        kvr_engine_close(e);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static int kvr_manager_check(kvr_py_manager_t *self)
{
    if (self->engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the manager is not initialised");
        return -1;
    }
    return 0;
}

static int kvr_dict_set_u64(PyObject *d, const char *k, uint64_t v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (o == NULL) {
        return -1;
    }
    int rc = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return rc;
}

/*
 * A histogram as a dict: "bounds" (the finite upper bounds, divided by
 * scale), "counts" (per bucket, not cumulative; one more than bounds, the
 * last is +Inf), "count" and "sum" (divided by scale).  Scale 1 gives ints.
 */
static PyObject *kvr_hist_dict(const kvr_hist_t *h, int kind, double scale)
{
    int n;
    const uint64_t *b = kvr_hist_bounds(kind, &n);
    PyObject *d = PyDict_New(), *bounds = PyTuple_New(n), *counts = PyList_New(n + 1), *o;
    if (d == NULL || bounds == NULL || counts == NULL) {
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        o = scale == 1.0 ? PyLong_FromUnsignedLongLong(b[i])
                         : PyFloat_FromDouble((double)b[i] / scale);
        if (o == NULL) {
            goto fail;
        }
        PyTuple_SET_ITEM(bounds, i, o);
    }
    for (int i = 0; i <= n; i++) {
        if ((o = PyLong_FromUnsignedLongLong(h->counts[i])) == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(counts, i, o);
    }
    o = scale == 1.0 ? PyLong_FromUnsignedLongLong(h->sum)
                     : PyFloat_FromDouble((double)h->sum / scale);
    if (o == NULL) {
        goto fail;
    }
    if (PyDict_SetItemString(d, "sum", o) < 0) {
        Py_DECREF(o);
        goto fail;
    }
    Py_DECREF(o);
    if (PyDict_SetItemString(d, "bounds", bounds) < 0 ||
        PyDict_SetItemString(d, "counts", counts) < 0 || kvr_dict_set_u64(d, "count", h->count) < 0) {
        goto fail;
    }
    Py_DECREF(bounds);
    Py_DECREF(counts);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(bounds);
    Py_XDECREF(counts);
    return NULL;
}

static int kvr_dict_set_hist(PyObject *d, const char *k, const kvr_hist_t *h, int kind,
                             double scale)
{
    PyObject *o = kvr_hist_dict(h, kind, scale);
    if (o == NULL) {
        return -1;
    }
    int rc = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return rc;
}

static PyObject *kvr_manager_stats(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    kvr_stats_t s;
    Py_BEGIN_ALLOW_THREADS
    kvr_engine_stats(self->engine, &s);
    Py_END_ALLOW_THREADS
    static const char *states[5] = {"Failed", "Bootstrapping", "WaitingForInput", "Transferring",
                                    "Success"};
    PyObject *d = PyDict_New(), *byst = PyDict_New(), *fails = PyDict_New();
    if (d == NULL || byst == NULL || fails == NULL) {
        goto fail;
    }
    for (int i = 0; i < 5; i++) {
        if (kvr_dict_set_u64(byst, states[i], s.rooms_by_state[i]) < 0) {
            goto fail;
        }
    }
    for (int i = 1; i < KVR_STATUS_LAST; i++) {
        if (kvr_dict_set_u64(fails, kvr_status_name(i), s.failures_by_code[i]) < 0) {
            goto fail;
        }
    }
    if (PyDict_SetItemString(d, "rooms_by_state", byst) < 0 ||
        PyDict_SetItemString(d, "failures_by_code", fails) < 0 ||
        kvr_dict_set_u64(d, "rooms_open", s.rooms_open) < 0 ||
        kvr_dict_set_u64(d, "rooms_draining", s.rooms_draining) < 0 ||
        kvr_dict_set_u64(d, "rooms_succeeded", s.rooms_succeeded) < 0 ||
        kvr_dict_set_u64(d, "rooms_force_drained", s.rooms_force_drained) < 0 ||
        kvr_dict_set_u64(d, "bytes_moved", s.bytes_moved) < 0 ||
        kvr_dict_set_u64(d, "rma_ops_posted", s.ops_posted) < 0 ||
        kvr_dict_set_u64(d, "ctrl_dropped", s.ctrl_dropped) < 0 ||
        kvr_dict_set_u64(d, "data_rejected", s.data_rejected) < 0 ||
        kvr_dict_set_u64(d, "heartbeats_missed", s.heartbeats_missed) < 0 ||
        kvr_dict_set_u64(d, "pending_requests", s.pending_requests) < 0 ||
        kvr_dict_set_u64(d, "peers", s.peers) < 0 ||
        kvr_dict_set_u64(d, "log_dropped", s.log_dropped) < 0 ||
        kvr_dict_set_u64(d, "data_packed", s.data_packed) < 0 ||
        kvr_dict_set_u64(d, "pack_cached_bytes", s.pack_cached_bytes) < 0 ||
        kvr_dict_set_u64(d, "poll_progressed", s.poll_progressed) < 0 ||
        kvr_dict_set_hist(d, "transfer_latency", &s.transfer_latency, KVR_HIST_LATENCY, 1e9) < 0 ||
        kvr_dict_set_hist(d, "room_ops", &s.room_ops, KVR_HIST_OPS, 1.0) < 0 ||
        kvr_dict_set_u64(d, "auth_rejected", s.auth_rejected) < 0 ||
        kvr_dict_set_u64(d, "auth_refused_by_peer", s.auth_refused_by_peer) < 0 ||
        kvr_dict_set_u64(d, "ctrl_oversized", s.ctrl_oversized) < 0 ||
        kvr_dict_set_u64(d, "data_foreign", s.data_foreign) < 0 ||
        kvr_dict_set_u64(d, "requests_refused", s.requests_refused) < 0 ||
        kvr_dict_set_u64(d, "data_rendezvous", s.data_rendezvous) < 0 ||
        kvr_dict_set_u64(d, "ucx_workers", s.ucx_workers) < 0 ||
        kvr_dict_set_u64(d, "ucx_workers_created", s.ucx_workers_created) < 0 ||
        kvr_dict_set_u64(d, "sib_fail_refused", s.sib_fail_refused) < 0 ||
        kvr_dict_set_u64(d, "staged_ops", s.staged_ops) < 0 ||
        kvr_dict_set_u64(d, "staged_bytes", s.staged_bytes) < 0 ||
        kvr_dict_set_u64(d, "staging_overflow", s.staging_overflow) < 0 ||
        kvr_dict_set_u64(d, "cma_reads", s.cma_reads) < 0 ||
        kvr_dict_set_u64(d, "cma_bytes", s.cma_bytes) < 0 ||
        kvr_dict_set_u64(d, "cma_helper_bytes", s.cma_helper_bytes) < 0 ||
        kvr_dict_set_u64(d, "staging_waits", s.staging_waits) < 0 ||
        kvr_dict_set_u64(d, "lane_messages", s.lane_messages) < 0 ||
        kvr_dict_set_u64(d, "lane_port", s.lane_port) < 0) {
        goto fail;
    }
    {
        const char *why = "";
        int path = kvr_engine_gpu_path(self->engine, &why);
        PyObject *pn = PyUnicode_FromString(kvr_gpu_path_name(path));
        PyObject *pw = pn ? PyUnicode_FromString(why) : NULL;
        int bad = pn == NULL || pw == NULL || PyDict_SetItemString(d, "gpu_path", pn) < 0 ||
                  PyDict_SetItemString(d, "gpu_path_why", pw) < 0;
        Py_XDECREF(pn);
        Py_XDECREF(pw);
        if (bad) {
            goto fail;
        }
    }
    Py_DECREF(byst);
    Py_DECREF(fails);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(byst);
    Py_XDECREF(fails);
    return NULL;
}

static PyObject *kvr_manager_get_closed(PyObject *op, void *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    return PyBool_FromLong(self->engine == NULL || kvr_engine_closed(self->engine));
}

static PyObject *kvr_manager_get_endpoint(PyObject *op, void *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    return PyUnicode_FromString(kvr_engine_endpoint(self->engine));
}

static PyObject *kvr_manager_get_epoch(PyObject *op, void *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(kvr_engine_epoch(self->engine));
}

static PyObject *kvr_manager_get_transport(PyObject *op, void *unused)
{
    (void)unused;
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    return PyUnicode_FromString(kvr_engine_transport(self->engine));
}

static PyObject *kvr_manager_set_siblings(PyObject *op, PyObject *arg)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(arg, "endpoints must be a sequence of str");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    const char **eps = PyMem_Calloc(n ? (size_t)n : 1, sizeof(char *));
    if (eps == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(fast, i);
        eps[i] = PyUnicode_Check(it) ? PyUnicode_AsUTF8(it) : NULL;
        if (eps[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "endpoints[%zd] must be a str", i);
            PyMem_Free(eps);
            Py_DECREF(fast);
            return NULL;
        }
    }
    char err[512] = "";
    int rc;
    kvr_engine_t *e = self->engine;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_engine_set_siblings(e, eps, (int)n, err, sizeof(err));
    Py_END_ALLOW_THREADS
    PyMem_Free(eps);
    Py_DECREF(fast);
    if (rc != 0) {
        return kvr_py_raise(rc, err);
    }
    Py_RETURN_NONE;
}

/* read_logs(timeout_ms) -> list of (level, text), or None once closed. */
static PyObject *kvr_manager_read_logs(PyObject *op, PyObject *arg)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    long timeout = PyLong_AsLong(arg);
    if (timeout == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int levels[16];
    char (*texts)[KVR_ENGINE_LOG_TEXT] = PyMem_Malloc(16 * KVR_ENGINE_LOG_TEXT);
    if (texts == NULL) {
        return PyErr_NoMemory();
    }
    int n;
    kvr_engine_t *e = self->engine;
    Py_BEGIN_ALLOW_THREADS
    n = kvr_engine_log_read(e, levels, texts, 16, (int)timeout);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        PyMem_Free(texts);
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("(iN)", levels[i], kvr_py_text(texts[i]));
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
    PyMem_Free(texts);
    return out;
}

static PyObject *kvr_manager_is_device(PyObject *op, PyObject *arg)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyBool_FromLong(i >= 0 && kvr_engine_buffer_is_device(self->engine, (uint32_t)i));
}

/* _test_corrupt_data(mode): tests only (csrc/testhook.h). */
static PyObject *kvr_manager_test_corrupt(PyObject *op, PyObject *arg)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (mode < 0 || mode >= KVR_TEST_CORRUPT_LAST) {
        PyErr_Format(PyExc_ValueError, "no corruption mode %ld", mode);
        return NULL;
    }
    kvr_engine_test_corrupt(self->engine, (int)mode);
    Py_RETURN_NONE;
}

/* _test_forge_data(tag, epoch): tests only (kvr_engine_test_forge). */
static PyObject *kvr_manager_test_forge(PyObject *op, PyObject *args)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    unsigned long long tag, epoch;
    if (kvr_manager_check(self) < 0 || !PyArg_ParseTuple(args, "KK", &tag, &epoch)) {
        return NULL;
    }
    kvr_engine_test_forge(self->engine, tag, epoch);
    Py_RETURN_NONE;
}

/* _test_room_tag(room): tests only (kvr_engine_test_room_tag). */
static PyObject *kvr_manager_test_room_tag(PyObject *op, PyObject *arg)
{
    kvr_py_manager_t *self = (kvr_py_manager_t *)op;
    if (kvr_manager_check(self) < 0) {
        return NULL;
    }
    unsigned long long room = PyLong_AsUnsignedLongLong(arg);
    if (room == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(kvr_engine_test_room_tag(self->engine, room));
}

static PyMethodDef kvr_manager_methods[] = {
    {"_test_forge_data", kvr_manager_test_forge, METH_VARARGS,
     "Tests only: the data messages this prefill posts name another room tag and epoch."},
    {"_test_room_tag", kvr_manager_test_room_tag, METH_O,
     "Tests only: the data tag of an open room (0 if none)."},
    {"_test_corrupt_data", kvr_manager_test_corrupt, METH_O,
     "Tests only: corrupt the headers of the data messages this prefill posts."},
    {"is_device", kvr_manager_is_device, METH_O,
     "True if buffer i (KV buffers first, then aux) is device memory."},
    {"read_logs", kvr_manager_read_logs, METH_O,
     "Wait up to timeout_ms for core log records; None once closed."},
    {"set_siblings", kvr_manager_set_siblings, METH_O,
     "Control endpoints of the other ranks of this instance."},
    {"close", kvr_manager_close, METH_NOARGS, "Stop the engine; idempotent."},
    {"stats", kvr_manager_stats, METH_NOARGS, "Counters and rooms by state."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef kvr_manager_getset[] = {
    {"closed", kvr_manager_get_closed, NULL, "True once close() ran.", NULL},
    {"endpoint", kvr_manager_get_endpoint, NULL, "Control endpoint.", NULL},
    {"epoch", kvr_manager_get_epoch, NULL, "Instance epoch.", NULL},
    {"transport", kvr_manager_get_transport, NULL, "Transport description.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot kvr_manager_slots[] = {
    {Py_tp_init, kvr_manager_init},
    {Py_tp_dealloc, kvr_manager_dealloc},
    {Py_tp_methods, kvr_manager_methods},
    {Py_tp_getset, kvr_manager_getset},
    {Py_tp_doc, "The C engine of one KVManager."},
    {0, NULL},
};

static PyType_Spec kvr_manager_spec = {
    "kvrecv._core.Manager",
    sizeof(kvr_py_manager_t),
    0,
    Py_TPFLAGS_DEFAULT,
    kvr_manager_slots,
};

int kvr_py_add_manager(PyObject *m, kvr_py_state_t *st)
{
    st->manager_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvr_manager_spec, NULL);
    if (st->manager_type == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(m, "Manager", (PyObject *)st->manager_type);
}
