/* Static rANS over a byte alphabet and the 16-bit plane split of kvstrata's lossless codecs.
 *
 * Modes say what the symbols of a buffer are: 0 its bytes, 1 its 4-bit halves (low first),
 * 2 the exponent byte of each bf16, 3 the high byte of each fp16.
 *
 * histogram(data[, mode]) -> bytes      256 u64 LE symbol counts
 * encode(data, freqs[, mode]) -> bytes
 *     freqs: 256 little-endian u16, summing to 4096 (12-bit probabilities); every symbol of
 *     `data` must have a non-zero frequency. Eight interleaved rANS states (32 bits, 16-bit
 *     renormalisation, as in Fabian Giesen's ryg_rans); symbol i goes to state i % 8. The
 *     output is the eight final states (u32 LE) then the 16-bit words in the order the decoder
 *     reads them.
 * decode(coded, freqs, out[, mode, plane])
 *     fills `out` (writable): mode 0 one symbol per byte, 1 two per byte, 2/3 one per 16-bit
 *     value, merged with `plane` (the sign+mantissa bytes, bf16; the low bytes, fp16).
 *     Anything that could not have come from encode() (short or long input, a state out of
 *     range, words left over, states that do not end where encode() starts them, a bad table,
 *     a 4-bit table with larger symbols) raises ValueError: never reads or writes out of
 *     bounds, whatever the input.
 * split16(data, kind) -> (a, b)     kind 0 bf16: a = exponent, b = sign | 7 mantissa bits;
 *                                   kind 1 fp16: a = high byte, b = low byte.
 * merge16(a, b, out, kind)          the inverse of split16, into `out` (2 * len(a) bytes).
 *
 * The loops run without the GIL, so the tiers' executor threads code chunks in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SCALE_BITS 12
#define SCALE (1u << SCALE_BITS)
#define RANS_L (1u << 16)
#define STATES 8
#define MODE_BYTES 0 /* one symbol per byte */
#define MODE_NIB4 1  /* two symbols per byte, low nibble first */
#define MODE_BF16 2  /* the exponent of each bf16 (the sign+mantissa plane travels apart) */
#define MODE_FP16 3  /* the high byte of each fp16 */

static int load_table(Py_buffer *fb, uint32_t freq[256], uint32_t cum[257]) {
    const uint8_t *f = (const uint8_t *)fb->buf;
    uint32_t total = 0;
    if (fb->len != 512) {
        PyErr_SetString(PyExc_ValueError, "rans: the table must be 256 u16 frequencies");
        return -1;
    }
    for (int s = 0; s < 256; s++) {
        freq[s] = (uint32_t)f[2 * s] | ((uint32_t)f[2 * s + 1] << 8);
        cum[s] = total;
        total += freq[s];
    }
    cum[256] = total;
    if (total != SCALE) {
        PyErr_SetString(PyExc_ValueError, "rans: frequencies do not sum to 4096");
        return -1;
    }
    return 0;
}

/* The i-th symbol of `src` in `mode` (see the module comment). */
static inline uint32_t symbol_at(const uint8_t *src, Py_ssize_t i, int mode) {
    switch (mode) {
    case MODE_NIB4: return (src[i >> 1] >> (4 * (i & 1))) & 0x0f;
    case MODE_BF16: return (uint8_t)((src[2 * i + 1] << 1) | (src[2 * i] >> 7));
    case MODE_FP16: return src[2 * i + 1];
    default: return src[i];
    }
}

/* Symbols in `len` bytes of `mode`, or -1 (bad length or mode, exception set). */
static Py_ssize_t symbol_count(Py_ssize_t len, int mode) {
    switch (mode) {
    case MODE_BYTES: return len;
    case MODE_NIB4: return 2 * len;
    case MODE_BF16:
    case MODE_FP16:
        if (len % 2 == 0) return len / 2;
        break;
    default: break;
    }
    PyErr_SetString(PyExc_ValueError, "rans: unknown mode or a length the mode cannot split");
    return -1;
}

static PyObject *histogram(PyObject *self, PyObject *args) {
    Py_buffer src;
    int mode = MODE_BYTES;
    if (!PyArg_ParseTuple(args, "y*|i", &src, &mode)) return NULL;
    Py_ssize_t n = symbol_count(src.len, mode);
    if (n < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    uint64_t h[4][256];
    memset(h, 0, sizeof h);
    const uint8_t *in = (const uint8_t *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    if (mode == MODE_BYTES) {
        Py_ssize_t i = 0;
        for (; i + 4 <= n; i += 4) {
            h[0][in[i]]++;
            h[1][in[i + 1]]++;
            h[2][in[i + 2]]++;
            h[3][in[i + 3]]++;
        }
        for (; i < n; i++) h[0][in[i]]++;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) h[i & 3][symbol_at(in, i, mode)]++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyObject *result = PyBytes_FromStringAndSize(NULL, 256 * 8);
    if (result == NULL) return NULL;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
    for (int s = 0; s < 256; s++) {
        uint64_t c = h[0][s] + h[1][s] + h[2][s] + h[3][s];
        for (int b = 0; b < 8; b++) o[8 * s + b] = (uint8_t)(c >> (8 * b));
    }
    return result;
}

static PyObject *rans_encode(PyObject *self, PyObject *args) {
    Py_buffer src, fb;
    int mode = MODE_BYTES;
    uint32_t freq[256], cum[257];
    if (!PyArg_ParseTuple(args, "y*y*|i", &src, &fb, &mode)) return NULL;
    PyObject *result = NULL;
    uint8_t *tmp = NULL;
    if (load_table(&fb, freq, cum) < 0) goto done;
    Py_ssize_t n = symbol_count(src.len, mode);
    if (n < 0) goto done;
    size_t cap = (size_t)n * 2 + 16;
    tmp = (uint8_t *)PyMem_RawMalloc(cap);
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *in = (const uint8_t *)src.buf;
    uint8_t *end = tmp + cap, *p = end;
    uint32_t x[STATES];
    for (int j = 0; j < STATES; j++) x[j] = RANS_L;
    int missing = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        uint32_t s = symbol_at(in, i, mode), fs = freq[s];
        uint32_t *xs = &x[i & (STATES - 1)];
        if (fs == 0) {
            missing = 1;
            break;
        }
        uint64_t xmax = ((uint64_t)(RANS_L >> SCALE_BITS) << 16) * fs;
        if ((uint64_t)*xs >= xmax) {
            p -= 2;
            p[0] = (uint8_t)(*xs & 0xff);
            p[1] = (uint8_t)((*xs >> 8) & 0xff);
            *xs >>= 16;
        }
        *xs = ((*xs / fs) << SCALE_BITS) + (*xs % fs) + cum[s];
    }
    Py_END_ALLOW_THREADS
    if (missing) {
        PyErr_SetString(PyExc_ValueError, "rans: a symbol has no frequency in the table");
        goto done;
    }
    Py_ssize_t words = end - p;
    result = PyBytes_FromStringAndSize(NULL, 4 * STATES + words);
    if (result == NULL) goto done;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
    for (int j = 0; j < STATES; j++) {
        o[4 * j] = (uint8_t)x[j];
        o[4 * j + 1] = (uint8_t)(x[j] >> 8);
        o[4 * j + 2] = (uint8_t)(x[j] >> 16);
        o[4 * j + 3] = (uint8_t)(x[j] >> 24);
    }
    memcpy(o + 4 * STATES, p, (size_t)words);
done:
    if (tmp != NULL) PyMem_RawFree(tmp);
    PyBuffer_Release(&src);
    PyBuffer_Release(&fb);
    return result;
}

/* Store symbols [i, i + k) (already decoded into g) in `mode`'s output. */
static inline void put_symbols(uint8_t *out, const uint8_t *plane, const uint8_t *g,
                               Py_ssize_t i, int k, int mode) {
    switch (mode) {
    case MODE_NIB4:
        for (int j = 0; j < k; j++) {
            Py_ssize_t b = (i + j) >> 1;
            if ((i + j) & 1)
                out[b] |= (uint8_t)(g[j] << 4);
            else
                out[b] = g[j];
        }
        break;
    case MODE_BF16:
        for (int j = 0; j < k; j++) {
            uint8_t e = g[j], sm = plane[i + j];
            out[2 * (i + j)] = (uint8_t)((e << 7) | (sm & 0x7f));
            out[2 * (i + j) + 1] = (uint8_t)((sm & 0x80) | (e >> 1));
        }
        break;
    case MODE_FP16:
        for (int j = 0; j < k; j++) {
            out[2 * (i + j)] = plane[i + j];
            out[2 * (i + j) + 1] = g[j];
        }
        break;
    default:
        memcpy(out + i, g, (size_t)k);
    }
}

/* One symbol of state J (the caller guarantees 2 readable bytes at p). The table entry packs
 * symbol (8 bits), frequency - 1 (12) and slot bias (12). A branch, not a select: with a
 * select every state's read would wait on the previous state's renormalisation. */
#define STEP_FAST(J)                                                                          \
    do {                                                                                      \
        uint32_t e = tab[x##J & (SCALE - 1)];                                                 \
        g[J] = (uint8_t)e;                                                                    \
        x##J = (((e >> 8) & 0xfff) + 1) * (x##J >> SCALE_BITS) + (e >> 20);                   \
        if (x##J < RANS_L) {                                                                  \
            x##J = (x##J << 16) | (uint32_t)p[0] | ((uint32_t)p[1] << 8);                     \
            p += 2;                                                                           \
        }                                                                                     \
    } while (0)

static PyObject *rans_decode(PyObject *self, PyObject *args) {
    Py_buffer src, fb, dst, pl = {0};
    int mode = MODE_BYTES;
    uint32_t freq[256], cum[257];
    uint32_t tab[SCALE];
    if (!PyArg_ParseTuple(args, "y*y*w*|iy*", &src, &fb, &dst, &mode, &pl)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = -1;
    if (load_table(&fb, freq, cum) < 0) goto done;
    if (mode == MODE_BYTES) n = dst.len;
    else if (mode == MODE_NIB4) n = 2 * dst.len;
    else if ((mode == MODE_BF16 || mode == MODE_FP16) && dst.len % 2 == 0) n = dst.len / 2;
    if (n < 0 || ((mode == MODE_BF16 || mode == MODE_FP16) ? pl.buf == NULL || pl.len != n
                                                            : pl.buf != NULL)) {
        PyErr_SetString(PyExc_ValueError, "rans: output, mode and plane do not agree");
        goto done;
    }
    if (mode == MODE_NIB4)
        for (int s = 16; s < 256; s++)
            if (freq[s]) {
                PyErr_SetString(PyExc_ValueError, "rans: a 4-bit stream with symbols over 15");
                goto done;
            }
    for (uint32_t s = 0; s < 256; s++)
        for (uint32_t slot = cum[s]; slot < cum[s] + freq[s]; slot++)
            tab[slot] = s | ((freq[s] - 1) << 8) | ((slot - cum[s]) << 20);
    const uint8_t *p = (const uint8_t *)src.buf, *end = p + src.len;
    if (src.len < 4 * STATES || (src.len - 4 * STATES) % 2) {
        PyErr_SetString(PyExc_ValueError, "rans: coded stream has a bad length");
        goto done;
    }
    uint32_t x[STATES];
    for (int j = 0; j < STATES; j++, p += 4) {
        x[j] = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
               ((uint32_t)p[3] << 24);
        if (x[j] < RANS_L) {
            PyErr_SetString(PyExc_ValueError, "rans: coded stream has a state out of range");
            goto done;
        }
    }
    uint8_t *out = (uint8_t *)dst.buf;
    const uint8_t *plane = (const uint8_t *)pl.buf;
    Py_ssize_t i = 0;
    int bad = 0;
    uint8_t g[STATES];
    Py_BEGIN_ALLOW_THREADS
    /* Fast groups while a whole group's words (at most one per state) are surely there. */
    {
        uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
        uint32_t x4 = x[4], x5 = x[5], x6 = x[6], x7 = x[7];
        for (; i + STATES <= n && end - p >= 2 * STATES; i += STATES) {
            STEP_FAST(0); STEP_FAST(1); STEP_FAST(2); STEP_FAST(3);
            STEP_FAST(4); STEP_FAST(5); STEP_FAST(6); STEP_FAST(7);
            switch (mode) { /* constant per call: predicted */
            case MODE_BYTES: memcpy(out + i, g, STATES); break;
            case MODE_BF16: put_symbols(out, plane, g, i, STATES, MODE_BF16); break;
            default: put_symbols(out, plane, g, i, STATES, mode); break;
            }
        }
        x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
        x[4] = x4, x[5] = x5, x[6] = x6, x[7] = x7;
    }
    /* The rest one symbol at a time, every read checked. */
    for (; i < n; i++) {
        int j = (int)(i & (STATES - 1));
        uint32_t e = tab[x[j] & (SCALE - 1)];
        g[0] = (uint8_t)e;
        x[j] = (((e >> 8) & 0xfff) + 1) * (x[j] >> SCALE_BITS) + (e >> 20);
        if (x[j] < RANS_L) {
            if (end - p < 2) {
                bad = 1;
                break;
            }
            x[j] = (x[j] << 16) | (uint32_t)p[0] | ((uint32_t)p[1] << 8);
            p += 2;
        }
        put_symbols(out, plane, g, i, 1, mode);
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rans: coded stream ends early");
        goto done;
    }
    int ok = p == end;
    for (int j = 0; j < STATES; j++) ok &= x[j] == RANS_L;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "rans: coded stream does not decode to its length");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&dst);
    if (pl.buf != NULL) PyBuffer_Release(&pl);
    return result;
}

static PyObject *split16(PyObject *self, PyObject *args) {
    Py_buffer src;
    int kind;
    if (!PyArg_ParseTuple(args, "y*i", &src, &kind)) return NULL;
    PyObject *a = NULL, *b = NULL, *result = NULL;
    if (src.len % 2 || (kind != 0 && kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "split16: odd length or unknown kind");
        goto done;
    }
    Py_ssize_t n = src.len / 2;
    a = PyBytes_FromStringAndSize(NULL, n);
    b = PyBytes_FromStringAndSize(NULL, n);
    if (a == NULL || b == NULL) goto done;
    const uint8_t *in = (const uint8_t *)src.buf;
    uint8_t *pa = (uint8_t *)PyBytes_AS_STRING(a), *pb = (uint8_t *)PyBytes_AS_STRING(b);
    Py_BEGIN_ALLOW_THREADS
    if (kind == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t lo = in[2 * i], hi = in[2 * i + 1];
            pa[i] = (uint8_t)((hi << 1) | (lo >> 7));
            pb[i] = (uint8_t)((hi & 0x80) | (lo & 0x7f));
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            pa[i] = in[2 * i + 1];
            pb[i] = in[2 * i];
        }
    }
    Py_END_ALLOW_THREADS
    result = PyTuple_Pack(2, a, b);
done:
    Py_XDECREF(a);
    Py_XDECREF(b);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *merge16(PyObject *self, PyObject *args) {
    Py_buffer a, b, dst;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*w*i", &a, &b, &dst, &kind)) return NULL;
    PyObject *result = NULL;
    if (a.len != b.len || dst.len != 2 * a.len || (kind != 0 && kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "merge16: plane lengths do not match the output");
        goto done;
    }
    const uint8_t *pa = (const uint8_t *)a.buf, *pb = (const uint8_t *)b.buf;
    uint8_t *out = (uint8_t *)dst.buf;
    Py_ssize_t n = a.len;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t e = pa[i], sm = pb[i];
            out[2 * i] = (uint8_t)((e << 7) | (sm & 0x7f));
            out[2 * i + 1] = (uint8_t)((sm & 0x80) | (e >> 1));
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            out[2 * i] = pb[i];
            out[2 * i + 1] = pa[i];
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", rans_encode, METH_VARARGS, "rANS-code bytes with a static 12-bit table."},
    {"decode", rans_decode, METH_VARARGS, "Decode a rANS stream into a writable buffer."},
    {"histogram", histogram, METH_VARARGS, "256 u64 byte counts."},
    {"split16", split16, METH_VARARGS, "Split 16-bit values into two byte planes."},
    {"merge16", merge16, METH_VARARGS, "Merge two byte planes into 16-bit values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rans", "Static rANS and 16-bit plane split.", -1, methods,
};

PyMODINIT_FUNC PyInit__rans(void) { return PyModule_Create(&module); }
