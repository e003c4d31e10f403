/* Y[M, N] = X[M, K] @ W[K, N] (+ bias) for the few rows (M <= ~16) of decoding and verification.
 *
 * W is packed once into panels of NR = 16 columns: panel p holds W[:, 16p:16p+16] as K contiguous
 * rows of 16 floats, so a panel streams from memory in order and stays in cache while each chunk of
 * up to MR = 6 rows of X is multiplied by it. Every output is one sequential sum over k, done the same
 * way whatever the number of rows: a row gives bitwise the same result alone or with others (exact
 * float32 greedy equality between plain and speculative decoding depends on that).
 *
 * Built at run time by specdec/models/cpu_gemm.py with the host compiler (-O3 -march=native -fopenmp).
 * With AVX2 + FMA the micro-kernel holds its 6 x 16 accumulators in registers; otherwise portable C.
 */
#include <stddef.h>

#define NR 16
#define MR 6

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* One accumulator pair per row, as named variables (arrays would be spilled to the stack every k). */
#define KERNEL(R)                                                                                         \
    static void kernel_##R(const float *restrict x, const float *restrict w, float *restrict y,           \
                           const float *restrict bias, int K, int ldy) {                                 \
        __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;                     \
        __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;                                      \
        for (int k = 0; k < K; k++) {                                                                     \
            const __m256 w0 = _mm256_loadu_ps(w + (size_t)k * NR), w1 = _mm256_loadu_ps(w + (size_t)k * NR + 8); \
            ROW(0, R) ROW(1, R) ROW(2, R) ROW(3, R) ROW(4, R) ROW(5, R)                                   \
        }                                                                                                 \
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
        _mm256_storeu_ps(y + (size_t)i * ldy, _mm256_add_ps(l##i, b0));                                   \
        _mm256_storeu_ps(y + (size_t)i * ldy + 8, _mm256_add_ps(h##i, b1));                               \
    }
#else
#define KERNEL(R)                                                                                         \
    static void kernel_##R(const float *restrict x, const float *restrict w, float *restrict y,           \
                           const float *restrict bias, int K, int ldy) {                                 \
        float acc[R][NR] = {{0}};                                                                         \
        for (int k = 0; k < K; k++)                                                                       \
            for (int i = 0; i < R; i++)                                                                   \
                for (int j = 0; j < NR; j++) acc[i][j] += x[(size_t)i * K + k] * w[(size_t)k * NR + j];   \
        for (int i = 0; i < R; i++)                                                                       \
            for (int j = 0; j < NR; j++) y[(size_t)i * ldy + j] = acc[i][j] + (bias ? bias[j] : 0.0f);    \
    }
#endif

KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

typedef void (*kernel_fn)(const float *, const float *, float *, const float *, int, int);
static const kernel_fn KERNELS[MR + 1] = {0, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6};

/* packed: [N/NR, K, NR] (N a multiple of NR); x: [M, K]; y: [M, N]; bias: [N] or NULL. */
void skinny_gemm(const float *x, const float *packed, const float *bias, float *y, int M, int K, int N) {
    const int panels = N / NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        const float *w = packed + (size_t)p * K * NR;
        const float *b = bias ? bias + (size_t)p * NR : NULL;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? M - m0 : MR;
            KERNELS[mr](x + (size_t)m0 * K, w, y + (size_t)m0 * N + (size_t)p * NR, b, K, N);
        }
    }
}
