/* kvstore._native._keyindex: the shared key index, a hash table in shared memory that the daemon writes and
 * same-node clients read.
 *
 * Why: vLLM's scheduler probes the store for every waiting request inside its step ("how many leading blocks
 * of this prompt are stored?"). Answered by the daemon, a 280-key probe costs a round trip plus ~100 us of
 * per-key work in the daemon's Python (dict lookups, tier checks). The daemon mirrors which keys are in its
 * RAM tier into this table; a client hashes its keys and finds their entry ids here in a few microseconds,
 * with no syscall, then sends only those ids for the daemon to check (kvstore/fastpath/key_index.py).
 *
 * Layout (little-endian, in a memfd the daemon hands out read-only):
 *
 *     header (64 B): u64 magic | u64 capacity (slots, a power of two) | u64 seq | u64 count | u64 incarnation |
 *                    24 B reserved
 *     slots[capacity] (24 B each): u64 h1 | u32 h2 | u32 entry id | u32 serial | u32 0     (h1 == 0: empty)
 *
 * h1/h2 are a 96-bit hash of (namespace, key); the serial tells a reused entry id from the one the client saw.
 * Open addressing with linear probing; deletion shifts the following run back (no tombstones, so a table that
 * churns for months never degrades). The daemon is the only writer (under its engine lock) and refuses to fill
 * the table past 3/4: a key it could not index is simply not found here, and the client asks the daemon.
 *
 * Readers and the writer meet through a sequence lock: the writer makes `seq` odd before it changes slots and
 * even after; a reader takes `seq` before and after its whole batch and retries the batch when it moved (at most
 * MAX_TRIES times, then it returns None and the client asks the daemon). The writer never trusts the header
 * (the capacity comes from its own argument); a reader checks the header against the mapping's size, and every
 * probe loop is bounded by the capacity, so a torn read can never run past the table or forever. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 0x3130584449535648ULL /* "HVSIDX01" */
#define HEADER_BYTES 64
#define SLOT_BYTES 24
#define MAX_TRIES 8
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL

typedef struct { uint64_t magic, capacity, seq, count, incarnation, reserved[3]; } header_t;
typedef struct { uint64_t h1; uint32_t h2, eid, serial, pad; } slot_t;
typedef struct { uint64_t a, b; } state_t;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static inline void absorb_word(state_t *s, uint64_t w) {
    s->a = rotl(s->a ^ (w * P2), 31) * P1;
    s->b = rotl(s->b ^ (w * P1), 27) * P2 + s->a;
}

static inline void absorb(state_t *s, const unsigned char *p, size_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        absorb_word(s, w);
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, p, n);
        absorb_word(s, w ^ ((uint64_t)n << 56));
    }
}

/* The state after the namespace (its length closes it, so ("ab", "c...") and ("a", "bc...") differ). */
static state_t ns_state(const char *ns, Py_ssize_t n) {
    state_t s = {P1 ^ 0x6b7673746f7265ULL, P2};
    absorb(&s, (const unsigned char *)ns, (size_t)n);
    absorb_word(&s, (uint64_t)n | (1ULL << 63));
    return s;
}

static inline void key_hash(state_t s, const char *key, Py_ssize_t n, uint64_t *h1, uint32_t *h2) {
    absorb(&s, (const unsigned char *)key, (size_t)n);
    uint64_t x = mix64(s.a ^ ((uint64_t)n * P2));
    uint64_t y = mix64(s.b + x);
    *h1 = x ? x : 1; /* 0 marks an empty slot */
    *h2 = (uint32_t)(y >> 32);
}

/* ---- argument checks ---------------------------------------------------------------------------------- */

static int get_table(Py_buffer *view, unsigned long long capacity) {
    if (capacity < 2 || (capacity & (capacity - 1))) {
        PyErr_Format(PyExc_ValueError, "capacity %llu is not a power of two >= 2", capacity);
        return -1;
    }
    if ((unsigned long long)view->len < HEADER_BYTES + capacity * SLOT_BYTES) {
        PyErr_Format(PyExc_ValueError, "a table of %llu slots needs %llu bytes, the buffer has %zd", capacity,
                     (unsigned long long)(HEADER_BYTES + capacity * SLOT_BYTES), view->len);
        return -1;
    }
    return 0; /* the writer's "w*" already refused a read-only buffer */
}

static int check_keys(PyObject *keys) {
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list of bytes");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        if (!PyBytes_Check(PyList_GET_ITEM(keys, i))) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is not bytes", i);
            return -1;
        }
    }
    return 0;
}

/* ---- the writer (the daemon) -------------------------------------------------------------------------- */

static inline void seq_begin(header_t *h) {
    uint64_t s = __atomic_load_n(&h->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&h->seq, s | 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void seq_end(header_t *h) {
    uint64_t s = __atomic_load_n(&h->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&h->seq, (s | 1) + 1, __ATOMIC_RELEASE);
}

static inline void slot_write(slot_t *d, uint64_t h1, uint32_t h2, uint32_t eid, uint32_t serial) {
    __atomic_store_n(&d->h2, h2, __ATOMIC_RELAXED);
    __atomic_store_n(&d->eid, eid, __ATOMIC_RELAXED);
    __atomic_store_n(&d->serial, serial, __ATOMIC_RELAXED);
    __atomic_store_n(&d->h1, h1, __ATOMIC_RELAXED);
}

static PyObject *index_insert(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned long long capacity;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *keys, *eids, *serials;
    if (!PyArg_ParseTuple(args, "w*Ks#OOO:insert", &view, &capacity, &ns, &ns_len, &keys, &eids, &serials))
        return NULL;
    PyObject *result = NULL;
    if (get_table(&view, capacity) < 0 || check_keys(keys) < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (!PyList_Check(eids) || !PyList_Check(serials) || PyList_GET_SIZE(eids) != n || PyList_GET_SIZE(serials) != n) {
        PyErr_SetString(PyExc_ValueError, "eids and serials must be lists as long as keys");
        goto done;
    }
    uint32_t *ids = PyMem_Malloc(sizeof(uint32_t) * 2 * (size_t)(n ? n : 1));
    if (!ids) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) { /* every value checked before the table changes */
        unsigned long long e = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(eids, i));
        unsigned long long s = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(serials, i));
        if (PyErr_Occurred() || e > 0xFFFFFFFFULL || s > 0xFFFFFFFFULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "eids[%zd] / serials[%zd] do not fit in 32 bits", i, i);
            PyMem_Free(ids);
            goto done;
        }
        ids[2 * i] = (uint32_t)e;
        ids[2 * i + 1] = (uint32_t)s;
    }
    header_t *h = (header_t *)view.buf;
    slot_t *slots = (slot_t *)((char *)view.buf + HEADER_BYTES);
    uint64_t mask = capacity - 1, limit = capacity / 4 * 3, count = h->count, added = 0;
    state_t st = ns_state(ns, ns_len);
    seq_begin(h);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        uint64_t h1;
        uint32_t h2;
        key_hash(st, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), &h1, &h2);
        uint64_t j = h1 & mask;
        for (uint64_t step = 0; step < capacity; step++, j = (j + 1) & mask) {
            if (slots[j].h1 == h1 && slots[j].h2 == h2) { /* already indexed: the newer entry wins */
                slot_write(&slots[j], h1, h2, ids[2 * i], ids[2 * i + 1]);
                added++;
                break;
            }
            if (slots[j].h1 == 0) {
                if (count < limit) {
                    slot_write(&slots[j], h1, h2, ids[2 * i], ids[2 * i + 1]);
                    count++;
                    added++;
                }
                break;
            }
        }
    }
    __atomic_store_n(&h->count, count, __ATOMIC_RELAXED);
    seq_end(h);
    PyMem_Free(ids);
    result = PyLong_FromUnsignedLongLong(added);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *index_remove(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned long long capacity;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "w*Ks#O:remove", &view, &capacity, &ns, &ns_len, &keys))
        return NULL;
    PyObject *result = NULL;
    if (get_table(&view, capacity) < 0 || check_keys(keys) < 0)
        goto done;
    header_t *h = (header_t *)view.buf;
    slot_t *slots = (slot_t *)((char *)view.buf + HEADER_BYTES);
    uint64_t mask = capacity - 1, count = h->count, removed = 0;
    state_t st = ns_state(ns, ns_len);
    seq_begin(h);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        uint64_t h1;
        uint32_t h2;
        key_hash(st, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), &h1, &h2);
        uint64_t j = h1 & mask, step = 0;
        for (; step < capacity && slots[j].h1 != 0; step++, j = (j + 1) & mask)
            if (slots[j].h1 == h1 && slots[j].h2 == h2)
                break;
        if (step == capacity || slots[j].h1 == 0)
            continue; /* not indexed (never, or the table was full) */
        /* backward shift: move each later member of the run whose home is not in (hole, it] into the hole */
        uint64_t hole = j, k2 = j;
        for (step = 0; step < capacity; step++) {
            k2 = (k2 + 1) & mask;
            if (slots[k2].h1 == 0)
                break;
            uint64_t home = slots[k2].h1 & mask;
            int movable = hole <= k2 ? (home <= hole || home > k2) : (home <= hole && home > k2);
            if (movable) {
                slot_write(&slots[hole], slots[k2].h1, slots[k2].h2, slots[k2].eid, slots[k2].serial);
                hole = k2;
            }
        }
        slot_write(&slots[hole], 0, 0, 0, 0);
        count--;
        removed++;
    }
    __atomic_store_n(&h->count, count, __ATOMIC_RELAXED);
    seq_end(h);
    result = PyLong_FromUnsignedLongLong(removed);
done:
    PyBuffer_Release(&view);
    return result;
}

/* ---- the reader (a client) ---------------------------------------------------------------------------- */

static PyObject *index_probe(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*s#O:probe", &view, &ns, &ns_len, &keys))
        return NULL;
    PyObject *result = NULL;
    uint32_t *out = NULL;
    if (view.len < HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "a table is at least %d bytes, the buffer has %zd", HEADER_BYTES, view.len);
        goto done;
    }
    header_t *h = (header_t *)view.buf;
    uint64_t capacity = __atomic_load_n(&h->capacity, __ATOMIC_RELAXED);
    if (h->magic != MAGIC) {
        PyErr_SetString(PyExc_ValueError, "not a kvstore key index (bad magic)");
        goto done;
    }
    if (get_table(&view, capacity) < 0 || check_keys(keys) < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    out = PyMem_Malloc(sizeof(uint32_t) * 2 * (size_t)(n ? n : 1));
    if (!out) { PyErr_NoMemory(); goto done; }
    const slot_t *slots = (const slot_t *)((const char *)view.buf + HEADER_BYTES);
    uint64_t mask = capacity - 1;
    state_t st = ns_state(ns, ns_len);
    Py_ssize_t found = -1;
    for (int attempt = 0; attempt < MAX_TRIES && found < 0; attempt++) {
        uint64_t s0 = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
        if (s0 & 1)
            continue;
        Py_ssize_t i = 0;
        for (; i < n; i++) { /* a prefix: stop at the first key not indexed */
            PyObject *k = PyList_GET_ITEM(keys, i);
            uint64_t h1;
            uint32_t h2;
            key_hash(st, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), &h1, &h2);
            uint64_t j = h1 & mask, step = 0;
            int hit = 0;
            for (; step < capacity; step++, j = (j + 1) & mask) {
                uint64_t s1 = __atomic_load_n(&slots[j].h1, __ATOMIC_RELAXED);
                if (s1 == 0)
                    break;
                if (s1 == h1 && __atomic_load_n(&slots[j].h2, __ATOMIC_RELAXED) == h2) {
                    out[2 * i] = __atomic_load_n(&slots[j].eid, __ATOMIC_RELAXED);
                    out[2 * i + 1] = __atomic_load_n(&slots[j].serial, __ATOMIC_RELAXED);
                    hit = 1;
                    break;
                }
            }
            if (!hit)
                break;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&h->seq, __ATOMIC_RELAXED) == s0)
            found = i;
    }
    if (found < 0) { /* the daemon kept writing: the caller asks it instead */
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    PyObject *eids = PyBytes_FromStringAndSize(NULL, found * 4);
    PyObject *serials = eids ? PyBytes_FromStringAndSize(NULL, found * 4) : NULL;
    if (serials) {
        uint32_t *e = (uint32_t *)PyBytes_AS_STRING(eids), *s = (uint32_t *)PyBytes_AS_STRING(serials);
        for (Py_ssize_t i = 0; i < found; i++) {
            e[i] = out[2 * i];
            s[i] = out[2 * i + 1];
        }
        result = Py_BuildValue("(nNN)", found, eids, serials);
    } else {
        Py_XDECREF(eids);
    }
done:
    PyMem_Free(out);
    PyBuffer_Release(&view);
    return result;
}

/* ---- the daemon's check of what a client found --------------------------------------------------------- */

static PyObject *index_check(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer ids, serials, state, ns_col, serial_col;
    unsigned long long n_entries;
    unsigned int ns_id, committed;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*KII:check", &ids, &serials, &state, &ns_col, &serial_col, &n_entries,
                          &ns_id, &committed))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = ids.len / 4;
    if (ids.len % 4 || serials.len != ids.len) {
        PyErr_SetString(PyExc_ValueError, "ids and serials must be u32 arrays of one length");
        goto done;
    }
    if ((unsigned long long)state.len < n_entries || (unsigned long long)ns_col.len < 2 * n_entries ||
        (unsigned long long)serial_col.len < 4 * n_entries) {
        PyErr_SetString(PyExc_ValueError, "the catalog columns are shorter than n_entries");
        goto done;
    }
    const uint32_t *id = ids.buf, *ser = serials.buf, *col_serial = serial_col.buf;
    const uint8_t *st = state.buf;
    const uint16_t *col_ns = ns_col.buf;
    Py_ssize_t k = 0;
    for (; k < m; k++) {
        uint32_t e = id[k];
        if (e >= n_entries || st[e] != committed || col_ns[e] != ns_id || col_serial[e] != ser[k])
            break;
    }
    result = PyLong_FromSsize_t(k);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&serials);
    PyBuffer_Release(&state);
    PyBuffer_Release(&ns_col);
    PyBuffer_Release(&serial_col);
    return result;
}

static PyMethodDef methods[] = {
    {"insert", index_insert, METH_VARARGS,
     "insert(table, capacity, namespace: bytes, keys: list[bytes], eids: list[int], serials: list[int]) -> int: index "
     "each key (an indexed key is updated); keys that find the table 3/4 full are skipped. Returns the keys written."},
    {"remove", index_remove, METH_VARARGS,
     "remove(table, capacity, namespace: bytes, keys: list[bytes]) -> int: unindex each key that is indexed."},
    {"probe", index_probe, METH_VARARGS,
     "probe(table, namespace: bytes, keys: list[bytes]) -> (n, eids: bytes, serials: bytes) | None: how many leading "
     "keys are indexed, with their entry ids and serials (u32 little-endian each); None when the writer kept "
     "changing the table (ask the daemon)."},
    {"check", index_check, METH_VARARGS,
     "check(ids, serials, state, ns, serial, n_entries, ns_id, committed) -> int: how many leading (id, serial) "
     "pairs (u32 buffers) name an entry below n_entries whose state is `committed`, namespace `ns_id` and serial "
     "the one given (the catalog's uint8 state, uint16 ns and uint32 serial columns). The daemon's check of a probe."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keyindex",
    "The shared key index: a hash table in shared memory, written by the daemon, probed by same-node clients.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyindex(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_BYTES", SLOT_BYTES) < 0 ||
        PyModule_AddObject(m, "MAGIC", PyLong_FromUnsignedLongLong(MAGIC)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
