/* kvstore._native._keyindex: the shared key index, a hash table in shared memory that the daemon writes and
 * same-node clients read.
 *
 * Why: vLLM's scheduler probes the store for every waiting request inside its step ("how many leading blocks
 * of this prompt are stored?"). Answered by the daemon, a 280-key probe costs a round trip plus ~100 us of
 * per-key work in the daemon's Python (dict lookups, tier checks). The daemon mirrors which keys are in its
 * RAM tier into this table; a client hashes its keys and finds their entry ids here in a few microseconds,
 * with no syscall, then sends only those ids for the daemon to check (kvstore/fastpath/key_index.py), or,
 * when every key is there, answers a counting Lookup itself (the slot also holds the block's arena offset,
 * size and checksum: a Lookup without lease needs nothing else but the slot generations in the arena).
 *
 * Layout (little-endian, in a memfd the daemon hands out read-only):
 *
 *     header (64 B): u64 magic | u64 capacity (slots, a power of two) | u64 seq | u64 count | u64 incarnation |
 *                    u64 authority | u64 deferred | u64 bound
 *     slots[capacity] (48 B each): u64 h1 | u32 h2 | u32 entry id | u32 serial | u32 0 | u64 size |
 *                                  u64 arena offset | u64 checksum                          (h1 == 0: empty)
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
 * probe loop is bounded by the capacity, so a torn read can never run past the table or forever.
 *
 * When a key is NOT here, may a client say "not stored" without asking? Only where the table holds every key a
 * Lookup would find: `authority` is 1 when the daemon has no other tier (no disk, no peers) and the table has
 * never had to skip a key (0 for good after the first). And only when no Store has answered its client before
 * its keys were indexed: the daemon counts such binds (`deferred`, before the reply) and finishes them
 * (`bound`, after their keys are written); a reader that finds them equal before its probe and `deferred`
 * unchanged after it has seen every key whose Store had answered (kvstore/fastpath/key_index.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#define MAGIC 0x3230584449535648ULL /* "HVSIDX02" */
#define HEADER_BYTES 64
#define SLOT_BYTES 48
#define MAX_TRIES 8
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL

typedef struct { uint64_t magic, capacity, seq, count, incarnation, words[3]; } header_t;
enum { AUTHORITY, DEFERRED, BOUND, N_WORDS }; /* header_t.words */
typedef struct { uint64_t h1; uint32_t h2, eid, serial, pad; uint64_t size, offset, checksum; } slot_t;
typedef struct { uint32_t eid, serial; uint64_t size, offset, checksum; } entry_t; /* what a slot says of a key */
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

static inline void slot_write(slot_t *d, uint64_t h1, uint32_t h2, const entry_t *e) {
    __atomic_store_n(&d->h2, h2, __ATOMIC_RELAXED);
    __atomic_store_n(&d->eid, e->eid, __ATOMIC_RELAXED);
    __atomic_store_n(&d->serial, e->serial, __ATOMIC_RELAXED);
    __atomic_store_n(&d->size, e->size, __ATOMIC_RELAXED);
    __atomic_store_n(&d->offset, e->offset, __ATOMIC_RELAXED);
    __atomic_store_n(&d->checksum, e->checksum, __ATOMIC_RELAXED);
    __atomic_store_n(&d->h1, h1, __ATOMIC_RELAXED);
}

static inline entry_t slot_entry(const slot_t *s) {
    entry_t e = {__atomic_load_n(&s->eid, __ATOMIC_RELAXED), __atomic_load_n(&s->serial, __ATOMIC_RELAXED),
                 __atomic_load_n(&s->size, __ATOMIC_RELAXED), __atomic_load_n(&s->offset, __ATOMIC_RELAXED),
                 __atomic_load_n(&s->checksum, __ATOMIC_RELAXED)};
    return e;
}

/* The n values of list `obj` as unsigned integers of at most `bits` bits, into out[i * stride]; -1 + error. */
static int get_column(PyObject *obj, Py_ssize_t n, const char *name, int bits, uint64_t *out, size_t stride) {
    if (!PyList_Check(obj) || PyList_GET_SIZE(obj) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a list as long as keys", name);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(obj, i));
        if (PyErr_Occurred())
            return -1;
        if (bits < 64 && v >> bits) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] does not fit in %d bits", name, i, bits);
            return -1;
        }
        out[(size_t)i * stride] = v;
    }
    return 0;
}

static PyObject *index_insert(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned long long capacity;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *keys, *cols[5];
    static const char *const names[5] = {"eids", "serials", "sizes", "offsets", "checksums"};
    static const int bits[5] = {32, 32, 64, 64, 64};
    if (!PyArg_ParseTuple(args, "w*Ks#OOOOOO:insert", &view, &capacity, &ns, &ns_len, &keys, &cols[0], &cols[1],
                          &cols[2], &cols[3], &cols[4]))
        return NULL;
    PyObject *result = NULL;
    if (get_table(&view, capacity) < 0 || check_keys(keys) < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t *vals = PyMem_Malloc(sizeof(uint64_t) * 5 * (size_t)(n ? n : 1));
    if (!vals) { PyErr_NoMemory(); goto done; }
    for (int c = 0; c < 5; c++) { /* every value checked before the table changes */
        if (get_column(cols[c], n, names[c], bits[c], vals + c, 5) < 0) {
            PyMem_Free(vals);
            goto done;
        }
    }
    header_t *h = (header_t *)view.buf;
    slot_t *slots = (slot_t *)((char *)view.buf + HEADER_BYTES);
    uint64_t mask = capacity - 1, limit = capacity / 4 * 3, count = h->count, added = 0;
    state_t st = ns_state(ns, ns_len);
    seq_begin(h);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        const uint64_t *v = vals + 5 * i;
        entry_t e = {(uint32_t)v[0], (uint32_t)v[1], v[2], v[3], v[4]};
        uint64_t h1;
        uint32_t h2;
        key_hash(st, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), &h1, &h2);
        uint64_t j = h1 & mask;
        for (uint64_t step = 0; step < capacity; step++, j = (j + 1) & mask) {
            if (slots[j].h1 == h1 && slots[j].h2 == h2) { /* already indexed: the newer entry wins */
                slot_write(&slots[j], h1, h2, &e);
                added++;
                break;
            }
            if (slots[j].h1 == 0) {
                if (count < limit) {
                    slot_write(&slots[j], h1, h2, &e);
                    count++;
                    added++;
                }
                break;
            }
        }
    }
    __atomic_store_n(&h->count, count, __ATOMIC_RELAXED);
    seq_end(h);
    PyMem_Free(vals);
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
                entry_t moved = slot_entry(&slots[k2]);
                slot_write(&slots[hole], slots[k2].h1, slots[k2].h2, &moved);
                hole = k2;
            }
        }
        static const entry_t none = {0, 0, 0, 0, 0};
        slot_write(&slots[hole], 0, 0, &none);
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

/* The table under `view` after checking its header against the mapping (its capacity, read once, in *capacity);
 * NULL + error when it is not one. */
static const header_t *reader_table(Py_buffer *view, uint64_t *capacity) {
    if (view->len < HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "a table is at least %d bytes, the buffer has %zd", HEADER_BYTES, view->len);
        return NULL;
    }
    const header_t *h = (const header_t *)view->buf;
    if (h->magic != MAGIC) {
        PyErr_SetString(PyExc_ValueError, "not a kvstore key index (bad magic)");
        return NULL;
    }
    *capacity = __atomic_load_n(&h->capacity, __ATOMIC_RELAXED);
    return get_table(view, *capacity) < 0 ? NULL : h;
}

/* What the table says of the leading keys, under the sequence lock: how many lead (their entries in out[]),
 * with the even seq the whole batch was read under in *seq; -1 when the writer kept changing the table.
 * h1[]/h2[] are the keys' hashes. The slot of key i + AHEAD is prefetched while key i is probed: a chain's
 * keys land in random slots of a table of MiBs, and a cold probe (a scheduler step after an idle spell) would
 * otherwise wait for each cache and TLB miss in turn. */
#define AHEAD 16
static Py_ssize_t read_entries(const header_t *h, uint64_t capacity, const uint64_t *h1, const uint32_t *h2,
                               Py_ssize_t n, entry_t *out, uint64_t *seq) {
    uint64_t mask = capacity - 1; /* checked by reader_table against the mapping */
    const slot_t *slots = (const slot_t *)((const char *)h + HEADER_BYTES);
    for (int attempt = 0; attempt < MAX_TRIES; attempt++) {
        uint64_t s0 = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
        if (s0 & 1)
            continue;
        for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
            __builtin_prefetch(&slots[h1[i] & mask]);
        Py_ssize_t i = 0;
        for (; i < n; i++) { /* a prefix: stop at the first key not indexed */
            if (i + AHEAD < n)
                __builtin_prefetch(&slots[h1[i + AHEAD] & mask]);
            uint64_t j = h1[i] & mask, step = 0;
            int hit = 0;
            for (; step < capacity; step++, j = (j + 1) & mask) {
                uint64_t s1 = __atomic_load_n(&slots[j].h1, __ATOMIC_RELAXED);
                if (s1 == 0)
                    break;
                if (s1 == h1[i] && __atomic_load_n(&slots[j].h2, __ATOMIC_RELAXED) == h2[i]) {
                    out[i] = slot_entry(&slots[j]);
                    hit = 1;
                    break;
                }
            }
            if (!hit)
                break;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&h->seq, __ATOMIC_RELAXED) == s0) {
            *seq = s0;
            return i;
        }
    }
    return -1;
}

/* A new bytes object of n fields, each `width` bytes at `field` of out[i]. */
static PyObject *column(const entry_t *out, Py_ssize_t n, size_t field, size_t width) {
    PyObject *b = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)width);
    if (b) {
        char *d = PyBytes_AS_STRING(b);
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(d + (size_t)i * width, (const char *)&out[i] + field, width);
    }
    return b;
}

/* probe (ids and serials) and entries (every column, and the seq): one reader, two answers. */
static PyObject *read_keys(PyObject *args, const char *fmt, int all_columns) {
    Py_buffer view;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, fmt, &view, &ns, &ns_len, &keys))
        return NULL;
    PyObject *result = NULL;
    entry_t *out = NULL;
    uint64_t capacity = 0;
    const header_t *h = reader_table(&view, &capacity);
    if (!h || check_keys(keys) < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    size_t m = (size_t)(n ? n : 1);
    out = PyMem_Malloc((sizeof(entry_t) + sizeof(uint64_t) + sizeof(uint32_t)) * m); /* entries, h1s, h2s */
    if (!out) { PyErr_NoMemory(); goto done; }
    uint64_t *h1 = (uint64_t *)(out + m);
    uint32_t *h2 = (uint32_t *)(h1 + m);
    state_t st = ns_state(ns, ns_len);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        key_hash(st, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), &h1[i], &h2[i]);
    }
    uint64_t seq = 0;
    Py_ssize_t found = read_entries(h, capacity, h1, h2, n, out, &seq);
    if (found < 0) { /* the daemon kept writing: the caller asks it instead */
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    PyObject *c[5] = {column(out, found, offsetof(entry_t, eid), 4), column(out, found, offsetof(entry_t, serial), 4),
                      NULL, NULL, NULL};
    if (all_columns) {
        c[2] = column(out, found, offsetof(entry_t, size), 8);
        c[3] = column(out, found, offsetof(entry_t, offset), 8);
        c[4] = column(out, found, offsetof(entry_t, checksum), 8);
    }
    int ok = c[0] && c[1] && (!all_columns || (c[2] && c[3] && c[4]));
    if (ok && all_columns)
        result = Py_BuildValue("(nNNNNNK)", found, c[0], c[1], c[2], c[3], c[4], (unsigned long long)seq);
    else if (ok)
        result = Py_BuildValue("(nNN)", found, c[0], c[1]);
    else
        for (int k = 0; k < 5; k++) Py_XDECREF(c[k]);
done:
    PyMem_Free(out);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *index_probe(PyObject *self, PyObject *args) {
    (void)self;
    return read_keys(args, "y*s#O:probe", 0);
}

static PyObject *index_entries(PyObject *self, PyObject *args) {
    (void)self;
    return read_keys(args, "y*s#O:entries", 1);
}

/* `read(h)` on the checked header of the table `arg`, after every load the caller made before (acquire). */
static PyObject *read_header(PyObject *arg, PyObject *(*read)(const header_t *)) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    uint64_t capacity = 0;
    const header_t *h = reader_table(&view, &capacity);
    if (h) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        result = read(h);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyObject *seq_of(const header_t *h) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE));
}

static PyObject *index_seq(PyObject *self, PyObject *arg) {
    (void)self;
    return read_header(arg, seq_of);
}

/* The header's words (authority, deferred, bound): the writer stores one (release: after everything it wrote
 * before), a reader loads all three (acquire) in the order the soundness argument above needs: deferred, then
 * bound, then authority. */
static PyObject *index_set_word(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned long long capacity, value;
    int which;
    if (!PyArg_ParseTuple(args, "w*KiK:set_word", &view, &capacity, &which, &value))
        return NULL;
    PyObject *result = NULL;
    if (which < 0 || which >= N_WORDS)
        PyErr_Format(PyExc_ValueError, "header word %d does not exist (0 to %d)", which, N_WORDS - 1);
    else if (get_table(&view, capacity) == 0) {
        header_t *h = (header_t *)view.buf;
        __atomic_store_n(&h->words[which], (uint64_t)value, __ATOMIC_RELEASE);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyObject *words_of(const header_t *h) {
    uint64_t deferred = __atomic_load_n(&h->words[DEFERRED], __ATOMIC_ACQUIRE);
    uint64_t bound = __atomic_load_n(&h->words[BOUND], __ATOMIC_ACQUIRE);
    uint64_t authority = __atomic_load_n(&h->words[AUTHORITY], __ATOMIC_ACQUIRE);
    return Py_BuildValue("(KKK)", (unsigned long long)authority, (unsigned long long)deferred,
                         (unsigned long long)bound);
}

static PyObject *index_words(PyObject *self, PyObject *arg) {
    (void)self;
    return read_header(arg, words_of);
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
     "insert(table, capacity, namespace, keys: list[bytes], eids, serials, sizes, offsets, checksums: list[int]) -> "
     "int: index each key (an indexed key is updated); keys that find the table 3/4 full are skipped. Returns the "
     "keys written."},
    {"remove", index_remove, METH_VARARGS,
     "remove(table, capacity, namespace: bytes, keys: list[bytes]) -> int: unindex each key that is indexed."},
    {"probe", index_probe, METH_VARARGS,
     "probe(table, namespace: bytes, keys: list[bytes]) -> (n, eids: bytes, serials: bytes) | None: how many leading "
     "keys are indexed, with their entry ids and serials (u32 little-endian each); None when the writer kept "
     "changing the table (ask the daemon)."},
    {"entries", index_entries, METH_VARARGS,
     "entries(table, namespace, keys) -> (n, eids, serials: u32 bytes, sizes, offsets, checksums: u64 bytes, seq) | "
     "None: probe with every column, and the table's sequence number the batch was read under (seq() equal to it "
     "later: no entry changed in between)."},
    {"seq", index_seq, METH_O, "seq(table) -> int: the table's sequence number now (odd: a write is under way)."},
    {"set_word", index_set_word, METH_VARARGS,
     "set_word(table, capacity, which, value): store header word `which` (0 authority, 1 deferred, 2 bound)."},
    {"words", index_words, METH_O,
     "words(table) -> (authority, deferred, bound): the header words, deferred read first, authority last."},
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
