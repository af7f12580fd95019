/* The feeder's two per-byte loops, in C with the GIL released: cutting samples out of the
 * memory-mapped token chunks (gather), and writing a whole StreamReply in one call
 * (frame): k batches in the proto3 wire format, each with its CRC-32C.
 *
 * In Python the same bytes cost ~60 us of held GIL per batch (varints, field lists, a bytes
 * join, a tobytes copy for the checksum); one feeder process serves every rank from one GIL,
 * so that was most of what limited it. Here the sizes are summed first, the reply is allocated
 * once, and the copies and checksums run with the GIL released.
 *
 * feeder/service/wire.py has the Python writer these bytes must equal (tests/test_wire.py
 * checks both against protobuf itself); it is used where this module was not built. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------------------ CRC-32C */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF]; n--; }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xFF] ^ crc_table[6][(v >> 8) & 0xFF] ^ crc_table[5][(v >> 16) & 0xFF] ^
              crc_table[4][(v >> 24) & 0xFF] ^ crc_table[3][(v >> 32) & 0xFF] ^ crc_table[2][(v >> 40) & 0xFF] ^
              crc_table[1][(v >> 48) & 0xFF] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

/* crc(A || B) from crc(A), crc(B) and |B|, as zlib's crc32_combine: crc(A) times x^(8|B|)
 * modulo the (reflected) polynomial, xor crc(B). */
static uint32_t x2n_table[32];

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

static uint32_t x8nmodp(size_t n) {   /* x^(8n) */
    uint32_t p = 1u << 31;
    unsigned k = 3;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void x2n_init(void) {
    uint32_t p = 1u << 30;   /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc_hw1(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

/* The crc32 instruction takes 3 cycles and issues one per cycle: three independent streams
 * over thirds of the buffer run ~3x faster than one, and are then combined. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    if (n < 3072) return crc_hw1(crc, p, n);
    size_t third = (n / 3) & ~(size_t)7;
    const unsigned char *q = p + third, *r = q + third;
    uint64_t a = ~crc, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
    for (size_t i = 0; i < third; i += 8) {
        uint64_t u, v, w;
        memcpy(&u, p + i, 8);
        memcpy(&v, q + i, 8);
        memcpy(&w, r + i, 8);
        a = _mm_crc32_u64(a, u);
        b = _mm_crc32_u64(b, v);
        c = _mm_crc32_u64(c, w);
    }
    uint32_t ca = ~(uint32_t)a, cb = ~(uint32_t)b, rest = (uint32_t)(n - 3 * third);
    uint32_t cc = crc_hw1(~(uint32_t)c, r + third, rest);   /* continue the third stream to the end */
    uint32_t ab = multmodp(x8nmodp(third), ca) ^ cb;
    return multmodp(x8nmodp(third + rest), ab) ^ cc;
}
#define HAVE_CRC_HW 1
#endif

static uint32_t (*crc32c)(uint32_t, const unsigned char *, size_t) = crc_soft;

/* ------------------------------------------------------------------------------ proto3 */

static size_t varint_len(uint64_t v) {
    size_t n = 1;
    while (v > 0x7F) { v >>= 7; n++; }
    return n;
}

static unsigned char *put_varint(unsigned char *o, uint64_t v) {
    while (v > 0x7F) { *o++ = (unsigned char)((v & 0x7F) | 0x80); v >>= 7; }
    *o++ = (unsigned char)v;
    return o;
}

/* A varint field; proto3 leaves zeros out. Keys here are all one byte (fields < 16). */
static size_t vfield_len(uint64_t v) { return v ? 1 + varint_len(v) : 0; }
static unsigned char *put_vfield(unsigned char *o, int field, uint64_t v) {
    if (!v) return o;
    *o++ = (unsigned char)(field << 3);
    return put_varint(o, v);
}

/* A length-delimited field; an empty one is left out. */
static size_t ldfield_len(size_t n) { return n ? 1 + varint_len(n) + n : 0; }
static unsigned char *put_ldfield(unsigned char *o, int field, const void *data, size_t n) {
    if (!n) return o;
    *o++ = (unsigned char)(field << 3 | 2);
    o = put_varint(o, n);
    memcpy(o, data, n);
    return o + n;
}

typedef struct {
    uint64_t epoch, step, n, raw_size;
    const unsigned char *raw, *ids, *payload, *cursor;
    size_t payload_len, cursor_len, ids_len;
    size_t body;   /* the Batch message's length */
} batch_t;

static size_t batch_body(const batch_t *b, uint64_t sample_len, uint64_t dtype, uint64_t comp, uint32_t crc) {
    return vfield_len(b->epoch) + vfield_len(b->step) + vfield_len(b->n) + vfield_len(sample_len) +
           vfield_len(dtype) + vfield_len(comp) + ldfield_len(b->payload_len) + ldfield_len(b->ids_len) +
           ldfield_len(b->cursor_len) + vfield_len(b->raw_size) + vfield_len(crc);
}

static int get_i64(PyObject *obj, Py_buffer *view, Py_ssize_t want, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != want * 8) {
        PyErr_Format(PyExc_ValueError, "frame: %s has %zd bytes, expected %zd int64 values", name, view->len, want);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Rows cut from several buffers: row i is bufs[which[i]][offs[i] : offs[i] + n] (items). The
 * feeder's mapped chunks are the buffers; the views keep them alive while the GIL is released. */
typedef struct {
    Py_ssize_t nbufs, k, itemsize;
    size_t row_bytes;   /* n items */
    Py_buffer *bufs;
    Py_buffer which, offs;
} rows_t;

static void rows_release(rows_t *r) {
    for (Py_ssize_t i = 0; i < r->nbufs; i++)
        if (r->bufs[i].obj) PyBuffer_Release(&r->bufs[i]);
    PyMem_Free(r->bufs);
    if (r->which.obj) PyBuffer_Release(&r->which);
    if (r->offs.obj) PyBuffer_Release(&r->offs);
    memset(r, 0, sizeof(*r));
}

/* Views of (bufs, which, offs), every row checked to lie inside its buffer. */
static int rows_get(PyObject *bufs_o, PyObject *which_o, PyObject *offs_o, Py_ssize_t n, Py_ssize_t itemsize,
                    rows_t *r) {
    memset(r, 0, sizeof(*r));
    PyObject *seq = PySequence_Fast(bufs_o, "rows: bufs must be a sequence of buffers");
    if (!seq) return -1;
    r->nbufs = PySequence_Fast_GET_SIZE(seq);
    r->bufs = PyMem_Calloc(r->nbufs ? r->nbufs : 1, sizeof(Py_buffer));
    if (!r->bufs) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < r->nbufs; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &r->bufs[i], PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(seq);
            rows_release(r);
            return -1;
        }
        if (r->bufs[i].itemsize != itemsize) {
            PyErr_Format(PyExc_ValueError, "rows: buffer %zd has items of %zd bytes, expected %zd", i,
                         r->bufs[i].itemsize, itemsize);
            Py_DECREF(seq);
            rows_release(r);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (PyObject_GetBuffer(which_o, &r->which, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(offs_o, &r->offs, PyBUF_C_CONTIGUOUS) < 0 || r->which.len % 8 ||
        r->which.len != r->offs.len || n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "rows: which and offs must be int64 arrays of one length");
        rows_release(r);
        return -1;
    }
    r->k = r->which.len / 8;
    r->itemsize = itemsize;
    r->row_bytes = (size_t)n * (size_t)itemsize;
    const int64_t *wv = r->which.buf, *ov = r->offs.buf;
    for (Py_ssize_t i = 0; i < r->k; i++) {
        if (wv[i] < 0 || wv[i] >= r->nbufs || ov[i] < 0 || ov[i] + n > r->bufs[wv[i]].len / itemsize) {
            PyErr_Format(PyExc_IndexError, "rows: row %zd (buffer %lld, offset %lld, %zd items) is out of range",
                         i, (long long)wv[i], (long long)ov[i], n);
            rows_release(r);
            return -1;
        }
    }
    return 0;
}

/* Rows [first, first + count) back to back at o; returns the end. Call without the GIL. */
static unsigned char *rows_copy(const rows_t *r, Py_ssize_t first, Py_ssize_t count, unsigned char *o) {
    const int64_t *wv = r->which.buf, *ov = r->offs.buf;
    for (Py_ssize_t i = first; i < first + count; i++, o += r->row_bytes)
        memcpy(o, (const unsigned char *)r->bufs[wv[i]].buf + (size_t)ov[i] * (size_t)r->itemsize, r->row_bytes);
    return o;
}

/* frame(tokens, payloads, ids, counts, epochs, steps, cursors, sample_len, itemsize, dtype,
 *       compression, region, rows=None) -> bytes
 *   tokens:   every batch's raw tokens back to back (batch j: counts[j] * sample_len items)
 *   payloads: None (the raw tokens are the payload) or k bytes (compressed), field 7
 *   ids:      int64 sample ids back to back (sum(counts)); counts, epochs, steps: int64 [k]
 *   cursors:  k bytes. The CRC-32C of field 11 is over each batch's raw tokens.
 *   rows:     with tokens None, (bufs, which, offs): the tokens are cut straight from the
 *             buffers into the reply (uncompressed only), one copy fewer, and each batch's
 *             checksum is taken while its ~32 KiB is still in cache. */
static PyObject *frame(PyObject *self, PyObject *args) {
    PyObject *tokens_o, *payloads, *ids_o, *counts_o, *epochs_o, *steps_o, *cursors, *rows_o = Py_None;
    unsigned long long sample_len, itemsize, dtype, comp;
    Py_buffer region, tail = {0};   /* tail: fields written after the region as they are (a mixture's sources) */
    if (!PyArg_ParseTuple(args, "OOOOOOOKKKKy*|Oy*", &tokens_o, &payloads, &ids_o, &counts_o, &epochs_o, &steps_o,
                          &cursors, &sample_len, &itemsize, &dtype, &comp, &region, &rows_o, &tail))
        return NULL;
    PyObject *result = NULL, *cur_seq = NULL, *pay_seq = NULL;
    Py_buffer tokens = {0}, ids = {0}, counts = {0}, epochs = {0}, steps = {0};
    batch_t *bs = NULL;
    uint32_t *crcs = NULL;
    rows_t rows = {0};
    int direct = tokens_o == Py_None;   /* cut from rows into the reply */
    unsigned char **staged = NULL;
    cur_seq = PySequence_Fast(cursors, "frame: cursors must be a sequence of bytes");
    if (!cur_seq) goto done;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(cur_seq);
    if (payloads != Py_None) {
        pay_seq = PySequence_Fast(payloads, "frame: payloads must be None or a sequence of bytes");
        if (!pay_seq) goto done;
        if (PySequence_Fast_GET_SIZE(pay_seq) != k) {
            PyErr_SetString(PyExc_ValueError, "frame: payloads and cursors differ in length");
            goto done;
        }
    }
    if (get_i64(counts_o, &counts, k, "counts") < 0 || get_i64(epochs_o, &epochs, k, "epochs") < 0 ||
        get_i64(steps_o, &steps, k, "steps") < 0)
        goto done;
    const int64_t *cv = counts.buf, *ev = epochs.buf, *sv = steps.buf;
    int64_t samples = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (cv[j] < 0) { PyErr_SetString(PyExc_ValueError, "frame: a negative count"); goto done; }
        samples += cv[j];
    }
    if (get_i64(ids_o, &ids, samples, "ids") < 0) goto done;
    if (direct) {
        PyObject *bufs_o, *which_o, *offs_o;
        if (pay_seq || !PyArg_ParseTuple(rows_o, "OOO", &bufs_o, &which_o, &offs_o)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "frame: without tokens, rows must be (bufs, which, offs) and "
                                              "payloads None");
            goto done;
        }
        if (rows_get(bufs_o, which_o, offs_o, (Py_ssize_t)sample_len, (Py_ssize_t)itemsize, &rows) < 0) goto done;
        if (rows.k != samples) {
            PyErr_Format(PyExc_ValueError, "frame: rows has %zd rows, the counts need %lld", rows.k, (long long)samples);
            goto done;
        }
    } else {
        if (PyObject_GetBuffer(tokens_o, &tokens, PyBUF_C_CONTIGUOUS) < 0) goto done;
        if ((unsigned long long)tokens.len != (unsigned long long)samples * sample_len * itemsize) {
            PyErr_Format(PyExc_ValueError, "frame: tokens has %zd bytes, the counts need %lld", tokens.len,
                         (long long)((unsigned long long)samples * sample_len * itemsize));
            goto done;
        }
    }
    bs = PyMem_Calloc(k ? k : 1, sizeof(batch_t));
    crcs = PyMem_Calloc(k ? k : 1, sizeof(uint32_t));
    staged = PyMem_Calloc(k ? k : 1, sizeof(unsigned char *));
    if (!bs || !crcs || !staged) { PyErr_NoMemory(); goto done; }
    const unsigned char *raw = direct ? NULL : tokens.buf, *idp = ids.buf;
    for (Py_ssize_t j = 0; j < k; j++) {
        batch_t *b = &bs[j];
        b->epoch = (uint64_t)ev[j];
        b->step = (uint64_t)sv[j];
        b->n = (uint64_t)cv[j];
        b->raw_size = b->n * sample_len * itemsize;
        b->raw = raw;
        if (raw) raw += b->raw_size;
        b->ids = idp;
        b->ids_len = (size_t)b->n * 8;
        idp += b->ids_len;
        PyObject *c = PySequence_Fast_GET_ITEM(cur_seq, j);
        if (!PyBytes_Check(c)) { PyErr_SetString(PyExc_TypeError, "frame: a cursor is not bytes"); goto done; }
        b->cursor = (const unsigned char *)PyBytes_AS_STRING(c);
        b->cursor_len = (size_t)PyBytes_GET_SIZE(c);
        if (pay_seq) {
            PyObject *p = PySequence_Fast_GET_ITEM(pay_seq, j);
            if (!PyBytes_Check(p)) { PyErr_SetString(PyExc_TypeError, "frame: a payload is not bytes"); goto done; }
            b->payload = (const unsigned char *)PyBytes_AS_STRING(p);
            b->payload_len = (size_t)PyBytes_GET_SIZE(p);
        } else {
            b->payload = b->raw;
            b->payload_len = b->raw_size;
        }
    }
    if (direct) {
        /* A batch's length prefix comes before its tokens but counts its checksum's varint
         * (0-6 bytes). Where the prefix has the same size whatever the checksum (nearly always)
         * the tokens go straight into the reply and the prefix is written after them; the rare
         * batch on a varint boundary is cut into a buffer of its own first (staged). */
        Py_ssize_t first = 0, n_staged = 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            size_t lo = batch_body(&bs[j], sample_len, dtype, comp, 0);
            if (varint_len(lo) != varint_len(lo + 6)) {
                staged[j] = PyMem_Malloc(bs[j].raw_size ? bs[j].raw_size : 1);
                if (!staged[j]) { PyErr_NoMemory(); goto done; }
                bs[j].raw = staged[j];
                bs[j].payload = staged[j];
                n_staged++;
            }
        }
        /* Rarely any: the GIL is released only for work (see cursors() on why not for less). */
        if (n_staged) {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t j = 0; j < k; first += (Py_ssize_t)bs[j].n, j++)
                if (staged[j]) {
                    rows_copy(&rows, first, (Py_ssize_t)bs[j].n, staged[j]);
                    crcs[j] = crc32c(0, staged[j], bs[j].raw_size);
                }
            Py_END_ALLOW_THREADS
        }
    } else {
        /* The checksums first (the lengths depend on them), without the GIL: the sequences hold
         * the bytes objects and the views hold the arrays. */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < k; j++) crcs[j] = crc32c(0, bs[j].raw, bs[j].raw_size);
        Py_END_ALLOW_THREADS
    }
    /* Exact where the checksum is known; an upper bound (the largest checksum field) for
     * batches whose tokens are cut in place, trimmed at the end. */
    size_t total = ldfield_len(region.len) + (size_t)tail.len;
    for (Py_ssize_t j = 0; j < k; j++) {
        int in_place = direct && !staged[j];
        bs[j].body = batch_body(&bs[j], sample_len, dtype, comp, crcs[j]) + (in_place ? 6 : 0);
        total += 1 + varint_len(bs[j].body) + bs[j].body;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!result) goto done;
    unsigned char *start = (unsigned char *)PyBytes_AS_STRING(result), *o = start;
    Py_ssize_t first = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < k; first += (Py_ssize_t)bs[j].n, j++) {
        const batch_t *b = &bs[j];
        int in_place = direct && !staged[j];
        *o++ = (unsigned char)(1 << 3 | 2);   /* StreamReply.batches */
        unsigned char *prefix = o;
        size_t plen = varint_len(b->body);
        o = in_place ? o + plen : put_varint(o, b->body);
        unsigned char *body = o;
        o = put_vfield(o, 1, b->epoch);
        o = put_vfield(o, 2, b->step);
        o = put_vfield(o, 3, b->n);
        o = put_vfield(o, 4, sample_len);
        o = put_vfield(o, 5, dtype);
        o = put_vfield(o, 6, comp);
        if (in_place) {
            if (b->raw_size) {
                *o++ = (unsigned char)(7 << 3 | 2);
                o = put_varint(o, b->raw_size);
                unsigned char *tok = o;
                o = rows_copy(&rows, first, (Py_ssize_t)b->n, o);
                crcs[j] = crc32c(0, tok, b->raw_size);
            }
        } else {
            o = put_ldfield(o, 7, b->payload, b->payload_len);
        }
        o = put_ldfield(o, 8, b->ids, b->ids_len);
        o = put_ldfield(o, 9, b->cursor, b->cursor_len);
        o = put_vfield(o, 10, b->raw_size);
        o = put_vfield(o, 11, crcs[j]);
        if (in_place)   /* same size as reserved: the bound and the real body differ by < 6 */
            put_varint(prefix, (uint64_t)(o - body));
    }
    o = put_ldfield(o, 2, region.buf, (size_t)region.len);   /* StreamReply.region */
    if (tail.len) {
        memcpy(o, tail.buf, (size_t)tail.len);
        o += tail.len;
    }
    Py_END_ALLOW_THREADS
    size_t used = (size_t)(o - start);
    if (used > total) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_SystemError, "frame: size mismatch");
    } else if (used < total) {
        _PyBytes_Resize(&result, (Py_ssize_t)used);   /* shrinks in place; NULL with an error if not */
    }
done:
    if (staged)
        for (Py_ssize_t j = 0; j < k; j++) PyMem_Free(staged[j]);
    PyMem_Free(staged);
    rows_release(&rows);
    PyMem_Free(bs);
    PyMem_Free(crcs);
    Py_XDECREF(cur_seq);
    Py_XDECREF(pay_seq);
    if (tail.obj) PyBuffer_Release(&tail);
    if (tokens.obj) PyBuffer_Release(&tokens);
    if (ids.obj) PyBuffer_Release(&ids);
    if (counts.obj) PyBuffer_Release(&counts);
    if (epochs.obj) PyBuffer_Release(&epochs);
    if (steps.obj) PyBuffer_Release(&steps);
    PyBuffer_Release(&region);
    return result;
}

static PyObject *crc32c_py(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = crc32c(0, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* gather(bufs, which, offs, n, out): out[i] = bufs[which[i]][offs[i] : offs[i] + n] for each row i.
 * numpy's fancy index of a sliding window view costs ~7x memcpy here (and np.take into `out`
 * far more). */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *bufs_o, *which_o, *offs_o;
    Py_ssize_t n;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OOOnw*", &bufs_o, &which_o, &offs_o, &n, &out)) return NULL;
    rows_t rows;
    Py_ssize_t isz = out.itemsize > 0 ? out.itemsize : 1;
    if (rows_get(bufs_o, which_o, offs_o, n, isz, &rows) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (out.len != rows.k * n * isz) {
        PyErr_Format(PyExc_ValueError, "gather: out has %zd bytes, %zd rows of %zd items need %zd", out.len, rows.k,
                     n, rows.k * n * isz);
        rows_release(&rows);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rows_copy(&rows, 0, rows.k, out.buf);
    Py_END_ALLOW_THREADS
    rows_release(&rows);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *crc32c_soft_py(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t c = crc_soft(0, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* ------------------------------------------------------------------ cursor MACs
 * HMAC-SHA256 of every cursor of a run (feeder/core/cursor.py: head | tail | MAC[:16]). In Python
 * each costs ~3.4 us of interpreter calls under the GIL, 256 of them per 4 MiB message; here
 * the pads' and the head's full blocks are hashed once per run, each cursor then costs its
 * last one or two blocks and the outer block (~1 us), and all of it runs without the GIL.
 * Plain C: the compression function of FIPS 180-4. tests/test_cursor.py checks the bytes
 * against hmac.digest. */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
static const uint32_t H256[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16); p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}
static void put_be64(unsigned char *p, uint64_t v) { put_be32(p, (uint32_t)(v >> 32)); put_be32(p + 4, (uint32_t)v); }

static void sha256_block(uint32_t st[8], const unsigned char *p) {
    uint32_t w[64], a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
    for (int t = 0; t < 16; t++) w[t] = be32(p + 4 * t);
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

/* The digest of (the `done` bytes already in `mid`) + tail[0:n], n < 120: the last blocks. */
static void sha256_finish(const uint32_t mid[8], uint64_t done, const unsigned char *tail, size_t n,
                          unsigned char out[32]) {
    unsigned char last[128] = {0};
    uint32_t st[8];
    size_t blocks = n + 9 <= 64 ? 1 : 2;
    memcpy(st, mid, sizeof st);
    memcpy(last, tail, n);
    last[n] = 0x80;
    put_be64(last + 64 * blocks - 8, (done + n) * 8);
    for (size_t i = 0; i < blocks; i++) sha256_block(st, last + 64 * i);
    for (int i = 0; i < 8; i++) put_be32(out + 4 * i, st[i]);
}

/* HMAC's inner and outer states after their pads (RFC 2104), from the 64-byte block key. */
static void hmac_pads(const unsigned char k[64], uint32_t inner[8], uint32_t outer[8]) {
    unsigned char pad[64];
    memcpy(inner, H256, 8 * sizeof(uint32_t));
    memcpy(outer, H256, 8 * sizeof(uint32_t));
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_block(inner, pad);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5C;
    sha256_block(outer, pad);
}

#define CURSOR_TAIL 28   /* cursor.py's _TAIL: epoch u32, base u64, pos u64, step u64 */
#define CURSOR_MAC 16

static PyObject *cursors(PyObject *self, PyObject *args) {
    Py_buffer key, head;
    unsigned long long epoch, base, first_step;
    PyObject *stops_obj, *out = NULL, *stops = NULL;
    unsigned char *buf = NULL;
    uint64_t *pos = NULL;
    if (!PyArg_ParseTuple(args, "y*y*KKOK", &key, &head, &epoch, &base, &stops_obj, &first_step)) return NULL;
    if (key.len != 64) {
        PyErr_Format(PyExc_ValueError, "key must be the 64-byte HMAC block key, got %zd bytes", key.len);
        goto done;
    }
    if (epoch > 0xFFFFFFFFull) {   /* a u32 in the cursor, as struct ">I" insists */
        PyErr_Format(PyExc_OverflowError, "epoch %llu does not fit the cursor's 32 bits", epoch);
        goto done;
    }
    stops = PySequence_Fast(stops_obj, "stops must be a sequence of positions");
    if (!stops) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(stops);
    size_t head_len = (size_t)head.len, one = head_len + CURSOR_TAIL + CURSOR_MAC;
    pos = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    buf = PyMem_Malloc(one * (n ? n : 1));
    if (!pos || !buf) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        pos[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(stops, i));
        if (PyErr_Occurred()) goto done;
    }
    /* With the GIL held: a run's cursors are ~0.5 us each, and a message holds at most 256
     * (~130 us). Releasing it here cost far more than it saved: under load the event loop
     * takes the GIL for a whole send (milliseconds of copying into gRPC and the socket), and a
     * builder that let go for microseconds of hashing then waited that long to go on, once per
     * run (an epoch boundary inside a message starts a new run). */
    {
    const unsigned char *hd = head.buf;
    unsigned char tail[128], digest[32];
    uint32_t inner[8], outer[8];
    hmac_pads(key.buf, inner, outer);
    size_t full = head_len / 64 * 64, rem = head_len - full;
    for (size_t at = 0; at < full; at += 64) sha256_block(inner, hd + at);
    memcpy(tail, hd + full, rem);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *c = buf + one * i, *t = tail + rem;
        put_be32(t, (uint32_t)epoch);
        put_be64(t + 4, base);
        put_be64(t + 12, pos[i]);
        put_be64(t + 20, first_step + (uint64_t)i + 1);
        sha256_finish(inner, 64 + full, tail, rem + CURSOR_TAIL, digest);
        sha256_finish(outer, 64, digest, 32, digest);
        memcpy(c, hd, head_len);
        memcpy(c + head_len, t, CURSOR_TAIL);
        memcpy(c + head_len + CURSOR_TAIL, digest, CURSOR_MAC);
    }
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)buf + one * i, (Py_ssize_t)one);
        if (!b) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, b);
    }
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    Py_XDECREF(stops);
    PyMem_Free(pos);
    PyMem_Free(buf);
    return out;
}

/* mac(key, body) -> HMAC-SHA256(key, body), key already its 64-byte block (cursor.py's _mac):
 * the MAC of a cursor a plan writes whole (a Kafka follow stream's, one per batch). Holding the
 * GIL, as cursors does, and for the same reason: hmac.digest lets it go for every cursor, and
 * with a feeder's W streams busy each release handed it to another thread (issue 26). */
static PyObject *mac_py(PyObject *self, PyObject *args) {
    Py_buffer key, body;
    if (!PyArg_ParseTuple(args, "y*y*", &key, &body)) return NULL;
    if (key.len != 64) {
        PyErr_Format(PyExc_ValueError, "key must be the 64-byte HMAC block key, got %zd bytes", key.len);
        PyBuffer_Release(&key);
        PyBuffer_Release(&body);
        return NULL;
    }
    const unsigned char *b = body.buf;
    unsigned char digest[32];
    uint32_t inner[8], outer[8];
    hmac_pads(key.buf, inner, outer);
    size_t len = (size_t)body.len, full = len / 64 * 64;
    for (size_t at = 0; at < full; at += 64) sha256_block(inner, b + at);
    sha256_finish(inner, 64 + full, b + full, len - full, digest);
    sha256_finish(outer, 64, digest, 32, digest);
    PyBuffer_Release(&key);
    PyBuffer_Release(&body);
    return PyBytes_FromStringAndSize((const char *)digest, 32);
}

/* blend(weights, index, draw): Megatron-LM's blending of datasets by weight
 * (megatron/core/datasets/helpers.cpp, build_blending_indices): slot i goes to the source d
 * with the largest weights[d] * max(i, 1) - count[d] (ties to the lowest d), and draw[i] is
 * count[d] before it. The same double arithmetic, so the counts are Megatron's bit for bit.
 * weights: float64 [D] (normalized), index: int16 [n] (out), draw: int64 [n] (out). */
/* Sums of a narrow order's ids p[0..n) at index base.. (below): ids and indexes below 2^32, so
 * every product is one 32x32->64 multiply, which vectorizes (pmuludq); built twice, for AVX2
 * where the CPU has it. Accumulates into acc = [sum, sum of squares, xor, max, sum of i * x_i]. */
#define ORDER_SUMS32_BODY                                                                   \
    uint64_t s = 0, q = 0, w = 0;                                                           \
    uint32_t x = 0, m = 0;                                                                  \
    for (uint32_t i = 0; i < n; i++) {                                                      \
        uint32_t v = p[i];                                                                  \
        s += v;                                                                             \
        q += (uint64_t)v * v;                                                               \
        x ^= v;                                                                             \
        m = v > m ? v : m;                                                                  \
        w += (uint64_t)(base + i) * v;                                                      \
    }                                                                                       \
    acc[0] += s; acc[1] += q; acc[2] ^= x; acc[3] = m > acc[3] ? m : acc[3]; acc[4] += w;
static void order_sums32(const uint32_t *p, uint32_t base, uint32_t n, uint64_t *acc) { ORDER_SUMS32_BODY }
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void order_sums32_avx2(const uint32_t *p, uint32_t base, uint32_t n,
                                                              uint64_t *acc) {
    ORDER_SUMS32_BODY
}
#endif

/* order_check(order, itemsize, out u64[6]): what verifies an epoch order file, at memory
 * bandwidth (feeder/domain/order_store.py, feeder/core/order.py's order_checks, which calls this
 * per block from several threads): out = [sum, sum of squares, xor, max, sum of (i + 1) * x_i with
 * i counted from the buffer's start, crc32c of the bytes], all mod 2^64. The first four are what
 * any permutation of [0, n) must have (damage that changes the multiset of ids: overwritten,
 * zeroed, out-of-range entries); the last two depend on where each id lies (swaps, which keep
 * every sum: a swap of x_i and x_j moves the weighted sum by (i - j)(x_j - x_i), never 0 mod
 * 2^64 while both factors are below 2^32). One pass: each 256 KiB is summed and then its CRC
 * continued while it is in cache, so memory is read once. */
static PyObject *order_check(PyObject *self, PyObject *args) {
    Py_buffer b, o;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*iw*", &b, &itemsize, &o)) return NULL;
    size_t n = itemsize > 0 ? (size_t)b.len / (size_t)itemsize : 0;
    if ((itemsize != 4 && itemsize != 8) || b.len % itemsize || o.len != 6 * 8 || (itemsize == 4 && n > 0xFFFFFFFFull)) {
        PyErr_Format(PyExc_ValueError, "order_check: itemsize %d over %zd bytes into %zd", itemsize, b.len, o.len);
        PyBuffer_Release(&b);
        PyBuffer_Release(&o);
        return NULL;
    }
    uint64_t *out = (uint64_t *)o.buf;
    Py_BEGIN_ALLOW_THREADS
    const size_t step = (256u << 10) / (size_t)itemsize;   /* ids per part: summed, then CRC'd while in cache */
    const unsigned char *bytes = (const unsigned char *)b.buf;
    uint64_t acc[5] = {0, 0, 0, 0, 0};
    uint32_t crc = 0;
    if (itemsize == 4) {
#if defined(__x86_64__) && defined(__GNUC__)
        int avx2 = __builtin_cpu_supports("avx2");
#endif
        for (size_t at = 0; at < n; at += step) {
            uint32_t k = (uint32_t)(n - at < step ? n - at : step);
            const uint32_t *p = (const uint32_t *)b.buf + at;
#if defined(__x86_64__) && defined(__GNUC__)
            if (avx2) order_sums32_avx2(p, (uint32_t)at, k, acc);
            else
#endif
            order_sums32(p, (uint32_t)at, k, acc);
            crc = crc32c(crc, bytes + at * 4, (size_t)k * 4);
        }
        acc[4] += acc[0];   /* sum of (i + 1) x_i */
    } else {
        const uint64_t *p = (const uint64_t *)b.buf;
        for (size_t at = 0; at < n; at += step) {
            size_t end = n - at < step ? n : at + step;
            for (size_t i = at; i < end; i++) {
                uint64_t v = p[i];
                acc[0] += v;
                acc[1] += v * v;
                acc[2] ^= v;
                acc[3] = v > acc[3] ? v : acc[3];
                acc[4] += (uint64_t)(i + 1) * v;
            }
            crc = crc32c(crc, bytes + at * 8, (end - at) * 8);
        }
    }
    memcpy(out, acc, sizeof acc);
    out[5] = crc;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

static PyObject *blend(PyObject *self, PyObject *args) {
    Py_buffer w, idx, draw;
    if (!PyArg_ParseTuple(args, "y*w*w*", &w, &idx, &draw)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t nd = w.len / (Py_ssize_t)sizeof(double), n = idx.len / (Py_ssize_t)sizeof(int16_t);
    int64_t *count = NULL;
    if (nd < 1 || nd > 32767 || draw.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "blend: 1..32767 weights, and index/draw of one length");
        goto done;
    }
    count = PyMem_Calloc((size_t)nd, sizeof(int64_t));
    if (!count) { PyErr_NoMemory(); goto done; }
    {
        const double *wt = (const double *)w.buf;
        int16_t *ix = (int16_t *)idx.buf;
        int64_t *dr = (int64_t *)draw.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            double at = i > 1 ? (double)i : 1.0;
            Py_ssize_t best = 0;
            double err = wt[0] * at - (double)count[0];
            for (Py_ssize_t d = 1; d < nd; d++) {
                double e = wt[d] * at - (double)count[d];
                if (e > err) { best = d; err = e; }
            }
            ix[i] = (int16_t)best;
            dr[i] = count[best]++;
        }
        Py_END_ALLOW_THREADS
    }
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&draw);
    PyMem_Free(count);
    return out;
}

/* The same blending at any slot, from checkpoints (a mixture of 10^10 positions cannot hold
 * its blending: 10 bytes a slot). table: int64 [rows, D], row k = each source's count before
 * slot k * every. blend_checkpoints fills rows first_row + 1 .. rows - 1 from row first_row
 * (one pass over the slots, ~1 ns a slot and source; progress[0] = rows done, progress[1] = a
 * stop flag); blend_at then answers any slot in at most `every` steps from its row. */
static inline Py_ssize_t blend_step(const double *wt, Py_ssize_t nd, int64_t *count, int64_t i) {
    double at = i > 1 ? (double)i : 1.0;
    Py_ssize_t best = 0;
    double err = wt[0] * at - (double)count[0];
    for (Py_ssize_t d = 1; d < nd; d++) {
        double e = wt[d] * at - (double)count[d];
        int more = e > err;              /* (selects, not a branch: the choice is unpredictable) */
        best = more ? d : best;
        err = more ? e : err;
    }
    return best;
}

#define SCAN_FIXED(NAME, ND)                                                                   \
static int64_t NAME(const double *wt, int64_t *count, int64_t i, int64_t end) {               \
    double w[ND], c[ND];                                                                       \
    for (int d = 0; d < ND; d++) { w[d] = wt[d]; c[d] = (double)count[d]; }                    \
    for (; i < end; i++) {                                                                     \
        double at = (double)i, err = w[0] * at - c[0];                                        \
        int best = 0;                                                                          \
        for (int d = 1; d < ND; d++) {                                                         \
            double e = w[d] * at - c[d];                                                       \
            int more = e > err;                                                                \
            best = more ? d : best;                                                            \
            err = more ? e : err;                                                              \
        }                                                                                      \
        for (int d = 0; d < ND; d++) c[d] += (double)(d == best);                              \
    }                                                                                          \
    for (int d = 0; d < ND; d++) count[d] = (int64_t)c[d];                                     \
    return i;                                                                                  \
}
SCAN_FIXED(scan_fixed2, 2)
SCAN_FIXED(scan_fixed3, 3)
SCAN_FIXED(scan_fixed4, 4)

/* 5..8 sources: padded to 8 with weight-0 sources that never win a slot (their error is
 * -count <= 0 < the best's: Sigma errors = 0 with some positive), same choice, same ties. */
static int64_t scan_fixed8(const double *wt, Py_ssize_t nd, int64_t *count, int64_t i, int64_t end) {
    double w[8], c[8];
    for (int d = 0; d < 8; d++) { w[d] = d < nd ? wt[d] : 0.0; c[d] = d < nd ? (double)count[d] : 1e300; }
    for (; i < end; i++) {
        double at = (double)i, err = w[0] * at - c[0];
        int best = 0;
        for (int d = 1; d < 8; d++) {
            double e = w[d] * at - c[d];
            int more = e > err;
            best = more ? d : best;
            err = more ? e : err;
        }
        for (int d = 0; d < 8; d++) c[d] += (double)(d == best);
    }
    for (int d = 0; d < nd; d++) count[d] = (int64_t)c[d];
    return i;
}

/* The counts before slot `end` from those before slot i (count: in and out). */
static void blend_scan(const double *wt, Py_ssize_t nd, int64_t *count, int64_t i, int64_t end) {
    for (; i < end && i < 2; i++)            /* slots 0 and 1 both weigh as 1 (max(i, 1)) */
        count[blend_step(wt, nd, count, i)]++;
    if (i < end && nd <= 8) {
        /* Up to 8 sources (nearly every mixture) without a branch to mispredict (the choice is
         * a coin flip per slot): the same double arithmetic, counts held as exact doubles
         * (< 2^53) in registers, ~1-3 ns a slot instead of ~10. */
        switch (nd) {
            case 1: count[0] += end - i; i = end; break;
            case 2: i = scan_fixed2(wt, count, i, end); break;
            case 3: i = scan_fixed3(wt, count, i, end); break;
            case 4: i = scan_fixed4(wt, count, i, end); break;
            default: i = scan_fixed8(wt, nd, count, i, end); break;
        }
    }
    for (; i < end; i++)
        count[blend_step(wt, nd, count, i)]++;
}

static PyObject *blend_checkpoints(PyObject *self, PyObject *args) {
    Py_buffer w, t, p;
    long long every, first;
    if (!PyArg_ParseTuple(args, "y*w*LLw*", &w, &t, &every, &first, &p)) return NULL;
    Py_ssize_t nd = w.len / 8, rows = nd ? t.len / (8 * nd) : 0;
    int stopped = 0;
    if (nd < 1 || t.len != rows * nd * 8 || every < 1 || first < 0 || first >= rows || p.len < 16) {
        PyBuffer_Release(&w); PyBuffer_Release(&t); PyBuffer_Release(&p);
        PyErr_SetString(PyExc_ValueError, "blend_checkpoints(weights f8[D], table i8[rows, D], every, first_row, progress i8[2])");
        return NULL;
    }
    const double *wt = (const double *)w.buf;
    int64_t *tab = (int64_t *)t.buf;
    volatile int64_t *prog = (volatile int64_t *)p.buf;
    int64_t *count = PyMem_RawMalloc(nd * 8);
    if (!count) { PyBuffer_Release(&w); PyBuffer_Release(&t); PyBuffer_Release(&p); return PyErr_NoMemory(); }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t d = 0; d < nd; d++) count[d] = tab[first * nd + d];
    for (Py_ssize_t r = first + 1; r < rows; r++) {
        blend_scan(wt, nd, count, (int64_t)(r - 1) * every, (int64_t)r * every);
        for (Py_ssize_t d = 0; d < nd; d++) tab[r * nd + d] = count[d];
        prog[0] = r;
        if (prog[1]) { stopped = 1; break; }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(count);
    PyBuffer_Release(&w); PyBuffer_Release(&t); PyBuffer_Release(&p);
    return PyBool_FromLong(stopped);
}

static PyObject *blend_at(PyObject *self, PyObject *args) {
    Py_buffer w, t, sl, src, dr;
    long long every, first_row = 0;
    if (!PyArg_ParseTuple(args, "y*y*Ly*w*w*|L", &w, &t, &every, &sl, &src, &dr, &first_row)) return NULL;
    Py_ssize_t nd = w.len / 8, rows = nd ? t.len / (8 * nd) : 0, m = sl.len / 8;
    int bad = nd < 1 || every < 1 || src.len != sl.len || dr.len != sl.len;
    int64_t *count = bad ? NULL : PyMem_RawMalloc(nd * 8);
    if (!bad && !count) bad = 2;
    if (!bad) {
        const double *wt = (const double *)w.buf;
        const int64_t *tab = (const int64_t *)t.buf, *slots = (const int64_t *)sl.buf;
        int64_t *so = (int64_t *)src.buf, *dv = (int64_t *)dr.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < m; k++) {
            int64_t s = slots[k], r = s / every - first_row;
            if (s < 0 || r < 0 || r >= rows) { bad = 3; break; }
            for (Py_ssize_t d = 0; d < nd; d++) count[d] = tab[r * nd + d];
            blend_scan(wt, nd, count, (r + first_row) * every, s);
            Py_ssize_t b = blend_step(wt, nd, count, s);
            so[k] = b;
            dv[k] = count[b];
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(count);
    PyBuffer_Release(&w); PyBuffer_Release(&t); PyBuffer_Release(&sl); PyBuffer_Release(&src); PyBuffer_Release(&dr);
    if (bad == 2) return PyErr_NoMemory();
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad == 3 ? "blend_at: a slot past the checkpoints"
                        : "blend_at(weights f8[D], table i8[rows, D], every, slots i8[m], src i8[m] out, draw i8[m] out)");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The counts before slot `target` without the pass from slot 0 ("coupling from the past").
 * Every error e_j = fl(w_j x) - c_j the loop compares stays within (-1, D-1) (up to float
 * fuzz): the one chosen is the largest, so >= ~0 (the errors sum to ~0), and drops by less than
 * 1; the others only grow. So the counts before slot `start` are among the few vectors with
 * c_j in (a_j - (D-1), a_j + 1) summing to start; each is run forward to `target` with the
 * loop's own arithmetic, and once all have met, the counts at `target` are theirs whatever
 * the true start was. Returns how many distinct vectors are left at `target` (1: `out` holds
 * the counts), or 0 where this does not apply (more than 4 sources, a fuzz too large). */
#define COUPLE_MAX 1024
static PyObject *blend_couple(PyObject *self, PyObject *args) {
    Py_buffer w, o;
    long long start, target;
    if (!PyArg_ParseTuple(args, "y*LLw*", &w, &start, &target, &o)) return NULL;
    Py_ssize_t nd = w.len / 8;
    if (nd < 1 || o.len != nd * 8 || start < 0 || target < start) {
        PyBuffer_Release(&w); PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "blend_couple(weights f8[D], start, target, out i8[D])");
        return NULL;
    }
    const double *wt = (const double *)w.buf;
    double x = start > 1 ? (double)start : 1.0;
    /* Covers sum_j fl(w_j x) - x (D roundings of ~x 2^-53 each) and the subtractions' rounding. */
    double margin = 0.01 + 1e-15 * (double)nd * x;
    long live = 0;
    int64_t (*cand)[4] = nd <= 4 && margin < 0.25 ? PyMem_RawMalloc(sizeof(int64_t[4]) * COUPLE_MAX) : NULL;
    if (cand) {
        Py_BEGIN_ALLOW_THREADS
        int64_t lo[4], hi[4], v[4];
        for (Py_ssize_t j = 0; j < nd; j++) {
            double a = start ? wt[j] * x : 0.0;
            lo[j] = (int64_t)ceil(a - (double)(nd - 1) - margin);
            hi[j] = start ? (int64_t)floor(a + 1.0 + margin) : 0;
            if (lo[j] < 0) lo[j] = 0;
            v[j] = lo[j];
        }
        /* every vector in the box with sum `start` (an odometer over the first D-1) */
        int more = 1;
        while (more && live < COUPLE_MAX) {
            int64_t sum = 0;
            for (Py_ssize_t j = 0; j + 1 < nd; j++) sum += v[j];
            int64_t last = (int64_t)start - sum;
            if (last >= lo[nd - 1] && last <= hi[nd - 1]) {
                for (Py_ssize_t j = 0; j + 1 < nd; j++) cand[live][j] = v[j];
                cand[live++][nd - 1] = last;
            }
            more = 0;
            for (Py_ssize_t j = 0; j + 1 < nd; j++) {
                if (v[j] < hi[j]) { v[j]++; more = 1; break; }
                v[j] = lo[j];
            }
        }
        if (more) live = 0;                  /* too many to run: not for this call */
        /* run them in step, dropping each that meets another (from there on they are one) */
        for (int64_t i = start; i < target && live > 0; ) {
            int64_t end = live > 1 && target - i > 256 ? i + 256 : target;
            for (long c = 0; c < live; c++) blend_scan(wt, nd, cand[c], i, end);
            i = end;
            long kept = 0;
            for (long c = 0; c < live; c++) {
                int dup = 0;
                for (long e = 0; e < kept && !dup; e++)
                    dup = memcmp(cand[e], cand[c], nd * sizeof(int64_t)) == 0;
                if (!dup) { if (kept != c) memcpy(cand[kept], cand[c], nd * sizeof(int64_t)); kept++; }
            }
            live = kept;
        }
        if (live == 1) memcpy(o.buf, cand[0], nd * sizeof(int64_t));
        Py_END_ALLOW_THREADS
        PyMem_RawFree(cand);
    }
    PyBuffer_Release(&w); PyBuffer_Release(&o);
    return PyLong_FromLong(live);
}

/* Scheduled blending (feeder/core/schedule.py has the rule): segment k, active from at[k],
 * gives T_d(x) = D[k,d] + u * (a[k,d] + u * h[k,d]) with u = x - start[k] (x = max(slot, 1));
 * slot j goes to the source with the largest T_d - count_d, ties to the lowest d. The same
 * double arithmetic as the module's (no fused multiply-add: -ffp-contract=off in setup.py), so
 * a feeder with or without this extension makes the same draws. sched_checkpoints fills rows
 * first_row + 1 .. rows - 1 of table (row r: counts before slot r * every) as blend_checkpoints
 * does; sched_at answers slots given in ascending order, scanning each row once. */
typedef struct { const int64_t *at, *start; const double *D, *a, *h; Py_ssize_t S, nd; } Sched;

static Py_ssize_t sched_seg(const Sched *s, int64_t x) {
    Py_ssize_t lo = 0, hi = s->S - 1;
    while (lo < hi) { Py_ssize_t mid = (lo + hi + 1) / 2; if (s->at[mid] <= x) lo = mid; else hi = mid - 1; }
    return lo;
}

/* The counts before slot `end` from those before slot i; with `want` (ascending slots in
 * [i, end]), the source and draw of each of them into so/dv (advancing *k). */
static void sched_scan(const Sched *s, int64_t *count, int64_t i, int64_t end,
                       const int64_t *want, Py_ssize_t nwant, Py_ssize_t *k, int64_t *so, int64_t *dv) {
    Py_ssize_t nd = s->nd;
    while (i < end || (want && *k < nwant && want[*k] == i)) {
        Py_ssize_t g = sched_seg(s, i);
        int64_t stop = (g + 1 < s->S && s->at[g + 1] <= end) ? s->at[g + 1] : end + 1;
        const double *D = s->D + g * nd, *A = s->a + g * nd, *H = s->h + g * nd;
        int64_t from = s->start[g];
        for (; i < stop; i++) {
            double u = (double)((i > 1 ? i : 1) - from);
            Py_ssize_t best = 0;
            double err = (D[0] + u * (A[0] + u * H[0])) - (double)count[0];
            for (Py_ssize_t d = 1; d < nd; d++) {
                double e = (D[d] + u * (A[d] + u * H[d])) - (double)count[d];
                int more = e > err;
                best = more ? d : best;
                err = more ? e : err;
            }
            if (want) {
                while (*k < nwant && want[*k] == i) { so[*k] = best; dv[*k] = count[best]; (*k)++; }
            }
            if (i == end) return;   /* (slot `end` itself only looked at, not counted) */
            count[best]++;
        }
    }
}

static int sched_parse(PyObject *args, Py_buffer *b, Sched *s, Py_ssize_t *used) {
    /* at i8[S], start i8[S], D f8[S,K], a f8[S,K], h f8[S,K] are the first five buffers */
    s->S = b[0].len / 8;
    s->nd = s->S ? b[2].len / (8 * s->S) : 0;
    if (s->S < 1 || s->nd < 1 || b[1].len != b[0].len || b[2].len != s->S * s->nd * 8 || b[3].len != b[2].len
        || b[4].len != b[2].len) return -1;
    s->at = b[0].buf; s->start = b[1].buf; s->D = b[2].buf; s->a = b[3].buf; s->h = b[4].buf;
    *used = 5;
    return 0;
}

static PyObject *sched_checkpoints(PyObject *self, PyObject *args) {
    Py_buffer b[8] = {{0}};
    long long every, first;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*LLw*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &every, &first, &b[6]))
        return NULL;
    Sched s;
    Py_ssize_t used;
    int stopped = 0, bad = sched_parse(args, b, &s, &used) < 0;
    Py_ssize_t rows = bad ? 0 : b[5].len / (8 * s.nd);
    if (!bad && (b[5].len != rows * s.nd * 8 || every < 1 || first < 0 || first >= rows || b[6].len < 16)) bad = 1;
    int64_t *count = bad ? NULL : PyMem_RawMalloc(s.nd * 8);
    if (!bad && count) {
        int64_t *tab = b[5].buf;
        volatile int64_t *prog = (volatile int64_t *)b[6].buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t d = 0; d < s.nd; d++) count[d] = tab[first * s.nd + d];
        for (Py_ssize_t r = first + 1; r < rows; r++) {
            sched_scan(&s, count, (int64_t)(r - 1) * every, (int64_t)r * every, NULL, 0, NULL, NULL, NULL);
            for (Py_ssize_t d = 0; d < s.nd; d++) tab[r * s.nd + d] = count[d];
            prog[0] = r;
            if (prog[1]) { stopped = 1; break; }
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(count);
    for (int j = 0; j < 7; j++) PyBuffer_Release(&b[j]);
    if (bad) { PyErr_SetString(PyExc_ValueError, "sched_checkpoints(at, start, D, a, h, table, every, first_row, progress)"); return NULL; }
    if (!count) return PyErr_NoMemory();
    return PyBool_FromLong(stopped);
}

static PyObject *sched_at(PyObject *self, PyObject *args) {
    Py_buffer b[9] = {{0}};
    long long every;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*Ly*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &every, &b[6],
                          &b[7], &b[8]))
        return NULL;
    Sched s;
    Py_ssize_t used, m = b[6].len / 8;
    int bad = sched_parse(args, b, &s, &used) < 0;
    Py_ssize_t rows = bad ? 0 : b[5].len / (8 * s.nd);
    if (!bad && (every < 1 || b[7].len != b[6].len || b[8].len != b[6].len)) bad = 1;
    int64_t *count = bad ? NULL : PyMem_RawMalloc(s.nd * 8);
    if (!bad && !count) bad = 2;
    if (!bad) {
        const int64_t *tab = b[5].buf, *slots = b[6].buf;
        int64_t *so = b[7].buf, *dv = b[8].buf;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t k = 0;
        while (k < m && !bad) {
            int64_t sl = slots[k], r = sl / every;
            if (sl < 0 || r >= rows || (k && sl < slots[k - 1])) { bad = 3; break; }
            for (Py_ssize_t d = 0; d < s.nd; d++) count[d] = tab[r * s.nd + d];
            int64_t end = sl, i = r * every;
            Py_ssize_t j = k;   /* the wanted slots in this row */
            while (j < m && slots[j] / every == r) { end = slots[j]; j++; }
            sched_scan(&s, count, i, end, slots, j, &k, so, dv);
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(count);
    for (int j = 0; j < 9; j++) PyBuffer_Release(&b[j]);
    if (bad == 2) return PyErr_NoMemory();
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad == 3 ? "sched_at: slots must be ascending and within the checkpoints"
                        : "sched_at(at, start, D, a, h, table, every, slots i8[m], src i8[m] out, draw i8[m] out)");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* StreamReply.sources (field 3), a mixture's: one entry per batch, batch j's sources as int64
 * (little-endian, as the ids are written), an empty batch an empty entry (a repeated field keeps
 * it, so entry j stays batch j's). feeder/service/wire.py has the same in numpy. */
static PyObject *sources_field(PyObject *self, PyObject *args) {
    PyObject *src_o, *counts_o, *out = NULL;
    if (!PyArg_ParseTuple(args, "OO", &src_o, &counts_o)) return NULL;
    Py_buffer counts = {0}, src = {0};
    if (PyObject_GetBuffer(counts_o, &counts, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t k = counts.len / 8;
    const int64_t *cv = counts.buf;
    int64_t samples = 0;
    size_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (cv[j] < 0) { PyErr_SetString(PyExc_ValueError, "sources: a negative count"); goto done; }
        samples += cv[j];
        total += 1 + varint_len(8 * (uint64_t)cv[j]) + 8 * (size_t)cv[j];
    }
    if (get_i64(src_o, &src, samples, "sources") < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!out) goto done;
    {
        unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
        const unsigned char *from = src.buf;
        for (Py_ssize_t j = 0; j < k; j++) {
            size_t n = 8 * (size_t)cv[j];
            *o++ = (unsigned char)(3 << 3 | 2);
            o = put_varint(o, n);
            memcpy(o, from, n);
            o += n;
            from += n;
        }
    }
done:
    if (src.obj) PyBuffer_Release(&src);
    PyBuffer_Release(&counts);
    return out;
}

/* pieces(bufs, which, offs, lens, dest, out): out[dest[i]:dest[i] + lens[i]] =
 * bufs[which[i]][offs[i]:offs[i] + lens[i]] (items): a best-fit bin's documents copied in from
 * the memory-mapped chunks, one memcpy per piece, without the GIL (feeder.sources.packed). */
static PyObject *pieces(PyObject *self, PyObject *args) {
    PyObject *bufs_o, *which_o, *offs_o;
    Py_buffer lens = {0}, dest = {0}, out = {0};
    if (!PyArg_ParseTuple(args, "OOOy*y*w*", &bufs_o, &which_o, &offs_o, &lens, &dest, &out)) return NULL;
    Py_ssize_t isz = out.itemsize > 0 ? out.itemsize : 1;
    rows_t rows;
    if (rows_get(bufs_o, which_o, offs_o, 0, isz, &rows) < 0) {
        PyBuffer_Release(&lens); PyBuffer_Release(&dest); PyBuffer_Release(&out);
        return NULL;
    }
    const int64_t *wv = rows.which.buf, *ov = rows.offs.buf, *lv = lens.buf, *dv = dest.buf;
    Py_ssize_t k = rows.k, cap = out.len / isz;
    int bad = lens.len != k * 8 || dest.len != k * 8;
    for (Py_ssize_t i = 0; !bad && i < k; i++)
        bad = lv[i] < 0 || ov[i] + lv[i] > rows.bufs[wv[i]].len / isz || dv[i] < 0 || dv[i] + lv[i] > cap;
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "pieces: a piece lies outside its buffer or the output");
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < k; i++)
            memcpy((unsigned char *)out.buf + (size_t)dv[i] * isz,
                   (const unsigned char *)rows.bufs[wv[i]].buf + (size_t)ov[i] * isz, (size_t)lv[i] * isz);
        Py_END_ALLOW_THREADS
    }
    rows_release(&rows);
    PyBuffer_Release(&lens); PyBuffer_Release(&dest); PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------- best-fit-decreasing packing
 * feeder/core/layout.py best_fit: items (document remainders, 1..capacity-1 tokens) taken longest
 * first (ties in index order), each into the fullest open bin it fits (ties: the bin that got
 * to that fill last), a new bin where none does. Bins are kept in stacks by remaining room,
 * and a two-level bitset over the room values finds the smallest room >= an item's length in
 * a few word operations: O(n + capacity) for n items, where a heap or a balanced tree would
 * be O(n log n) with far larger constants (10^7 documents in well under a second). */
static int64_t room_at_least(const uint64_t *l0, const uint64_t *l1, Py_ssize_t words, uint64_t s) {
    /* the smallest open room >= s, or -1 */
    uint64_t w = s >> 6;
    if (w >= (uint64_t)words) return -1;
    uint64_t bits = l0[w] & (~0ULL << (s & 63));
    if (bits) return (int64_t)((w << 6) + __builtin_ctzll(bits));
    uint64_t w1 = w + 1;
    Py_ssize_t n1 = (words + 63) >> 6;
    for (uint64_t sw = w1 >> 6; sw < (uint64_t)n1; sw++) {
        uint64_t sb = l1[sw];
        if (sw == (w1 >> 6)) sb &= (w1 & 63) ? (~0ULL << (w1 & 63)) : ~0ULL;
        if (sb) {
            uint64_t word = (sw << 6) + __builtin_ctzll(sb);
            return (int64_t)((word << 6) + __builtin_ctzll(l0[word]));
        }
    }
    return -1;
}

/* Best-fit decreasing of n items (lengths 1..cap-1) into bins of cap: order[] the items in bin
 * order, ptr[] the bins as CSR; the number of bins. Needs no GIL. Scratch: bin_of, sorted and
 * next [n], pos and head [cap + 1], l0 [cap/64 + 1] and l1 [cap/4096 + 2], l0 and l1 zeroed.
 * Made twice, for indexes of 32 and of 64 bits (BFD_CORE below): a block of 10^6 documents
 * (2^30 tokens) packs in ~26 ms with 32-bit indexes against ~40 ms with 64, whose scratch
 * (~50 MB) no longer fits a shared L3 once two threads pack side by side. */
#define BFD_CORE(SUF, IDX)                                                                          \
typedef struct {                                                                                    \
    uint64_t *l0, *l1;  /* bit r of l0: a bin with room r is open; bit w of l1: l0 word w is not 0 */ \
    IDX *head, *next;   /* per room, the stack of bins (linked through next) */                    \
    IDX *bin_of, *sorted, *pos;                                                                     \
    Py_ssize_t words;                                                                               \
} bfd_##SUF;                                                                                        \
                                                                                                    \
static void bfd_free_##SUF(bfd_##SUF *w) {                                                          \
    PyMem_RawFree(w->bin_of); PyMem_RawFree(w->sorted); PyMem_RawFree(w->pos);                      \
    PyMem_RawFree(w->next); PyMem_RawFree(w->head); PyMem_RawFree(w->l0); PyMem_RawFree(w->l1);     \
}                                                                                                   \
                                                                                                    \
static int bfd_alloc_##SUF(bfd_##SUF *w, Py_ssize_t n, Py_ssize_t cap) {                            \
    w->words = (cap >> 6) + 1;                                                                      \
    w->bin_of = PyMem_RawMalloc((n ? n : 1) * sizeof(IDX));                                         \
    w->sorted = PyMem_RawMalloc((n ? n : 1) * sizeof(IDX));                                         \
    w->pos = PyMem_RawCalloc(cap + 1, sizeof(IDX));                                                 \
    w->next = PyMem_RawMalloc((n ? n : 1) * sizeof(IDX));                                           \
    w->head = PyMem_RawMalloc((cap + 1) * sizeof(IDX));                                             \
    w->l0 = PyMem_RawCalloc(w->words, sizeof(uint64_t));                                           \
    w->l1 = PyMem_RawCalloc(((w->words + 63) >> 6) + 1, sizeof(uint64_t));                          \
    return w->bin_of && w->sorted && w->pos && w->next && w->head && w->l0 && w->l1;                \
}                                                                                                   \
                                                                                                    \
static IDX bfd_core_##SUF(bfd_##SUF *w, const uint32_t *len, Py_ssize_t n, Py_ssize_t cap, IDX *order, \
                          IDX *ptr) {                                                               \
    IDX *bin_of = w->bin_of, *sorted = w->sorted, *pos = w->pos, *head = w->head, *next = w->next;  \
    uint64_t *l0 = w->l0, *l1 = w->l1;                                                              \
    IDX n_bins = 0, at = 0;                                                                         \
    /* counting sort, longest first, ties in index order */                                         \
    for (Py_ssize_t i = 0; i < n; i++) pos[len[i]]++;                                               \
    for (Py_ssize_t l = cap; l >= 1; l--) { IDX c = pos[l]; pos[l] = at; at += c; }                 \
    for (Py_ssize_t i = 0; i < n; i++) sorted[pos[len[i]]++] = (IDX)i;                              \
    for (Py_ssize_t r = 0; r <= cap; r++) head[r] = -1;                                             \
    for (Py_ssize_t j = 0; j < n; j++) {                                                            \
        IDX i = sorted[j], b;                                                                       \
        uint64_t s = len[i];                                                                        \
        int64_t r = room_at_least(l0, l1, w->words, s);                                             \
        if (r < 0) { b = n_bins++; r = cap; }                                                       \
        else {   /* the top of room r's stack; the room's bits cleared when it empties */           \
            b = head[r];                                                                            \
            head[r] = next[b];                                                                      \
            if (head[r] < 0) {                                                                      \
                l0[r >> 6] &= ~(1ULL << (r & 63));                                                  \
                if (!l0[r >> 6]) l1[r >> 12] &= ~(1ULL << ((r >> 6) & 63));                         \
            }                                                                                       \
        }                                                                                           \
        bin_of[i] = b;                                                                              \
        if ((uint64_t)r > s) {   /* b onto the stack of its new room */                             \
            uint64_t left = (uint64_t)r - s;                                                        \
            next[b] = head[left];                                                                   \
            head[left] = b;                                                                         \
            l0[left >> 6] |= 1ULL << (left & 63);                                                   \
            l1[left >> 12] |= 1ULL << ((left >> 6) & 63);                                           \
        }                                                                                           \
    }                                                                                               \
    /* the bins as CSR, each bin's items in the order they went in */                               \
    for (IDX b = 0; b <= n_bins; b++) ptr[b] = 0;                                                   \
    for (Py_ssize_t i = 0; i < n; i++) ptr[bin_of[i] + 1]++;                                        \
    for (IDX b = 0; b < n_bins; b++) ptr[b + 1] += ptr[b];                                          \
    IDX *fill = next;   /* (free now: reused as each bin's next slot) */                            \
    for (IDX b = 0; b < n_bins; b++) fill[b] = ptr[b];                                              \
    for (Py_ssize_t j = 0; j < n; j++) { IDX i = sorted[j]; order[fill[bin_of[i]]++] = i; }         \
    return n_bins;                                                                                  \
}                                                                                                   \
                                                                                                    \
/* pack()'s remainders (m items) into bins, written after its `whole` whole pieces: the bins,     \
 * or -1 out of memory. Allocates with PyMem_RawMalloc: runs without the GIL. */                   \
static int64_t pack_items_##SUF(const uint32_t *item_len, const int64_t *item_start, Py_ssize_t m,   \
                                Py_ssize_t cap, int64_t whole, int64_t *ptr, int64_t *start, uint32_t *length) { \
    bfd_##SUF w = {0};                                                                              \
    IDX *order = PyMem_RawMalloc((m ? m : 1) * sizeof(IDX)), *iptr = PyMem_RawMalloc((m + 1) * sizeof(IDX)); \
    int64_t n_bins = -1;                                                                            \
    if (order && iptr && bfd_alloc_##SUF(&w, m, cap)) {                                             \
        n_bins = bfd_core_##SUF(&w, item_len, m, cap, order, iptr);                                 \
        for (int64_t b = 0; b <= n_bins; b++) ptr[whole + b] = whole + iptr[b];                     \
        for (Py_ssize_t j = 0; j < m; j++) {                                                        \
            start[whole + j] = item_start[order[j]];                                                \
            length[whole + j] = item_len[order[j]];                                                 \
        }                                                                                           \
    }                                                                                               \
    bfd_free_##SUF(&w);                                                                             \
    PyMem_RawFree(order); PyMem_RawFree(iptr);                                                      \
    return n_bins;                                                                                  \
}

BFD_CORE(32, int32_t)
BFD_CORE(64, int64_t)

static PyObject *best_fit(PyObject *self, PyObject *args) {
    Py_buffer len_b, order_b, ptr_b;
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "y*nw*w*", &len_b, &cap, &order_b, &ptr_b)) return NULL;
    Py_ssize_t n = len_b.len / 4;
    PyObject *result = NULL;
    bfd_64 w = {0};
    if (cap < 2 || len_b.len % 4 || order_b.len != n * 8 || ptr_b.len != (n + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "best_fit(lengths u4[n], capacity >= 2, order i8[n] out, ptr i8[n + 1] out)");
        goto done;
    }
    const uint32_t *len = len_b.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (len[i] == 0 || len[i] >= (uint64_t)cap) {
            PyErr_Format(PyExc_ValueError, "best_fit: item %zd has length %u, expected 1..%zd", i, len[i], cap - 1);
            goto done;
        }
    if (!bfd_alloc_64(&w, n, cap)) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t n_bins;
    Py_BEGIN_ALLOW_THREADS
    n_bins = bfd_core_64(&w, len, n, cap, order_b.buf, ptr_b.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(n_bins);
done:
    bfd_free_64(&w);
    PyBuffer_Release(&len_b); PyBuffer_Release(&order_b); PyBuffer_Release(&ptr_b);
    return result;
}

/* pack(starts i8[n], end, capacity, ptr i8[pieces + 1] out, start i8[pieces] out, length u4[pieces] out)
 * -> bins: layout.best_fit whole (the bins of long documents' bin-sized pieces in stream order,
 * then best-fit decreasing of the remainders), from the documents' starts to the bins, in one
 * release of the GIL: threads packing blocks of a corpus (feeder.sources.pack_blocks) then run
 * side by side, where numpy's many short steps between them each took the GIL back. `pieces`
 * must be what the documents make (layout.best_fit counts it). wide=True: 64-bit indexes even
 * where 32 bits hold them. */
static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer st_b, ptr_b, start_b, len_b;
    long long end;
    Py_ssize_t cap;
    int wide = 0;   /* the 64-bit core whatever the size (the tests: both cores give the same bins) */
    if (!PyArg_ParseTuple(args, "y*Lnw*w*w*|p", &st_b, &end, &cap, &ptr_b, &start_b, &len_b, &wide)) return NULL;
    Py_ssize_t n = st_b.len / 8, pieces = start_b.len / 8;
    PyObject *result = NULL;
    uint32_t *item_len = NULL;
    int64_t *item_start = NULL;
    if (cap < 2 || st_b.len % 8 || start_b.len % 8 || len_b.len != pieces * 4 || ptr_b.len != (pieces + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "pack(starts i8[n], end, capacity >= 2, ptr i8[p + 1] out, start i8[p] out, "
                                          "length u4[p] out)");
        goto done;
    }
    item_len = PyMem_RawMalloc((n ? n : 1) * sizeof(uint32_t));
    item_start = PyMem_RawMalloc((n ? n : 1) * sizeof(int64_t));
    if (!item_len || !item_start) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *s = st_b.buf;
    int64_t *ptr = ptr_b.buf, *start = start_b.buf, whole = 0, m = 0, n_bins = 0;
    uint32_t *length = len_b.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t l = (i + 1 < n ? s[i + 1] : (int64_t)end) - s[i];
        if (l < 0) { bad = 1; break; }
        int64_t full = l / cap, rest = l % cap;
        if (whole + full + m + (rest > 0) > pieces) { bad = 2; break; }
        for (int64_t k = 0; k < full; k++, whole++) {
            ptr[whole] = whole;
            start[whole] = s[i] + k * cap;
            length[whole] = (uint32_t)cap;
        }
        if (rest) { item_start[m] = s[i] + full * cap; item_len[m] = (uint32_t)rest; m++; }
    }
    if (!bad && whole + m != pieces) bad = 2;
    if (!bad) {   /* (a block of 2^30 tokens has < 2^31 items: the 32-bit core, ~1.5x faster) */
        n_bins = !wide && m < INT32_MAX && cap < INT32_MAX
                     ? pack_items_32(item_len, item_start, m, cap, whole, ptr, start, length)
                     : pack_items_64(item_len, item_start, m, cap, whole, ptr, start, length);
        if (n_bins < 0) bad = 3;
    }
    Py_END_ALLOW_THREADS
    if (bad == 3)
        PyErr_NoMemory();
    else if (bad)
        PyErr_SetString(PyExc_ValueError, bad == 1 ? "pack: document starts are not sorted (or past the end)"
                                                   : "pack: the pieces do not number as counted");
    else
        result = PyLong_FromLongLong(whole + n_bins);
done:
    PyMem_RawFree(item_len); PyMem_RawFree(item_start);
    PyBuffer_Release(&st_b); PyBuffer_Release(&ptr_b); PyBuffer_Release(&start_b); PyBuffer_Release(&len_b);
    return result;
}

/* ids(payload, itemsize, eos) -> (lo, hi, out): the smallest and largest of a Kafka record's
 * little-endian unsigned ids (itemsize 2 or 4; (0, 0) when there are none) and, when eos >= 0,
 * the ids with eos after them as a new bytearray in the host's order (np.frombuffer makes it
 * the record's tokens), else None. In one pass, and without releasing the GIL: a record is a
 * microsecond of work, and each release hands the GIL to another thread that wants it. With
 * W follow streams in a feeder, numpy's min, max and copy (which do release it, for more than
 * 500 ids) made that a context switch or two per record, and the feeder's CPU per token grew
 * with the ranks (issue 26). */
static PyObject *ids(PyObject *self, PyObject *args) {
    Py_buffer b;
    int itemsize;
    long long eos;
    if (!PyArg_ParseTuple(args, "y*iL", &b, &itemsize, &eos)) return NULL;
    if ((itemsize != 2 && itemsize != 4) || b.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "ids: %zd bytes are not a whole number of %d-byte ids (2 or 4)", b.len,
                     itemsize);
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_ssize_t n = b.len / itemsize;
    PyObject *out = Py_None;
    Py_INCREF(out);
    if (eos >= 0) {
        Py_DECREF(out);
        out = PyByteArray_FromStringAndSize(NULL, (n + 1) * itemsize);
        if (!out) {
            PyBuffer_Release(&b);
            return NULL;
        }
    }
    const unsigned char *p = (const unsigned char *)b.buf;
    uint32_t lo = UINT32_MAX, hi = 0;
    if (itemsize == 2) {
        uint16_t *o = out == Py_None ? NULL : (uint16_t *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(p[2 * i] | (p[2 * i + 1] << 8));
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            if (o) o[i] = v;
        }
        if (o) o[n] = (uint16_t)eos;
    } else {
        uint32_t *o = out == Py_None ? NULL : (uint32_t *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned char *q = p + 4 * i;
            uint32_t v = (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            if (o) o[i] = v;
        }
        if (o) o[n] = (uint32_t)eos;
    }
    PyBuffer_Release(&b);
    if (n == 0) lo = 0;
    return Py_BuildValue("(kkN)", (unsigned long)lo, (unsigned long)hi, out);
}

/* rows(pieces, skip, L, mb, itemsize) -> bytearray of mb rows of L + 1 items, row j being items
 * [skip + j*L, skip + j*L + L + 1) of the pieces (contiguous buffers) one after another: a
 * follow stream's batch from the records it has taken. Holding the GIL, as ids does: two numpy
 * calls per batch (join, then the overlapping rows) were two more GIL hand-offs. */
static PyObject *rows_py(PyObject *self, PyObject *args) {
    PyObject *pieces_o;
    Py_ssize_t skip, L, mb, isz;
    if (!PyArg_ParseTuple(args, "Onnnn", &pieces_o, &skip, &L, &mb, &isz)) return NULL;
    if (skip < 0 || L < 1 || mb < 1 || isz < 1) {
        PyErr_SetString(PyExc_ValueError, "rows: skip >= 0, L >= 1, mb >= 1 and itemsize >= 1 are needed");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(pieces_o, "rows: pieces must be a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *bufs = PyMem_Calloc(k ? k : 1, sizeof(Py_buffer));
    if (!bufs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    Py_ssize_t got = 0, total = 0;
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0) goto done;
        total += bufs[got].len / isz;
    }
    Py_ssize_t row = L + 1;
    if (skip + (mb - 1) * L + row > total) {
        PyErr_Format(PyExc_ValueError, "rows: %zd rows of %zd from item %zd need %zd items, the pieces hold %zd", mb,
                     row, skip, skip + (mb - 1) * L + row, total);
        goto done;
    }
    out = PyByteArray_FromStringAndSize(NULL, mb * row * isz);
    if (!out) goto done;
    char *dst = PyByteArray_AS_STRING(out);
    Py_ssize_t pi = 0, pstart = 0;   /* the piece holding the current row's start, and its first item */
    for (Py_ssize_t j = 0; j < mb; j++) {
        Py_ssize_t a = skip + j * L, need = row;
        while (pstart + bufs[pi].len / isz <= a) {
            pstart += bufs[pi].len / isz;
            pi++;
        }
        Py_ssize_t q = pi, qstart = pstart, from = a;
        while (need > 0) {
            Py_ssize_t n = bufs[q].len / isz - (from - qstart);
            if (n > need) n = need;
            memcpy(dst, (char *)bufs[q].buf + (from - qstart) * isz, n * isz);
            dst += n * isz;
            need -= n;
            from += n;
            qstart += bufs[q].len / isz;
            q++;
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"frame", frame, METH_VARARGS,
     "frame(tokens, payloads, ids, counts, epochs, steps, cursors, sample_len, itemsize, dtype, compression, "
     "region, rows=None) -> StreamReply bytes"},
    {"gather", gather, METH_VARARGS, "gather(bufs, which, offs, n, out): out[i] = bufs[which[i]][offs[i]:offs[i] + n]"},
    {"crc32c", crc32c_py, METH_VARARGS, "CRC-32C (Castagnoli) of any contiguous buffer."},
    {"crc32c_soft", crc32c_soft_py, METH_VARARGS, "The same by table (the fallback without SSE4.2; for tests)."},
    {"cursors", cursors, METH_VARARGS,
     "cursors(key64, head, epoch, base, stops, first_step) -> [head | tail | HMAC-SHA256[:16]] per stop"},
    {"sources", sources_field, METH_VARARGS, "sources(src i8[n], counts i8[k]) -> StreamReply.sources, entry j batch j's"},
    {"blend_checkpoints", blend_checkpoints, METH_VARARGS, "Megatron's blending counts every `every` slots"},
    {"blend_at", blend_at, METH_VARARGS, "Megatron's blending at given slots, from checkpoints"},
    {"sched_checkpoints", sched_checkpoints, METH_VARARGS, "a scheduled blending's counts every `every` slots"},
    {"sched_at", sched_at, METH_VARARGS, "a scheduled blending at given ascending slots, from checkpoints"},
    {"blend_couple", blend_couple, METH_VARARGS, "Megatron's blending counts at a slot, by coupling from the past"},
    {"pieces", pieces, METH_VARARGS, "pieces(bufs, which, offs, lens, dest, out): variable-length rows into out"},
    {"best_fit", best_fit, METH_VARARGS,
     "best_fit(lengths u4[n], capacity, order i8[n] out, ptr i8[n + 1] out) -> bins: best-fit decreasing"},
    {"pack", pack, METH_VARARGS,
     "pack(starts i8[n], end, capacity, ptr i8[p + 1] out, start i8[p] out, length u4[p] out) -> bins: "
     "layout.best_fit in one call"},
    {"ids", ids, METH_VARARGS, "ids(payload, itemsize, eos) -> (lo, hi, ids + [eos] as a bytearray, or None if eos < 0)"},
    {"mac", mac_py, METH_VARARGS, "mac(key64, body) -> HMAC-SHA256 (the key already its 64-byte block)"},
    {"rows", rows_py, METH_VARARGS, "rows(pieces, skip, L, mb, itemsize) -> mb overlapping rows of L + 1 items"},
    {"order_check", order_check, METH_VARARGS,
     "order_check(order, itemsize, out u64[6]): sum, sum of squares, xor, max, sum of (i+1)*x_i, crc32c"},
    {"blend", blend, METH_VARARGS, "blend(weights f8[D], index i2[n] out, draw i8[n] out): Megatron's blending"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    x2n_init();
#ifdef HAVE_CRC_HW
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) crc32c = crc_hw;
#endif
    return PyModule_Create(&module);
}
