/* kvstore._native._copy: batched gather/scatter memcpy for KV-cache offload.
 *
 * Moving one KV block means moving dozens to thousands of small pieces (one per layer, per K/V), plus
 * whole 2 MiB blocks. A Python loop of slice assignments costs microseconds per piece and holds the GIL
 * the whole time; here one call validates the whole batch, then copies it with the GIL released, so
 * the gRPC server and every other Python thread keep running during large copies. With threads > 1
 * the work is split by BYTES (not by triples), so one 64 MiB copy and 10,000 tiny ones balance alike, and only
 * calls of at least 2 x MIN_SHARE (24 MiB) use more than one thread.
 *
 * Every check runs before the first byte moves: a rejected call leaves dst untouched. The validated
 * triples are snapshotted into a private array of absolute pointers, so nothing the caller mutates while
 * the GIL is released can change what is copied. The Py_buffer views stay held until the copy ends,
 * which stops bytearray/numpy/mmap exporters from resizing or unmapping the memory underneath us.
 *
 * Non-temporal stores: a KV transfer is far larger than the caches and its destination is not read back soon
 * by this CPU (an arena slot, or a KV cache the GPU or a later step reads). Ordinary stores first read every
 * destination line into the cache (read-for-ownership), which costs a third of the bandwidth; glibc switches
 * to streaming stores only for single copies of several MiB, never for the 16-64 KiB pieces a KV block is cut
 * into. So on x86-64 a call of at least STREAM_MIN_TOTAL bytes copies each piece of at least
 * STREAM_MIN_PIECE bytes with streaming stores (AVX2 when the CPU has it, else SSE2) and ends each thread's
 * share with an sfence, so the bytes are visible before the caller's next store (its Commit). Measured here: a
 * gather of 32 KiB pieces into 2 MiB blocks, 2 threads, 13-14 GB/s with memmove, 19-21 GB/s streamed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define MAX_THREADS 64
/* Bytes per thread: a second thread only pays off past the last-level cache. Measured here with one range: 2 MiB
 * 22 GB/s on 1 thread vs 12 on 2 (thread start and cache sharing), 16 MiB 22.5 vs 20, 32 MiB 17 vs 21. */
#define MIN_SHARE (12u * 1024u * 1024u)
static uint64_t min_share = MIN_SHARE; /* tests lower it (_set_min_share) to exercise the split on small data */
#define STREAM_MIN_TOTAL (1u << 20) /* streaming stores only for calls this large (auto mode) */
#define STREAM_MIN_PIECE 4096u      /* ... and only for pieces this large */

typedef struct { char *dst; const char *src; uint64_t len; } job_t;
typedef struct { const job_t *jobs; size_t idx; uint64_t skip, bytes; int stream; } share_t;

#if HAVE_STREAM
static int has_avx2 = -1;

__attribute__((target("avx2"))) static void stream_body_avx2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) { /* n is a multiple of 128; d is 32-byte aligned */
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
}

static void stream_body_sse2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) { /* n is a multiple of 64; d is 16-byte aligned */
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

/* memcpy semantics (no overlap) with streaming stores for the 32-byte aligned middle of dst. */
static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d) & 31u;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)127u;
    if (has_avx2) stream_body_avx2(d, s, body);
    else stream_body_sse2(d, s, body);
    memcpy(d + body, s + body, n - body);
}
#endif

/* Copy `bytes` bytes of the concatenated job stream, starting `skip` bytes into jobs[idx]. */
static void *run_share(void *arg) {
    const share_t *s = arg;
    size_t i = s->idx;
    uint64_t skip = s->skip, left = s->bytes;
    while (left) {
        const job_t *j = &s->jobs[i++];
        uint64_t n = j->len - skip < left ? j->len - skip : left;
        char *d = j->dst + skip;
        const char *src = j->src + skip;
#if HAVE_STREAM
        if (s->stream && n >= STREAM_MIN_PIECE && (d + n <= src || src + n <= d)) stream_copy(d, src, (size_t)n);
        else
#endif
        /* memmove, not memcpy: same speed, and no UB if a caller overlaps src and dst of one range. */
        if (n) memmove(d, src, (size_t)n);
        left -= n;
        skip = 0;
    }
#if HAVE_STREAM
    if (s->stream) _mm_sfence(); /* streamed bytes are visible before anything this thread stores next */
#endif
    return NULL;
}

/* Runs WITHOUT the GIL. Thread t copies global bytes [t*total/T, (t+1)*total/T) of the job stream;
 * the calling thread does share 0 itself. A failed pthread_create degrades to copying inline. */
static void run_jobs(const job_t *jobs, size_t n, uint64_t total, int threads, int stream) {
    share_t shares[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    uint64_t cap = total / min_share;
    int T = (uint64_t)threads < cap ? threads : (int)(cap ? cap : 1);
    size_t i = 0;
    uint64_t pos = 0; /* stream offset of jobs[i] */
    uint64_t q = total / (uint64_t)T, r = total % (uint64_t)T, prev = 0;
    for (int t = 0; t < T; t++) {
        uint64_t end = t + 1 == T ? total : q * (uint64_t)(t + 1) + r * (uint64_t)(t + 1) / (uint64_t)T;
        uint64_t begin = prev;
        while (i < n && pos + jobs[i].len <= begin) pos += jobs[i++].len; /* also skips empty jobs */
        shares[t] = (share_t){jobs, i, begin - pos, end - begin, stream};
        prev = end;
    }
    for (int t = 1; t < T; t++) started[t] = pthread_create(&tids[t], NULL, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < T; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run_share(&shares[t]);
    }
}

/* Borrow a 1-D C-contiguous uint64 array (numpy uint64, array('Q'), ...). 0 on success. */
static int get_u64(PyObject *obj, const char *fn, const char *name, Py_buffer *v) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous uint64 buffer, got %.100s", fn, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) f++;
    int u64 = v->itemsize == 8 && f[1] == '\0' && (f[0] == 'Q' || (f[0] == 'L' && sizeof(unsigned long) == 8));
    if (!u64 || v->ndim != 1) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a 1-D array of uint64 (format 'Q'/'L', itemsize 8), got format '%s', "
                     "itemsize %zd, ndim %d", fn, name, v->format ? v->format : "B", v->itemsize, v->ndim);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int parse_threads(int threads) { return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads; }

/* Borrow the three index arrays and check they have equal length; on success *n is that length. */
static int get_triples(PyObject *a, PyObject *b, PyObject *c, const char *fn, const char *const names[3],
                       Py_buffer v[3], size_t *n) {
    PyObject *objs[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        if (get_u64(objs[k], fn, names[k], &v[k]) < 0) {
            while (k--) PyBuffer_Release(&v[k]);
            return -1;
        }
    }
    Py_ssize_t n0 = v[0].shape[0], n1 = v[1].shape[0], n2 = v[2].shape[0];
    if (n0 != n1 || n0 != n2) {
        PyErr_Format(PyExc_ValueError, "%s: %s, %s and %s must have equal length, got %zd, %zd and %zd", fn,
                     names[0], names[1], names[2], n0, n1, n2);
        for (int k = 0; k < 3; k++) PyBuffer_Release(&v[k]);
        return -1;
    }
    *n = (size_t)n0;
    return 0;
}

/* -1 auto (streaming stores for large calls), 0 never, 1 always (where the CPU can). */
static int parse_stream(int mode, uint64_t total) {
#if HAVE_STREAM
    if (has_avx2 < 0) has_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    return mode < 0 ? total >= STREAM_MIN_TOTAL : mode > 0;
#else
    (void)mode, (void)total;
    return 0;
#endif
}

/* Shared tail: copy `jobs` with the GIL released and return the byte count as a Python int. */
static PyObject *finish(job_t *jobs, size_t n, uint64_t total, int threads, int stream_mode) {
    int stream = parse_stream(stream_mode, total);
    if (total) {
        Py_BEGIN_ALLOW_THREADS
        run_jobs(jobs, n, total, threads, stream);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(jobs);
    return PyLong_FromUnsignedLongLong(total);
}

PyDoc_STRVAR(copy_batch_doc,
"copy_batch(dst, src, dst_offsets, src_offsets, lengths, threads=1, stream=-1) -> int\n\n"
"For every i: dst[dst_offsets[i] : +lengths[i]] = src[src_offsets[i] : +lengths[i]] (byte offsets).\n"
"Returns the total number of bytes copied.\n\n"
"dst: writable C-contiguous buffer; src: readable C-contiguous buffer (may be the same object as dst).\n"
"dst_offsets, src_offsets, lengths: equal-length 1-D C-contiguous uint64 arrays.\n\n"
"Why: one call replaces a Python loop over thousands of KV-cache pieces. EVERYTHING is validated\n"
"first (dst writable -> TypeError; dtype -> TypeError; lengths, bounds, offset+length overflow ->\n"
"ValueError naming the index and numbers), so a rejected call copies nothing. The copy itself runs\n"
"with the GIL released, so other Python threads (e.g. the gRPC server) keep running.\n"
"threads (clamped to 1..64) splits the work by BYTES, so one huge copy and many small ones balance\n"
"alike; no extra threads are spawned for less than 12 MiB per thread (so never under 24 MiB total: below\n"
"that one thread copying from cache beats two).\n"
"stream: -1 (auto) uses non-temporal stores for pieces >= 4 KiB of calls >= 1 MiB on x86-64; 0 never; 1 always.\n"
"Ranges must not overlap each other across src/dst; if they do, the result is unspecified.");

static PyObject *copy_batch(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst", "src", "dst_offsets", "src_offsets", "lengths", "threads", "stream", NULL};
    static const char *const names[3] = {"dst_offsets", "src_offsets", "lengths"};
    PyObject *dst_o, *src_o, *a, *b, *c;
    int threads = 1, stream = -1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|ii:copy_batch", kwlist, &dst_o, &src_o, &a, &b, &c,
                                     &threads, &stream))
        return NULL;
    Py_buffer dv, sv, iv[3];
    if (PyObject_GetBuffer(dst_o, &dv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (dv.readonly) {
        PyErr_Format(PyExc_TypeError, "copy_batch: dst must be a writable buffer, got read-only %.100s",
                     Py_TYPE(dst_o)->tp_name);
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (PyObject_GetBuffer(src_o, &sv, PyBUF_C_CONTIGUOUS) < 0) goto fail_dst;
    size_t n;
    if (get_triples(a, b, c, "copy_batch", names, iv, &n) < 0) goto fail_src;
    job_t *jobs = PyMem_Malloc(n ? n * sizeof(job_t) : 1);
    if (!jobs) { PyErr_NoMemory(); goto fail_all; }
    const uint64_t *doff = iv[0].buf, *soff = iv[1].buf, *len = iv[2].buf;
    const uint64_t dsize = (uint64_t)dv.len, ssize = (uint64_t)sv.len;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t d = doff[i], s = soff[i], l = len[i];
        if (l > UINT64_MAX - d || l > UINT64_MAX - s) {
            PyErr_Format(PyExc_ValueError, "copy_batch: triple %zu: offset + length overflows uint64 "
                         "(dst_offset %llu, src_offset %llu, length %llu)", i, (unsigned long long)d,
                         (unsigned long long)s, (unsigned long long)l);
            goto fail_jobs;
        }
        if (d + l > dsize || s + l > ssize) {
            int is_dst = d + l > dsize;
            PyErr_Format(PyExc_ValueError, "copy_batch: triple %zu out of bounds: %s_offset %llu + length "
                         "%llu = %llu > %s size %llu", i, is_dst ? "dst" : "src",
                         (unsigned long long)(is_dst ? d : s), (unsigned long long)l,
                         (unsigned long long)((is_dst ? d : s) + l), is_dst ? "dst" : "src",
                         (unsigned long long)(is_dst ? dsize : ssize));
            goto fail_jobs;
        }
        total += l;
        if (total < l) { /* only reachable with absurdly many huge ranges, but checked anyway */
            PyErr_Format(PyExc_ValueError, "copy_batch: sum of lengths overflows uint64 at triple %zu", i);
            goto fail_jobs;
        }
        jobs[i] = (job_t){(char *)dv.buf + d, (const char *)sv.buf + s, l};
    }
    for (int k = 0; k < 3; k++) PyBuffer_Release(&iv[k]);
    PyObject *res = finish(jobs, n, total, parse_threads(threads), stream);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return res;
fail_jobs:
    PyMem_Free(jobs);
fail_all:
    for (int k = 0; k < 3; k++) PyBuffer_Release(&iv[k]);
fail_src:
    PyBuffer_Release(&sv);
fail_dst:
    PyBuffer_Release(&dv);
    return NULL;
}

PyDoc_STRVAR(copy_addrs_doc,
"copy_addrs(dst_addrs, src_addrs, lengths, threads=1, stream=-1) -> int\n\n"
"!!! UNCHECKED RAW-POINTER COPY: a wrong address or length corrupts memory or crashes the process. !!!\n"
"For every i: memcpy((void *)dst_addrs[i], (void *)src_addrs[i], lengths[i]). Returns total bytes.\n\n"
"The ONLY checks: the three uint64 arrays have equal length, addresses are non-null (for lengths > 0),\n"
"and address + length does not wrap around. Nothing checks that the memory exists, is writable, stays\n"
"alive, or does not overlap: the caller must hold references to the owning objects (tensors, arrays,\n"
"mmaps) for the duration of the call. This exists for the vLLM connector, which gathers one block's\n"
"pieces from 32+ separate per-layer tensors (torch.Tensor.data_ptr(), ndarray.ctypes.data) into one\n"
"arena slot, where no single buffer object spans all sources. Like copy_batch: GIL released during\n"
"the copy, threads (1..64) split by bytes, no threads for less than 12 MiB per thread; stream as for\n"
"copy_batch (non-temporal stores for large calls).");

static PyObject *copy_addrs(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst_addrs", "src_addrs", "lengths", "threads", "stream", NULL};
    static const char *const names[3] = {"dst_addrs", "src_addrs", "lengths"};
    PyObject *a, *b, *c;
    int threads = 1, stream = -1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|ii:copy_addrs", kwlist, &a, &b, &c, &threads, &stream))
        return NULL;
    Py_buffer iv[3];
    size_t n;
    if (get_triples(a, b, c, "copy_addrs", names, iv, &n) < 0) return NULL;
    job_t *jobs = PyMem_Malloc(n ? n * sizeof(job_t) : 1);
    const uint64_t *dp = iv[0].buf, *sp = iv[1].buf, *len = iv[2].buf;
    uint64_t total = 0;
    if (!jobs) PyErr_NoMemory();
    for (size_t i = 0; jobs && i < n; i++) {
        uint64_t d = dp[i], s = sp[i], l = len[i];
        const char *why = NULL;
        if (l && (!d || !s)) why = "null address";
        else if (l > (uint64_t)PY_SSIZE_T_MAX || l > UINTPTR_MAX - d || l > UINTPTR_MAX - s)
            why = "address + length wraps around";
        else if (total + l < total) why = "sum of lengths overflows uint64";
        if (why) {
            char msg[160]; /* PyErr_Format has no %llx */
            PyOS_snprintf(msg, sizeof msg, "triple %zu: %s (dst_addr 0x%llx, src_addr 0x%llx, length %llu)",
                          i, why, (unsigned long long)d, (unsigned long long)s, (unsigned long long)l);
            PyErr_Format(PyExc_ValueError, "copy_addrs: %s", msg);
            PyMem_Free(jobs);
            jobs = NULL;
            break;
        }
        total += l;
        jobs[i] = (job_t){(char *)(uintptr_t)d, (const char *)(uintptr_t)s, l};
    }
    for (int k = 0; k < 3; k++) PyBuffer_Release(&iv[k]);
    return jobs ? finish(jobs, n, total, parse_threads(threads), stream) : NULL;
}

PyDoc_STRVAR(copy_buffers_doc,
"copy_buffers(addrs, lengths, buffers, into_buffers=False, threads=1, stream=-1, check_only=False) -> int\n\n"
"!!! The addresses are UNCHECKED raw pointers, as in copy_addrs; the buffers are checked. !!!\n"
"into_buffers=False: for every i, memcpy((void *)addrs[i], buffers[i], lengths[i]), and buffers[i] must hold\n"
"exactly lengths[i] bytes. into_buffers=True: memcpy(buffers[i], (void *)addrs[i], lengths[i]), and\n"
"buffers[i] must be writable and hold at least lengths[i] bytes. Returns total bytes.\n\n"
"Why: a client's put or get moves blocks between the caller's objects (numpy arrays, bytes, bytearrays)\n"
"and arena slots. Taking each object's address in Python (ndarray.ctypes.data, a view, its flags) cost\n"
"~2.4 us a block, 80 us of a 32-block put; here it is one buffer export each. buffers: a list of objects of\n"
"the buffer protocol, C-contiguous; every one is checked (ValueError naming its index) before any byte moves,\n"
"and all stay exported until the copy ends. check_only=True checks them and copies nothing (a caller that\n"
"copies a batch in parts checks it whole first). Like copy_addrs: GIL released during the copy, threads\n"
"(1..64) split by bytes, no threads for less than 12 MiB per thread; stream as for copy_batch.");

static PyObject *copy_buffers(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"addrs", "lengths", "buffers", "into_buffers", "threads", "stream", "check_only", NULL};
    PyObject *a, *b, *list;
    int into = 0, threads = 1, stream = -1, check_only = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|piip:copy_buffers", kwlist, &a, &b, &list, &into, &threads,
                                     &stream, &check_only))
        return NULL;
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "copy_buffers: buffers must be a list, got %.100s", Py_TYPE(list)->tp_name);
        return NULL;
    }
    Py_buffer iv[2];
    if (get_u64(a, "copy_buffers", "addrs", &iv[0]) < 0) return NULL;
    if (get_u64(b, "copy_buffers", "lengths", &iv[1]) < 0) {
        PyBuffer_Release(&iv[0]);
        return NULL;
    }
    Py_ssize_t n = iv[0].shape[0];
    PyObject *res = NULL;
    job_t *jobs = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0;
    if (iv[1].shape[0] != n || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "copy_buffers: %zd addrs, %zd lengths and %zd buffers: give one of each a "
                     "block", n, iv[1].shape[0], PyList_GET_SIZE(list));
        goto done;
    }
    jobs = PyMem_Malloc(n ? (size_t)n * sizeof(job_t) : 1);
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!jobs || !views) { PyErr_NoMemory(); goto done; }
    const uint64_t *ap = iv[0].buf, *lp = iv[1].buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyList_GET_ITEM(list, i);
        if (PyObject_GetBuffer(obj, &views[i], PyBUF_C_CONTIGUOUS | (into ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Clear();
            int readonly = into && PyObject_CheckBuffer(obj) &&
                           PyObject_GetBuffer(obj, &views[i], PyBUF_C_CONTIGUOUS) == 0;
            if (readonly) PyBuffer_Release(&views[i]);
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, readonly
                         ? "buffer %zd (%.100s) is read-only: pass a bytearray, numpy array or writable memoryview"
                         : "buffer %zd (%.100s) is not a C-contiguous buffer: pass bytes, a bytearray, a "
                           "C-contiguous numpy array or memoryview", i, Py_TYPE(obj)->tp_name);
            goto done;
        }
        held = i + 1;
        uint64_t l = lp[i], addr = ap[i], have = (uint64_t)views[i].len;
        if (into ? have < l : have != l) {
            PyErr_Format(PyExc_ValueError, into ? "buffer %zd holds %llu bytes but the block has %llu"
                                                : "buffer %zd holds %llu bytes, not the %llu of its block", i,
                         (unsigned long long)have, (unsigned long long)l);
            goto done;
        }
        if (l && (!addr || l > UINTPTR_MAX - addr || total + l < total)) {
            PyErr_Format(PyExc_ValueError, "copy_buffers: block %zd: null address or address + length wraps", i);
            goto done;
        }
        total += l;
        char *mine = views[i].buf;
        jobs[i] = into ? (job_t){mine, (const char *)(uintptr_t)addr, l} : (job_t){(char *)(uintptr_t)addr, mine, l};
    }
    if (check_only) {
        res = PyLong_FromUnsignedLongLong(total);
        goto done;
    }
    res = finish(jobs, (size_t)n, total, parse_threads(threads), stream);
    jobs = NULL; /* finish frees it */
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(jobs);
    PyBuffer_Release(&iv[0]);
    PyBuffer_Release(&iv[1]);
    return res;
}

static PyObject *set_min_share(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (v < 1) {
        PyErr_SetString(PyExc_ValueError, "_set_min_share: need at least 1 byte per thread");
        return NULL;
    }
    uint64_t old = min_share;
    min_share = v;
    return PyLong_FromUnsignedLongLong(old);
}

static PyMethodDef methods[] = {
    {"_set_min_share", set_min_share, METH_O, "_set_min_share(bytes) -> previous: bytes per thread below which "
     "no thread is spawned (tests only; default 12 MiB)"},
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_VARARGS | METH_KEYWORDS, copy_batch_doc},
    {"copy_addrs", (PyCFunction)(void (*)(void))copy_addrs, METH_VARARGS | METH_KEYWORDS, copy_addrs_doc},
    {"copy_buffers", (PyCFunction)(void (*)(void))copy_buffers, METH_VARARGS | METH_KEYWORDS, copy_buffers_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Batched gather/scatter copy for KV-cache offload (C, GIL released, optional byte-balanced threads).\n\n"
"copy_batch moves many (offset, length) byte ranges between two buffer-protocol objects in one call,\n"
"validated up front; copy_addrs does the same for raw pointers (unchecked, for the vLLM connector).\n"
"Use the typed wrappers in kvstore._native, which accept lists and convert to uint64 arrays.");

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_copy", module_doc, -1, methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&mod); }
