/* Y[M, N] = X[M, K] @ W[K, N] (+ bias) for 4-bit GGUF blocks (Q4_0, Q4_1) with the activations quantised
 * to int8, in integer dot products, as llama.cpp's CPU path runs them: the `-A8` formats of a quantized
 * drafter (views.quantized_copy), never a target. skinny_gemm() sends those weight types here.
 *
 * Why: skinny_gemm.c's block kernels dequantise every weight into float32 in registers and run a float32
 * FMA chain (about 10 vector instructions per 16 weights), which is instruction-bound: a Q4_1 product of
 * one row was barely faster than float32's, although it reads a sixth of the bytes. Here a 32-byte load
 * of weights feeds 64 multiply-adds of 8-bit integers (_mm256_maddubs_epi16), about 9 instructions per 64
 * weights for one row; with VNNI (_mm256_dpbusd), about 7, and the same bits (see DOT4).
 *
 * Activations: each row of X is quantised per block of QK = 32 along K, symmetrically (Q8_0's rule):
 * d = max|x| / 127, q = x * (1 / d) rounded to nearest even (q = 0 where d = 0), keeping the block's sum
 * of q (Q4_0's offset) and its float32 sum of x, k ascending (Q4_1's minimum; llama.cpp's Q8_1 keeps
 * d * sum(q) instead, which rounds more).
 *
 * Products, per output column j and block b, s = sum over the block's 32 k of q_w * q_x (exact, int32):
 *     Q4_0 (w = d_w (q_w - 8)):  acc += (float)(s - 8 sum(q_x)) * (d_w * d_x)
 *     Q4_1 (w = d_w q_w + m_w):  acc += (float)s * (d_w * d_x);  acc += m_w * sum(x)
 * block after block, then y = acc + bias (float32; bfloat16 outputs rounded to nearest even). With AVX2
 * each += is one FMA; the portable C multiplies, then adds (-ffp-contract=off), so the two builds differ
 * in the last bits. Every row is quantised and summed on its own, in an order fixed by K: a row's output
 * is bitwise the same whatever M and the threads, as with the float kernels; but it is not the product
 * of X with the dequantised weight (the activations are rounded), which is why only a drafter uses it:
 * verification keeps the output the target's whatever the draft computes.
 *
 * Panels: NR = 16 columns, as skinny_gemm.c's, of K / QK blocks, the same bytes per weight as GGUF's
 * (Q4_0 0.5625, Q4_1 0.625). A block holds the 16 columns' float16 scales d (Q4_1: then their float16
 * minimums m), then 8 groups of 4 k in 32 bytes each: byte 4 j + t of group g holds weight (k = 4 g + t,
 * column j) in its low nibble and (4 g + t, j + 8) in its high nibble, j < 8, t < 4 (cpu_quant.pack_blocks).
 * A group's 32 bytes, masked and shifted, are two vectors of 32 unsigned 4-bit weights (columns 0-7 and
 * 8-15, 4 k each); _mm256_maddubs_epi16 against the row's 4 int8 of those k, broadcast, sums pairs of k
 * per column into 16-bit lanes 2 j and 2 j + 1; int16 adds gather the block's 8 groups (at most
 * 8 * 2 * 15 * 128 = 30720 in magnitude: no overflow) and _mm256_madd_epi16 with ones turns the lanes
 * into the 8 columns' block sums in int32, in column order.
 *
 * Threads (cpu_threads.c) take whole panels, as in skinny_gemm.c; rows run in chunks of up to A8_ROWS,
 * each chunk reading the panel's weights once.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_f16.h"

/* cpu_threads.c */
void specdec_parallel(int tasks, int threads, void (*fn)(void *ctx, int task), void *ctx);

#define NR 16                       /* panel width, as skinny_gemm.c */
#define QK 32                       /* weights per block along K */
#define GROUPS (QK / 4)             /* groups of 4 k per block */
#define A8_ROWS 4                   /* rows one kernel call computes */
#define L2_BLOCK_BYTES (192 * 1024) /* weights per task when many rows share them, as skinny_gemm.c */

/* Bytes of one block of 16 columns: scales (and minimums), then QK * NR / 2 bytes of nibbles. */
static size_t block_bytes(int q4_1) { return (size_t)NR * (q4_1 ? 4 : 2) + QK * NR / 2; }

/* X quantised per block: [M, K] int8 values, and per [M, K / QK] block its scale, sum of q and sum of x. */
typedef struct {
    int8_t *q;
    float *d, *xsum;
    int32_t *qsum;
} q8_rows;

static void quantise_rows(const float *x, int M, int K, q8_rows *out) {
    const int nb = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * K + (size_t)b * QK;
            int8_t *qb = out->q + (size_t)m * K + (size_t)b * QK;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < QK; i++) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
                sum += xb[i];
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t qsum = 0;
            for (int i = 0; i < QK; i++) {
                qb[i] = (int8_t)nearbyintf(xb[i] * id);
                qsum += qb[i];
            }
            out->d[(size_t)m * nb + b] = d, out->xsum[(size_t)m * nb + b] = sum, out->qsum[(size_t)m * nb + b] = qsum;
        }
}

/* The unsigned 4-bit weight (k, j) of block blk (k < QK): see the panel layout above. */
static inline int nibble(const uint8_t *blk, int q4_1, int k, int j) {
    const uint8_t byte = blk[NR * (q4_1 ? 4 : 2) + (k / 4) * 32 + 4 * (j % 8) + k % 4];
    return j < 8 ? byte & 15 : byte >> 4;
}

/* Weight (k, j) of a panel, dequantised as gguf does (skinny_gemm.c's block_weight, for this layout). */
float specdec_int_dot_weight(const uint8_t *panel, int q4_1, int k, int j) {
    const uint8_t *blk = panel + (size_t)(k / QK) * block_bytes(q4_1);
    const float d = load_f16(blk + 2 * j);
    const int q = nibble(blk, q4_1, k % QK, j);
    return q4_1 ? d * (float)q + load_f16(blk + NR * 2 + 2 * j) : d * (float)(q - 8);
}

/* rows(x, m0, R, panel, y, ldy, bias, K): y [R, NR] (row stride ldy) = rows m0 .. m0 + R - 1 of x times
 * one panel, + bias [NR] (or NULL). */
typedef void (*rows_fn)(const q8_rows *x, int m0, const uint8_t *panel, float *y, int ldy, const float *bias, int K);

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* The block PREFETCH_AHEAD bytes on (in this panel or the next; a panel stream is contiguous), into L2:
 * the hardware's prefetch alone left the one-row kernel waiting on memory (LM head 576 x 49152 on one
 * thread: 1.51 against 1.69 ms with a 2 KiB prefetch into L1, the variants alternating call by call on
 * the 2-core AMD EPYC). Into L2 (T1), 4 KiB ahead: a draft forward's weights come from memory inside
 * the decode loop (they do not stay cached between the target's forwards), and a core has more misses
 * in flight to L2 than to L1. Q4_1-A8 draft beside the float32 default model, 2-core Intel VM with
 * VNNI, decode loop, per step: draft layers 18.1-18.7 -> 16.6-16.9 ms (alternated, 2 + 3 runs);
 * 1 KiB 19.8, 8 KiB 16.9. */
#define PREFETCH_AHEAD 4096
#define PREFETCH(blk)                                                                                     \
    for (int line = 0; line < NR * 4 + QK * NR / 2; line += 64)                                           \
        _mm_prefetch((const char *)(blk) + PREFETCH_AHEAD + line, _MM_HINT_T1);

/* DOT4(a, w, x): a's lanes += a group's products of 4 unsigned weights (w) and 4 int8 activations (x).
 * With VNNI one dpbusd adds the 4 products of each column into its int32 lane; AVX2 sums pairs into
 * int16 lanes (maddubs) and BLOCK_SUMS turns a block's pairs into int32 lanes. Integer sums either way:
 * the same bits. */
#if defined(__AVXVNNI__)
#define INT_DOT_ISA "avx-vnni"
#define DOT4(a, w, x) _mm256_dpbusd_avx_epi32(a, w, x)
#define BLOCK_SUMS(a) (a)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT_DOT_ISA "avx512-vnni"
#define DOT4(a, w, x) _mm256_dpbusd_epi32(a, w, x)
#define BLOCK_SUMS(a) (a)
#else
#define INT_DOT_ISA "avx2"
#define DOT4(a, w, x) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
#define BLOCK_SUMS(a) _mm256_madd_epi16(a, ones)
#endif
/* Row i's int16 sums (columns 0-7, 8-15) of the current block and its float accumulators. */
#define A8_STATE(i) __m256 f##i##0 = _mm256_setzero_ps(), f##i##1 = f##i##0; __m256i a##i##0, a##i##1;
#define A8_ZERO(i, R) if (i < R) a##i##0 = a##i##1 = _mm256_setzero_si256();
#define A8_GROUP(i, R)                                                                                    \
    if (i < R) {                                                                                          \
        int32_t four;                                                                                     \
        memcpy(&four, xq + (size_t)i * K + 4 * g, 4);                                                     \
        const __m256i xb = _mm256_set1_epi32(four);                                                       \
        a##i##0 = DOT4(a##i##0, lo, xb);                                                                  \
        a##i##1 = DOT4(a##i##1, hi, xb);                                                                  \
    }
/* Row i's block sums into its accumulators: scale by d_w * d_x (and Q4_0's offset, or Q4_1's minimum). */
#define A8_BLOCK(i, R, Q4_1)                                                                              \
    if (i < R) {                                                                                          \
        const size_t at = (size_t)(m0 + i) * nb + b;                                                      \
        __m256i s0 = BLOCK_SUMS(a##i##0), s1 = BLOCK_SUMS(a##i##1);                                       \
        if (!Q4_1) {                                                                                      \
            const __m256i offset = _mm256_set1_epi32(8 * x->qsum[at]);                                    \
            s0 = _mm256_sub_epi32(s0, offset), s1 = _mm256_sub_epi32(s1, offset);                         \
        }                                                                                                 \
        const __m256 dx = _mm256_set1_ps(x->d[at]);                                                       \
        f##i##0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, dx), f##i##0);                \
        f##i##1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, dx), f##i##1);                \
        if (Q4_1) {                                                                                       \
            const __m256 sx = _mm256_set1_ps(x->xsum[at]);                                                \
            f##i##0 = _mm256_fmadd_ps(F16X8(blk + 32), sx, f##i##0);                                      \
            f##i##1 = _mm256_fmadd_ps(F16X8(blk + 48), sx, f##i##1);                                      \
        }                                                                                                 \
    }
#define A8_STORE(i, R)                                                                                    \
    if (i < R) {                                                                                          \
        _mm256_storeu_ps(y + (size_t)i * ldy, bias ? _mm256_add_ps(f##i##0, _mm256_loadu_ps(bias)) : f##i##0); \
        _mm256_storeu_ps(y + (size_t)i * ldy + 8, bias ? _mm256_add_ps(f##i##1, _mm256_loadu_ps(bias + 8)) : f##i##1); \
    }
#define A8_KERNEL(NAME, Q4_1, R)                                                                          \
    static void NAME##_##R(const q8_rows *x, int m0, const uint8_t *panel, float *y, int ldy, const float *bias, int K) { \
        const int nb = K / QK;                                                                            \
        const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                           \
        A8_STATE(0) A8_STATE(1) A8_STATE(2) A8_STATE(3)                                                   \
        const uint8_t *blk = panel;                                                                       \
        for (int b = 0; b < nb; b++, blk += block_bytes(Q4_1)) {                                          \
            const int8_t *xq = x->q + (size_t)m0 * K + (size_t)b * QK;                                    \
            const uint8_t *groups = blk + NR * (Q4_1 ? 4 : 2);                                            \
            PREFETCH(blk)                                                                                 \
            A8_ZERO(0, R) A8_ZERO(1, R) A8_ZERO(2, R) A8_ZERO(3, R)                                       \
            for (int g = 0; g < GROUPS; g++) {                                                            \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(groups + 32 * g));                 \
                const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask); \
                A8_GROUP(0, R) A8_GROUP(1, R) A8_GROUP(2, R) A8_GROUP(3, R)                               \
            }                                                                                             \
            const __m256 d0 = F16X8(blk), d1 = F16X8(blk + 16);                                           \
            A8_BLOCK(0, R, Q4_1) A8_BLOCK(1, R, Q4_1) A8_BLOCK(2, R, Q4_1) A8_BLOCK(3, R, Q4_1)           \
        }                                                                                                 \
        A8_STORE(0, R) A8_STORE(1, R) A8_STORE(2, R) A8_STORE(3, R)                                       \
    }
#else
#define INT_DOT_ISA "portable"
/* Portable C: the same integer sums, then a product and a sum per float operation. */
#define A8_KERNEL(NAME, Q4_1, R)                                                                          \
    static void NAME##_##R(const q8_rows *x, int m0, const uint8_t *panel, float *y, int ldy, const float *bias, int K) { \
        const int nb = K / QK;                                                                            \
        for (int i = 0; i < R; i++)                                                                       \
            for (int j = 0; j < NR; j++) {                                                                \
                float acc = 0.0f;                                                                         \
                for (int b = 0; b < nb; b++) {                                                            \
                    const uint8_t *blk = panel + (size_t)b * block_bytes(Q4_1);                           \
                    const int8_t *xq = x->q + (size_t)(m0 + i) * K + (size_t)b * QK;                      \
                    const size_t at = (size_t)(m0 + i) * nb + b;                                          \
                    int32_t s = 0;                                                                        \
                    for (int k = 0; k < QK; k++) s += nibble(blk, Q4_1, k, j) * xq[k];                    \
                    if (!Q4_1) s -= 8 * x->qsum[at];                                                      \
                    acc += (float)s * (load_f16(blk + 2 * j) * x->d[at]);                                 \
                    if (Q4_1) acc += load_f16(blk + NR * 2 + 2 * j) * x->xsum[at];                        \
                }                                                                                         \
                y[(size_t)i * ldy + j] = bias ? acc + bias[j] : acc;                                      \
            }                                                                                             \
    }
#endif

/* Which instructions the integer sums run on: avx-vnni, avx512-vnni (its 256-bit form), avx2 or portable. */
const char *specdec_int_dot_isa(void) { return INT_DOT_ISA; }

#define A8_KERNELS(NAME, Q4_1)                                                                            \
    A8_KERNEL(NAME, Q4_1, 1) A8_KERNEL(NAME, Q4_1, 2) A8_KERNEL(NAME, Q4_1, 3) A8_KERNEL(NAME, Q4_1, 4)   \
    static const rows_fn NAME##_table[A8_ROWS + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4};
A8_KERNELS(q4_0_a8, 0)
A8_KERNELS(q4_1_a8, 1)

typedef struct {
    q8_rows x;
    const uint8_t *packed;
    const float *bias;
    void *y;
    int q4_1, y_bf16, M, K, N, per_task;
} int_dot_job;

/* Task t: all rows times panels [t * per_task, (t + 1) * per_task). */
static void int_dot_task(void *arg, int task) {
    const int_dot_job *g = arg;
    const int panels = g->N / NR, p0 = task * g->per_task, p1 = p0 + g->per_task < panels ? p0 + g->per_task : panels;
    const size_t panel_bytes = (size_t)(g->K / QK) * block_bytes(g->q4_1);
    const rows_fn *table = g->q4_1 ? q4_1_a8_table : q4_0_a8_table;
    float tile[A8_ROWS * NR];
    for (int m0 = 0; m0 < g->M; m0 += A8_ROWS) {
        const int rows = g->M - m0 < A8_ROWS ? g->M - m0 : A8_ROWS;
        for (int p = p0; p < p1; p++) {
            const float *bias = g->bias ? g->bias + (size_t)p * NR : NULL;
            float *out = g->y_bf16 ? tile : (float *)g->y + (size_t)m0 * g->N + (size_t)p * NR;
            table[rows](&g->x, m0, g->packed + (size_t)p * panel_bytes, out, g->y_bf16 ? NR : g->N, bias, g->K);
            if (g->y_bf16) {
                uint16_t *y = (uint16_t *)g->y + (size_t)m0 * g->N + (size_t)p * NR;
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < NR; j++) y[(size_t)i * g->N + j] = f32_to_bf16(tile[i * NR + j]);
            }
        }
    }
}

/* Panels per task: for a few rows, about 16 tasks per thread (they share out evenly on a busy CPU);
 * for many, a block of panels that stays in L2 while every chunk of rows runs over it. */
static int panels_per_task(int panels, size_t panel_bytes, int M, int threads) {
    if (M > 2 * A8_ROWS) {
        const int block = (int)(L2_BLOCK_BYTES / panel_bytes);
        return block < 1 ? 1 : block;
    }
    return (panels + 16 * threads - 1) / (16 * threads);
}

/* x: [M, K] float32; packed: N / NR panels of K / QK blocks (q4_1: Q4_1, else Q4_0; K a multiple of QK);
 * bias: [N] float32 or NULL; y: [M, N] float32 or bfloat16 (y_bf16). N is a multiple of NR. */
void specdec_int_dot(const float *x, const void *packed, int q4_1, const float *bias, void *y, int y_bf16, int M, int K,
                     int N, int threads) {
    const size_t blocks = (size_t)M * (K / QK);
    void *buffer = malloc((size_t)M * K + blocks * (2 * sizeof(float) + sizeof(int32_t)));
    if (!buffer) abort();
    float *d = (float *)buffer, *xsum = d + blocks;
    q8_rows rows = {(int8_t *)((int32_t *)(xsum + blocks) + blocks), d, xsum, (int32_t *)(xsum + blocks)};
    quantise_rows(x, M, K, &rows);
    const int panels = N / NR;
    int_dot_job g = {rows, packed, bias, y, q4_1, y_bf16, M, K, N,
                     panels_per_task(panels, (size_t)(K / QK) * block_bytes(q4_1), M, threads)};
    specdec_parallel((panels + g.per_task - 1) / g.per_task, threads, int_dot_task, &g);
    free(buffer);
}

/* A 4-bit copy's LM head ranks the vocabulary and the target's head rows in int8 score its best logits
 * again (views.RescoredHead). Per row r of logits [R, V] (float32, in place): find its k largest (k <=
 * RESCORE_MAX; on ties the lower index), then replace each by scale[v] * sum_d hidden[r, d] * weight[v, d]
 * (weight [V, D] int8, d ascending, float32). One pass over V: a block of 8 logits is looked at only when
 * one beats the k-th best so far, so the pass costs about one compare per 8 logits. */
#define RESCORE_MAX 16

static void rescore_row(float *logits, const float *hidden, const int8_t *weight, const float *scale, int V, int D, int k) {
    float best[RESCORE_MAX];
    int index[RESCORE_MAX], n = 0;
    float floor = -INFINITY; /* the k-th best so far (-inf until k are kept) */
    for (int v0 = 0; v0 < V; v0 += 8) {
        const int end = v0 + 8 < V ? v0 + 8 : V;
#if defined(__AVX2__) && defined(__FMA__)
        if (end - v0 == 8 && n == k &&
            !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + v0), _mm256_set1_ps(floor), _CMP_GT_OQ)))
            continue;
#endif
        for (int v = v0; v < end; v++) {
            const float x = logits[v];
            if (!(n < k || x > floor)) continue;
            int at = n < k ? n++ : k - 1; /* sorted descending: drop the last, sink x into place */
            while (at > 0 && best[at - 1] < x) best[at] = best[at - 1], index[at] = index[at - 1], at--;
            best[at] = x, index[at] = v;
            if (n == k) floor = best[k - 1];
        }
    }
    for (int i = 0; i < n; i++) {
        const int8_t *w = weight + (size_t)index[i] * D;
        float sum = 0.0f;
        for (int d = 0; d < D; d++) sum += hidden[d] * (float)w[d];
        logits[index[i]] = scale[index[i]] * sum;
    }
}

void specdec_rescore(float *logits, const float *hidden, const int8_t *weight, const float *scale, int R, int V, int D, int k) {
    if (k > RESCORE_MAX) k = RESCORE_MAX;
    for (int r = 0; r < R; r++) rescore_row(logits + (size_t)r * V, hidden + (size_t)r * D, weight, scale, V, D, k);
}
