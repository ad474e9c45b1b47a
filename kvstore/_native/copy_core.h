/* What copy.c (the module's functions) uses of copy_core.c (the copy engine). */
#ifndef KVSTORE_COPY_CORE_H
#define KVSTORE_COPY_CORE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_THREADS 64

/* One range to copy: len bytes from src to dst (absolute pointers, checked by the caller). */
typedef struct { char *dst; const char *src; uint64_t len; } job_t;

/* Borrow a 1-D C-contiguous uint64 array (numpy uint64, array('Q'), ...). 0 on success, else -1 and TypeError. */
int kvc_get_u64(PyObject *obj, const char *fn, const char *name, Py_buffer *v);
/* Borrow three such arrays of equal length; on success *n is that length. */
int kvc_get_triples(PyObject *a, PyObject *b, PyObject *c, const char *fn, const char *const names[3], Py_buffer v[3],
                    size_t *n);
/* threads clamped to 1..MAX_THREADS. */
int kvc_parse_threads(int threads);
/* Copy `jobs` with the GIL released, free them, and return the byte count as a Python int. stream_mode: -1 auto
 * (streaming stores for large calls), 0 never, 1 always (where the CPU can). */
PyObject *kvc_finish(job_t *jobs, size_t n, uint64_t total, int threads, int stream_mode);
/* Bytes per thread below which no thread is spawned (the chunks threads take: at most a quarter of it); returns
 * the previous value (tests lower it). */
uint64_t kvc_set_min_share(uint64_t bytes);
/* (threads a copy of `total` bytes asked for `threads` runs on, the CPUs its helper threads may use: empty when
 * none is started or they are not restricted), as the copy itself decides now (tests). */
PyObject *kvc_threads_for(int threads, uint64_t total);

#endif
