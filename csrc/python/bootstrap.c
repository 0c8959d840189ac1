#include "module.h"

#include "../control.h"

typedef struct {
    PyObject_HEAD
    kvr_bootstrap_t *bs;
    int port;
} kvr_py_bootstrap_t;

static int kvr_bs_pyinit(PyObject *op, PyObject *args, PyObject *kwds)
{
    kvr_py_bootstrap_t *self = (kvr_py_bootstrap_t *)op;
    static char *kwlist[] = {"host", "port", "secret", NULL};
    const char *host = "127.0.0.1";
    int port = 8998;
    PyObject *secret_obj = Py_None;
    unsigned char secret[KVR_AUTH_SECRET_MAX];
    size_t secret_len = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|siO", kwlist, &host, &port, &secret_obj)) {
        return -1;
    }
    if (kvr_py_secret(secret_obj, "secret", secret, &secret_len) < 0) {
        return -1;
    }
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port=%d must be in [0, 65535]", port);
        return -1;
    }
    if (self->bs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BootstrapServer is already started");
        return -1;
    }
    char err[256] = "";
    int rc;
    kvr_config_t dflt; /* the managers' default bound of control queues */
    kvr_config_default(&dflt);
    Py_BEGIN_ALLOW_THREADS
    rc = kvr_bootstrap_start(host, port, secret, secret_len, dflt.ctrl_queue_bytes, &self->bs,
                             err, sizeof(err));
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetString(PyExc_OSError, err);
        return -1;
    }
    self->port = kvr_bootstrap_port(self->bs);
    return 0;
}

static void kvr_bs_stop(kvr_py_bootstrap_t *self)
{
    if (self->bs) {
        kvr_bootstrap_t *bs = self->bs;
        self->bs = NULL;
        Py_BEGIN_ALLOW_THREADS
        kvr_bootstrap_stop(bs);
        Py_END_ALLOW_THREADS
    }
}

static void kvr_bs_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    kvr_bs_stop((kvr_py_bootstrap_t *)op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *kvr_bs_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_bs_stop((kvr_py_bootstrap_t *)op);
    Py_RETURN_NONE;
}

static PyObject *kvr_bs_counts(PyObject *op, PyObject *unused)
{
    (void)unused;
    kvr_py_bootstrap_t *self = (kvr_py_bootstrap_t *)op;
    kvr_bootstrap_counts_t c;
    memset(&c, 0, sizeof(c));
    if (self->bs) {
        kvr_bootstrap_counts(self->bs, &c);
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:s}", "registrations", (unsigned long long)c.registered,
                         "dropped", (unsigned long long)c.dropped, "auth_rejected",
                         (unsigned long long)c.auth_rejected, "last_auth_rejected",
                         c.last_rejected);
}

static PyObject *kvr_bs_get_port(PyObject *op, void *unused)
{
    (void)unused;
    return PyLong_FromLong(((kvr_py_bootstrap_t *)op)->port);
}

static PyMethodDef kvr_bs_methods[] = {
    {"close", kvr_bs_close, METH_NOARGS, "Stop the server; idempotent."},
    {"stats", kvr_bs_counts, METH_NOARGS, "Registrations seen and messages dropped."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef kvr_bs_getset[] = {
    {"port", kvr_bs_get_port, NULL, "The bound port.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot kvr_bs_slots[] = {
    {Py_tp_init, kvr_bs_pyinit},
    {Py_tp_dealloc, kvr_bs_dealloc},
    {Py_tp_methods, kvr_bs_methods},
    {Py_tp_getset, kvr_bs_getset},
    {Py_tp_doc, "The rendezvous where prefill ranks register and decode ranks look them up."},
    {0, NULL},
};

static PyType_Spec kvr_bs_spec = {
    "kvrecv._core.BootstrapServer",
    sizeof(kvr_py_bootstrap_t),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    kvr_bs_slots,
};

int kvr_py_add_bootstrap(PyObject *m, kvr_py_state_t *st)
{
    st->bootstrap_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &kvr_bs_spec, NULL);
    if (st->bootstrap_type == NULL) {
        return -1;
    }
    return PyModule_AddObjectRef(m, "BootstrapServer", (PyObject *)st->bootstrap_type);
}
