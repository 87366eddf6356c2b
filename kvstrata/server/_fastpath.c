/* Compiled fast path of the request loop: scan -> dispatch -> reply for the hottest small
 * commands (PING, ECHO, GET, SET key value, EXISTS), run straight against the string store's
 * structures. kvstrata/server/fastpath.py documents the contract and holds the conditions under
 * which a connection may call it; the Python path (Connection._execute and the handlers) is the
 * reference it must match, reply for reply and side effect for side effect.
 *
 * FastPath(keyspace, strings, cmdstats, entry_type, large_value, entry_overhead)
 * FastPath.run(buf, pos, end, out, resp3, max_bulk, max_args, slow, max_out)
 *     -> (pos, executed, last, slow_hit)
 *   Executes the complete commands at buf[pos:end] it can honour, appends their replies (one
 *   bytes object) to the list out, and stops at the first command it does not handle: another
 *   command, other arguments, an option, a key with a TTL or of another type, a write that
 *   would need eviction, anything malformed or incomplete. pos is where the Python path takes
 *   over (at a command boundary). last: index into NAMES of the last command run (-1: none).
 *   slow_hit: None, or (started, argv) for a command that took longer than `slow` seconds (the
 *   run stops after it so that the caller records it in the slow log). A command that raises
 *   (MemoryError, a store bug) is reported through sys.unraisablehook and the run stops before
 *   it, its side effects consistent: the Python path then runs it and answers for it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "_fastpath_scan.h"

enum { C_PING, C_ECHO, C_GET, C_SET, C_EXISTS, C_MATCH, C_MGET, N_CMDS };
static const char *NAMES[N_CMDS] = {"PING", "ECHO", "GET", "SET", "EXISTS", "KV.MATCH",
                                    "KV.MGET"};

/* ASCII-only case folding, as the registry's bytes.upper(): strncasecmp follows the locale. */
static int name_is(const Arg *a, const char *name) {
    size_t n = strlen(name);
    if ((size_t)a->n != n) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = a->p[i];
        if (c >= 'a' && c <= 'z') c = (char)(c - 'a' + 'A');
        if (c != name[i]) return 0;
    }
    return 1;
}

static int command_of(const Arg *argv, int argc) {
    switch (argv[0].n) {
    case 3:
        if (argc == 2 && name_is(argv, "GET")) return C_GET;
        if (argc == 3 && name_is(argv, "SET")) return C_SET;
        return -1;
    case 4:
        if (argc <= 2 && name_is(argv, "PING")) return C_PING;
        if (argc == 2 && name_is(argv, "ECHO")) return C_ECHO;
        return -1;
    case 6:
        if (argc >= 2 && name_is(argv, "EXISTS")) return C_EXISTS;
        return -1;
    case 7:
        if (argc >= 3 && name_is(argv, "KV.MGET")) return C_MGET;
        return -1;
    case 8:
        if (argc >= 3 && name_is(argv, "KV.MATCH")) return C_MATCH;
        return -1;
    default:
        return -1;
    }
}

/* -- the FastPath object ------------------------------------------------------------------ */

/* What KV.MATCH and KV.MGET use (_fastpath_kv.h), bound by FastPath.bind_kv once the store
 * is built: the store's containers, created once and changed in place, never rebound. */
typedef struct {
    PyObject *records;          /* state.index._records (NULL: no store bound) */
    PyObject *key_type, *rec_type, *store, *not_now, *values;
    PyObject *dram, *dram_name, *dram_chunks, *tiers;  /* dram: NULL without a DRAM tier */
    PyObject *name;  /* a bytes object only this struct refers to: each keyspace name probed */
    Py_ssize_t key_ns_at, key_hash_at;  /* ChunkKey's slots */
    Py_ssize_t tiers_at, expire_at, access_at, moving_at, size_at, rkey_at;  /* ChunkRecord's */
    int raw_key;     /* ChunkKey built without __init__ (exactly its two slots) */
    int hash_known;  /* hash(ChunkKey(ns, h)) == hash((ns, h)): the dict probe skips __hash__ */
    int remote;      /* a shared tier: a short chain or a miss asks it (the Python path) */
} Kv;

typedef struct {
    PyObject_HEAD
    PyObject *keyspace, *strings, *cmdstats, *entry_type, *stat_type;
    Py_ssize_t large_value, entry_overhead;
    /* the stores' containers, created once and changed in place, never rebound: keyspace._data,
     * strings._lru, cmdstats.commands, and strings.config.values (NULL when not a dict: the
     * `limit` property is asked) */
    PyObject *data, *lru, *commands, *values;
    /* where StringEntry keeps `value` and `expire_at` and CommandStat `calls` and `seconds`
     * (their __slots__); -1: use getattr */
    Py_ssize_t value_at, expire_at, calls_at, seconds_at;
    /* a new StringEntry without its Python __init__: when the type holds exactly the slots
     * value, expire_at, type_name (nothing else, no __dict__), its other two are set to what
     * entry_type(b"") gave them at bind time; type_name_at -1: call entry_type(value) */
    Py_ssize_t type_name_at;
    PyObject *expire_default, *type_name_default;
    Kv kv;
} FastPath;

static PyObject *s_data, *s_lru, *s_value, *s_expire_at, *s_hits, *s_misses, *s_used, *s_limit,
    *s_move_to_end, *s_bind, *s_commands, *s_stat, *s_calls, *s_seconds, *s_config, *s_values,
    *s_maxmemory, *s_dram_capacity, *s_type_name, *s_names[N_CMDS];

/* The offset of a __slots__ attribute of type tp (a member descriptor), -1 if it is not one. */
static Py_ssize_t slot_offset(PyObject *tp, PyObject *name) {
    PyObject *d = PyObject_GetAttr(tp, name);
    if (d == NULL) return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) off = m->offset;
    }
    Py_DECREF(d);
    return off;
}

/* entry.<name> as a new reference; NULL with no error set when a slot is empty */
static PyObject *slot_get(PyObject *entry, Py_ssize_t at, PyObject *name) {
    if (at < 0) return PyObject_GetAttr(entry, name);
    PyObject *v = *(PyObject **)((char *)entry + at);
    Py_XINCREF(v);
    return v;
}

static int slot_set(PyObject *entry, Py_ssize_t at, PyObject *name, PyObject *value) {
    if (at < 0) return PyObject_SetAttr(entry, name, value);
    PyObject **slot = (PyObject **)((char *)entry + at);
    PyObject *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
    return 0;
}

static void kv_clear(Kv *kv);  /* _fastpath_kv.h */

static void fp_dealloc(FastPath *self) {
    Py_XDECREF(self->keyspace);
    Py_XDECREF(self->strings);
    Py_XDECREF(self->cmdstats);
    Py_XDECREF(self->entry_type);
    Py_XDECREF(self->stat_type);
    Py_XDECREF(self->data);
    Py_XDECREF(self->lru);
    Py_XDECREF(self->commands);
    Py_XDECREF(self->values);
    Py_XDECREF(self->expire_default);
    Py_XDECREF(self->type_name_default);
    kv_clear(&self->kv);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int init_containers(FastPath *self) {
    Py_XSETREF(self->data, PyObject_GetAttr(self->keyspace, s_data));
    Py_XSETREF(self->lru, PyObject_GetAttr(self->strings, s_lru));
    Py_XSETREF(self->commands, PyObject_GetAttr(self->cmdstats, s_commands));
    if (PyErr_Occurred()) return -1;
    if (!PyDict_Check(self->data) || !PyDict_Check(self->lru) ||
        !PyDict_Check(self->commands)) {
        PyErr_SetString(PyExc_TypeError, "unexpected store layout");
        return -1;
    }
    PyObject *config = PyObject_GetAttr(self->strings, s_config);
    PyObject *values = config == NULL ? NULL : PyObject_GetAttr(config, s_values);
    Py_XDECREF(config);
    if (values == NULL) return -1;
    if (!PyDict_CheckExact(values)) Py_CLEAR(values);
    Py_XSETREF(self->values, values);
    return 0;
}

/* Whether StringEntry is simple enough to build without __init__ (see FastPath above). */
static int init_new_entry(FastPath *self) {
    PyTypeObject *tp = (PyTypeObject *)self->entry_type;
    self->type_name_at = -1;
    Py_CLEAR(self->expire_default);
    Py_CLEAR(self->type_name_default);
    Py_ssize_t at = slot_offset(self->entry_type, s_type_name);
    if (PyErr_Occurred()) PyErr_Clear();  /* no such attribute: not this kind of type */
    if (at < 0 || self->value_at < 0 || self->expire_at < 0 || tp->tp_dictoffset != 0 ||
        tp->tp_basicsize != (Py_ssize_t)(sizeof(PyObject) + 3 * sizeof(PyObject *)) ||
        tp->tp_itemsize != 0)
        return 0;
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    PyObject *probe = empty == NULL ? NULL : PyObject_CallOneArg(self->entry_type, empty);
    Py_XDECREF(empty);
    if (probe == NULL) return -1;
    if (Py_TYPE(probe) == tp) {
        self->expire_default = slot_get(probe, self->expire_at, s_expire_at);
        self->type_name_default = slot_get(probe, at, s_type_name);
        if (self->expire_default != NULL && self->type_name_default != NULL)
            self->type_name_at = at;
    }
    Py_DECREF(probe);
    return PyErr_Occurred() ? -1 : 0;
}

/* entry_type(value) as a new reference */
static PyObject *new_entry(FastPath *fp, PyObject *value) {
    if (fp->type_name_at < 0) return PyObject_CallOneArg(fp->entry_type, value);
    PyTypeObject *tp = (PyTypeObject *)fp->entry_type;
    PyObject *e = tp->tp_alloc(tp, 0);
    if (e == NULL) return NULL;
    slot_set(e, fp->value_at, s_value, value);
    slot_set(e, fp->expire_at, s_expire_at, fp->expire_default);
    slot_set(e, fp->type_name_at, s_type_name, fp->type_name_default);
    return e;
}

static int fp_init(FastPath *self, PyObject *args, PyObject *kw) {
    if (kw != NULL && PyDict_GET_SIZE(kw) > 0) {
        PyErr_SetString(PyExc_TypeError, "FastPath() takes no keyword arguments");
        return -1;
    }
    PyObject *ks, *st, *cs, *et, *ct;
    Py_ssize_t large, overhead;
    if (!PyArg_ParseTuple(args, "OOOO!O!nn", &ks, &st, &cs, &PyType_Type, &et, &PyType_Type,
                          &ct, &large, &overhead))
        return -1;
    Py_INCREF(ks); Py_XSETREF(self->keyspace, ks);
    Py_INCREF(st); Py_XSETREF(self->strings, st);
    Py_INCREF(cs); Py_XSETREF(self->cmdstats, cs);
    Py_INCREF(et); Py_XSETREF(self->entry_type, et);
    Py_INCREF(ct); Py_XSETREF(self->stat_type, ct);
    self->large_value = large;
    self->entry_overhead = overhead;
    self->value_at = slot_offset(et, s_value);
    self->expire_at = slot_offset(et, s_expire_at);
    self->calls_at = slot_offset(ct, s_calls);
    self->seconds_at = slot_offset(ct, s_seconds);
    if (PyErr_Occurred()) return -1;
    if (init_containers(self) < 0) return -1;
    return init_new_entry(self);
}

/* Per-run state: counters written back to the Python objects once, at the end. */
typedef struct {
    PyObject *data, *lru;
    long long hits, misses;
    long long calls[N_CMDS];
    double seconds[N_CMDS];
    long long limit;  /* -1: not read yet */
    long long used;   /* StringStore.used, read when first needed, written back at the end */
    int used_read, used_dirty;
    int failed;  /* a command raised: reported, and left to the Python path */
} Run;

/* 1: the entry is a plain string without a TTL (the cases handled here); 0: not; -1 error */
static int plain_string(FastPath *fp, PyObject *entry) {
    if (Py_TYPE(entry) != (PyTypeObject *)fp->entry_type) return 0;
    PyObject *exp = slot_get(entry, fp->expire_at, s_expire_at);
    if (exp == NULL) return PyErr_Occurred() ? -1 : 0;
    int plain = exp == Py_None;
    Py_DECREF(exp);
    return plain;
}

static long long get_ll(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* values[name] when it is an int (not a subclass) that fits; -2 when not (no error set) */
static long long config_int(PyObject *values, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(values, name);  /* borrowed */
    if (v == NULL || !PyLong_CheckExact(v)) return -2;
    long long r = PyLong_AsLongLong(v);
    if (r < 0) { PyErr_Clear(); return -2; }
    return r;
}

/* StringStore.limit (the Python property is the reference): its two config values read
 * straight from strings.config.values when they are plain ints, else the property itself. */
static long long read_limit(FastPath *fp) {
    long long limit = -2;
    if (fp->values != NULL) {
        limit = config_int(fp->values, s_maxmemory);
        if (limit == 0) limit = config_int(fp->values, s_dram_capacity);
    }
    if (PyErr_Occurred()) return -1;
    return limit >= 0 ? limit : get_ll(fp->strings, s_limit);
}

static int set_used(FastPath *fp, long long used) {
    PyObject *v = PyLong_FromLongLong(used);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(fp->strings, s_used, v);
    Py_DECREF(v);
    return rc;
}

/* Write StringStore.used back when this run changed it (before Python code reads it). */
static int sync_used(FastPath *fp, Run *run) {
    if (!run->used_dirty) return 0;
    run->used_dirty = 0;
    return set_used(fp, run->used);
}

/* lru.move_to_end(key) (a method call without a bound-method object) */
static int touch(Run *run, PyObject *key) {
    PyObject *r = PyObject_CallMethodOneArg(run->lru, s_move_to_end, key);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Each do_* returns 1 done, 0 not for us (nothing changed), -1 error. */
static int do_get(FastPath *fp, Run *run, const Arg *argv, Out *o, int resp3) {
    PyObject *key = PyBytes_FromStringAndSize(argv[1].p, argv[1].n);
    if (key == NULL) return -1;
    PyObject *entry = PyDict_GetItemWithError(run->data, key);  /* borrowed */
    int rc = 1;
    if (entry == NULL) {
        if (PyErr_Occurred()) { rc = -1; goto done; }
        run->misses++;
        rc = resp3 ? out_put(o, "_\r\n", 3) : out_put(o, "$-1\r\n", 5);
        rc = rc < 0 ? -1 : 1;
        goto done;
    }
    Py_INCREF(entry);
    int plain = plain_string(fp, entry);
    PyObject *value = plain == 1 ? slot_get(entry, fp->value_at, s_value) : NULL;
    Py_DECREF(entry);
    if (plain != 1 || value == NULL) {
        rc = plain < 0 || PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    if (!PyBytes_CheckExact(value) && !PyByteArray_CheckExact(value)) {
        Py_DECREF(value); rc = 0; goto done;
    }
    int in_lru = PyDict_Contains(run->lru, key);
    if (in_lru == 1 && touch(run, key) < 0) in_lru = -1;
    if (in_lru < 0) { Py_DECREF(value); rc = -1; goto done; }
    if (PyBytes_CheckExact(value))
        rc = out_bulk(o, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
    else
        rc = out_bulk(o, PyByteArray_AS_STRING(value), PyByteArray_GET_SIZE(value));
    rc = rc < 0 ? -1 : 1;
    if (rc == 1) run->hits++;  /* counted once done: a failed GET is run again by Python */
    Py_DECREF(value);
done:
    Py_DECREF(key);
    return rc;
}

/* SET key value: replaces a plain string in place (the LRU and `used` as StringStore._bind
 * does) or creates a key through StringStore._bind itself; anything else is the Python path. */
static int do_set(FastPath *fp, Run *run, const Arg *argv, Out *o) {
    if (argv[2].n >= fp->large_value) return 0;
    if (run->limit < 0) {
        run->limit = read_limit(fp);
        if (run->limit < 0) return PyErr_Occurred() ? -1 : 0;
    }
    if (!run->used_read) {
        run->used = get_ll(fp->strings, s_used);
        if (run->used == -1 && PyErr_Occurred()) return -1;
        run->used_read = 1;
    }
    long long cost = argv[1].n + argv[2].n + fp->entry_overhead;
    if (run->used + cost > run->limit) return 0;  /* eviction (or OOM): the Python path */
    PyObject *key = PyBytes_FromStringAndSize(argv[1].p, argv[1].n);
    if (key == NULL) return -1;
    int rc = 0;
    PyObject *value = NULL, *pycost = NULL, *entry = PyDict_GetItemWithError(run->data, key);
    if (entry == NULL && PyErr_Occurred()) { rc = -1; goto done; }
    Py_XINCREF(entry);
    if (entry != NULL) {
        int plain = plain_string(fp, entry);
        if (plain != 1) { rc = plain; goto done; }
        PyObject *before = PyDict_GetItemWithError(run->lru, key);  /* borrowed */
        if (before == NULL) { rc = PyErr_Occurred() ? -1 : 0; goto done; }
        long long was = PyLong_AsLongLong(before);
        if (was == -1 && PyErr_Occurred()) { rc = -1; goto done; }
        value = PyBytes_FromStringAndSize(argv[2].p, argv[2].n);
        if (value == NULL) { rc = -1; goto done; }
        if (cost != was) {  /* an equal cost: the LRU and `used` stay as they are */
            pycost = PyLong_FromLongLong(cost);
            if (pycost == NULL || PyObject_SetItem(run->lru, key, pycost) < 0) {
                rc = -1; goto done;
            }
            run->used += cost - was;  /* with the LRU's new cost: consistent if touch fails */
            run->used_dirty = 1;
        }
        if (touch(run, key) < 0) { rc = -1; goto done; }
        rc = slot_set(entry, fp->value_at, s_value, value) < 0 ? -1 : 1;
    } else {
        value = PyBytes_FromStringAndSize(argv[2].p, argv[2].n);
        pycost = PyLong_FromLongLong(cost);
        if (value == NULL || pycost == NULL) { rc = -1; goto done; }
        PyObject *fresh = new_entry(fp, value);
        if (fresh == NULL || sync_used(fp, run) < 0) { Py_XDECREF(fresh); rc = -1; goto done; }
        run->used_read = 0;  /* _bind changes it */
        PyObject *r = PyObject_CallMethodObjArgs(fp->strings, s_bind, key, fresh, pycost, NULL);
        Py_DECREF(fresh);
        rc = r == NULL ? -1 : 1;
        Py_XDECREF(r);
    }
    if (rc == 1 && out_put(o, "+OK\r\n", 5) < 0) rc = -1;
done:
    Py_XDECREF(entry);
    Py_XDECREF(value);
    Py_XDECREF(pycost);
    Py_DECREF(key);
    return rc;
}

static int do_exists(Run *run, const Arg *argv, int argc, Out *o) {
    long long found = 0;
    for (int i = 1; i < argc; i++) {  /* a key with a TTL: expiry is Python's, hand over */
        PyObject *key = PyBytes_FromStringAndSize(argv[i].p, argv[i].n);
        if (key == NULL) return -1;
        PyObject *entry = PyDict_GetItemWithError(run->data, key);  /* borrowed */
        Py_DECREF(key);
        if (entry == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        Py_INCREF(entry);  /* another type's expire_at may be a property: Python code */
        PyObject *exp = PyObject_GetAttr(entry, s_expire_at);
        Py_DECREF(entry);
        if (exp == NULL) return -1;
        int plain = exp == Py_None;
        Py_DECREF(exp);
        if (!plain) return 0;
        found++;
    }
    return out_int(o, found) < 0 ? -1 : 1;
}

#include "_fastpath_kv.h"

static int execute(FastPath *fp, Run *run, int cmd, const Arg *argv, int argc, Out *o,
                   int resp3) {
    switch (cmd) {
    case C_PING:
        if (argc == 1) return out_put(o, "+PONG\r\n", 7) < 0 ? -1 : 1;
        return out_bulk(o, argv[1].p, argv[1].n) < 0 ? -1 : 1;
    case C_ECHO:
        return out_bulk(o, argv[1].p, argv[1].n) < 0 ? -1 : 1;
    case C_GET:
        return do_get(fp, run, argv, o, resp3);
    case C_SET:
        return do_set(fp, run, argv, o);
    case C_EXISTS:
        return do_exists(run, argv, argc, o);
    case C_MATCH:
        return do_match(fp, argv, argc, o);
    case C_MGET:
        return do_mget(fp, run, argv, argc, o, resp3);
    }
    return 0;
}

/* obj.<name> += delta (through its slot at `at` when >= 0) */
static int add_attr(PyObject *obj, Py_ssize_t at, PyObject *name, PyObject *delta) {
    PyObject *v = slot_get(obj, at, name);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
        return -1;
    }
    PyObject *sum = PyNumber_Add(v, delta);
    Py_DECREF(v);
    if (sum == NULL) return -1;
    int rc = slot_set(obj, at, name, sum);
    Py_DECREF(sum);
    return rc;
}

static int add_count(PyObject *obj, Py_ssize_t at, PyObject *name, long long n) {
    if (n == 0) return 0;
    PyObject *d = PyLong_FromLongLong(n);
    if (d == NULL) return -1;
    int rc = add_attr(obj, at, name, d);
    Py_DECREF(d);
    return rc;
}

/* Write the run's counters back: keyspace hits/misses, INFO commandstats. */
static int write_back(FastPath *fp, Run *run) {
    if (sync_used(fp, run) < 0) return -1;
    if (add_count(fp->keyspace, -1, s_hits, run->hits) < 0) return -1;
    if (add_count(fp->keyspace, -1, s_misses, run->misses) < 0) return -1;
    for (int c = 0; c < N_CMDS; c++) {
        if (run->calls[c] == 0) continue;
        PyObject *stat = PyDict_GetItemWithError(fp->commands, s_names[c]);
        Py_XINCREF(stat);
        if (stat == NULL) {
            if (PyErr_Occurred()) return -1;
            stat = PyObject_CallMethodOneArg(fp->cmdstats, s_stat, s_names[c]);
            if (stat == NULL) return -1;
        }
        int own = Py_TYPE(stat) == (PyTypeObject *)fp->stat_type;
        PyObject *secs = PyFloat_FromDouble(run->seconds[c]);
        int rc = secs == NULL ? -1 : add_count(stat, own ? fp->calls_at : -1, s_calls,
                                               run->calls[c]);
        if (rc == 0) rc = add_attr(stat, own ? fp->seconds_at : -1, s_seconds, secs);
        Py_XDECREF(secs);
        Py_DECREF(stat);
        if (rc < 0) return -1;
    }
    return 0;
}

static PyObject *argv_list(const Arg *argv, int argc) {
    PyObject *list = PyList_New(argc);
    if (list == NULL) return NULL;
    for (int i = 0; i < argc; i++) {
        PyObject *a = PyBytes_FromStringAndSize(argv[i].p, argv[i].n);
        if (a == NULL) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, a);
    }
    return list;
}

/* What one run may do: the connection's frame limits, protocol and slow-log threshold. */
typedef struct {
    Py_ssize_t max_bulk, max_args, max_out;
    int resp3;
    double slow;
} Limits;

/* Execute commands from base[*pos:end] until one is not for us or fails (run->failed, the
 * error set; *pos is then at that command); *pos, *last and *slow_hit (see the top of this
 * file) updated. The number executed. */
static Py_ssize_t run_commands(FastPath *fp, Run *run, const char *base, Py_ssize_t *pos,
                               Py_ssize_t end, const Limits *lim, Out *o, int *last,
                               PyObject **slow_hit) {
    Py_ssize_t executed = 0;
    double clock = now_s();
    while (*pos < end && o->len < lim->max_out) {
        Arg argv[MAX_ARGV];
        int argc;
        const char *next;
        if (scan_one(base + *pos, base + end, lim->max_bulk, lim->max_args, argv, &argc, &next))
            break;
        int cmd = command_of(argv, argc);
        if (cmd < 0) break;
        double started = clock;
        int rc = execute(fp, run, cmd, argv, argc, o, lim->resp3);
        if (rc < 0) run->failed = 1;
        if (rc <= 0) return executed;
        clock = now_s();  /* this command's end, the next one's start */
        run->calls[cmd]++;
        run->seconds[cmd] += clock - started;
        executed++;
        *last = cmd;
        *pos = next - base;
        if (clock - started > lim->slow) {
            PyObject *list = argv_list(argv, argc);
            *slow_hit = list == NULL ? NULL : Py_BuildValue("(dN)", started, list);
            if (*slow_hit == NULL) run->failed = 1;  /* only its slow-log entry is lost */
            return executed;
        }
    }
    return executed;
}

/* (pos, executed, last, slow_hit or None); steals nothing */
static PyObject *result_tuple(Py_ssize_t pos, Py_ssize_t executed, int last, PyObject *slow) {
    PyObject *t = PyTuple_New(4);
    if (t == NULL) return NULL;
    PyObject *items[3] = {PyLong_FromSsize_t(pos), PyLong_FromSsize_t(executed),
                          PyLong_FromLong(last)};
    for (int i = 0; i < 3; i++) {
        if (items[i] == NULL) {
            for (int j = i; j < 3; j++) Py_XDECREF(items[j]);
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    slow = slow ? slow : Py_None;
    Py_INCREF(slow);
    PyTuple_SET_ITEM(t, 3, slow);
    return t;
}

/* One run over base[*pos:end] (the body of FastPath.run, and of ConnBase.buffer_updated's lean
 * read): *pos, *executed, *last and *slow_hit (a new reference or NULL) set; the replies are
 * left in o (the caller owns and frees it). -1 with an error set when the counters could not be
 * written back. */
static int fp_run_core(FastPath *fp, const char *base, Py_ssize_t *pos, Py_ssize_t end,
                       const Limits *lim, Out *o, Py_ssize_t *executed, int *last,
                       PyObject **slow_hit) {
    Run run;
    memset(&run, 0, sizeof run);
    run.limit = -1;
    *slow_hit = NULL;
    *last = -1;
    run.data = fp->data;  /* borrowed: the FastPath holds them */
    run.lru = fp->lru;
    *executed = run_commands(fp, &run, base, pos, end, lim, o, last, slow_hit);
    if (run.failed)  /* reported (sys.unraisablehook); the Python path runs it again and
                      * answers as it does for a failing handler (or succeeds: MemoryError) */
        PyErr_WriteUnraisable((PyObject *)fp);
    if (write_back(fp, &run) < 0) {
        Py_CLEAR(*slow_hit);
        return -1;
    }
    return 0;
}

static PyObject *fp_run(FastPath *fp, PyObject *const *args, Py_ssize_t nargs) {
    if (fp->keyspace == NULL) {  /* FastPath.__new__ without __init__ */
        PyErr_SetString(PyExc_TypeError, "FastPath is not initialised");
        return NULL;
    }
    if (nargs != 9 || !PyList_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "run(buf, pos, end, out, resp3, max_bulk, max_args, slow, max_out)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    Limits lim = {PyLong_AsSsize_t(args[5]), PyLong_AsSsize_t(args[6]),
                  PyLong_AsSsize_t(args[8]), PyObject_IsTrue(args[4]),
                  PyFloat_AsDouble(args[7])};
    if (end > view.len) end = view.len;
    if (!PyErr_Occurred() && (pos < 0 || pos > end))
        PyErr_SetString(PyExc_ValueError, "pos out of the buffer");
    if (PyErr_Occurred()) { PyBuffer_Release(&view); return NULL; }
    Out o;
    out_init(&o);
    PyObject *slow_hit = NULL, *result = NULL;
    int last = -1;
    Py_ssize_t executed = 0;
    if (fp_run_core(fp, (const char *)view.buf, &pos, end, &lim, &o, &executed, &last,
                    &slow_hit) < 0)
        goto fail;
    if (o.len > 0) {
        PyObject *bytes = PyBytes_FromStringAndSize(o.buf, o.len);
        if (bytes == NULL || PyList_Append(args[3], bytes) < 0) { Py_XDECREF(bytes); goto fail; }
        Py_DECREF(bytes);
    }
    result = result_tuple(pos, executed, last, slow_hit);
fail:
    Py_XDECREF(slow_hit);
    out_free(&o);
    PyBuffer_Release(&view);
    return result;
}

static PyTypeObject FastPathType;  /* below: ConnBase checks that it runs the real one */
#include "_fastpath_conn.h"

static PyMethodDef fp_methods[] = {
    {"run", (PyCFunction)(void (*)(void))fp_run, METH_FASTCALL, "Execute the leading fast commands of a buffer."},
    {"bind_kv", (PyCFunction)fp_bind_kv, METH_VARARGS, "Bind the KV store's structures (records None: unbind)."},
    {"kv_info", (PyCFunction)fp_kv_info, METH_NOARGS, "(bound, raw_key, hash_known, remote)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.server._fastpath.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_dealloc = (destructor)fp_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled small-command path bound to one server's stores.",
    .tp_methods = fp_methods,
    .tp_init = (initproc)fp_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef module_methods[] = {
    {"set_conn_limits", set_conn_limits, METH_VARARGS,
     "set_conn_limits(flush_parts, max_out): ConnBase's FLUSH_PARTS and MAX_OUT."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "Compiled small-command path.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__fastpath(void) {
    INTERN(s_data, "_data");
    INTERN(s_lru, "_lru");
    INTERN(s_value, "value");
    INTERN(s_expire_at, "expire_at");
    INTERN(s_hits, "hits");
    INTERN(s_misses, "misses");
    INTERN(s_used, "used");
    INTERN(s_limit, "limit");
    INTERN(s_move_to_end, "move_to_end");
    INTERN(s_bind, "_bind");
    INTERN(s_commands, "commands");
    INTERN(s_stat, "_stat");
    INTERN(s_calls, "calls");
    INTERN(s_seconds, "seconds");
    INTERN(s_config, "config");
    INTERN(s_type_name, "type_name");
    INTERN(s_values, "values");
    INTERN(s_maxmemory, "maxmemory");
    INTERN(s_dram_capacity, "dram-capacity");
    INTERN(s_get_now, "get_now");
    INTERN(s_view, "view");
    INTERN(s_release, "release");
    INTERN(s_max_chain, "max-chain-chunks");
    for (int c = 0; c < N_CMDS; c++) INTERN(s_names[c], NAMES[c]);
    if (PyType_Ready(&FastPathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(m, "FastPath", (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(m);
        return NULL;
    }
    if (conn_init_module(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
