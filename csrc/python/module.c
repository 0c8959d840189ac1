#include "module.h"

#include <string.h>

#include "../cuda.h"
#include "../transport.h"
#include "../wire.h"

kvr_py_state_t *kvr_py_state_of_type(PyTypeObject *tp)
{
    PyObject *mod = PyType_GetModuleByDef(tp, &kvr_py_module_def);
    return mod ? PyModule_GetState(mod) : NULL;
}

int kvr_py_secret(PyObject *v, const char *what, unsigned char *out, size_t *len)
{
    const char *data;
    Py_ssize_t n;
    *len = 0;
    if (v == Py_None) {
        return 0;
    }
    if (PyUnicode_Check(v)) {
        data = PyUnicode_AsUTF8AndSize(v, &n);
        if (data == NULL) {
            return -1;
        }
    } else if (PyBytes_Check(v)) {
        data = PyBytes_AS_STRING(v);
        n = PyBytes_GET_SIZE(v);
    } else if (PyByteArray_Check(v)) {
        data = PyByteArray_AS_STRING(v);
        n = PyByteArray_GET_SIZE(v);
    } else {
        PyErr_Format(PyExc_TypeError, "%s must be a str or bytes, not %s", what,
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    if (n > KVR_AUTH_SECRET_MAX) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes long, more than %d", what, n,
                     KVR_AUTH_SECRET_MAX);
        return -1;
    }
    memcpy(out, data, (size_t)n);
    *len = (size_t)n;
    return 0;
}

PyObject *kvr_py_raise(int rc, const char *err)
{
    switch (rc) {
    case KVR_EVALUE:
        PyErr_SetString(PyExc_ValueError, err);
        break;
    case KVR_ENOMEM:
        PyErr_SetString(PyExc_MemoryError, err);
        break;
    default:
        PyErr_SetString(PyExc_RuntimeError, err);
        break;
    }
    return NULL;
}

/* ---- KVTransferError ---- */

/*
 * KVTransferError(bootstrap_room, failure_reason, is_from_another_rank=False,
 *                 *, code=None, origin_rank=None, peer=None)
 * Attributes live in the instance __dict__ and args holds the positional
 * ones, so BaseException's pickling (type, args, __dict__) keeps them all.
 */
static int kvr_err_init(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"bootstrap_room", "failure_reason", "is_from_another_rank", "code",
                             "origin_rank", "peer", NULL};
    PyObject *room, *reason, *another = Py_False, *code = Py_None, *origin = Py_None,
                                      *peer = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$OOO", kwlist, &room, &reason, &another,
                                     &code, &origin, &peer)) {
        return -1;
    }
    PyObject *pos = PyTuple_Pack(3, room, reason, another);
    if (pos == NULL) {
        return -1;
    }
    if (PyObject_SetAttrString(self, "args", pos) < 0) {
        Py_DECREF(pos);
        return -1;
    }
    Py_DECREF(pos);
    int truth = PyObject_IsTrue(another);
    if (truth < 0) {
        return -1;
    }
    PyObject *code_v = code;
    if (code == Py_None) {
        code_v = PyObject_GetAttrString((PyObject *)Py_TYPE(self), "default_code");
        if (code_v == NULL) {
            return -1;
        }
    } else {
        Py_INCREF(code_v);
    }
    int rc = 0;
    rc |= PyObject_SetAttrString(self, "bootstrap_room", room);
    rc |= PyObject_SetAttrString(self, "failure_reason", reason);
    rc |= PyObject_SetAttrString(self, "is_from_another_rank", truth ? Py_True : Py_False);
    rc |= PyObject_SetAttrString(self, "code", code_v);
    rc |= PyObject_SetAttrString(self, "origin_rank", origin);
    rc |= PyObject_SetAttrString(self, "peer", peer);
    Py_DECREF(code_v);
    return rc ? -1 : 0;
}

static PyObject *kvr_err_str(PyObject *self)
{
    PyObject *room = PyObject_GetAttrString(self, "bootstrap_room");
    PyObject *reason = room ? PyObject_GetAttrString(self, "failure_reason") : NULL;
    PyObject *out = NULL;
    if (room && reason) {
        out = PyUnicode_FromFormat("KVTransferError(bootstrap_room=%S): %S", room, reason);
    }
    Py_XDECREF(room);
    Py_XDECREF(reason);
    return out;
}

static PyObject *kvr_err_reduce(PyObject *self, PyObject *unused)
{
    (void)unused;
    PyObject *args = PyObject_GetAttrString(self, "args");
    PyObject *dict = args ? PyObject_GenericGetDict(self, NULL) : NULL;
    PyObject *out = NULL;
    if (args && dict) {
        out = Py_BuildValue("(OOO)", (PyObject *)Py_TYPE(self), args, dict);
    }
    Py_XDECREF(args);
    Py_XDECREF(dict);
    return out;
}

static PyMethodDef kvr_err_methods[] = {
    {"__reduce__", kvr_err_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot kvr_err_slots[] = {
    {Py_tp_init, kvr_err_init},
    {Py_tp_str, kvr_err_str},
    {Py_tp_methods, kvr_err_methods},
    {Py_tp_doc, "A KV transfer failed.  Attributes: bootstrap_room, failure_reason, "
                "is_from_another_rank, code, origin_rank, peer."},
    {0, NULL},
};

/* Subclass names per code, from the status table. */
static const char *const kvr_err_names[KVR_STATUS_LAST] = {
#define KVR_STATUS_PYCLASS(name, str, pyclass, msg) pyclass,
    KVR_STATUS_MAP(KVR_STATUS_PYCLASS)
#undef KVR_STATUS_PYCLASS
};

static PyObject *kvr_make_error_type(PyObject *m, const char *name, PyObject *base,
                                     const char *code)
{
    char qual[96];
    PyOS_snprintf(qual, sizeof(qual), "kvrecv.%s", name);
    PyType_Spec spec = {qual, 0, 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, kvr_err_slots};
    PyObject *bases = PyTuple_Pack(1, base);
    if (bases == NULL) {
        return NULL;
    }
    PyObject *tp = PyType_FromModuleAndSpec(m, &spec, bases);
    Py_DECREF(bases);
    if (tp == NULL) {
        return NULL;
    }
    PyObject *cv = code ? PyUnicode_FromString(code) : (Py_INCREF(Py_None), Py_None);
    if (cv == NULL || PyObject_SetAttrString(tp, "default_code", cv) < 0 ||
        PyModule_AddObjectRef(m, name, tp) < 0) {
        Py_XDECREF(cv);
        Py_DECREF(tp);
        return NULL;
    }
    Py_DECREF(cv);
    return tp;
}

PyObject *kvr_py_text(const char *s)
{
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

PyObject *kvr_py_error_new(kvr_py_state_t *st, uint64_t room, const kvr_failure_t *f,
                           int is_from_another_rank)
{
    int code = f->code > KVR_OK && f->code < KVR_STATUS_LAST ? f->code : KVR_REMOTE;
    PyObject *cls = st->error_by_code[code];
    PyObject *args = Py_BuildValue("(KNi)", (unsigned long long)room, kvr_py_text(f->reason),
                                   is_from_another_rank);
    if (args == NULL) {
        return NULL;
    }
    PyObject *kw = Py_BuildValue("{s:s}", "code", kvr_status_name(code));
    if (kw == NULL) {
        Py_DECREF(args);
        return NULL;
    }
    if (f->origin_rank >= 0) {
        PyObject *o = PyLong_FromLong(f->origin_rank);
        if (o == NULL || PyDict_SetItemString(kw, "origin_rank", o) < 0) {
            Py_XDECREF(o);
            goto fail;
        }
        Py_DECREF(o);
    }
    if (f->peer[0]) {
        PyObject *p = kvr_py_text(f->peer);
        if (p == NULL || PyDict_SetItemString(kw, "peer", p) < 0) {
            Py_XDECREF(p);
            goto fail;
        }
        Py_DECREF(p);
    }
    PyObject *exc = PyObject_Call(cls, args, kw);
    Py_DECREF(args);
    Py_DECREF(kw);
    return exc;
fail:
    Py_DECREF(args);
    Py_DECREF(kw);
    return NULL;
}

/* _set_poll_values(members): KVPoll members indexed by value. */
static PyObject *kvr_set_poll_values(PyObject *m, PyObject *seq)
{
    kvr_py_state_t *st = PyModule_GetState(m);
    if (!PySequence_Check(seq) || PySequence_Size(seq) != 5) {
        PyErr_SetString(PyExc_TypeError, "expected the 5 KVPoll members in value order");
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        PyObject *v = PySequence_GetItem(seq, i);
        if (v == NULL) {
            return NULL;
        }
        Py_XSETREF(st->poll_values[i], v);
    }
    Py_RETURN_NONE;
}

static PyObject *kvr_status_names(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return NULL;
    }
    for (int i = 1; i < KVR_STATUS_LAST; i++) {
        PyObject *v = PyUnicode_FromString(kvr_status_message(i));
        if (v == NULL || PyDict_SetItemString(d, kvr_status_name(i), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* cuda_info() -> {loaded, path, error, runtime_version, devices, device_error} */
static PyObject *kvr_cuda_info(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char err[512] = "", derr[256] = "";
    int rc, n = -1;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_cuda_load(err, sizeof(err));
    if (rc == 0) {
        n = kvr_cuda_device_count(derr, sizeof(derr));
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:O,s:s,s:s,s:i,s:i,s:s}", "loaded", rc == 0 ? Py_True : Py_False,
                         "path", kvr_cuda_path(), "error", err, "runtime_version",
                         kvr_cuda_runtime_version(), "devices", n < 0 ? 0 : n, "device_error",
                         derr);
}

/* ucx_memory_types() -> (["host", ...], supports_cuda) */
static PyObject *kvr_ucx_memory_types(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char names[128] = "", err[256] = "";
    unsigned mask = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_tp_probe_memory_types(&mask, names, sizeof(names), err, sizeof(err));
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    return Py_BuildValue("(sO)", names, (mask & KVR_TP_MEM_CUDA) ? Py_True : Py_False);
}

static PyMethodDef kvr_module_methods[] = {
    {"cuda_info", kvr_cuda_info, METH_NOARGS, "Loads the CUDA runtime if it can; what it found."},
    {"ucx_memory_types", kvr_ucx_memory_types, METH_NOARGS,
     "Memory types UCX supports here (comma separated) and whether cuda is one."},
    {"_set_poll_values", kvr_set_poll_values, METH_O, "Install the KVPoll members."},
    {"failure_codes", kvr_status_names, METH_NOARGS, "Failure codes and their meaning."},
    {"config_defaults", kvr_py_config_defaults, METH_NOARGS,
     "The core's default of every numeric KVConfig field."},
    {NULL, NULL, 0, NULL},
};

static int kvr_module_exec(PyObject *m)
{
    kvr_py_state_t *st = PyModule_GetState(m);
    st->error_base = kvr_make_error_type(m, "KVTransferError", PyExc_Exception, NULL);
    if (st->error_base == NULL) {
        return -1;
    }
    for (int i = 1; i < KVR_STATUS_LAST; i++) {
        st->error_by_code[i] =
            kvr_make_error_type(m, kvr_err_names[i], st->error_base, kvr_status_name(i));
        if (st->error_by_code[i] == NULL) {
            return -1;
        }
    }
    if (kvr_py_add_manager(m, st) < 0 || kvr_py_add_room(m, st) < 0 ||
        kvr_py_add_bootstrap(m, st) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(m, "MODE_PREFILL", KVR_MODE_PREFILL) < 0 ||
        PyModule_AddIntConstant(m, "MODE_DECODE", KVR_MODE_DECODE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DP_RANK", KVR_WIRE_MAX_DP_PP) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PP", KVR_MAX_PP) < 0) {
        return -1;
    }
    return 0;
}

static int kvr_module_traverse(PyObject *m, visitproc visit, void *arg)
{
    kvr_py_state_t *st = PyModule_GetState(m);
    Py_VISIT(st->manager_type);
    Py_VISIT(st->room_type);
    Py_VISIT(st->bootstrap_type);
    Py_VISIT(st->error_base);
    for (int i = 0; i < KVR_STATUS_LAST; i++) {
        Py_VISIT(st->error_by_code[i]);
    }
    for (int i = 0; i < 5; i++) {
        Py_VISIT(st->poll_values[i]);
    }
    return 0;
}

static int kvr_module_clear(PyObject *m)
{
    kvr_py_state_t *st = PyModule_GetState(m);
    Py_CLEAR(st->manager_type);
    Py_CLEAR(st->room_type);
    Py_CLEAR(st->bootstrap_type);
    Py_CLEAR(st->error_base);
    for (int i = 0; i < KVR_STATUS_LAST; i++) {
        Py_CLEAR(st->error_by_code[i]);
    }
    for (int i = 0; i < 5; i++) {
        Py_CLEAR(st->poll_values[i]);
    }
    return 0;
}

static void kvr_module_free(void *m)
{
    kvr_module_clear(m);
}

static PyModuleDef_Slot kvr_module_slots[] = {
    {Py_mod_exec, kvr_module_exec},
    {0, NULL},
};

PyModuleDef kvr_py_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvrecv._core",
    .m_doc = "The C core of kvrecv.",
    .m_size = sizeof(kvr_py_state_t),
    .m_methods = kvr_module_methods,
    .m_slots = kvr_module_slots,
    .m_traverse = kvr_module_traverse,
    .m_clear = kvr_module_clear,
    .m_free = kvr_module_free,
};

PyMODINIT_FUNC PyInit__core(void);
PyMODINIT_FUNC PyInit__core(void)
{
    return PyModuleDef_Init(&kvr_py_module_def);
}
