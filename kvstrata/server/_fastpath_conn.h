/* The connection's read callbacks in C: ConnBase, the base type of server.connection.Connection
 * (included by _fastpath.c, which it shares the compiled path's run with).
 *
 * uvloop (and asyncio) call a buffered protocol's get_buffer and buffer_updated for every read.
 * ConnBase keeps the connection state those two callbacks test as C fields (Python reads and
 * writes them as ordinary attributes: _busy, _closing, ..., the `_in` Intake, the `_out` list),
 * answers the common read itself — the lean read of server.fastread (an idle connection, small
 * commands the compiled path runs, one reply buffer written at once) — and hands every other
 * read to the Python twins, Connection._get_buffer and Connection._buffer_updated, before it
 * has changed anything. What it does for a lean read is what Connection._buffer_updated and
 * FastRead._run_lean do, step for step (tests/test_lean_read.py compares the two, write for
 * write and counter for counter); the Python twins are the reference and the only path
 * without the extension.
 */

static Py_ssize_t conn_flush_parts = 48, conn_max_out = 256 * 1024;  /* set_conn_limits */

typedef struct {
    PyObject_HEAD
    PyObject *server, *client, *transport, *in, *out, *queue, *error, *values, *slow_micros;
    double slow;
    char busy, closing, close_after, read_paused, write_paused, unsent, resp3;
} ConnBase;

static PyObject *c_get_buffer_py, *c_buffer_updated_py, *c_process, *c_flush, *c_after_write,
    *c_slow_threshold, *c_slowlog_record, *c_write, *c_direct, *c_grow, *c_partial, *c_yielded,
    *c_overflow, *c_start, *c_end, *c_buf, *c_mv, *c_loading, *c_monitors, *c_cmdstats,
    *c_histograms, *c_authenticated, *c_last_interaction, *c_last_command,
    *c_in_bytes, *c_processed, *c_out_bytes, *c_fast_path, *c_slowlog_setting, *c_max_bulk,
    *c_max_args, *c_fastpath, *c_stats;

/* A __slots__ attribute read through its offset, found once per type (getattr otherwise). */
typedef struct {
    PyTypeObject *tp;
    Py_ssize_t at;
} SlotCache;

static Py_ssize_t cached_offset(PyObject *obj, SlotCache *c, PyObject *name) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (c->tp != tp) {
        Py_ssize_t at = slot_offset((PyObject *)tp, name);
        if (at < 0) PyErr_Clear();
        c->tp = tp;  /* borrowed: compared, never dereferenced once the type could be gone */
        c->at = at;
    }
    return c->at;
}

/* obj.<name> as a borrowed reference (NULL with an error set, or AttributeError); the slot's
 * object lives as long as obj holds it, which the caller ensures for the call. */
static PyObject *sgetb(PyObject *obj, SlotCache *c, PyObject *name) {
    Py_ssize_t at = cached_offset(obj, c, name);
    if (at >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + at);
        if (v == NULL) PyErr_SetObject(PyExc_AttributeError, name);
        return v;
    }
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v != NULL) Py_DECREF(v);  /* as borrowed: obj (a __dict__) still holds it */
    return v;
}

static int sset(PyObject *obj, SlotCache *c, PyObject *name, PyObject *value) {
    Py_ssize_t at = cached_offset(obj, c, name);
    return slot_set(obj, at, name, value);
}

static int sadd(PyObject *obj, SlotCache *c, PyObject *name, Py_ssize_t n) {
    return add_count(obj, cached_offset(obj, c, name), name, n);
}

static SlotCache sc_direct, sc_grow, sc_partial, sc_yielded, sc_overflow, sc_start, sc_end,
    sc_buf, sc_mv, sc_auth, sc_inter, sc_cmds, sc_lastcmd, sc_in_bytes, sc_processed,
    sc_out_bytes;

/* 1: obj is None; 0: it is not; -1: error */
static int is_none(PyObject *obj, SlotCache *c, PyObject *name) {
    PyObject *v = sgetb(obj, c, name);
    return v == NULL ? -1 : v == Py_None;
}

static int truthy(PyObject *obj, SlotCache *c, PyObject *name) {
    PyObject *v = sgetb(obj, c, name);
    return v == NULL ? -1 : PyObject_IsTrue(v);
}

/* obj.<name> (a plain attribute) is true */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static Py_ssize_t ssize_of(PyObject *obj, SlotCache *c, PyObject *name) {
    PyObject *v = sgetb(obj, c, name);
    return v == NULL ? -1 : PyLong_AsSsize_t(v);
}

static int set_ssize(PyObject *obj, SlotCache *c, PyObject *name, Py_ssize_t n) {
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL) return -1;
    int rc = sset(obj, c, name, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *value_of(PyObject *values, PyObject *key) {
    PyObject *v = PyDict_CheckExact(values) ? PyDict_GetItemWithError(values, key)
                                            : NULL;
    if (v == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return v;  /* borrowed */
}

/* -- get_buffer -------------------------------------------------------------------------- */

/* The whole buffer of an idle intake (Intake.get_buffer's common case), else the Python twin. */
static PyObject *cb_get_buffer(ConnBase *self, PyObject *sizehint) {
    PyObject *in = self->in;
    if (in != NULL && in != Py_None) {
        int idle = ssize_of(in, &sc_end, c_end) == 0 && is_none(in, &sc_direct, c_direct) == 1
                   && is_none(in, &sc_grow, c_grow) == 1
                   && is_none(in, &sc_partial, c_partial) == 1
                   && truthy(in, &sc_overflow, c_overflow) == 0;
        if (PyErr_Occurred()) return NULL;
        if (idle) {
            PyObject *mv = sgetb(in, &sc_mv, c_mv);
            Py_XINCREF(mv);
            return mv;
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, c_get_buffer_py, sizehint);
}

/* -- buffer_updated ---------------------------------------------------------------------- */

/* 1: Connection._buffer_updated would take the lean path for this read (see its test) and the
 * bytes land in the buffer (Intake.received's common case); 0: it would not; -1: error. */
static int lean_read(ConnBase *self, PyObject **fast) {
    if (self->in == NULL || self->in == Py_None
        || self->server == NULL || self->client == NULL || self->values == NULL
        || self->transport == NULL || self->transport == Py_None)
        return 0;
    if (self->busy || self->write_paused || self->read_paused || self->closing
        || self->close_after)
        return 0;
    if (self->error != NULL && self->error != Py_None) return 0;
    if (self->out == NULL || !PyList_CheckExact(self->out) || PyList_GET_SIZE(self->out))
        return 0;
    Py_ssize_t queued = self->queue == NULL ? 0 : PyObject_Size(self->queue);
    if (queued != 0) return queued < 0 ? -1 : 0;
    PyObject *in = self->in;
    int t;
    if ((t = is_none(in, &sc_direct, c_direct)) != 1) return t;
    if ((t = is_none(in, &sc_grow, c_grow)) != 1) return t;
    if ((t = is_none(in, &sc_partial, c_partial)) != 1) return t;
    if ((t = truthy(in, &sc_yielded, c_yielded)) != 0) return t < 0 ? -1 : 0;
    if ((t = truthy(self->client, &sc_auth, c_authenticated)) != 1) return t;
    PyObject *server = self->server;
    if ((t = attr_true(server, c_loading)) != 0) return t < 0 ? -1 : 0;
    if ((t = attr_true(server, c_monitors)) != 0) return t < 0 ? -1 : 0;
    PyObject *cmdstats = PyObject_GetAttr(server, c_cmdstats);
    if (cmdstats == NULL) return -1;
    t = attr_true(cmdstats, c_histograms);
    Py_DECREF(cmdstats);
    if (t != 0) return t < 0 ? -1 : 0;
    PyObject *on = value_of(self->values, c_fast_path);
    if (on == NULL) return -1;
    if ((t = PyObject_IsTrue(on)) != 1) return t;
    /* server.fastpath, read as the Python path reads it; anything but the compiled path
     * itself (None, a test's wrapper) goes the Python way */
    PyObject *fp = PyObject_GetAttr(server, c_fastpath);
    if (fp == NULL) return -1;
    if (!Py_IS_TYPE(fp, &FastPathType) || ((FastPath *)fp)->keyspace == NULL) {
        Py_DECREF(fp);
        return 0;
    }
    *fast = fp;
    return 1;
}

/* The lean read (Connection._buffer_updated, then FastRead._run_lean), for a read lean_read
 * accepted; 0, or -1 with an error set. */
static int cb_lean(ConnBase *self, FastPath *fast, Py_ssize_t nbytes) {
    PyObject *stats = PyObject_GetAttr(self->server, c_stats);
    if (stats == NULL) return -1;
    PyObject *in = self->in, *client = self->client;
    PyObject *me = (PyObject *)self;
    Py_INCREF(in);  /* a Python call below may rebind them: hold them for the read */
    Py_INCREF(client);
    int rc = -1;
    PyObject *r = NULL, *slow_hit = NULL;
    Out o;
    out_init(&o);
    /* Connection._buffer_updated */
    if (sadd(stats, &sc_in_bytes, c_in_bytes, nbytes) < 0) goto done;
    PyObject *now = PyFloat_FromDouble(now_s());  /* CLOCK_MONOTONIC: time.monotonic's */
    if (now == NULL) goto done;
    int set = sset(client, &sc_inter, c_last_interaction, now);
    Py_DECREF(now);
    if (set < 0) goto done;
    Py_ssize_t start = ssize_of(in, &sc_start, c_start), end = ssize_of(in, &sc_end, c_end);
    if (PyErr_Occurred()) goto done;
    end += nbytes;
    if (set_ssize(in, &sc_end, c_end, end) < 0) goto done;
    /* FastRead._run_lean */
    PyObject *values = self->values;
    PyObject *micros = value_of(values, c_slowlog_setting);
    if (micros == NULL) goto done;
    int same = PyObject_RichCompareBool(micros, self->slow_micros ? self->slow_micros : Py_None,
                                        Py_EQ);
    if (same < 0) goto done;
    if (!same) {
        r = PyObject_CallMethodOneArg(me, c_slow_threshold, values);
        if (r == NULL) goto done;
        Py_CLEAR(r);
    }
    PyObject *max_bulk = value_of(values, c_max_bulk), *max_args = value_of(values, c_max_args);
    if (max_bulk == NULL || max_args == NULL) goto done;
    Limits lim = {PyLong_AsSsize_t(max_bulk), PyLong_AsSsize_t(max_args), conn_max_out,
                  self->resp3, self->slow};
    if (PyErr_Occurred()) goto done;
    PyObject *buf = sgetb(in, &sc_buf, c_buf);
    if (buf == NULL) goto done;
    if (!PyByteArray_CheckExact(buf)) {
        PyErr_SetString(PyExc_TypeError, "the intake buffer is not a bytearray");
        goto done;
    }
    Py_ssize_t pos = start, ran = 0;
    int last = -1;
    if (end > PyByteArray_GET_SIZE(buf) || start < 0 || start > end) {
        PyErr_SetString(PyExc_ValueError, "pos out of the buffer");
        goto done;
    }
    Py_INCREF(buf);  /* the run calls into Python (move_to_end, get_now): keep the bytes */
    int run = fp_run_core(fast, PyByteArray_AS_STRING(buf), &pos, end, &lim,
                          &o, &ran, &last, &slow_hit);
    Py_DECREF(buf);
    if (run < 0) goto done;
    if (!ran) {
        PyObject *at = PyLong_FromSsize_t(start);
        r = at == NULL ? NULL : PyObject_CallMethodOneArg(me, c_process, at);
        Py_XDECREF(at);
        rc = r == NULL ? -1 : 0;
        goto done;
    }
    if (sadd(stats, &sc_processed, c_processed, ran) < 0) goto done;
    if (sadd(client, &sc_cmds, s_commands, ran) < 0) goto done;
    if (sset(client, &sc_lastcmd, c_last_command, s_names[last]) < 0) goto done;
    if (slow_hit != NULL) {
        r = PyObject_CallMethodObjArgs(self->server, c_slowlog_record,
                                       PyTuple_GET_ITEM(slow_hit, 0),
                                       PyTuple_GET_ITEM(slow_hit, 1), client, NULL);
        if (r == NULL) goto done;
        Py_CLEAR(r);
    }
    PyObject *data = PyBytes_FromStringAndSize(o.buf, o.len);
    if (data == NULL) goto done;
    if (pos != end || o.len == 0 || self->out == NULL || !PyList_CheckExact(self->out)
        || PyList_GET_SIZE(self->out) != 0) {
        /* a command for the Python path follows: as _run_lean, with the replies in _out */
        PyObject *out = self->out;
        int added = out != NULL && PyList_CheckExact(out) ? PyList_Append(out, data) : -1;
        if (added < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "the connection's _out is not a list");
        Py_DECREF(data);
        if (added < 0) goto done;
        if (set_ssize(in, &sc_start, c_start, pos) < 0) goto done;
        if (PyList_GET_SIZE(out) >= conn_flush_parts || o.len >= conn_max_out) {
            r = PyObject_CallMethodNoArgs(me, c_flush);
            if (r == NULL) goto done;
            Py_CLEAR(r);
        }
        r = PyObject_CallMethodNoArgs(me, c_process);
        rc = r == NULL ? -1 : 0;
        goto done;
    }
    PyObject *zero = PyLong_FromLong(0);  /* the small int: cannot fail */
    int moved = sset(in, &sc_start, c_start, zero) < 0 || sset(in, &sc_end, c_end, zero) < 0;
    Py_DECREF(zero);
    if (moved || sadd(stats, &sc_out_bytes, c_out_bytes, o.len) < 0) {
        Py_DECREF(data);
        goto done;
    }
    PyObject *transport = self->transport;
    Py_INCREF(transport);
    r = PyObject_CallMethodOneArg(transport, c_write, data);
    Py_DECREF(transport);
    Py_DECREF(data);
    if (r == NULL) goto done;
    Py_CLEAR(r);
    if (self->unsent) {
        r = PyObject_CallMethodNoArgs(me, c_after_write);
        if (r == NULL) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(r);
    Py_XDECREF(slow_hit);
    out_free(&o);
    Py_DECREF(in);
    Py_DECREF(client);
    Py_DECREF(stats);
    return rc;
}

static PyObject *cb_buffer_updated(ConnBase *self, PyObject *nbytes) {
    PyObject *fast = NULL;
    int lean = lean_read(self, &fast);
    if (lean < 0) return NULL;
    if (!lean) return PyObject_CallMethodOneArg((PyObject *)self, c_buffer_updated_py, nbytes);
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    int rc = n == -1 && PyErr_Occurred() ? -1 : cb_lean(self, (FastPath *)fast, n);
    Py_DECREF(fast);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- the type ---------------------------------------------------------------------------- */

static int cb_traverse(ConnBase *self, visitproc visit, void *arg) {
    Py_VISIT(self->server);
    Py_VISIT(self->client);
    Py_VISIT(self->transport);
    Py_VISIT(self->in);
    Py_VISIT(self->out);
    Py_VISIT(self->queue);
    Py_VISIT(self->error);
    Py_VISIT(self->values);
    Py_VISIT(self->slow_micros);
    return 0;
}

static int cb_clear(ConnBase *self) {
    Py_CLEAR(self->server);
    Py_CLEAR(self->client);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->in);
    Py_CLEAR(self->out);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->error);
    Py_CLEAR(self->values);
    Py_CLEAR(self->slow_micros);
    return 0;
}

static void cb_dealloc(ConnBase *self) {
    PyObject_GC_UnTrack(self);
    cb_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define CB_OBJ(name, field) {name, T_OBJECT, offsetof(ConnBase, field), 0, NULL}
#define CB_BOOL(name, field) {name, T_BOOL, offsetof(ConnBase, field), 0, NULL}

static PyMemberDef cb_members[] = {
    CB_OBJ("server", server),
    CB_OBJ("client", client),
    CB_OBJ("transport", transport),
    CB_OBJ("_in", in),
    CB_OBJ("_out", out),
    CB_OBJ("_queue", queue),
    CB_OBJ("_error", error),
    CB_OBJ("_values", values),
    CB_OBJ("_slow_micros", slow_micros),
    {"_slow", T_DOUBLE, offsetof(ConnBase, slow), 0, NULL},
    CB_BOOL("_busy", busy),
    CB_BOOL("_closing", closing),
    CB_BOOL("_close_after", close_after),
    CB_BOOL("_read_paused", read_paused),
    CB_BOOL("_write_paused", write_paused),
    CB_BOOL("_unsent", unsent),
    CB_BOOL("_resp3", resp3),
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef cb_methods[] = {
    {"get_buffer", (PyCFunction)cb_get_buffer, METH_O,
     "The transport's read buffer (an idle intake's whole buffer, else Connection._get_buffer)."},
    {"buffer_updated", (PyCFunction)cb_buffer_updated, METH_O,
     "A read landed: the lean read in C, else Connection._buffer_updated."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.server._fastpath.ConnBase",
    .tp_basicsize = sizeof(ConnBase),
    .tp_dealloc = (destructor)cb_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of server.connection.Connection: its read callbacks in C.",
    .tp_traverse = (traverseproc)cb_traverse,
    .tp_clear = (inquiry)cb_clear,
    .tp_methods = cb_methods,
    .tp_members = cb_members,
    .tp_new = PyType_GenericNew,
};

static PyObject *set_conn_limits(PyObject *mod, PyObject *args) {
    Py_ssize_t parts, max_out;
    if (!PyArg_ParseTuple(args, "nn", &parts, &max_out)) return NULL;
    conn_flush_parts = parts;
    conn_max_out = max_out;
    Py_RETURN_NONE;
}

#define CINTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1

static int conn_init_module(PyObject *m) {
    CINTERN(c_get_buffer_py, "_get_buffer");
    CINTERN(c_buffer_updated_py, "_buffer_updated");
    CINTERN(c_process, "_process");
    CINTERN(c_flush, "_flush");
    CINTERN(c_after_write, "_after_write");
    CINTERN(c_slow_threshold, "_slow_threshold");
    CINTERN(c_slowlog_record, "slowlog_record");
    CINTERN(c_write, "write");
    CINTERN(c_direct, "_direct");
    CINTERN(c_grow, "_grow");
    CINTERN(c_partial, "partial");
    CINTERN(c_yielded, "yielded");
    CINTERN(c_overflow, "overflow");
    CINTERN(c_start, "start");
    CINTERN(c_end, "end");
    CINTERN(c_buf, "buf");
    CINTERN(c_mv, "_mv");
    CINTERN(c_loading, "loading");
    CINTERN(c_monitors, "monitors");
    CINTERN(c_cmdstats, "cmdstats");
    CINTERN(c_histograms, "histograms");
    CINTERN(c_authenticated, "authenticated");
    CINTERN(c_last_interaction, "last_interaction");
    CINTERN(c_last_command, "last_command");
    CINTERN(c_in_bytes, "total_net_input_bytes");
    CINTERN(c_processed, "total_commands_processed");
    CINTERN(c_out_bytes, "total_net_output_bytes");
    CINTERN(c_fast_path, "fast-path");
    CINTERN(c_slowlog_setting, "slowlog-log-slower-than");
    CINTERN(c_max_bulk, "proto-max-bulk-len");
    CINTERN(c_max_args, "max-multibulk-len");
    CINTERN(c_fastpath, "fastpath");
    CINTERN(c_stats, "stats");
    if (PyType_Ready(&ConnBaseType) < 0) return -1;
    Py_INCREF(&ConnBaseType);
    if (PyModule_AddObject(m, "ConnBase", (PyObject *)&ConnBaseType) < 0) {
        Py_DECREF(&ConnBaseType);
        return -1;
    }
    return 0;
}
