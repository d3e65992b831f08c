/* Page copies between two host KV caches, without the GIL.
 *
 * copy_runs(dst_base, d_stride, dst_pages, src_base, s_stride, src_pages, page_bytes,
 *           runs_addr, nruns, stream) -> bytes copied
 *
 * ``runs_addr`` is the address of ``nruns`` int64 triples (src page, dst page, pages).
 * Page ``p`` of a cache starts at ``base + p * stride`` and is ``page_bytes`` long.
 * Every run is checked against both caches before anything is copied (ValueError).
 * With ``stream`` the bytes are written with non-temporal (streaming) AVX2 stores: a large
 * copy then does not read each destination line before writing it, nor evict the
 * caches (glibc's memcpy does the same only above its non-temporal threshold, which
 * KV pages never reach on their own). One sfence orders the stores before returning.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OMNIKV_X86 1
#endif

#ifdef OMNIKV_X86
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    if (i < n) memcpy(d + i, s + i, n - i);
}

static int have_avx2 = -1;

/* streaming copy of n bytes: plain memcpy up to a 64-byte aligned destination (and on
 * CPUs without AVX2) */
static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (n < 256 || !have_avx2) {
        memcpy(d, s, n);
        return;
    }
    if (head) {
        memcpy(d, s, head);
        d += head, s += head, n -= head;
    }
    stream_avx2(d, s, n);
}
#define FENCE() _mm_sfence()
#else
static const int have_avx2 = 0;
static void stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#define FENCE() ((void)0)
#endif

static int fits(int64_t page, int64_t n, long long pages) {
    return page >= 0 && n >= 0 && page <= pages && n <= pages - page;
}

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base, runs_addr;
    long long d_stride, dst_pages, s_stride, src_pages, per, nruns;
    int stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLKLLLKLp", &dst_base, &d_stride, &dst_pages, &src_base,
                          &s_stride, &src_pages, &per, &runs_addr, &nruns, &stream))
        return NULL;
    if (per <= 0 || d_stride < per || s_stride < per || nruns < 0 || dst_pages < 0 ||
        src_pages < 0 || (nruns && !runs_addr) || !dst_base || !src_base) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_runs: pages must be dense and not overlap (stride >= page "
                        "bytes > 0), with valid addresses");
        return NULL;
    }
    const int64_t *runs = (const int64_t *)(uintptr_t)runs_addr;
    long long total = 0;
    for (long long r = 0; r < nruns; r++) {
        int64_t s = runs[3 * r], d = runs[3 * r + 1], n = runs[3 * r + 2];
        if (!fits(s, n, src_pages) || !fits(d, n, dst_pages)) {
            PyErr_Format(PyExc_ValueError,
                         "copy_runs: run %lld (source page %lld, destination page %lld, "
                         "%lld pages) lies outside a cache of %lld / %lld pages",
                         r, (long long)s, (long long)d, (long long)n, src_pages, dst_pages);
            return NULL;
        }
        total += n * per;
    }
    const int contiguous = d_stride == per && s_stride == per;
    Py_BEGIN_ALLOW_THREADS
    for (long long r = 0; r < nruns; r++) {
        int64_t s = runs[3 * r], d = runs[3 * r + 1], n = runs[3 * r + 2];
        char *dp = (char *)(uintptr_t)dst_base + d * d_stride;
        const char *sp = (const char *)(uintptr_t)src_base + s * s_stride;
        if (contiguous) {
            if (stream)
                stream_copy(dp, sp, (size_t)(n * per));
            else
                memcpy(dp, sp, (size_t)(n * per));
            continue;
        }
        for (int64_t j = 0; j < n; j++) {
            if (stream)
                stream_copy(dp + j * d_stride, sp + j * s_stride, (size_t)per);
            else
                memcpy(dp + j * d_stride, sp + j * s_stride, (size_t)per);
        }
    }
    if (stream) FENCE();
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(total);
}

static PyObject *features(PyObject *self, PyObject *args) {
    (void)self, (void)args;
#ifdef OMNIKV_X86
    return Py_BuildValue("s", have_avx2 ? "avx2 streaming stores" : "memcpy (no AVX2 on this CPU)");
#else
    return Py_BuildValue("s", "memcpy (no streaming stores on this architecture)");
#endif
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS, "Copy runs of pages between two host caches."},
    {"features", features, METH_NOARGS, "How copies are made on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagecopy", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pagecopy(void) {
#ifdef OMNIKV_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    return PyModule_Create(&module);
}
