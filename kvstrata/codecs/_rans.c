/* Static rANS over a byte alphabet and the 16-bit plane split of kvstrata's lossless codecs.
 *
 * encode(symbols, freqs) -> bytes
 *     freqs: 256 little-endian u16, summing to 4096 (12-bit probabilities); every symbol of
 *     `symbols` must have a non-zero frequency. Four interleaved rANS states (32 bits, 16-bit
 *     renormalisation, as in Fabian Giesen's ryg_rans); symbol i goes to state i % 4. The
 *     output is the four final states (u32 LE) then the 16-bit words in the order the decoder
 *     reads them.
 * decode(coded, freqs, out)
 *     fills `out` (writable, one byte per symbol). Anything that could not have come from
 *     encode() (short or long input, a state out of range, words left over, states that do not
 *     end where encode() starts them, a bad table) raises ValueError: never reads or writes out
 *     of bounds, whatever the input.
 * histogram(data) -> bytes          256 u64 LE counts
 * split16(data, kind) -> (a, b)     kind 0 bf16: a = exponent, b = sign | 7 mantissa bits;
 *                                   kind 1 fp16: a = high byte (sign, exponent, 2 mantissa
 *                                   bits), b = low byte. len(data) must be even.
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
#define STATES 4

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

static PyObject *rans_encode(PyObject *self, PyObject *args) {
    Py_buffer src, fb;
    uint32_t freq[256], cum[257];
    if (!PyArg_ParseTuple(args, "y*y*", &src, &fb)) return NULL;
    PyObject *result = NULL;
    uint8_t *tmp = NULL;
    if (load_table(&fb, freq, cum) < 0) goto done;
    Py_ssize_t n = src.len;
    size_t cap = (size_t)n * 2 + 16;
    tmp = (uint8_t *)PyMem_RawMalloc(cap);
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *in = (const uint8_t *)src.buf;
    uint8_t *end = tmp + cap, *p = end;
    uint32_t x[STATES] = {RANS_L, RANS_L, RANS_L, RANS_L};
    int missing = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        uint32_t s = in[i], fs = freq[s];
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

#define DECODE_ONE(J)                                                                         \
    do {                                                                                      \
        uint32_t slot = x[J] & (SCALE - 1);                                                   \
        uint32_t s = lut[slot];                                                               \
        out[i + J] = (uint8_t)s;                                                              \
        x[J] = freq[s] * (x[J] >> SCALE_BITS) + slot - cum[s];                                \
        if (x[J] < RANS_L) {                                                                  \
            if (p + 2 > end) {                                                                \
                bad = 1;                                                                      \
                break;                                                                        \
            }                                                                                 \
            x[J] = (x[J] << 16) | (uint32_t)p[0] | ((uint32_t)p[1] << 8);                     \
            p += 2;                                                                           \
        }                                                                                     \
    } while (0)

static PyObject *rans_decode(PyObject *self, PyObject *args) {
    Py_buffer src, fb, dst;
    uint32_t freq[256], cum[257];
    uint8_t lut[SCALE];
    if (!PyArg_ParseTuple(args, "y*y*w*", &src, &fb, &dst)) return NULL;
    PyObject *result = NULL;
    if (load_table(&fb, freq, cum) < 0) goto done;
    for (int s = 0; s < 256; s++)
        memset(lut + cum[s], s, freq[s]);
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
    Py_ssize_t n = dst.len, i = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i + STATES <= n; i += STATES) {
        DECODE_ONE(0);
        if (bad) break;
        DECODE_ONE(1);
        if (bad) break;
        DECODE_ONE(2);
        if (bad) break;
        DECODE_ONE(3);
        if (bad) break;
    }
    if (!bad) {
        Py_ssize_t base = i;
        for (int j = 0; base + j < n && !bad; j++) {
            i = base;
            switch (j) {
            case 0: DECODE_ONE(0); break;
            case 1: DECODE_ONE(1); break;
            default: DECODE_ONE(2); break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rans: coded stream ends early");
        goto done;
    }
    if (p != end || x[0] != RANS_L || x[1] != RANS_L || x[2] != RANS_L || x[3] != RANS_L) {
        PyErr_SetString(PyExc_ValueError, "rans: coded stream does not decode to its length");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *histogram(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    uint64_t h[4][256];
    memset(h, 0, sizeof h);
    const uint8_t *in = (const uint8_t *)src.buf;
    Py_ssize_t n = src.len, i = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i + 4 <= n; i += 4) {
        h[0][in[i]]++;
        h[1][in[i + 1]]++;
        h[2][in[i + 2]]++;
        h[3][in[i + 3]]++;
    }
    for (; i < n; i++) h[0][in[i]]++;
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
