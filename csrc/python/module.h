/*
 * The CPython binding of the kvrecv core: module kvrecv._core.
 *
 * module.c    module state, multi-phase init, the exception hierarchy
 * manager.c   _core.Manager (one kvr_engine_t)
 * room.c      _core.Room (one room handle; KVSender/KVReceiver subclass it)
 * bootstrap.c _core.BootstrapServer
 *
 * The GIL is released around every call that can wait: engine creation and
 * close, and any call that takes the engine lock.  poll() takes no lock.
 */
#ifndef KVR_PY_MODULE_H
#define KVR_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../engine.h"
#include "../registry.h"

typedef struct {
    PyTypeObject *manager_type;
    PyTypeObject *room_type;
    PyTypeObject *bootstrap_type;
    PyObject *error_base;                   /* KVTransferError */
    PyObject *error_by_code[KVR_STATUS_LAST]; /* subclasses; [KVR_OK] unused */
    PyObject *poll_values[5];               /* KVPoll members, set from Python */
} kvr_py_state_t;

extern PyModuleDef kvr_py_module_def;

kvr_py_state_t *kvr_py_state_of_type(PyTypeObject *tp);

/* Reads a secret (str: its UTF-8 bytes; bytes or bytearray; None or empty:
 * none) into out (KVR_AUTH_SECRET_MAX bytes).  Returns 0, or -1 with a
 * TypeError or ValueError naming the argument as what. */
int kvr_py_secret(PyObject *v, const char *what, unsigned char *out, size_t *len);

/* config_defaults() -> {field: default} of the numeric KVConfig fields,
 * from kvr_config_default (manager.c). */
PyObject *kvr_py_config_defaults(PyObject *m, PyObject *unused);

/* Raises the built-in exception matching a KVR_E* code with message err. */
PyObject *kvr_py_raise(int rc, const char *err);

/* A C string as str: UTF-8, bytes that are not (a peer's) replaced by
 * U+FFFD, so text from the wire never raises UnicodeDecodeError. */
PyObject *kvr_py_text(const char *s);

/* Builds (without raising) a KVTransferError subclass instance for a failure
 * record. */
PyObject *kvr_py_error_new(kvr_py_state_t *st, uint64_t room, const kvr_failure_t *f,
                           int is_from_another_rank);

int kvr_py_add_manager(PyObject *m, kvr_py_state_t *st);
int kvr_py_add_room(PyObject *m, kvr_py_state_t *st);
int kvr_py_add_bootstrap(PyObject *m, kvr_py_state_t *st);

/* _core.Manager instances (room.c needs the engine). */
typedef struct {
    PyObject_HEAD
    kvr_engine_t *engine;
    int mode;
} kvr_py_manager_t;

#endif
