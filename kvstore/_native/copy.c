/* kvstore._native._copy: batched gather/scatter memcpy for KV-cache offload.
 *
 * Moving one KV block means moving dozens to thousands of small pieces (one per layer, per K/V), plus
 * whole 2 MiB blocks. A Python loop of slice assignments costs microseconds per piece and holds the GIL
 * the whole time; here one call validates the whole batch, then copies it with the GIL released, so
 * the gRPC server and every other Python thread keep running during large copies. With threads > 1
 * the work is split by BYTES (not by triples), so one 64 MiB copy and 10,000 tiny ones balance alike.
 *
 * Every check runs before the first byte moves: a rejected call leaves dst untouched. The validated
 * triples are snapshotted into a private array of absolute pointers, so nothing the caller mutates while
 * the GIL is released can change what is copied. The Py_buffer views stay held until the copy ends,
 * which stops bytearray/numpy/mmap exporters from resizing or unmapping the memory underneath us. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
#define MIN_SHARE (512u * 1024u) /* bytes per thread; so totals under 1 MiB never spawn threads */

typedef struct { char *dst; const char *src; uint64_t len; } job_t;
typedef struct { const job_t *jobs; size_t idx; uint64_t skip, bytes; } share_t;

/* Copy `bytes` bytes of the concatenated job stream, starting `skip` bytes into jobs[idx]. */
static void *run_share(void *arg) {
    const share_t *s = arg;
    size_t i = s->idx;
    uint64_t skip = s->skip, left = s->bytes;
    while (left) {
        const job_t *j = &s->jobs[i++];
        uint64_t n = j->len - skip < left ? j->len - skip : left;
        /* memmove, not memcpy: same speed, and no UB if a caller overlaps src and dst of one range. */
        if (n) memmove(j->dst + skip, j->src + skip, (size_t)n);
        left -= n;
        skip = 0;
    }
    return NULL;
}

/* Runs WITHOUT the GIL. Thread t copies global bytes [t*total/T, (t+1)*total/T) of the job stream;
 * the calling thread does share 0 itself. A failed pthread_create degrades to copying inline. */
static void run_jobs(const job_t *jobs, size_t n, uint64_t total, int threads) {
    share_t shares[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    uint64_t cap = total / MIN_SHARE;
    int T = (uint64_t)threads < cap ? threads : (int)(cap ? cap : 1);
    size_t i = 0;
    uint64_t pos = 0; /* stream offset of jobs[i] */
    uint64_t q = total / (uint64_t)T, r = total % (uint64_t)T, prev = 0;
    for (int t = 0; t < T; t++) {
        uint64_t end = t + 1 == T ? total : q * (uint64_t)(t + 1) + r * (uint64_t)(t + 1) / (uint64_t)T;
        uint64_t begin = prev;
        while (i < n && pos + jobs[i].len <= begin) pos += jobs[i++].len; /* also skips empty jobs */
        shares[t] = (share_t){jobs, i, begin - pos, end - begin};
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

/* Shared tail: copy `jobs` with the GIL released and return the byte count as a Python int. */
static PyObject *finish(job_t *jobs, size_t n, uint64_t total, int threads) {
    if (total) {
        Py_BEGIN_ALLOW_THREADS
        run_jobs(jobs, n, total, threads);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(jobs);
    return PyLong_FromUnsignedLongLong(total);
}

PyDoc_STRVAR(copy_batch_doc,
"copy_batch(dst, src, dst_offsets, src_offsets, lengths, threads=1) -> int\n\n"
"For every i: dst[dst_offsets[i] : +lengths[i]] = src[src_offsets[i] : +lengths[i]] (byte offsets).\n"
"Returns the total number of bytes copied.\n\n"
"dst: writable C-contiguous buffer; src: readable C-contiguous buffer (may be the same object as dst).\n"
"dst_offsets, src_offsets, lengths: equal-length 1-D C-contiguous uint64 arrays.\n\n"
"Why: one call replaces a Python loop over thousands of KV-cache pieces. EVERYTHING is validated\n"
"first (dst writable -> TypeError; dtype -> TypeError; lengths, bounds, offset+length overflow ->\n"
"ValueError naming the index and numbers), so a rejected call copies nothing. The copy itself runs\n"
"with the GIL released, so other Python threads (e.g. the gRPC server) keep running.\n"
"threads (clamped to 1..64) splits the work by BYTES, so one huge copy and many small ones balance\n"
"alike; no extra threads are spawned for less than 512 KiB per thread (so never under 1 MiB total).\n"
"Ranges must not overlap each other across src/dst; if they do, the result is unspecified.");

static PyObject *copy_batch(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst", "src", "dst_offsets", "src_offsets", "lengths", "threads", NULL};
    static const char *const names[3] = {"dst_offsets", "src_offsets", "lengths"};
    PyObject *dst_o, *src_o, *a, *b, *c;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|i:copy_batch", kwlist, &dst_o, &src_o, &a, &b, &c,
                                     &threads))
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
    PyObject *res = finish(jobs, n, total, parse_threads(threads));
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
"copy_addrs(dst_addrs, src_addrs, lengths, threads=1) -> int\n\n"
"!!! UNCHECKED RAW-POINTER COPY: a wrong address or length corrupts memory or crashes the process. !!!\n"
"For every i: memcpy((void *)dst_addrs[i], (void *)src_addrs[i], lengths[i]). Returns total bytes.\n\n"
"The ONLY checks: the three uint64 arrays have equal length, addresses are non-null (for lengths > 0),\n"
"and address + length does not wrap around. Nothing checks that the memory exists, is writable, stays\n"
"alive, or does not overlap: the caller must hold references to the owning objects (tensors, arrays,\n"
"mmaps) for the duration of the call. This exists for the vLLM connector, which gathers one block's\n"
"pieces from 32+ separate per-layer tensors (torch.Tensor.data_ptr(), ndarray.ctypes.data) into one\n"
"arena slot, where no single buffer object spans all sources. Like copy_batch: GIL released during\n"
"the copy, threads (1..64) split by bytes, no threads for less than 512 KiB per thread.");

static PyObject *copy_addrs(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst_addrs", "src_addrs", "lengths", "threads", NULL};
    static const char *const names[3] = {"dst_addrs", "src_addrs", "lengths"};
    PyObject *a, *b, *c;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|i:copy_addrs", kwlist, &a, &b, &c, &threads)) return NULL;
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
    return jobs ? finish(jobs, n, total, parse_threads(threads)) : NULL;
}

static PyMethodDef methods[] = {
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_VARARGS | METH_KEYWORDS, copy_batch_doc},
    {"copy_addrs", (PyCFunction)(void (*)(void))copy_addrs, METH_VARARGS | METH_KEYWORDS, copy_addrs_doc},
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
