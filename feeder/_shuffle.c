/* torch.randperm's CPU permutation, without torch, at every n and for every torch release.
 *
 * torch's CPU generator is MT19937 seeded with init_genrand(seed mod 2^32); random() is one
 * 32-bit draw and random64() is (first draw << 32) | second draw. randperm(n) is then
 *   forward  (every n before torch 2.7; n < 214,748,364 since):
 *       r = 0..n-1;  for i in [0, n-1): z = random() % (n - i); swap(r[i], r[i + z])
 *   inside-out (n >= 214,748,364 from torch 2.7, pytorch#143682):
 *       for i in [0, n): z = random64() % (i + 1); r[i] = r[z]; r[z] = i
 * (214,748,364 = (2^32 - 1) / 20, torch's own threshold.)
 *
 * Why C, and why this shape: an epoch of 10^9 samples is a 4 GB array swapped at random
 * places, so each step is a cache and TLB miss (~100 ns: 100 s an epoch). The draws do not
 * depend on the array, so they are made AHEAD into a ring and the places they will touch are
 * prefetched PREFETCH steps before they are used: the misses overlap, and the loop runs at
 * memory parallelism instead of memory latency (~10x). The output is written in the narrowest
 * type that holds n (uint32 below 2^32), often straight into a memory-mapped file, and the loop
 * reports progress and stops when asked (a feeder's SIGTERM must not wait for a build). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* ---- MT19937, as torch's at::mt19937 (and numpy's legacy RandomState) ---- */
#define MT_N 624
#define MT_M 397
typedef struct { uint32_t s[MT_N]; uint32_t t[MT_N]; int i; } mt_t;   /* state; its tempered draws */

static void mt_seed(mt_t *m, uint32_t seed) {
    m->s[0] = seed;
    for (int j = 1; j < MT_N; j++) m->s[j] = 1812433253u * (m->s[j - 1] ^ (m->s[j - 1] >> 30)) + (uint32_t)j;
    m->i = MT_N;
}

/* The twist in its three ranges, without a modulo per word (the draws are half of a build's
 * time, and `% MT_N` in the loop made them twice as slow), then all 624 words tempered in one
 * loop the compiler vectorizes (a third faster than tempering each word as it is drawn); the
 * twist is compiled twice, for AVX2 and without, chosen at load (0.74 -> 0.62 s for the early part
 * of 2.4*10^8 ids, 4.9 -> 4.4 s for the whole, on this host). */
#define MT_TW(j, j1, jm) { uint32_t y = (s[j] & 0x80000000u) | (s[j1] & 0x7fffffffu); \
                           s[j] = s[jm] ^ (y >> 1) ^ (-(y & 1u) & 0x9908b0dfu); }
#if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__)   /* (ifuncs: glibc) */
__attribute__((target_clones("avx2", "default")))   /* 8 words a step where the CPU has AVX2 */
#endif
static void mt_twist(mt_t *m) {
    uint32_t *s = m->s;
    int j = 0;
    for (; j < MT_N - MT_M; j++) MT_TW(j, j + 1, j + MT_M)
    for (; j < MT_N - 1; j++) MT_TW(j, j + 1, j + MT_M - MT_N)
    MT_TW(MT_N - 1, 0, MT_M - 1)
    for (j = 0; j < MT_N; j++) {
        uint32_t y = s[j];
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        m->t[j] = y ^ (y >> 18);
    }
    m->i = 0;
}

static inline uint32_t mt_next(mt_t *m) {
    if (m->i >= MT_N) mt_twist(m);
    return m->t[m->i++];
}

static inline uint64_t mt_next64(mt_t *m) {   /* torch's random64(): (first << 32) | second */
    uint64_t hi = mt_next(m);
    return (hi << 32) | mt_next(m);
}

#define PREFETCH 64          /* draws made ahead of their use: a ring of places to prefetch */
#define REPORT (1 << 20)     /* steps between progress reports and looks at the stop flag */

/* Load / store element k of r, whose elements are `w` bytes (4 or 8). */
static inline uint64_t ld(const void *r, int w, int64_t k) {
    return w == 4 ? ((const uint32_t *)r)[k] : ((const uint64_t *)r)[k];
}
static inline void st(void *r, int w, int64_t k, uint64_t v) {
    if (w == 4) ((uint32_t *)r)[k] = (uint32_t)v; else ((uint64_t *)r)[k] = v;
}
static inline void pf(const void *r, int w, int64_t k) {
    __builtin_prefetch((const char *)r + k * w, 1, 0);   /* (nta: measured best here) */
}

/* Returns 1 when stopped by the flag, else 0. progress[0]: steps done; progress[1]: stop flag. */
static int forward(void *r, int w, int64_t n, mt_t *m, volatile int64_t *progress) {
    for (int64_t i = 0; i < n; i++) st(r, w, i, (uint64_t)i);
    if (n < 2) return 0;
    int64_t z[PREFETCH];      /* ring: the absolute place swapped at step i is z[i % PREFETCH] */
    int64_t ahead = n - 1 < PREFETCH ? n - 1 : PREFETCH;
    for (int64_t i = 0; i < ahead; i++) {
        z[i] = i + (int64_t)(mt_next(m) % (uint64_t)(n - i));
        pf(r, w, z[i]);
    }
    for (int64_t i = 0; i < n - 1; i++) {
        int64_t j = z[i % PREFETCH];
        int64_t k = i + PREFETCH;
        if (k < n - 1) {
            z[k % PREFETCH] = k + (int64_t)(mt_next(m) % (uint64_t)(n - k));
            pf(r, w, z[k % PREFETCH]);
        }
        uint64_t t = ld(r, w, i);
        st(r, w, i, ld(r, w, j));
        st(r, w, j, t);
        if (progress && (i & (REPORT - 1)) == 0) {
            progress[0] = i;
            if (progress[1]) return 1;
        }
    }
    return 0;
}

static int inside_out(void *r, int w, int64_t n, mt_t *m, volatile int64_t *progress) {
    int64_t z[PREFETCH];
    int64_t ahead = n < PREFETCH ? n : PREFETCH;
    for (int64_t i = 0; i < ahead; i++) {
        z[i] = (int64_t)(mt_next64(m) % (uint64_t)(i + 1));
        pf(r, w, z[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t j = z[i % PREFETCH];
        int64_t k = i + PREFETCH;
        if (k < n) {
            z[k % PREFETCH] = (int64_t)(mt_next64(m) % (uint64_t)(k + 1));
            pf(r, w, z[k % PREFETCH]);
        }
        st(r, w, i, ld(r, w, j));   /* (j == i reads the slot before it is written: i itself) */
        st(r, w, j, (uint64_t)i);
        if (progress && (i & (REPORT - 1)) == 0) {
            progress[0] = i;
            if (progress[1]) return 1;
        }
    }
    return 0;
}

/* ---- The first k ids of randperm(n), without drawing the whole (served while it is built) ----
 * forward: positions [0, k) are final after step k - 1 (step i swaps i with a place >= i), so
 *   only k steps are run. Places >= k that they touch are kept in a small hash table (at most
 *   k of them; every other place still holds its own index): O(k) time and memory at any n.
 * inside-out: position p < k is written at step p (from a place <= p) and then only by steps
 *   i > p that draw z = p (r[z] = i); places >= k never flow back below k. So the loop runs on
 *   an array of k with every later step reduced to "if z < k: r[z] = i": all n draws are still
 *   made (they are sequential), but no array of n is touched: 0.62 s at 2.4*10^8 against 4.4 s. */
static int forward_prefix(void *r, int w, int64_t k, int64_t n, mt_t *m, volatile int64_t *progress) {
    for (int64_t i = 0; i < k; i++) st(r, w, i, (uint64_t)i);
    int64_t steps = k < n - 1 ? k : n - 1;
    if (steps <= 0) return 0;
    int bits = 4;
    while (((int64_t)1 << bits) < 2 * steps) bits++;
    int64_t cap = (int64_t)1 << bits;
    int64_t *keys = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
    uint64_t *vals = (uint64_t *)malloc((size_t)cap * sizeof(uint64_t));
    if (!keys || !vals) { free(keys); free(vals); return -1; }
    for (int64_t s = 0; s < cap; s++) keys[s] = -1;
    int stopped = 0;
    for (int64_t i = 0; i < steps; i++) {
        int64_t j = i + (int64_t)(mt_next(m) % (uint64_t)(n - i));
        uint64_t t = ld(r, w, i);
        if (j < k) {
            st(r, w, i, ld(r, w, j));
            st(r, w, j, t);
        } else {
            int64_t s = (int64_t)(((uint64_t)j * 0x9E3779B97F4A7C15ull) >> (64 - bits));
            while (keys[s] != -1 && keys[s] != j) s = (s + 1) & (cap - 1);
            st(r, w, i, keys[s] == j ? vals[s] : (uint64_t)j);
            keys[s] = j;
            vals[s] = t;
        }
        if (progress && (i & (REPORT - 1)) == 0) {
            progress[0] = i;
            if (progress[1]) { stopped = 1; break; }
        }
    }
    free(keys);
    free(vals);
    return stopped;
}

static int inside_out_prefix(void *r, int w, int64_t k, int64_t n, mt_t *m, volatile int64_t *progress) {
    for (int64_t i = 0; i < k; i++) {
        int64_t z = (int64_t)(mt_next64(m) % (uint64_t)(i + 1));
        st(r, w, i, ld(r, w, z));
        st(r, w, z, (uint64_t)i);
    }
    /* The rest straight off each twist's 624 draws (312 pairs: the draws so far are pairs, so a
     * pair never straddles two twists), with the stop flag looked at once per twist. */
    int64_t i = k, seen = 0;
    while (i < n) {
        if (m->i >= MT_N) mt_twist(m);
        const uint32_t *t = m->t + m->i;
        int64_t take = (MT_N - m->i) / 2;
        if (take > n - i) take = n - i;
        for (int64_t j = 0; j < take; j++) {
            uint64_t z = (((uint64_t)t[2 * j] << 32) | t[2 * j + 1]) % (uint64_t)(i + j + 1);
            if (z < (uint64_t)k) st(r, w, (int64_t)z, (uint64_t)(i + j));
        }
        m->i += (int)(2 * take);
        i += take;
        if (progress && i - seen >= REPORT) {
            progress[0] = seen = i;
            if (progress[1]) return 1;
        }
    }
    return 0;
}

/* The optional progress argument: None, or a writable int64[2] ([steps done, stop flag]) read and
 * set by another thread while a loop runs. 0 and *progress (NULL for None), or -1 with the
 * exception set; on success with a buffer the caller releases `p`. */
static int take_progress(PyObject *prog, Py_buffer *p, volatile int64_t **progress, const char *who) {
    *progress = NULL;
    if (prog == Py_None) return 0;
    if (PyObject_GetBuffer(prog, p, PyBUF_WRITABLE) < 0) return -1;
    if (p->len < 16) {
        PyBuffer_Release(p);
        PyErr_Format(PyExc_ValueError, "%s: progress must be a writable int64[2]", who);
        return -1;
    }
    *progress = (volatile int64_t *)p->buf;
    return 0;
}

/* prefix(out, n, seed, inside_out, progress=None) -> bool (True: stopped by the flag)
 * out: a writable buffer of k <= n uint32 or uint64: ids at positions [0, k) of randperm(n);
 * progress as randperm's (steps done: of k for the forward loop, of n for the inside-out one). */
static PyObject *prefix(PyObject *self, PyObject *args) {
    Py_buffer r, p = {0};
    long long n;
    unsigned long long seed;
    int io;
    PyObject *prog = Py_None;
    if (!PyArg_ParseTuple(args, "w*LKp|O", &r, &n, &seed, &io, &prog)) return NULL;
    int w = (int)r.itemsize;
    int64_t k = (w == 4 || w == 8) && r.len % w == 0 ? r.len / w : -1;
    if (k < 0 || k > n || (w == 4 && n > ((int64_t)1 << 32))) {
        PyBuffer_Release(&r);
        PyErr_SetString(PyExc_ValueError, "prefix(out: uint32[k] or uint64[k] with k <= n (uint32: n <= 2^32), n, "
                                          "seed, inside_out, progress)");
        return NULL;
    }
    volatile int64_t *progress;
    if (take_progress(prog, &p, &progress, "prefix") < 0) { PyBuffer_Release(&r); return NULL; }
    mt_t *m = (mt_t *)PyMem_RawMalloc(sizeof(mt_t));
    int stopped = -1;
    if (m) {
        Py_BEGIN_ALLOW_THREADS
        mt_seed(m, (uint32_t)(seed & 0xffffffffu));
        stopped = io ? inside_out_prefix(r.buf, w, k, n, m, progress) : forward_prefix(r.buf, w, k, n, m, progress);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(m);
    }
    PyBuffer_Release(&r);
    if (progress) PyBuffer_Release(&p);
    if (stopped < 0) return PyErr_NoMemory();
    return PyBool_FromLong(stopped);
}

/* randperm(out, seed, inside_out, progress=None) -> bool (True: stopped by the flag)
 * out: a writable buffer of n uint32 or uint64 (n = its length); progress: None or a writable
 * int64[2] buffer ([steps done, stop flag]), read by another thread while this one runs. */
static PyObject *randperm(PyObject *self, PyObject *args) {
    Py_buffer r, p = {0};
    unsigned long long seed;
    int io;
    PyObject *prog = Py_None;
    if (!PyArg_ParseTuple(args, "w*Kp|O", &r, &seed, &io, &prog)) return NULL;
    int w = (int)r.itemsize;
    if ((w != 4 && w != 8) || r.len % w) {
        PyBuffer_Release(&r);
        PyErr_SetString(PyExc_ValueError, "randperm(out: uint32[n] or uint64[n], seed, inside_out, progress)");
        return NULL;
    }
    int64_t n = r.len / w;
    if (w == 4 && n > ((int64_t)1 << 32)) {
        PyBuffer_Release(&r);
        PyErr_SetString(PyExc_ValueError, "randperm: uint32 holds at most 2^32 samples");
        return NULL;
    }
    volatile int64_t *progress;
    if (take_progress(prog, &p, &progress, "randperm") < 0) { PyBuffer_Release(&r); return NULL; }
    mt_t *m = (mt_t *)PyMem_RawMalloc(sizeof(mt_t));
    if (!m) { PyBuffer_Release(&r); if (progress) PyBuffer_Release(&p); return PyErr_NoMemory(); }
    int stopped;
    Py_BEGIN_ALLOW_THREADS
    mt_seed(m, (uint32_t)(seed & 0xffffffffu));
    stopped = io ? inside_out(r.buf, w, n, m, progress) : forward(r.buf, w, n, m, progress);
    if (progress && !stopped) progress[0] = n;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(m);
    PyBuffer_Release(&r);
    if (progress) PyBuffer_Release(&p);
    return PyBool_FromLong(stopped);
}


/* ---- The stateless order: a Feistel network over [0, 4^h) >= n, cycle-walked into [0, n) ----
 * A balanced Feistel network is a bijection of its 2h-bit domain whatever its round function,
 * and walking x -> F(x) -> F(F(x)) ... until the value falls below n is then a bijection of
 * [0, n) (each cycle of F, restricted to [0, n), stays a cycle). The domain is the smallest
 * even power of two >= n (at most 4n: under 4 steps of walk on average), so every n works,
 * 2^k + 1 included. feeder/core/order.py has the same arithmetic in numpy (the reference). */
static inline uint64_t mix64(uint64_t x) {   /* splitmix64's finalizer */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline uint64_t feistel_once(uint64_t x, int half, const uint64_t *keys, int rounds) {
    uint64_t mask = ((uint64_t)1 << half) - 1, l = x >> half, r = x & mask;
    for (int k = 0; k < rounds; k++) {
        uint64_t t = l ^ (mix64(r ^ keys[k]) & mask);
        l = r;
        r = t;
    }
    return (l << half) | r;
}

/* feistel(positions: int64[k], out: int64[k], n, half, keys: uint64[rounds]) */
static PyObject *feistel(PyObject *self, PyObject *args) {
    Py_buffer x, y, kb;
    long long n;
    int half;
    if (!PyArg_ParseTuple(args, "y*w*Liy*", &x, &y, &n, &half, &kb)) return NULL;
    int rounds = (int)(kb.len / 8);
    Py_ssize_t k = x.len / 8;
    if (x.len % 8 || y.len != x.len || kb.len % 8 || rounds < 1 || half < 1 || half > 31 ||
        n < 1 || (uint64_t)n > ((uint64_t)1 << (2 * half))) {
        PyBuffer_Release(&x); PyBuffer_Release(&y); PyBuffer_Release(&kb);
        PyErr_SetString(PyExc_ValueError, "feistel(positions: int64[k], out: int64[k], n, half, keys: uint64[r])");
        return NULL;
    }
    const int64_t *xv = (const int64_t *)x.buf;
    int64_t *yv = (int64_t *)y.buf;
    const uint64_t *keys = (const uint64_t *)kb.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        if (xv[i] < 0 || xv[i] >= n) { bad = 1; break; }
        uint64_t v = (uint64_t)xv[i];
        do v = feistel_once(v, half, keys, rounds); while (v >= (uint64_t)n);
        yv[i] = (int64_t)v;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x); PyBuffer_Release(&y); PyBuffer_Release(&kb);
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "feistel: a position outside [0, n)");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"randperm", randperm, METH_VARARGS, "torch.randperm(n) into a uint32/uint64 buffer (see the module doc)."},
    {"prefix", prefix, METH_VARARGS, "The ids at positions [0, k) of torch.randperm(n), without drawing the rest."},
    {"feistel", feistel, METH_VARARGS, "The stateless order's ids at positions (see feeder/core/order.py)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shuffle", NULL, -1, methods};

PyMODINIT_FUNC PyInit__shuffle(void) { return PyModule_Create(&module); }
