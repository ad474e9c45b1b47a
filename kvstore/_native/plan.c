/* plan_pieces: the copy plan of a batch of stored blocks, the (dst, src, length) of every piece of every vLLM
 * block, written into three caller-owned uint64 arrays for copy_addrs (CPU) or the GPU copy kernel.
 *
 * Why in C: a connector save of 32 keys of a 32-layer model is 2,048 pieces a step. The same arithmetic in numpy
 * (about fifteen whole-array passes and their temporaries) cost 22 us warm and 60-110 us on vLLM's thread right
 * after the step's 64 MiB gather had cooled the caches (bench.connector --chunk 512: 3 ms of a 70 ms pass). Here it
 * is one pass that writes each output once. */
#include "plan.h"

/* Borrow a 1-D C-contiguous array of 8-byte integers: unsigned ('Q'/'L') or signed ('q'/'l'); writable on
 * request. 0 on success, else -1 and TypeError naming the argument. */
static int get_i8(PyObject *obj, const char *name, int is_signed, int writable, Py_buffer *v) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "plan_pieces: %s must be a%s C-contiguous %s buffer, got %.100s", name,
                     writable ? " writable" : "", is_signed ? "int64" : "uint64", Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) f++;
    char q = is_signed ? 'q' : 'Q', l = is_signed ? 'l' : 'L';
    int ok = v->itemsize == 8 && f[1] == '\0' && (f[0] == q || (f[0] == l && sizeof(long) == 8)) && v->ndim == 1;
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "plan_pieces: %s must be a 1-D array of %s, got format '%s', itemsize %zd, "
                     "ndim %d", name, is_signed ? "int64" : "uint64", v->format ? v->format : "B", v->itemsize,
                     v->ndim);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

enum { SLOTS, BLOCKS, BASE, STRIDE, OFFSET, BYTES, DST, SRC, LEN, NARGS };

PyObject *kvc_plan_pieces(PyObject *self, PyObject *args) {
    static const char *const names[NARGS] = {"slots", "blocks", "piece_base", "piece_stride", "piece_offset",
                                             "piece_bytes", "dst", "src", "lengths"};
    static const int is_signed[NARGS] = {0, 1, 0, 0, 0, 0, 0, 0, 0};
    PyObject *objs[NARGS];
    Py_ssize_t per_slot;
    unsigned long long block_bytes, num_blocks;
    int to_store;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnOOOOKKpOOO:plan_pieces", &objs[SLOTS], &objs[BLOCKS], &per_slot, &objs[BASE],
                          &objs[STRIDE], &objs[OFFSET], &objs[BYTES], &block_bytes, &num_blocks, &to_store,
                          &objs[DST], &objs[SRC], &objs[LEN]))
        return NULL;
    Py_buffer v[NARGS];
    int got = 0;
    for (; got < NARGS; got++)
        if (get_i8(objs[got], names[got], is_signed[got], got >= DST, &v[got]) < 0) break;
    PyObject *res = NULL;
    if (got < NARGS) goto done;
    Py_ssize_t n = v[SLOTS].shape[0], pieces = v[BASE].shape[0], cap = v[DST].shape[0];
    /* products compared by division: no argument can make them wrap */
    if (per_slot < 1 || v[BLOCKS].shape[0] / per_slot != n || v[BLOCKS].shape[0] % per_slot) {
        PyErr_Format(PyExc_ValueError, "plan_pieces: %zd block ids for %zd slots of %zd blocks each",
                     v[BLOCKS].shape[0], n, per_slot);
        goto done;
    }
    if (v[STRIDE].shape[0] != pieces || v[OFFSET].shape[0] != pieces || v[BYTES].shape[0] != pieces) {
        PyErr_Format(PyExc_ValueError, "plan_pieces: piece arrays of unequal length (%zd, %zd, %zd, %zd)", pieces,
                     v[STRIDE].shape[0], v[OFFSET].shape[0], v[BYTES].shape[0]);
        goto done;
    }
    if (v[SRC].shape[0] != cap || v[LEN].shape[0] != cap || (pieces && v[BLOCKS].shape[0] > cap / pieces)) {
        PyErr_Format(PyExc_ValueError, "plan_pieces: outputs of %zd, %zd and %zd entries for %zd blocks of %zd "
                     "pieces", cap, v[SRC].shape[0], v[LEN].shape[0], v[BLOCKS].shape[0], pieces);
        goto done;
    }
    const int64_t *blocks = v[BLOCKS].buf;
    for (Py_ssize_t i = 0; i < n * per_slot; i++) { /* every id checked before anything is written */
        if (blocks[i] < -1 || (blocks[i] >= 0 && (uint64_t)blocks[i] >= num_blocks)) {
            PyErr_Format(PyExc_ValueError, "block id out of range [0, %llu): %lld (-1 leaves a block untouched)",
                         num_blocks, (long long)blocks[i]);
            goto done;
        }
    }
    const uint64_t *slots = v[SLOTS].buf, *base = v[BASE].buf, *stride = v[STRIDE].buf, *offset = v[OFFSET].buf,
                   *bytes = v[BYTES].buf;
    uint64_t *cache_out = to_store ? v[SRC].buf : v[DST].buf, *slot_out = to_store ? v[DST].buf : v[SRC].buf;
    uint64_t *len_out = v[LEN].buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t s = 0; s < n; s++) {
        for (Py_ssize_t j = 0; j < per_slot; j++) {
            int64_t b = blocks[s * per_slot + j];
            if (b < 0) continue;
            uint64_t slot = slots[s] + (uint64_t)j * block_bytes;
            for (Py_ssize_t p = 0; p < pieces; p++, k++) {
                cache_out[k] = base[p] + (uint64_t)b * stride[p];
                slot_out[k] = slot + offset[p];
                len_out[k] = bytes[p];
            }
        }
    }
    res = PyLong_FromSsize_t(k);
done:
    while (got--) PyBuffer_Release(&v[got]);
    return res;
}
