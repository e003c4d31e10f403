/* Y[M, N] = X[M, K] @ W[K, N] (+ bias) for the few rows (M <= ~16) of decoding and verification.
 *
 * W is packed once into panels of NR = 16 columns: panel p holds W[:, 16p:16p+16] as K contiguous
 * rows of 16 weights, so a panel streams from memory in order and stays in cache while each chunk of
 * up to MR = 6 rows of X is multiplied by it. Every output is one sequential sum over k, done the same
 * way whatever the number of rows: a row gives bitwise the same result alone or with others (exact
 * float32 greedy equality between plain and speculative decoding depends on that).
 *
 * Two weight types: float32 (skinny_gemm) and int8 with one float scale per output column
 * (skinny_gemm_i8: Y = (X @ Wq) * scale + bias), a quarter of the bytes to read.
 *
 * Built at run time by specdec/models/cpu_gemm.py with the host compiler (-O3 -march=native -fopenmp).
 * With AVX2 + FMA the micro-kernel holds its 6 x 16 accumulators in registers; otherwise portable C.
 */
#include <stddef.h>
#include <stdint.h>

#define NR 16
#define MR 6

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define LOAD_F32(w, k)                                                                                    \
    const __m256 w0 = _mm256_loadu_ps((w) + (size_t)(k) * NR), w1 = _mm256_loadu_ps((w) + (size_t)(k) * NR + 8);
#define LOAD_I8(w, k)                                                                                     \
    const __m128i q = _mm_loadu_si128((const __m128i *)((w) + (size_t)(k) * NR));                         \
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));                                        \
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));

/* One accumulator pair per row, as named variables (arrays would be spilled to the stack every k).
 * Output = acc * scale (when scale) + bias (when bias). */
#define KERNEL(NAME, WTYPE, LOAD, R)                                                                      \
    static void NAME##_##R(const float *restrict x, const WTYPE *restrict w, float *restrict y,           \
                           const float *restrict scale, const float *restrict bias, int K, int ldy) {    \
        __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;                     \
        __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;                                      \
        for (int k = 0; k < K; k++) {                                                                     \
            LOAD(w, k)                                                                                    \
            ROW(0, R) ROW(1, R) ROW(2, R) ROW(3, R) ROW(4, R) ROW(5, R)                                   \
        }                                                                                                 \
        const __m256 s0 = scale ? _mm256_loadu_ps(scale) : _mm256_set1_ps(1.0f);                          \
        const __m256 s1 = scale ? _mm256_loadu_ps(scale + 8) : _mm256_set1_ps(1.0f);                      \
        const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                             \
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();                         \
        STORE(0, R) STORE(1, R) STORE(2, R) STORE(3, R) STORE(4, R) STORE(5, R)                           \
    }
#define ROW(i, R)                                                                                         \
    if (i < R) {                                                                                          \
        const __m256 xi = _mm256_broadcast_ss(x + (size_t)i * K + k);                                     \
        l##i = _mm256_fmadd_ps(xi, w0, l##i);                                                             \
        h##i = _mm256_fmadd_ps(xi, w1, h##i);                                                             \
    }
#define STORE(i, R)                                                                                       \
    if (i < R) {                                                                                          \
        _mm256_storeu_ps(y + (size_t)i * ldy, scale ? _mm256_fmadd_ps(l##i, s0, b0) : _mm256_add_ps(l##i, b0)); \
        _mm256_storeu_ps(y + (size_t)i * ldy + 8, scale ? _mm256_fmadd_ps(h##i, s1, b1) : _mm256_add_ps(h##i, b1)); \
    }
#else
#define KERNEL(NAME, WTYPE, LOAD, R)                                                                      \
    static void NAME##_##R(const float *restrict x, const WTYPE *restrict w, float *restrict y,           \
                           const float *restrict scale, const float *restrict bias, int K, int ldy) {    \
        float acc[R][NR] = {{0}};                                                                         \
        for (int k = 0; k < K; k++)                                                                       \
            for (int i = 0; i < R; i++)                                                                   \
                for (int j = 0; j < NR; j++) acc[i][j] += x[(size_t)i * K + k] * (float)w[(size_t)k * NR + j]; \
        for (int i = 0; i < R; i++)                                                                       \
            for (int j = 0; j < NR; j++)                                                                  \
                y[(size_t)i * ldy + j] = acc[i][j] * (scale ? scale[j] : 1.0f) + (bias ? bias[j] : 0.0f); \
    }
#define LOAD_F32(w, k)
#define LOAD_I8(w, k)
#endif

#define KERNELS_FOR(NAME, WTYPE, LOAD)                                                                    \
    KERNEL(NAME, WTYPE, LOAD, 1)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 2)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 3)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 4)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 5)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 6)                                                                          \
    typedef void (*NAME##_fn)(const float *, const WTYPE *, float *, const float *, const float *, int, int); \
    static const NAME##_fn NAME##_table[MR + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};

KERNELS_FOR(f32, float, LOAD_F32)
KERNELS_FOR(i8, int8_t, LOAD_I8)

/* The panel loop, shared by both weight types. packed: [N/NR, K, NR]; x: [M, K]; y: [M, N];
 * scale, bias: [N] or NULL. */
#define PANELS(TABLE, WTYPE)                                                                              \
    const int panels = N / NR;                                                                            \
    _Pragma("omp parallel for schedule(static)")                                                          \
    for (int p = 0; p < panels; p++) {                                                                    \
        const WTYPE *w = (const WTYPE *)packed + (size_t)p * K * NR;                                      \
        const float *s = scale ? scale + (size_t)p * NR : NULL;                                           \
        const float *b = bias ? bias + (size_t)p * NR : NULL;                                             \
        for (int m0 = 0; m0 < M; m0 += MR) {                                                              \
            const int mr = M - m0 < MR ? M - m0 : MR;                                                     \
            TABLE[mr](x + (size_t)m0 * K, w, y + (size_t)m0 * N + (size_t)p * NR, s, b, K, N);            \
        }                                                                                                 \
    }

void skinny_gemm(const float *x, const float *packed, const float *bias, float *y, int M, int K, int N) {
    const float *scale = NULL;
    PANELS(f32_table, float)
}

void skinny_gemm_i8(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y, int M, int K, int N) {
    PANELS(i8_table, int8_t)
}
