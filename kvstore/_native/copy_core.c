/* The copy engine of kvstore._native._copy (copy.c): threads sharing a copy in chunks, and streaming stores.
 *
 * Non-temporal stores: a KV transfer is far larger than the caches and its destination is not read back soon
 * by this CPU (an arena slot, or a KV cache the GPU or a later step reads). Ordinary stores first read every
 * destination line into the cache (read-for-ownership), which costs a third of the bandwidth; glibc switches
 * to streaming stores only for single copies of several MiB, never for the 16-64 KiB pieces a KV block is cut
 * into. So on x86-64 a call of at least STREAM_MIN_TOTAL bytes copies each piece of at least
 * STREAM_MIN_PIECE bytes with streaming stores (AVX2 when the CPU has it, else SSE2) and ends each thread's
 * share with an sfence, so the bytes are visible before the caller's next store (its Commit). Measured here: a
 * gather of 32 KiB pieces into 2 MiB blocks, 2 threads, 13-14 GB/s with memmove, 19-21 GB/s streamed. */
#include "copy_core.h"

#include <pthread.h>
#include <sched.h> /* sched_getcpu, cpu_set_t (Python.h defines _GNU_SOURCE on Linux) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

/* Bytes per thread: a second thread only pays off past the last-level cache. Measured here with one range: 2 MiB
 * 22 GB/s on 1 thread vs 12 on 2 (thread start and cache sharing), 16 MiB 22.5 vs 20, 32 MiB 17 vs 21. */
#define MIN_SHARE (12u * 1024u * 1024u)
static uint64_t min_share = MIN_SHARE; /* tests lower it (_set_min_share) to exercise the split on small data */
#define STREAM_MIN_TOTAL (1u << 20) /* streaming stores only for calls this large (auto mode) */
#define STREAM_MIN_PIECE 4096u      /* ... and only for pieces this large */

#define CHUNK_BYTES (1u << 20) /* the grain threads share a copy in (run_jobs says why) */
static uint64_t chunk_bytes = CHUNK_BYTES; /* at most a quarter of min_share (tests' small copies still interleave) */

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

/* Copy `left` bytes of the concatenated job stream, starting `skip` bytes into jobs[i]. */
static void copy_range(const job_t *jobs, size_t i, uint64_t skip, uint64_t left, int stream) {
    while (left) {
        const job_t *j = &jobs[i++];
        uint64_t n = j->len - skip < left ? j->len - skip : left;
        char *d = j->dst + skip;
        const char *src = j->src + skip;
#if HAVE_STREAM
        if (stream && n >= STREAM_MIN_PIECE && (d + n <= src || src + n <= d)) stream_copy(d, src, (size_t)n);
        else
#endif
        /* memmove, not memcpy: same speed, and no UB if a caller overlaps src and dst of one range. */
        if (n) memmove(d, src, (size_t)n);
        left -= n;
        skip = 0;
    }
    (void)stream;
}

/* Ends a thread's part of a copy: streamed bytes are visible before anything this thread stores next. */
static void end_stream(int stream) {
#if HAVE_STREAM
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
}

/* The shared state of one multi-threaded copy: threads take `chunk` bytes of the job stream at a time. */
typedef struct {
    const job_t *jobs;
    const uint64_t *starts; /* starts[i]: stream offset of jobs[i] */
    size_t n;
    uint64_t total, chunk, next; /* next: the next chunk's index, taken with an atomic add */
    int stream;
} pool_t;

/* The job holding stream byte `off` (< total): the last i with starts[i] <= off (an empty job shares its start
 * with the next one, so it is never the last). */
static size_t job_at(const uint64_t *starts, size_t n, uint64_t off) {
    size_t lo = 0, hi = n; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= off) lo = mid;
        else hi = mid;
    }
    return lo;
}

static void *run_pool(void *arg) {
    pool_t *p = arg;
    for (;;) {
        uint64_t begin = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED) * p->chunk;
        if (begin >= p->total) break;
        uint64_t end = p->total - begin > p->chunk ? begin + p->chunk : p->total;
        size_t i = job_at(p->starts, p->n, begin);
        copy_range(p->jobs, i, begin - p->starts[i], end - begin, p->stream);
    }
    end_stream(p->stream);
    return NULL;
}

/* The helper threads' attributes: the CPUs the caller may run on, less the one it runs on now; *threads at most
 * the count of those CPUs. 1 when `attr` was made (the caller destroys it), 0 to use the defaults.
 * Why: the kernel starts a new thread on the least busy CPU, and when the others are busy at that moment (the
 * daemon answering the previous Store, on a 2-core box) that can be the caller's own; there it stays, since a
 * just-started thread is cache-hot and not moved to the CPU that goes idle. The copy then runs on one core: in
 * bench.connector --chunk 512 one 64 MiB gather of four took ~8 ms instead of ~4. Kept off the caller's CPU, the
 * helper waits for the busy one at worst. And more threads than allowed CPUs only share them (a vLLM CPU worker
 * bound to one core). */
static int helpers_elsewhere(pthread_attr_t *attr, int *threads) {
#if defined(__linux__)
    cpu_set_t allowed;
    if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0) return 0;
    int count = CPU_COUNT(&allowed), here = sched_getcpu();
    if (count >= 1 && *threads > count) *threads = count;
    if (*threads < 2 || here < 0 || here >= CPU_SETSIZE || !CPU_ISSET(here, &allowed)) return 0;
    CPU_CLR(here, &allowed);
    if (pthread_attr_init(attr) != 0) return 0;
    if (pthread_attr_setaffinity_np(attr, sizeof allowed, &allowed) != 0) {
        pthread_attr_destroy(attr);
        return 0;
    }
    return 1;
#else
    (void)attr;
    (void)threads;
    return 0;
#endif
}

/* The threads asked for, at most one per min_share bytes, at least one. */
static int threads_by_size(int threads, uint64_t total) {
    uint64_t cap = total / min_share;
    return (uint64_t)threads < cap ? threads : (int)(cap ? cap : 1);
}

PyObject *kvc_threads_for(int threads, uint64_t total) {
    int T = threads_by_size(threads, total);
    pthread_attr_t attr;
    PyObject *cpus = PyList_New(0);
    if (!cpus) return NULL;
    if (T > 1 && helpers_elsewhere(&attr, &T)) {
#if defined(__linux__)
        cpu_set_t set;
        if (pthread_attr_getaffinity_np(&attr, sizeof set, &set) == 0) {
            for (int c = 0; c < CPU_SETSIZE; c++) {
                PyObject *v = CPU_ISSET(c, &set) ? PyLong_FromLong(c) : NULL;
                if (v && PyList_Append(cpus, v) < 0) {
                    Py_DECREF(v);
                    pthread_attr_destroy(&attr);
                    Py_DECREF(cpus);
                    return NULL;
                }
                Py_XDECREF(v);
            }
        }
#endif
        pthread_attr_destroy(&attr);
    }
    return Py_BuildValue("(iN)", T, cpus);
}

/* Runs WITHOUT the GIL. The calling thread and T-1 new ones take chunks of chunk_bytes from the job stream
 * until none is left. Why chunks and not one fixed share a thread: a thread descheduled for a while (the daemon
 * committing the previous part, another process) would leave its share for last while the others idle; with
 * chunks the running threads take over its work. A failed pthread_create (or no memory for the offsets)
 * degrades to fewer threads, down to copying inline. */
static void run_jobs(const job_t *jobs, size_t n, uint64_t total, int threads, int stream) {
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int T = threads_by_size(threads, total);
    pthread_attr_t attr;
    int off_here = T > 1 && helpers_elsewhere(&attr, &T);
    uint64_t *starts = T > 1 ? malloc(sizeof(uint64_t) * n) : NULL;
    if (!starts) {
        if (off_here) pthread_attr_destroy(&attr);
        copy_range(jobs, 0, 0, total, stream);
        end_stream(stream);
        return;
    }
    uint64_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        starts[i] = pos;
        pos += jobs[i].len;
    }
    pool_t pool = {jobs, starts, n, total, chunk_bytes, 0, stream};
    for (int t = 1; t < T; t++) started[t] = pthread_create(&tids[t], off_here ? &attr : NULL, run_pool, &pool) == 0;
    if (off_here) pthread_attr_destroy(&attr);
    run_pool(&pool);
    for (int t = 1; t < T; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    free(starts);
}

int kvc_get_u64(PyObject *obj, const char *fn, const char *name, Py_buffer *v) {
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

int kvc_parse_threads(int threads) { return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads; }

/* Borrow the three index arrays and check they have equal length; on success *n is that length. */
int kvc_get_triples(PyObject *a, PyObject *b, PyObject *c, const char *fn, const char *const names[3],
                       Py_buffer v[3], size_t *n) {
    PyObject *objs[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        if (kvc_get_u64(objs[k], fn, names[k], &v[k]) < 0) {
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
PyObject *kvc_finish(job_t *jobs, size_t n, uint64_t total, int threads, int stream_mode) {
    int stream = parse_stream(stream_mode, total);
    if (total) {
        Py_BEGIN_ALLOW_THREADS
        run_jobs(jobs, n, total, threads, stream);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(jobs);
    return PyLong_FromUnsignedLongLong(total);
}

uint64_t kvc_set_min_share(uint64_t bytes) {
    uint64_t old = min_share;
    min_share = bytes;
    chunk_bytes = bytes / 4 < CHUNK_BYTES ? (bytes / 4 ? bytes / 4 : 1) : CHUNK_BYTES;
    return old;
}
