/* Copy a buffer and compute its xxh3-128 checksum in one pass (kvstrata.clients.copysum).
 *
 * A zero-copy put copies the engine's bytes into a shared-memory slot; the server then hashed
 * the slot again at KV.COMMIT, a second pass over memory that cost about half of the copy.
 * Here the copy goes in blocks small enough to stay in the L1/L2 cache, and each block is
 * hashed right after it is copied, while it is still there: the hash reads no memory.
 * The digest is the same 16 bytes as Python's xxhash.xxh3_128_digest (canonical, big-endian),
 * computed by the vendored xxHash 0.8.4 (_xxhash/, BSD-2-Clause) with its x86 runtime
 * dispatch (SSE2 / AVX2 / AVX-512, whichever the CPU has).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include "_xxhash/xxhash.h"
#ifdef KVS_XXH_DISPATCH
#include "_xxhash/xxh_x86dispatch.h"
#endif

/* 256 KiB: a copied block is hashed from L2 (1 MiB per core here, 256 KiB and up on x86);
 * smaller blocks cost memcpy its large-copy strategy, larger ones leave the cache. */
#define BLOCK ((size_t)256 * 1024)

static int copy_and_hash(char *dst, const char *src, size_t n, XXH3_state_t *st)
{
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t len = n - off < BLOCK ? n - off : BLOCK;
        memcpy(dst + off, src + off, len);
        if (XXH3_128bits_update(st, dst + off, len) != XXH_OK)
            return -1;
    }
    return 0;
}

static PyObject *copy_checksum(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy_checksum", &dst, &src))
        return NULL;
    PyObject *out = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_checksum: %zd bytes do not fill a %zd-byte buffer",
                     src.len, dst.len);
        goto done;
    }
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int rc = XXH3_128bits_reset(st);
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = copy_and_hash((char *)dst.buf, (const char *)src.buf, (size_t)dst.len, st);
        Py_END_ALLOW_THREADS
    }
    if (rc != 0) {
        PyErr_SetString(PyExc_RuntimeError, "copy_checksum: xxh3 update failed");
    } else {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
        out = PyBytes_FromStringAndSize((const char *)c.digest, sizeof c.digest);
    }
    XXH3_freeState(st);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_checksum", copy_checksum, METH_VARARGS,
     "copy_checksum(dst, src) -> bytes: copy src into dst (same length, C-contiguous) and "
     "return the xxh3-128 digest of the bytes (canonical, 16 bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstrata.clients._copysum", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module); }
