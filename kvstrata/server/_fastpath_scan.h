/* The scanning and reply-encoding half of _fastpath.c: complete RESP commands (multibulk or
 * plain inline) located in the connection's buffer without copying, and replies appended to a
 * growing C buffer. Included by _fastpath.c only. */
#ifndef KVSTRATA_FASTPATH_SCAN_H
#define KVSTRATA_FASTPATH_SCAN_H

#include <Python.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define MAX_ARGV 1026 /* more arguments: the Python path (KV.MATCH/MGET of 1024 hashes) */
#define MAX_LINE 1024 /* longest inline command / header line looked at */

typedef struct { const char *p; Py_ssize_t n; } Arg;

#define OUT_INLINE 2048 /* replies up to this size need no allocation (an unpipelined read) */

typedef struct {
    char *buf;  /* small: the replies so far, else a PyMem block */
    Py_ssize_t len, cap;
    char small[OUT_INLINE];
} Out;

static void out_init(Out *o) {
    o->buf = o->small;
    o->len = 0;
    o->cap = OUT_INLINE;
}

static void out_free(Out *o) {
    if (o->buf != o->small) PyMem_Free(o->buf);
}

static int out_reserve(Out *o, Py_ssize_t more) {
    if (o->len + more <= o->cap) return 0;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + more) cap *= 2;
    char *b = PyMem_Malloc((size_t)cap);
    if (b == NULL) { PyErr_NoMemory(); return -1; }
    memcpy(b, o->buf, (size_t)o->len);
    out_free(o);
    o->buf = b;
    o->cap = cap;
    return 0;
}

static int out_put(Out *o, const char *s, Py_ssize_t n) {
    if (out_reserve(o, n) < 0) return -1;
    memcpy(o->buf + o->len, s, (size_t)n);
    o->len += n;
    return 0;
}

/* prefix, the decimal digits of v (>= 0) and CRLF into line; its length */
static int format_line(char *line, char prefix, long long v) {
    char digits[24];
    int d = 0;
    do { digits[d++] = (char)('0' + v % 10); v /= 10; } while (v > 0);
    int h = 0;
    line[h++] = prefix;
    while (d > 0) line[h++] = digits[--d];
    line[h++] = '\r';
    line[h++] = '\n';
    return h;
}

static int out_bulk(Out *o, const char *s, Py_ssize_t n) {
    char head[32];
    int h = format_line(head, '$', n);
    if (out_reserve(o, h + n + 2) < 0) return -1;
    memcpy(o->buf + o->len, head, (size_t)h);
    memcpy(o->buf + o->len + h, s, (size_t)n);
    memcpy(o->buf + o->len + h + n, "\r\n", 2);
    o->len += h + n + 2;
    return 0;
}

static int out_int(Out *o, long long v) {  /* v >= 0 (a count) */
    char line[32];
    return out_put(o, line, format_line(line, ':', v));
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *find_crlf(const char *p, const char *end) {
    while (p < end) {
        const char *r = memchr(p, '\r', (size_t)(end - p));
        if (r == NULL || r + 1 >= end) return NULL;
        if (r[1] == '\n') return r;
        p = r + 1;
    }
    return NULL;
}

static int parse_len(const char *p, const char *e, long long *out) {
    long long v = 0;
    if (p >= e || e - p > 18) return -1;
    for (; p < e; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    *out = v;
    return 0;
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

/* One complete command at p: its arguments in argv, *argc, and where the next begins.
 * 0 on success, -1 when it is not for us (incomplete, malformed, too long, quoted inline...). */
static int scan_one(const char *p, const char *stop, Py_ssize_t max_bulk, Py_ssize_t max_args,
                    Arg *argv, int *argc, const char **next) {
    if (p >= stop) return -1;
    if (*p != '*') {  /* inline: plain words, no quotes (those are the Python decoder's) */
        const char *lim = stop - p > MAX_LINE ? p + MAX_LINE : stop;
        const char *nl = memchr(p, '\n', (size_t)(lim - p));
        if (nl == NULL) return -1;
        int n = 0;
        for (const char *q = p; q < nl;) {
            while (q < nl && is_space(*q)) q++;
            const char *w = q;
            while (q < nl && !is_space(*q)) {
                if (*q == '"' || *q == '\'') return -1;
                q++;
            }
            if (q > w) {
                if (n == MAX_ARGV) return -1;
                argv[n].p = w;
                argv[n].n = q - w;
                n++;
            }
        }
        if (n == 0) return -1;  /* a blank line: the Python decoder skips it */
        *argc = n;
        *next = nl + 1;
        return 0;
    }
    const char *lim = stop - p > MAX_LINE ? p + MAX_LINE : stop;
    const char *nl = find_crlf(p, lim);
    long long n;
    if (nl == NULL || parse_len(p + 1, nl, &n) != 0 || n <= 0 || n > MAX_ARGV || n > max_args)
        return -1;
    p = nl + 2;
    for (long long i = 0; i < n; i++) {
        if (p >= stop || *p != '$') return -1;
        lim = stop - p > MAX_LINE ? p + MAX_LINE : stop;
        const char *bnl = find_crlf(p, lim);
        long long ln;
        if (bnl == NULL || parse_len(p + 1, bnl, &ln) != 0 || ln > max_bulk) return -1;
        const char *data = bnl + 2;
        if (ln > stop - data - 2 || data[ln] != '\r' || data[ln + 1] != '\n') return -1;
        argv[i].p = data;
        argv[i].n = (Py_ssize_t)ln;
        p = data + ln + 2;
    }
    *argc = (int)n;
    *next = p;
    return 0;
}

#endif
