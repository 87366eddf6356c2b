/* The KV half of _fastpath.c: KV.MATCH and KV.MGET of a chain the index holds, against the
 * store's own structures (issue 31). Included by _fastpath.c only; fastpath.py states the
 * contract and kvstrata/server/commands/kv.py (kv_match, kv_mget) is the reference.
 *
 * Both commands look before they touch: a first pass over the chain decides, with no side
 * effect, whether the whole command is for us; anything else (an invalid namespace or hash,
 * an option word, too many hashes, a chunk with a TTL, a chunk moving or not in DRAM for
 * KV.MGET, a short match when a shared tier could extend it, more than LARGE_VALUE bytes of
 * payload) hands the command, untouched, to the Python path.
 *
 * KV.MATCH then stamps `last_access` on the matched records, as KVStore.matched does. KV.MGET
 * reads each chunk through KVStore.get_now itself (the reference read: LRU touch, hits, the
 * tier's counters and a pin), copies the bytes into the reply and releases the pin at once: a
 * copy made inside this call cannot see the slot change, so no pin has to outlive it (the
 * Python path keeps its zero-copy view pinned until the transport wrote it). */
#ifndef KVSTRATA_FASTPATH_KV_H
#define KVSTRATA_FASTPATH_KV_H

#include <Python.h>
#include <structmember.h>

#define MAX_HASH 64 /* bytes of a hash, as keys.MAX_HASH_BYTES */
#define MAX_NS 256  /* bytes of a namespace, as keys.MAX_NAMESPACE_BYTES */
#define MAX_NAME (3 + MAX_NS + 1 + 2 * MAX_HASH)  /* kv:{ns}:{hex} */

static PyObject *s_get_now, *s_view, *s_release, *s_max_chain;

static void kv_clear(Kv *kv) {
    Py_CLEAR(kv->records);
    Py_CLEAR(kv->key_type);
    Py_CLEAR(kv->rec_type);
    Py_CLEAR(kv->store);
    Py_CLEAR(kv->not_now);
    Py_CLEAR(kv->values);
    Py_CLEAR(kv->dram);
    Py_CLEAR(kv->dram_name);
    Py_CLEAR(kv->dram_chunks);
    Py_CLEAR(kv->tiers);
    if (kv->name != NULL) Py_SET_SIZE(kv->name, MAX_NAME);  /* as it was made */
    Py_CLEAR(kv->name);
}

static int kv_slot(PyObject *tp, const char *name, Py_ssize_t *at) {
    PyObject *n = PyUnicode_FromString(name);
    if (n == NULL) return -1;
    *at = slot_offset(tp, n);
    Py_DECREF(n);
    if (PyErr_Occurred()) return -1;
    if (*at < 0) {
        PyErr_Format(PyExc_TypeError, "%R has no writable slot %s", tp, name);
        return -1;
    }
    return 0;
}

static PyObject *kv_new_key(Kv *kv, PyObject *ns, PyObject *hash);
static Py_hash_t pair_hash(PyObject *a, PyObject *b);

/* FastPath.bind_kv(records, ChunkKey, ChunkRecord, store, NOT_NOW, dram, dram_chunks, tiers,
 * remote, values): the store's structures; records None unbinds. */
static PyObject *fp_bind_kv(FastPath *fp, PyObject *args) {
    PyObject *rec, *kt, *rt, *store, *nn, *dram, *chunks, *tiers, *values;
    int remote;
    if (!PyArg_ParseTuple(args, "OOOOOOOOpO", &rec, &kt, &rt, &store, &nn, &dram, &chunks,
                          &tiers, &remote, &values))
        return NULL;
    Kv *kv = &fp->kv;
    kv_clear(kv);
    if (rec == Py_None) Py_RETURN_NONE;
    if (!PyDict_CheckExact(rec) || !PyType_Check(kt) || !PyType_Check(rt) ||
        !PyList_CheckExact(tiers) || !PyDict_CheckExact(values) ||
        (dram != Py_None && !PyDict_CheckExact(chunks))) {
        PyErr_SetString(PyExc_TypeError, "unexpected store layout");
        return NULL;
    }
    if (kv_slot(kt, "namespace", &kv->key_ns_at) < 0 || kv_slot(kt, "hash", &kv->key_hash_at) < 0 ||
        kv_slot(rt, "tiers", &kv->tiers_at) < 0 || kv_slot(rt, "expire_at", &kv->expire_at) < 0 ||
        kv_slot(rt, "last_access", &kv->access_at) < 0 ||
        kv_slot(rt, "moving", &kv->moving_at) < 0 || kv_slot(rt, "size", &kv->size_at) < 0 ||
        kv_slot(rt, "key", &kv->rkey_at) < 0)
        return NULL;
    PyTypeObject *ktp = (PyTypeObject *)kt;
    kv->raw_key = ktp->tp_dictoffset == 0 && ktp->tp_itemsize == 0 &&
                  ktp->tp_basicsize == (Py_ssize_t)(sizeof(PyObject) + 2 * sizeof(PyObject *));
    Py_INCREF(rec); kv->records = rec;
    Py_INCREF(kt); kv->key_type = kt;
    Py_INCREF(rt); kv->rec_type = rt;
    Py_INCREF(store); kv->store = store;
    Py_INCREF(nn); kv->not_now = nn;
    Py_INCREF(values); kv->values = values;
    Py_INCREF(tiers); kv->tiers = tiers;
    kv->remote = remote;
    kv->name = PyBytes_FromStringAndSize(NULL, MAX_NAME);
    if (kv->name == NULL) { kv_clear(kv); return NULL; }
    if (dram != Py_None) {
        kv->dram_name = PyObject_GetAttrString(dram, "name");
        if (kv->dram_name == NULL) { kv_clear(kv); return NULL; }
        Py_INCREF(dram); kv->dram = dram;
        Py_INCREF(chunks); kv->dram_chunks = chunks;
    }
    /* the known-hash probe only when a real key hashes as the tuple of its fields */
    kv->hash_known = 0;
    PyObject *ns = PyUnicode_FromString("probe@ns"), *h = PyBytes_FromString("\x01probe");
    PyObject *key = ns && h ? kv_new_key(kv, ns, h) : NULL;
    PyObject *called = ns && h ? PyObject_CallFunctionObjArgs(kt, ns, h, NULL) : NULL;
    PyObject *tuple = ns && h ? PyTuple_Pack(2, ns, h) : NULL;
    if (key && called && tuple) {
        Py_hash_t a = PyObject_Hash(key), b = PyObject_Hash(called), c = PyObject_Hash(tuple);
        Py_hash_t d = pair_hash(ns, h);
        int eq = PyObject_RichCompareBool(key, called, Py_EQ);
        if (a == -1 || b == -1 || c == -1 || eq < 0) goto probe_done;
        if (eq != 1) {  /* a ChunkKey built from its slots must be the real thing */
            PyErr_SetString(PyExc_TypeError, "ChunkKey built from its slots differs");
            goto probe_done;
        }
        kv->hash_known = a == c && b == c && d == c;
    }
probe_done:
    Py_XDECREF(ns); Py_XDECREF(h); Py_XDECREF(key); Py_XDECREF(called); Py_XDECREF(tuple);
    if (PyErr_Occurred()) { kv_clear(kv); return NULL; }
    Py_RETURN_NONE;
}

/* FastPath.kv_info() -> (bound, raw_key, hash_known, remote): how bind_kv found the store */
static PyObject *fp_kv_info(FastPath *fp, PyObject *unused) {
    Kv *kv = &fp->kv;
    return Py_BuildValue("(iiii)", kv->records != NULL, kv->raw_key, kv->hash_known, kv->remote);
}

/* ChunkKey(ns, hash) as a new reference */
static PyObject *kv_new_key(Kv *kv, PyObject *ns, PyObject *hash) {
    if (!kv->raw_key) return PyObject_CallFunctionObjArgs(kv->key_type, ns, hash, NULL);
    PyTypeObject *tp = (PyTypeObject *)kv->key_type;
    PyObject *k = tp->tp_alloc(tp, 0);
    if (k == NULL) return NULL;
    slot_set(k, kv->key_ns_at, NULL, ns);
    slot_set(k, kv->key_hash_at, NULL, hash);
    return k;
}

/* hash((ns, hash)) without the tuple: CPython's tuple hash (xxHash-style, 3.8 and later) over
 * the two items' own hashes (cached in str and bytes objects). bind_kv checks it against
 * hash(ChunkKey(...)) once; where they differ the dict probes call ChunkKey.__hash__. */
static Py_hash_t pair_hash(PyObject *a, PyObject *b) {
    const Py_uhash_t p1 = 11400714785074694791ULL, p2 = 14029467366897019727ULL,
                     p5 = 2870177450012600261ULL;
    Py_uhash_t acc = p5;
    PyObject *items[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        Py_uhash_t lane = (Py_uhash_t)PyObject_Hash(items[i]);
        if (lane == (Py_uhash_t)-1) return -1;
        acc += lane * p2;
        acc = (acc << 31) | (acc >> 33);
        acc *= p1;
    }
    acc += 2 ^ (p5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) return 1546275796;
    return (Py_hash_t)acc;
}

/* records[key] (borrowed; NULL with or without an error) */
static PyObject *kv_probe(Kv *kv, PyObject *key, PyObject *ns, PyObject *hash) {
    if (!kv->hash_known) return PyDict_GetItemWithError(kv->records, key);
    Py_hash_t code = pair_hash(ns, hash);
    return code == -1 ? NULL : _PyDict_GetItem_KnownHash(kv->records, key, code);
}

/* The record the keyspace names kv:{ns}:{hex}, when it is the index's record of (ns, h):
 * found through the record's own key object, the dict probe is an identity check (a key built
 * here would be compared through ChunkKey.__eq__, Python code). Borrowed, or NULL.
 *
 * The name is written into kv->name, a bytes object nothing else refers to (its reference
 * count is 1: a dict probe keeps no reference to its key), and probed with its hash computed
 * here: no bytes object made and freed per hash. Should anything hold it, a new one is made. */
static PyObject *kv_by_name(FastPath *fp, const Arg *ns, const Arg *h) {
    Kv *kv = &fp->kv;
    static const char hex[] = "0123456789abcdef";
    int scratch = kv->name != NULL && Py_REFCNT(kv->name) == 1;
    char local[MAX_NAME + 1];
    char *name = scratch ? PyBytes_AS_STRING(kv->name) : local;
    Py_ssize_t n = 0;
    memcpy(name, "kv:", 3);
    n = 3;
    memcpy(name + n, ns->p, (size_t)ns->n);
    n += ns->n;
    name[n++] = ':';
    for (Py_ssize_t i = 0; i < h->n; i++) {
        unsigned char c = (unsigned char)h->p[i];
        name[n++] = hex[c >> 4];
        name[n++] = hex[c & 15];
    }
    PyObject *rec;
    if (scratch) {
        name[n] = '\0';
        Py_SET_SIZE(kv->name, n);
#if PY_VERSION_HEX < 0x030D0000
        _Py_COMP_DIAG_PUSH
        _Py_COMP_DIAG_IGNORE_DEPR_DECLS
        ((PyBytesObject *)kv->name)->ob_shash = -1;  /* the cached hash of the last name */
        _Py_COMP_DIAG_POP
#endif
        rec = _PyDict_GetItem_KnownHash(fp->data, kv->name, _Py_HashBytes(name, n));
    } else {
        PyObject *kb = PyBytes_FromStringAndSize(name, n);
        if (kb == NULL) return NULL;
        rec = PyDict_GetItemWithError(fp->data, kb);
        Py_DECREF(kb);
    }
    if (rec == NULL || Py_TYPE(rec) != (PyTypeObject *)kv->rec_type) return NULL;
    PyObject *key = *(PyObject **)((char *)rec + kv->rkey_at);
    if (key == NULL || Py_TYPE(key) != (PyTypeObject *)kv->key_type) return NULL;
    PyObject *kns = *(PyObject **)((char *)key + kv->key_ns_at);
    PyObject *kh = *(PyObject **)((char *)key + kv->key_hash_at);
    if (kns == NULL || kh == NULL || !PyUnicode_CheckExact(kns) || !PyUnicode_IS_COMPACT_ASCII(kns) ||
        PyUnicode_GET_LENGTH(kns) != ns->n || memcmp(PyUnicode_DATA(kns), ns->p, (size_t)ns->n) ||
        !PyBytes_CheckExact(kh) || PyBytes_GET_SIZE(kh) != h->n ||
        memcmp(PyBytes_AS_STRING(kh), h->p, (size_t)h->n))
        return NULL;
    Py_INCREF(rec);
    PyObject *indexed = kv_probe(kv, key, kns, kh);
    Py_DECREF(rec);  /* still held by the keyspace: nothing ran that could drop it */
    return indexed == rec ? rec : NULL;
}

/* index.get(ChunkKey(ns, h)): a borrowed record, or NULL (an error set or not). ``*ns``: the
 * namespace as a str, made here the first time a hash needs it (NULL until then; the
 * caller releases it). */
static PyObject *kv_record(FastPath *fp, PyObject **ns, const Arg *nsarg, const Arg *h) {
    Kv *kv = &fp->kv;
    PyObject *rec = kv_by_name(fp, nsarg, h);
    if (rec != NULL || PyErr_Occurred()) return rec;
    if (*ns == NULL && (*ns = PyUnicode_DecodeASCII(nsarg->p, nsarg->n, NULL)) == NULL)
        return NULL;
    PyObject *hash = PyBytes_FromStringAndSize(h->p, h->n);  /* the index decides */
    if (hash == NULL) return NULL;
    PyObject *key = kv_new_key(kv, *ns, hash);
    rec = key == NULL ? NULL : kv_probe(kv, key, *ns, hash);
    Py_XDECREF(key);
    Py_DECREF(hash);
    return rec;
}

static int valid_ns(const Arg *a) {
    if (a->n < 1 || a->n > MAX_NS) return 0;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        unsigned char c = (unsigned char)a->p[i];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) continue;
        if (c == 0 || strchr("_.:@/+=,#%~^-", c) == NULL) return 0;
    }
    return 1;
}

/* Optimal-string-alignment distance of a (upper-cased) and b is at most 1 (commands/_near.py) */
static int within_one_edit(const char *a, Py_ssize_t na, const char *b, Py_ssize_t nb) {
    if (na == nb) {
        Py_ssize_t d[3], nd = 0;
        for (Py_ssize_t i = 0; i < na && nd < 3; i++)
            if (a[i] != b[i]) d[nd++] = i;
        if (nd <= 1) return 1;
        return nd == 2 && d[1] == d[0] + 1 && a[d[0]] == b[d[1]] && a[d[1]] == b[d[0]];
    }
    if (na - nb != 1 && nb - na != 1) return 0;
    const char *s = na < nb ? a : b, *l = na < nb ? b : a;
    Py_ssize_t ns = na < nb ? na : nb, i = 0;
    while (i < ns && s[i] == l[i]) i++;
    return memcmp(s + i, l + i + 1, (size_t)(ns - i)) == 0;
}

/* KV.MATCH's last hash is an option word but for case or one edit: the Python handler logs a
 * warning about it (commands/_near.py), so the command is its. */
static int option_like(const Arg *a) {
    if (a->n < 7 || a->n > 10) return 0;
    char up[10];
    for (Py_ssize_t i = 0; i < a->n; i++) {
        char c = a->p[i];
        up[i] = c >= 'a' && c <= 'z' ? (char)(c - 'a' + 'A') : c;
    }
    return within_one_edit(up, a->n, "WITHTIERS", 9) || within_one_edit(up, a->n, "PREFETCH", 8);
}

/* The arguments are a chain for us: a valid namespace, 1..max-chain-chunks hashes of 1..64
 * bytes, a last hash that is not KV.MATCH's option word nor one edit from one (KV.MGET hands
 * those over too: harmless). 1 for us, 0 not (never an error). */
static int kv_chain(Kv *kv, const Arg *argv, int argc) {
    if (kv->records == NULL || argc < 3 || !valid_ns(&argv[1])) return 0;
    const Arg *last = &argv[argc - 1];
    if (name_is(last, "WITHTIERS") || name_is(last, "PREFETCH") || option_like(last)) return 0;
    long long limit = config_int(kv->values, s_max_chain);
    if (PyErr_Occurred()) PyErr_Clear();
    if (limit < 0 || argc - 2 > limit) return 0;  /* the error reply is Python's */
    for (int i = 2; i < argc; i++)
        if (argv[i].n < 1 || argv[i].n > MAX_HASH) return 0;
    return 1;
}

static int is_true_slot(PyObject *obj, Py_ssize_t at) {
    PyObject *v = *(PyObject **)((char *)obj + at);
    return v == NULL ? -1 : PyObject_IsTrue(v);
}

/* KV.MATCH ns hash...: 1 done, 0 not for us (nothing changed), -1 error */
static int do_match(FastPath *fp, const Arg *argv, int argc, Out *o) {
    Kv *kv = &fp->kv;
    if (!kv_chain(kv, argv, argc)) return 0;
    PyObject *ns = NULL;  /* made by kv_record when a hash is not found by its name */
    PyObject *found[MAX_ARGV];
    int n = 0, rc = 1;
    for (int i = 2; i < argc; i++) {
        PyObject *rec = kv_record(fp, &ns, &argv[1], &argv[i]);
        if (rec == NULL) {
            if (PyErr_Occurred()) rc = -1;
            break;
        }
        if (Py_TYPE(rec) != (PyTypeObject *)kv->rec_type) { rc = 0; break; }
        PyObject *tiers = *(PyObject **)((char *)rec + kv->tiers_at);
        PyObject *exp = *(PyObject **)((char *)rec + kv->expire_at);
        if (tiers == NULL || !PyAnySet_CheckExact(tiers) || exp == NULL) { rc = 0; break; }
        if (PySet_GET_SIZE(tiers) == 0) break;  /* not held anywhere: the match ends */
        if (exp != Py_None) { rc = 0; break; }  /* a TTL: expiry is Python's */
        Py_INCREF(rec);
        found[n++] = rec;
    }
    if (rc == 1 && n < argc - 2 && kv->remote) rc = 0;  /* s3 may extend it: I/O */
    PyObject *stamp = NULL;
    if (rc == 1 && n > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic's clock */
        stamp = PyFloat_FromDouble((double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
        if (stamp == NULL) rc = -1;
    }
    if (rc == 1 && out_int(o, n) < 0) rc = -1;
    if (rc == 1)
        for (int i = 0; i < n; i++) slot_set(found[i], kv->access_at, NULL, stamp);
    for (int i = 0; i < n; i++) Py_DECREF(found[i]);
    Py_XDECREF(stamp);
    Py_XDECREF(ns);
    return rc;
}

/* KV.MGET's first pass: every hash a clean miss (no shared tier) or a DRAM hit get_now serves
 * (no TTL, not moving, its slot in the arena), LARGE_VALUE bytes at most in all. */
static int mget_ours(FastPath *fp, PyObject *ns, const Arg *argv, int argc) {
    Kv *kv = &fp->kv;
    if (kv->dram == NULL || kv->remote || PyList_GET_SIZE(kv->tiers) == 0 ||
        PyList_GET_ITEM(kv->tiers, 0) != kv->dram)
        return 0;
    long long total = 0;
    for (int i = 2; i < argc; i++) {
        PyObject *rec = kv_record(fp, &ns, &argv[1], &argv[i]);  /* (ns is made already) */
        if (rec == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        if (Py_TYPE(rec) != (PyTypeObject *)kv->rec_type) return 0;
        Py_INCREF(rec);
        PyObject *tiers = *(PyObject **)((char *)rec + kv->tiers_at);
        PyObject *exp = *(PyObject **)((char *)rec + kv->expire_at);
        PyObject *size = *(PyObject **)((char *)rec + kv->size_at);
        PyObject *rkey = *(PyObject **)((char *)rec + kv->rkey_at);
        int ok = tiers != NULL && PyAnySet_CheckExact(tiers) && exp == Py_None &&
                 size != NULL && PyLong_CheckExact(size) && rkey != NULL;
        if (ok) ok = is_true_slot(rec, kv->moving_at) == 0;
        if (ok) ok = PySet_Contains(tiers, kv->dram_name);
        if (ok == 1) {  /* the arena holds its slot (ChunkKey's __hash__ may run Python) */
            Py_INCREF(rkey);
            ok = PyDict_Contains(kv->dram_chunks, rkey);
            Py_DECREF(rkey);
        }
        if (ok == 1) {
            total += PyLong_AsLongLong(size);
            if (total >= fp->large_value) ok = 0;
        }
        Py_DECREF(rec);
        if (ok != 1) return PyErr_Occurred() ? -1 : 0;
    }
    return 1;
}

/* one chunk read through store.get_now and copied into the reply; 1 hit, 0 miss, -1 error */
static int mget_one(Kv *kv, PyObject *ns, const Arg *h, Out *o, int resp3) {
    PyObject *hash = PyBytes_FromStringAndSize(h->p, h->n);
    PyObject *payload = hash == NULL ? NULL
        : PyObject_CallMethodObjArgs(kv->store, s_get_now, ns, hash, NULL);
    Py_XDECREF(hash);
    if (payload == NULL) return -1;
    if (payload == Py_None) {
        Py_DECREF(payload);
        return (resp3 ? out_put(o, "_\r\n", 3) : out_put(o, "$-1\r\n", 5)) < 0 ? -1 : 0;
    }
    if (payload == kv->not_now) {
        /* the first pass said it would serve it: get_now's conditions changed without
         * mget_ours's. Reported; the Python path answers the command (the right bytes; the
         * chunks read before this one count twice in the hit counters) */
        Py_DECREF(payload);
        PyErr_SetString(PyExc_RuntimeError, "KV.MGET: get_now declined a chunk checked");
        return -1;
    }
    PyObject *view = PyObject_GetAttr(payload, s_view);
    PyObject *release = view == NULL ? NULL : PyObject_GetAttr(payload, s_release);
    Py_DECREF(payload);
    int rc = -1;
    Py_buffer buf;
    if (release != NULL && PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE) == 0) {
        rc = out_bulk(o, buf.buf, buf.len) < 0 ? -1 : 1;
        PyBuffer_Release(&buf);
    }
    if (release != NULL && release != Py_None) {  /* the pin, even when the copy failed */
        PyObject *r = PyObject_CallNoArgs(release);
        if (r == NULL) rc = -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(view);
    Py_XDECREF(release);
    return rc;
}

/* KV.MGET ns hash...: 1 done, 0 not for us (nothing changed), -1 error (see the top) */
static int do_mget(FastPath *fp, Run *run, const Arg *argv, int argc, Out *o, int resp3) {
    Kv *kv = &fp->kv;
    if (!kv_chain(kv, argv, argc)) return 0;
    PyObject *ns = PyUnicode_DecodeASCII(argv[1].p, argv[1].n, NULL);  /* get_now's */
    if (ns == NULL) return -1;
    int rc = mget_ours(fp, ns, argv, argc);
    if (rc == 1) {
        Py_ssize_t mark = o->len;
        char head[32];
        rc = out_put(o, head, format_line(head, '*', argc - 2)) < 0 ? -1 : 1;
        long long hits = 0, misses = 0;
        for (int i = 2; i < argc && rc == 1; i++) {
            int one = mget_one(kv, ns, &argv[i], o, resp3);
            if (one < 0) rc = -1;
            else if (one) hits++;
            else misses++;
        }
        if (rc == 1) {
            run->hits += hits;  /* INFO keyspace_hits/misses, as kv._count */
            run->misses += misses;
        } else {
            o->len = mark;
        }
    }
    Py_DECREF(ns);
    return rc;
}

#endif
