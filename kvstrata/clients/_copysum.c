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
#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include "_xxhash/xxhash.h"
#ifdef KVS_XXH_DISPATCH
#include "_xxhash/xxh_x86dispatch.h"
#endif

/* The copy goes in blocks of 64 KiB (L2 is 512 KiB per core and up on current x86), each
 * hashed right after it is copied.
 *
 * A buffer below NT_MIN bytes is copied with ordinary stores and each block hashed from the
 * slot, where it is still cached. From NT_MIN up (a core's L2: a larger slot would not stay
 * cached anyway) it is copied with non-temporal stores, which skip the read-for-ownership of
 * the destination (memcpy streams only its largest copies; 64 one-MiB slots filled streaming
 * ran at 0.9-1.2x memcpy's throughput, with ordinary stores at 0.8-0.9x, on a loaded 2-core
 * EPYC), and each block is hashed from the source, which the copy has just pulled into the
 * cache: a slot written with streaming stores is not cached, and hashing it would read it back
 * from memory. Either way the bytes cross memory once. A source that another thread changes
 * during the copy (an engine bug) can then leave a digest that does not match the slot: the
 * chunk fails verification and is dropped, as for any wrong digest (KV.COMMIT DIGEST); its
 * bytes are never taken for others.
 *
 * The x86 copy aligns the destination to 32 bytes and loads the source unaligned (AVX2 where
 * the CPU has it, else SSE2): memcpy's `rep movsb` runs at 0.6-0.9x of its best when source
 * and destination differ in alignment (an engine's buffer 16 bytes past a page, a slot on a
 * page boundary). Elsewhere the blocks go through memcpy. */
#define BLOCK ((size_t)64 * 1024)
#define NT_MIN ((size_t)512 * 1024)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVS_X86 1

__attribute__((target("avx2"))) static void copy_avx2(char *dst, const char *src, size_t n,
                                                      int nt)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    if (nt) {
        for (; i + 128 <= n; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
            _mm256_stream_si256((__m256i *)(dst + i), a);
            _mm256_stream_si256((__m256i *)(dst + i + 32), b);
            _mm256_stream_si256((__m256i *)(dst + i + 64), c);
            _mm256_stream_si256((__m256i *)(dst + i + 96), d);
        }
    } else {
        for (; i + 128 <= n; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
            _mm256_store_si256((__m256i *)(dst + i), a);
            _mm256_store_si256((__m256i *)(dst + i + 32), b);
            _mm256_store_si256((__m256i *)(dst + i + 64), c);
            _mm256_store_si256((__m256i *)(dst + i + 96), d);
        }
    }
    memcpy(dst + i, src + i, n - i);
}

static void copy_sse2(char *dst, const char *src, size_t n, int nt)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        if (nt) {
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        } else {
            _mm_store_si128((__m128i *)(dst + i), a);
            _mm_store_si128((__m128i *)(dst + i + 16), b);
            _mm_store_si128((__m128i *)(dst + i + 32), c);
            _mm_store_si128((__m128i *)(dst + i + 48), d);
        }
    }
    memcpy(dst + i, src + i, n - i);
}

static int have_avx2 = -1;
#endif

/* Copy one block; nt: with streaming stores (x86 only; the caller fences once at the end). */
static void copy_block(char *dst, const char *src, size_t n, int nt)
{
#ifdef KVS_X86
    if (have_avx2)
        copy_avx2(dst, src, n, nt);
    else
        copy_sse2(dst, src, n, nt);
#else
    (void)nt;
    memcpy(dst, src, n);
#endif
}

static int copy_and_hash(char *dst, const char *src, size_t n, XXH3_state_t *st)
{
#ifdef KVS_X86
    int nt = n >= NT_MIN;
#else
    int nt = 0;
#endif
    int rc = 0;
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t len = n - off < BLOCK ? n - off : BLOCK;
        copy_block(dst + off, src + off, len, nt);
        /* the cached copy of the block: the slot's, or (streamed) the source's */
        if (XXH3_128bits_update(st, nt ? src + off : dst + off, len) != XXH_OK) {
            rc = -1;
            break;
        }
    }
#ifdef KVS_X86
    if (nt)
        _mm_sfence(); /* the streamed stores are visible before the caller's KV.COMMIT */
#endif
    return rc;
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

/* _use_avx2(flag) -> the previous setting: tests run the SSE2 loop on an AVX2 CPU with it
 * (flag 0); a flag of 1 is kept only where the CPU has AVX2. */
static PyObject *use_avx2(PyObject *self, PyObject *arg)
{
    int flag = PyObject_IsTrue(arg);
    if (flag < 0)
        return NULL;
#ifdef KVS_X86
    int was = have_avx2;
    have_avx2 = flag && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(was);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"_use_avx2", use_avx2, METH_O, "_use_avx2(flag) -> bool: tests only (the SSE2 loop)."},
    {"copy_checksum", copy_checksum, METH_VARARGS,
     "copy_checksum(dst, src) -> bytes: copy src into dst (same length, C-contiguous) and "
     "return the xxh3-128 digest of the bytes (canonical, 16 bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstrata.clients._copysum", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__copysum(void)
{
#ifdef KVS_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    return PyModule_Create(&module);
}
