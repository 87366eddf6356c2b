/* C accelerated RESP request scanner; same contract as decoder.py's py_parse_requests.
 *
 * parse_requests(buf, pos, end, big, max_bulk, max_args) -> (cmds, pos, state)
 *   state: None (all complete commands consumed, or the next one is incomplete),
 *          1 (an inline command with quotes starts at pos: the Python side decodes it),
 *          (args, remaining, length, data_pos) (a bulk of >= big bytes starts at data_pos).
 * Malformed input raises the class given to set_error_class (ProtocolError, which adds the
 * "Protocol error: " prefix) with the Redis protocol error text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_HEADER (64 * 1024)

static const char *find_crlf(const char *p, const char *end) {
    while (p < end) {
        const char *r = memchr(p, '\r', (size_t)(end - p));
        if (r == NULL || r + 1 >= end) return NULL;
        if (r[1] == '\n') return r;
        p = r + 1;
    }
    return NULL;
}

/* Strict decimal (optional leading '-'), at most 18 digits (no overflow). 0 on success. */
static int parse_ll(const char *p, const char *e, long long *out) {
    int neg = 0;
    long long v = 0;
    if (p < e && *p == '-') { neg = 1; p++; }
    if (p >= e || e - p > 18) return -1;
    for (; p < e; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

static PyObject *error_class = NULL; /* ProtocolError, set by the Python side */

static PyObject *proto_error(const char *msg) {
    PyErr_SetString(error_class != NULL ? error_class : PyExc_ValueError, msg);
    return NULL;
}

/* "expected '$', got X" for a multibulk element that is not a bulk (X escaped if unprintable) */
static PyObject *not_a_bulk(unsigned char ch) {
    char msg[64];
    if (ch >= 0x20 && ch < 0x7f)
        snprintf(msg, sizeof msg, "expected '$', got '%c'", ch);
    else
        snprintf(msg, sizeof msg, "expected '$', got '\\x%02x'", ch);
    return proto_error(msg);
}

static PyObject *set_error_class(PyObject *self, PyObject *cls) {
    Py_XINCREF(cls);
    Py_XSETREF(error_class, cls);
    Py_RETURN_NONE;
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

/* An inline command at p: 1 decoded (appended unless blank, *pos advanced), 0 incomplete,
 * 2 has quotes (left to the Python decoder), -1 error. */
static int scan_inline(const char *p, const char *stop, PyObject *cmds, Py_ssize_t *pos,
                       const char *base) {
    const char *nl = memchr(p, '\n', (size_t)(stop - p));
    if (nl == NULL) {
        if (stop - p > MAX_HEADER) { proto_error("too big inline request"); return -1; }
        return 0;
    }
    if (memchr(p, '"', (size_t)(nl - p)) || memchr(p, '\'', (size_t)(nl - p))) return 2;
    PyObject *argv = PyList_New(0);
    if (argv == NULL) return -1;
    const char *q = p;
    while (q < nl) {
        while (q < nl && is_space(*q)) q++;
        const char *w = q;
        while (q < nl && !is_space(*q)) q++;
        if (q > w) {
            PyObject *arg = PyBytes_FromStringAndSize(w, q - w);
            if (arg == NULL || PyList_Append(argv, arg) != 0) {
                Py_XDECREF(arg); Py_DECREF(argv); return -1;
            }
            Py_DECREF(arg);
        }
    }
    if (PyList_GET_SIZE(argv) > 0 && PyList_Append(cmds, argv) != 0) {
        Py_DECREF(argv); return -1;
    }
    Py_DECREF(argv);
    *pos = (nl + 1) - base;
    return 1;
}

static PyObject *parse_requests(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, end, big, max_bulk, max_args;
    if (!PyArg_ParseTuple(args, "y*nnnnn", &view, &pos, &end, &big, &max_bulk, &max_args))
        return NULL;
    PyObject *cmds = PyList_New(0);
    PyObject *state = NULL;
    const char *base = (const char *)view.buf;
    if (end > view.len) end = view.len;
    if (cmds == NULL) goto fail;
    while (pos < end) {
        const char *p = base + pos, *stop = base + end;
        if (*p != '*') {
            int r = scan_inline(p, stop, cmds, &pos, base);
            if (r < 0) goto fail;
            if (r == 0) break;          /* incomplete line */
            if (r == 2) { state = PyLong_FromLong(1); break; }  /* quoted: Python decodes it */
            continue;
        }
        const char *nl = find_crlf(p, stop);
        if (nl == NULL) {
            if (end - pos > MAX_HEADER) { proto_error("too big mbulk count string"); goto fail; }
            break;
        }
        long long n;
        if (parse_ll(p + 1, nl, &n) != 0 || n > max_args) {
            proto_error("invalid multibulk length"); goto fail;
        }
        p = nl + 2;
        if (n <= 0) { pos = p - base; continue; }
        PyObject *argv = PyList_New(0);
        if (argv == NULL) goto fail;
        int complete = 1;
        for (long long i = 0; i < n; i++) {
            if (p >= stop) { complete = 0; break; }
            if (*p != '$') {
                Py_DECREF(argv); not_a_bulk((unsigned char)*p); goto fail;
            }
            const char *bnl = find_crlf(p, stop);
            if (bnl == NULL) {
                if (stop - p > MAX_HEADER) {
                    Py_DECREF(argv); proto_error("too big bulk count string"); goto fail;
                }
                complete = 0; break;
            }
            long long ln;
            if (parse_ll(p + 1, bnl, &ln) != 0 || ln < 0 || ln > max_bulk) {
                Py_DECREF(argv); proto_error("invalid bulk length"); goto fail;
            }
            const char *data = bnl + 2;
            if (ln >= big) {
                state = Py_BuildValue("(NLLn)", argv, (long long)(n - i), ln,
                                      (Py_ssize_t)(data - base));
                if (state == NULL) goto fail;
                complete = -1;
                break;
            }
            if (data + ln + 2 > stop) { complete = 0; break; }
            if (data[ln] != '\r' || data[ln + 1] != '\n') {
                Py_DECREF(argv); proto_error("expected CRLF after bulk data"); goto fail;
            }
            PyObject *arg = PyBytes_FromStringAndSize(data, (Py_ssize_t)ln);
            if (arg == NULL || PyList_Append(argv, arg) != 0) {
                Py_XDECREF(arg); Py_DECREF(argv); goto fail;
            }
            Py_DECREF(arg);
            p = data + ln + 2;
        }
        if (complete == -1) break;  /* state owns argv */
        if (!complete) { Py_DECREF(argv); break; }
        if (PyList_Append(cmds, argv) != 0) { Py_DECREF(argv); goto fail; }
        Py_DECREF(argv);
        pos = p - base;
    }
    PyBuffer_Release(&view);
    if (state == NULL) { state = Py_None; Py_INCREF(state); }
    return Py_BuildValue("(NnN)", cmds, pos, state);
fail:
    PyBuffer_Release(&view);
    /* Commands before a malformed one still run: report the error on the next call. */
    if (cmds != NULL && PyList_GET_SIZE(cmds) > 0
        && PyErr_ExceptionMatches(error_class != NULL ? error_class : PyExc_ValueError)) {
        PyErr_Clear();
        return Py_BuildValue("(NnO)", cmds, pos, Py_None);
    }
    Py_XDECREF(cmds);
    return NULL;
}

/* parse_args(buf, pos, end, n, big, max_bulk, args) -> (pos, state): up to n bulk arguments
 * appended to the list args; state True when all n were parsed, None when more bytes are needed
 * (the arguments parsed so far stay in args; pos is where to resume), or
 * (args, remaining, length, data_pos) at a bulk of >= big bytes. Same contract as the Python
 * decoder.parse_args, so a long command is continued without rescanning it. */
static PyObject *parse_args(PyObject *self, PyObject *pyargs) {
    Py_buffer view;
    Py_ssize_t pos, end, n, big, max_bulk;
    PyObject *argv;
    if (!PyArg_ParseTuple(pyargs, "y*nnnnnO!", &view, &pos, &end, &n, &big, &max_bulk,
                          &PyList_Type, &argv))
        return NULL;
    const char *base = (const char *)view.buf;
    if (end > view.len) end = view.len;
    const char *p = base + pos, *stop = base + end;
    PyObject *state = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p >= stop) break;
        if (*p != '$') {
            PyBuffer_Release(&view); return not_a_bulk((unsigned char)*p);
        }
        const char *bnl = find_crlf(p, stop);
        if (bnl == NULL) {
            if (stop - p > MAX_HEADER) {
                PyBuffer_Release(&view); return proto_error("too big bulk count string");
            }
            break;
        }
        long long ln;
        if (parse_ll(p + 1, bnl, &ln) != 0 || ln < 0 || ln > max_bulk) {
            PyBuffer_Release(&view); return proto_error("invalid bulk length");
        }
        const char *data = bnl + 2;
        if (ln >= big) {
            state = Py_BuildValue("(OLLn)", argv, (long long)(n - i), ln,
                                  (Py_ssize_t)(data - base));
            if (state == NULL) { PyBuffer_Release(&view); return NULL; }
            break;
        }
        if (data + ln + 2 > stop) break;
        if (data[ln] != '\r' || data[ln + 1] != '\n') {
            PyBuffer_Release(&view); return proto_error("expected CRLF after bulk data");
        }
        PyObject *arg = PyBytes_FromStringAndSize(data, (Py_ssize_t)ln);
        if (arg == NULL || PyList_Append(argv, arg) != 0) {
            Py_XDECREF(arg); PyBuffer_Release(&view); return NULL;
        }
        Py_DECREF(arg);
        p = data + ln + 2;
        if (i == n - 1) { state = Py_True; Py_INCREF(state); }
    }
    if (n <= 0) { state = Py_True; Py_INCREF(state); }
    Py_ssize_t at = p - base;
    PyBuffer_Release(&view);
    if (state == NULL) { state = Py_None; Py_INCREF(state); }
    return Py_BuildValue("(nN)", at, state);
}

/* ---- replies (the client's kvstrata.clients.resp.ReplyReader) ------------------------------
 *
 * parse_reply(buf, pos, end, big, simple) -> (value, pos) or None
 *
 * One whole top-level reply at pos, when it lies complete in buf[pos:end] and holds only
 * arrays, bulks shorter than big, integers, simple strings (made with simple, the Simple class)
 * and nulls, as the Python reader maps them (bulk -> bytes, array -> list, a negative length ->
 * None). None for anything else (a partial reply, another type, an odd header such as a length
 * Python's int() would read but this does not): the Python reader then parses it from pos,
 * with its own checks and errors. It raises only MemoryError. */
#define REPLY_DEPTH 32

/* A new reference, or NULL: *st is 0 (not handled here) or -1 (a Python error is set). */
static PyObject *reply_item(const char *base, const char **at, const char *stop, long long big,
                            PyObject *simple, int depth, int *st)
{
    const char *p = *at;
    *st = 0;
    if (p >= stop) return NULL;
    const char *nl = find_crlf(p + 1, stop);
    if (nl == NULL) return NULL;
    long long v;
    PyObject *obj;
    switch (*p) {
    case '$':
        if (parse_ll(p + 1, nl, &v) != 0) return NULL;
        if (v < 0) { *at = nl + 2; Py_RETURN_NONE; }
        if (v >= big || stop - (nl + 2) < v + 2) return NULL;
        if (nl[2 + v] != '\r' || nl[3 + v] != '\n') return NULL;
        obj = PyBytes_FromStringAndSize(nl + 2, (Py_ssize_t)v);
        if (obj == NULL) { *st = -1; return NULL; }
        *at = nl + 4 + v;
        return obj;
    case ':':
        if (parse_ll(p + 1, nl, &v) != 0) return NULL;
        obj = PyLong_FromLongLong(v);
        if (obj == NULL) { *st = -1; return NULL; }
        *at = nl + 2;
        return obj;
    case '+': {
        PyObject *line = PyBytes_FromStringAndSize(p + 1, nl - (p + 1));
        if (line == NULL) { *st = -1; return NULL; }
        obj = PyObject_CallOneArg(simple, line);
        Py_DECREF(line);
        if (obj == NULL) { *st = -1; return NULL; }
        *at = nl + 2;
        return obj;
    }
    case '_':
        *at = nl + 2;
        Py_RETURN_NONE;
    case '*': {
        if (parse_ll(p + 1, nl, &v) != 0) return NULL;
        if (v < 0) { *at = nl + 2; Py_RETURN_NONE; }
        /* every element takes at least 3 bytes: a count beyond the buffer is not complete */
        if (depth >= REPLY_DEPTH || v > (stop - (nl + 2)) / 3) return NULL;
        PyObject *list = PyList_New((Py_ssize_t)v);
        if (list == NULL) { *st = -1; return NULL; }
        const char *q = nl + 2;
        for (Py_ssize_t i = 0; i < (Py_ssize_t)v; i++) {
            PyObject *item = reply_item(base, &q, stop, big, simple, depth + 1, st);
            if (item == NULL) { Py_DECREF(list); return NULL; }
            PyList_SET_ITEM(list, i, item);
        }
        *at = q;
        return list;
    }
    default:
        return NULL;
    }
}

static PyObject *parse_reply(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, end;
    long long big;
    PyObject *simple;
    if (!PyArg_ParseTuple(args, "y*nnLO:parse_reply", &view, &pos, &end, &big, &simple))
        return NULL;
    if (end > view.len) end = view.len;
    PyObject *out = NULL;
    if (pos >= 0 && pos < end) {
        const char *base = (const char *)view.buf, *at = base + pos;
        int st = 0;
        PyObject *value = reply_item(base, &at, base + end, big, simple, 0, &st);
        if (value != NULL)
            out = Py_BuildValue("(Nn)", value, (Py_ssize_t)(at - base));
        else if (st == 0) {
            out = Py_None;
            Py_INCREF(out);
        }
    } else {
        out = Py_None;
        Py_INCREF(out);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"parse_reply", parse_reply, METH_VARARGS,
     "One complete reply of arrays, bulks, integers, simple strings and nulls, or None."},
    {"parse_requests", parse_requests, METH_VARARGS, "Scan complete RESP commands."},
    {"parse_args", parse_args, METH_VARARGS, "Continue a command: parse up to n arguments."},
    {"set_error_class", set_error_class, METH_O, "Exception class for malformed input."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cresp", "C accelerated RESP request scanner.", -1, methods,
};

PyMODINIT_FUNC PyInit__cresp(void) { return PyModule_Create(&module); }
