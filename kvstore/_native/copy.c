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
 * The copy engine itself (threads, streaming stores) is copy_core.c; the connector's copy plans are plan.c. */
#include "copy_core.h"
#include "plan.h"

#if defined(__x86_64__)
#include <cpuid.h>     /* __get_cpuid_count */
#include <immintrin.h> /* _mm_clflush, _mm_mfence (SSE2: every x86-64) */
#endif

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
"threads (clamped to 1..64) share the work in 1 MiB chunks of the byte stream, so one huge copy and many\n"
"small ones balance alike, and a thread that gets descheduled leaves its chunks to the others; no extra\n"
"threads are spawned for less than 12 MiB per thread (so never under 24 MiB total: below that one thread\n"
"copying from cache beats two).\n"
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
    if (kvc_get_triples(a, b, c, "copy_batch", names, iv, &n) < 0) goto fail_src;
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
    PyObject *res = kvc_finish(jobs, n, total, kvc_parse_threads(threads), stream);
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
"the copy, threads (1..64) sharing it in 1 MiB chunks, no threads for less than 12 MiB per thread; stream as for\n"
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
    if (kvc_get_triples(a, b, c, "copy_addrs", names, iv, &n) < 0) return NULL;
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
    return jobs ? kvc_finish(jobs, n, total, kvc_parse_threads(threads), stream) : NULL;
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
"(1..64) sharing it in 1 MiB chunks, no threads for less than 12 MiB per thread; stream as for copy_batch.");

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
    if (kvc_get_u64(a, "copy_buffers", "addrs", &iv[0]) < 0) return NULL;
    if (kvc_get_u64(b, "copy_buffers", "lengths", &iv[1]) < 0) {
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
    res = kvc_finish(jobs, (size_t)n, total, kvc_parse_threads(threads), stream);
    jobs = NULL; /* finish frees it */
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(jobs);
    PyBuffer_Release(&iv[0]);
    PyBuffer_Release(&iv[1]);
    return res;
}

/* Borrow two equal-length uint64 arrays (ValueError naming both counts otherwise); their length, or -1. */
static Py_ssize_t get_pair(PyObject *a, PyObject *b, const char *fn, const char *const names[2], Py_buffer v[2]) {
    if (kvc_get_u64(a, fn, names[0], &v[0]) < 0) return -1;
    if (kvc_get_u64(b, fn, names[1], &v[1]) < 0) {
        PyBuffer_Release(&v[0]);
        return -1;
    }
    if (v[1].shape[0] != v[0].shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: %zd %s but %zd %s", fn, v[0].shape[0], names[0], v[1].shape[0],
                     names[1]);
        PyBuffer_Release(&v[0]);
        PyBuffer_Release(&v[1]);
        return -1;
    }
    return v[0].shape[0];
}

PyDoc_STRVAR(first_outside_doc,
"first_outside(offsets, sizes, lo, hi, slab) -> int\n\n"
"The index of the first range [offsets[i], +sizes[i]) that is not inside one slab of the region [lo, hi)\n"
"(slabs of `slab` bytes from lo), -1 when every one is. offsets and sizes: equal-length 1-D uint64 arrays.\n\n"
"Why: a client checks every slot a daemon names before it copies a byte into or out of it (an offset\n"
"outside the mapping would be a wild write); in numpy that check cost ~130 us of a 32-block put with cold\n"
"caches, here well under a microsecond.");

static PyObject *first_outside(PyObject *self, PyObject *args) {
    static const char *const names[2] = {"offsets", "sizes"};
    PyObject *objs[2];
    unsigned long long lo, hi, slab;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOKKK:first_outside", &objs[0], &objs[1], &lo, &hi, &slab)) return NULL;
    if (slab == 0 || lo > hi) {
        PyErr_Format(PyExc_ValueError, "first_outside: need slab > 0 and lo <= hi (slab %llu, lo %llu, hi %llu)",
                     slab, lo, hi);
        return NULL;
    }
    Py_buffer v[2];
    Py_ssize_t n = get_pair(objs[0], objs[1], "first_outside", names, v), bad = -1;
    if (n < 0) return NULL;
    const uint64_t *off = v[0].buf, *len = v[1].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t o = off[i], z = len[i];
        /* inside [lo, hi) without wrap-around, then first and last byte in the same slab */
        int ok = o >= lo && o <= hi && z <= hi - o && (z == 0 || (o - lo) / slab == (o - lo + z - 1) / slab);
        if (!ok) {
            bad = i;
            break;
        }
    }
    PyBuffer_Release(&v[0]);
    PyBuffer_Release(&v[1]);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(evict_lines_doc,
"evict_lines(addrs, lengths) -> int\n\n"
"Write back and evict from every cache level the lines of each range [addrs[i], +lengths[i]) (x86-64:\n"
"clflush, then a fence). Returns the bytes covered; 0 on other CPUs, where nothing is done.\n\n"
"!!! UNCHECKED RAW ADDRESSES, like copy_addrs: each range must be mapped. !!!\n"
"Why: benchmarks (bench/copy_limit.py) time a copy of KV blocks from memory, as a block saved after a\n"
"forward pass or loaded for a new turn is, without also pushing the store's own code and tables out of the\n"
"cache, which a flush by copying a buffer larger than the last-level cache would do.");

#if defined(__x86_64__)
/* CPUID leaf 7, EBX bit 23 (read directly: older compilers' __builtin_cpu_supports does not know the name) */
static int has_clflushopt(void) {
    unsigned int a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23));
}

__attribute__((target("clflushopt"))) static void flush_opt(uintptr_t a, uintptr_t end) {
    for (; a < end; a += 64) _mm_clflushopt((void *)a);
}
#endif

static PyObject *evict_lines(PyObject *self, PyObject *args) {
    static const char *const names[2] = {"addresses", "lengths"};
    PyObject *objs[2];
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:evict_lines", &objs[0], &objs[1])) return NULL;
    Py_buffer v[2];
    Py_ssize_t n = get_pair(objs[0], objs[1], "evict_lines", names, v);
    if (n < 0) return NULL;
    const uint64_t *ap = v[0].buf, *lp = v[1].buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lp[i] && (!ap[i] || lp[i] > UINTPTR_MAX - ap[i])) {
            PyErr_Format(PyExc_ValueError, "evict_lines: range %zd: null address or address + length wraps", i);
            PyBuffer_Release(&v[0]);
            PyBuffer_Release(&v[1]);
            return NULL;
        }
    }
#if defined(__x86_64__)
    int opt = has_clflushopt(); /* unordered: many lines in flight, ~10x clflush's rate */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)ap[i] & ~(uintptr_t)63, end = (uintptr_t)ap[i] + (uintptr_t)lp[i];
        if (opt)
            flush_opt(a, end);
        else
            for (; a < end; a += 64) _mm_clflush((const void *)a);
        total += lp[i];
    }
    _mm_mfence();
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&v[0]);
    PyBuffer_Release(&v[1]);
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *set_min_share(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (v < 1) {
        PyErr_SetString(PyExc_ValueError, "_set_min_share: need at least 1 byte per thread");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(kvc_set_min_share(v));
}

static PyObject *threads_for(PyObject *self, PyObject *args) {
    int threads;
    unsigned long long total;
    (void)self;
    if (!PyArg_ParseTuple(args, "iK:_threads_for", &threads, &total)) return NULL;
    return kvc_threads_for(kvc_parse_threads(threads), total);
}

static PyMethodDef methods[] = {
    {"_set_min_share", set_min_share, METH_O, "_set_min_share(bytes) -> previous: bytes per thread below which "
     "no thread is spawned (tests only; default 12 MiB)"},
    {"_threads_for", threads_for, METH_VARARGS, "_threads_for(threads, total) -> (threads used, [helper CPUs]): how a "
     "copy of `total` bytes asked for `threads` would run, from the calling thread now (tests only)"},
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_VARARGS | METH_KEYWORDS, copy_batch_doc},
    {"copy_addrs", (PyCFunction)(void (*)(void))copy_addrs, METH_VARARGS | METH_KEYWORDS, copy_addrs_doc},
    {"copy_buffers", (PyCFunction)(void (*)(void))copy_buffers, METH_VARARGS | METH_KEYWORDS, copy_buffers_doc},
    {"first_outside", first_outside, METH_VARARGS, first_outside_doc},
    {"evict_lines", evict_lines, METH_VARARGS, evict_lines_doc},
    {"plan_pieces", kvc_plan_pieces, METH_VARARGS,
     "plan_pieces(slots, blocks, per_slot, piece_base, piece_stride, piece_offset, piece_bytes, block_bytes, "
     "num_blocks, to_store, dst, src, lengths) -> int: the copy plan of a batch of stored blocks written into dst, "
     "src, lengths (see kvstore._native.plan_pieces)"},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Batched gather/scatter copy for KV-cache offload (C, GIL released, optional threads sharing it in chunks).\n\n"
"copy_batch moves many (offset, length) byte ranges between two buffer-protocol objects in one call,\n"
"validated up front; copy_addrs does the same for raw pointers (unchecked, for the vLLM connector).\n"
"Use the typed wrappers in kvstore._native, which accept lists and convert to uint64 arrays.");

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_copy", module_doc, -1, methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&mod); }
