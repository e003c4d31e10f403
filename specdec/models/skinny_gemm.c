/* Y[M, N] = X[M, K] @ W[K, N] (+ bias) on the CPU, with one summation order per output whatever M is.
 *
 * W is packed once into panels of NR = 16 columns: panel p holds W[:, 16p:16p+16] as K contiguous
 * rows of 16 weights, so a panel streams from memory in order. Every output is one sequential sum
 * over k = 0 .. K-1 (a fused multiply-add per k), done by the same micro-kernel for every chunk of up
 * to MR = 6 rows (16 for float32 and GGUF block weights with AVX-512, MRQ; the same arithmetic in wider vectors): a row
 * gives bitwise the same result alone, in a verify block, in a batch or in a prefill of any length
 * (exact greedy equality between plain and speculative decoding depends on that). Nothing here splits
 * K, and the number of rows only decides how many chunks run.
 *
 * Weight types: float32, bfloat16 (converted to float32 in registers: exact, then the same
 * arithmetic as float32), int8 with one float scale per output column (Y = (X @ Wq) * scale + bias),
 * and GGUF's block formats Q4_0, Q4_1 and Q8_0 (see "GGUF blocks" below: each weight is dequantised
 * in registers exactly as gguf's reference dequantises it, then takes the float32 arithmetic, so the
 * product is bitwise the float32 kernel's on the dequantised weight). Two more weight types, Q4_0 and
 * Q4_1 blocks laid out for integer dot products with int8 activations (a drafter's `-A8` formats), run
 * in int_dot.c: approximate, and only for drafts.
 * Activations X and outputs Y are float32 or bfloat16 (converted on the way in, rounded to nearest
 * even on the way out, as PyTorch rounds), always accumulated in float32.
 *
 * Large M (prefill, big batches): panels are taken in blocks that fit in L2, and each chunk of rows
 * (in L1) runs over the whole block, so X is read from L3 once per block instead of once per panel;
 * a bfloat16 or int8 block is first widened to float32 in a per-thread buffer, so the conversion is
 * paid once per block, not once per chunk. A GGUF block weight is widened so too without AVX-512; with
 * it, chunks of up to MRQ = 16 rows dequantise in registers instead (see MRQ). All of these change where
 * data comes from, never the order of the sums (the widening is exact). See cpu_gemm.py for the
 * measured speed against MKL.
 *
 * A single row (a plain decoding step) runs through WIDE = 4 panels at once: 8 independent FMA chains
 * instead of 2, the same arithmetic per output (about 25 % faster on one core). Threads
 * (cpu_threads.c) take tasks of whole panels: which thread computes an output never changes how.
 *
 * Built at run time by specdec/models/cpu_gemm.py with the host compiler (-O3 -march=native -pthread
 * -ffp-contract=off). With AVX2 + FMA the micro-kernels hold their accumulators in registers;
 * otherwise portable C (multiply then add: -ffp-contract=off keeps the compiler from fusing some and
 * not others).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_f16.h"

/* cpu_threads.c */
void specdec_parallel(int tasks, int threads, void (*fn)(void *ctx, int task), void *ctx);
float *specdec_scratch(size_t n);
/* int_dot.c */
void specdec_int_dot(const float *x, const void *packed, int q4_1, const float *bias, void *y, int y_bf16, int M, int K,
                     int N, int threads);
float specdec_int_dot_weight(const uint8_t *panel, int q4_1, int k, int j);

#define NR 16
#define MR 6
#define WIDE 4 /* panels a single row runs through at once */
#define L2_BLOCK_BYTES (192 * 1024) /* weights per panel block: fits a 512 KiB L2 beside X and Y */

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_Q4_0 = 3, W_Q4_1 = 4, W_Q8_0 = 5, W_Q4_0_A8 = 6, W_Q4_1_A8 = 7 };
#define WEIGHT_TYPES 8 /* W_Q4_0_A8 and W_Q4_1_A8 (int8 activations) run in int_dot.c, not in the tables below */

/* GGUF blocks. cpu_quant.py repacks a GGUF tensor of QK = 32 weights per block along K into panels of
 * NR columns; a panel is K / QK blocks, each block the 16 columns' float16 scales d (Q4_1: then their
 * float16 minimums m), then QK rows of the 16 columns' quantised weights: 16 int8 (Q8_0), or 8 bytes
 * holding column j in the low nibble of byte j and column j + 8 in the high nibble (Q4_0, Q4_1).
 * A weight is, as in gguf's reference (gguf.quants): Q4_0 d * (q - 8), Q4_1 d * q + m (a product, then
 * a sum: -ffp-contract=off keeps them apart), Q8_0 q * d, with float16 -> float32 exact. The bytes per
 * weight are GGUF's own (Q4_0 0.5625, Q4_1 0.625, Q8_0 1.0625). */
#define QK 32
#define Q4_0_BLOCK (NR * 2 + QK * NR / 2)
#define Q4_1_BLOCK (NR * 4 + QK * NR / 2)
#define Q8_0_BLOCK (NR * 2 + QK * NR)

static int block_quantised(int wtype) { return wtype >= W_Q4_0; }

static int int_dot(int wtype) { return wtype >= W_Q4_0_A8; }

static size_t block_bytes_of(int wtype) {
    return wtype == W_Q4_0 || wtype == W_Q4_0_A8 ? Q4_0_BLOCK : wtype == W_Q4_1 || wtype == W_Q4_1_A8 ? Q4_1_BLOCK : Q8_0_BLOCK;
}

/* Bytes of one panel of K weights per column, as stored. */
static size_t panel_bytes_of(int wtype, int K) {
    static const size_t per_weight[3] = {4, 2, 1};
    return block_quantised(wtype) ? (size_t)(K / QK) * block_bytes_of(wtype) : (size_t)K * NR * per_weight[wtype];
}

/* Weight (k, j) of a block-quantised panel, dequantised as gguf does. */
static inline float block_weight(const uint8_t *panel, int wtype, int k, int j) {
    if (int_dot(wtype)) return specdec_int_dot_weight(panel, wtype == W_Q4_1_A8, k, j);
    const uint8_t *blk = panel + (size_t)(k / QK) * block_bytes_of(wtype);
    uint16_t bits;
    memcpy(&bits, blk + 2 * j, 2);
    const float d = f16_to_f32(bits);
    if (wtype == W_Q8_0) return (float)((const int8_t *)blk)[NR * 2 + (k % QK) * NR + j] * d;
    const int head = wtype == W_Q4_1 ? NR * 4 : NR * 2;
    const uint8_t byte = blk[head + (k % QK) * (NR / 2) + j % (NR / 2)];
    const int q = j < NR / 2 ? byte & 15 : byte >> 4;
    if (wtype == W_Q4_0) return d * (float)(q - 8);
    memcpy(&bits, blk + NR * 2 + 2 * j, 2);
    return d * (float)q + f16_to_f32(bits);
}

/* bfloat16 panels: in each row of 16 weights, columns 4-7 and 8-11 trade places (cpu_gemm.pack lays
 * them out so), because AVX2's unpack instructions widen 16 bfloat16 values lane by lane: positions
 * 0-3 and 8-11 into the low 8 floats, 4-7 and 12-15 into the high 8. Two instructions per 16 weights
 * instead of six: about 18 % faster decoding of a bfloat16 weight on one core. The portable code
 * reads the same layout through BF16_COLUMN. */


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#if defined(__AVX512F__)
const char *specdec_isa(void) { return "avx2, avx512 for float32 and block weights x 7+ rows"; }
#else
const char *specdec_isa(void) { return "avx2"; }
#endif

/* Weights come from memory in a decoding step (a model's are larger than the caches), so the kernels of
 * 1-6 rows prefetch each panel stream PREFETCH_AHEAD bytes on, into L2 (a core keeps more misses in
 * flight to L2 than to L1, and the hardware's prefetchers stop at every 4 KiB page). PREFETCH_ROW: row
 * k of a panel, per k; PREFETCH_BLOCK: a GGUF block's lines, per block. Default model, 2-core Intel VM,
 * a 5-token forward (a verify step): float32 36.1 -> 23.4 ms, native Q4_1 15.2 -> 12.6-13.0; one token:
 * float32 18.8 -> 18.6, Q4_1 unchanged (7.2-7.4). The one-row GGUF kernel over 4 panels (_wide) is left
 * without: there it cost 2-3 %. */
#define PREFETCH_AHEAD 4096
#define PREFETCH_ROW(w, k) _mm_prefetch((const char *)((w) + (size_t)(k) * NR) + PREFETCH_AHEAD, _MM_HINT_T1);
#define PREFETCH_BLOCK(blk, bytes)                                                                        \
    for (int line = 0; line < (bytes); line += 64) _mm_prefetch((const char *)(blk) + PREFETCH_AHEAD + line, _MM_HINT_T1);
#define LOAD_F32(w, k)                                                                                    \
    const __m256 w0 = _mm256_loadu_ps((w) + (size_t)(k) * NR), w1 = _mm256_loadu_ps((w) + (size_t)(k) * NR + 8);
/* Interleaving zeros below each bfloat16 widens it (see the bfloat16 panel layout above). */
#define LOAD_BF16(w, k)                                                                                   \
    const __m256i q = _mm256_loadu_si256((const __m256i *)((w) + (size_t)(k) * NR));                      \
    const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), q));              \
    const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), q));
#define LOAD_I8(w, k)                                                                                     \
    const __m128i q = _mm_loadu_si128((const __m128i *)((w) + (size_t)(k) * NR));                         \
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));                                        \
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));

/* One accumulator pair per row, as named variables (arrays would be spilled to the stack every k).
 * Output = acc * scale (when scale) + bias (when bias). */
#define ACCUMULATORS                                                                                      \
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;                         \
    __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
#define EPILOGUE(R)                                                                                       \
    const __m256 s0 = scale ? _mm256_loadu_ps(scale) : _mm256_set1_ps(1.0f);                              \
    const __m256 s1 = scale ? _mm256_loadu_ps(scale + 8) : _mm256_set1_ps(1.0f);                          \
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                                 \
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();                             \
    STORE(0, R) STORE(1, R) STORE(2, R) STORE(3, R) STORE(4, R) STORE(5, R)
#define KERNEL(NAME, WTYPE, LOAD, R)                                                                      \
    static void NAME##_##R(const float *restrict x, const void *restrict wv, float *restrict y,           \
                           const float *restrict scale, const float *restrict bias, int K, int ldy) {    \
        const WTYPE *restrict w = wv;                                                                     \
        ACCUMULATORS                                                                                      \
        for (int k = 0; k < K; k++) {                                                                     \
            PREFETCH_ROW(w, k)                                                                            \
            LOAD(w, k)                                                                                    \
            ROW(0, R) ROW(1, R) ROW(2, R) ROW(3, R) ROW(4, R) ROW(5, R)                                   \
        }                                                                                                 \
        EPILOGUE(R)                                                                                       \
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
/* One row times WIDE adjacent panels (pstride weights apart; y gets WIDE * NR outputs): for each
 * output the same arithmetic as NAME##_1 (one FMA chain over k, then scale and bias), but 8
 * independent chains instead of 2, so that a decoding step is not bound by the FMA latency. */
#define KERNEL_WIDE(NAME, WTYPE, LOAD)                                                                    \
    static void NAME##_wide(const float *restrict x, const void *restrict wv, size_t pstride, float *restrict y, \
                            const float *restrict scale, const float *restrict bias, int K) {            \
        const WTYPE *restrict w = wv;                                                                     \
        __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;   \
        for (int k = 0; k < K; k++) {                                                                     \
            const __m256 xk = _mm256_broadcast_ss(x + k);                                                 \
            PANEL(LOAD, 0) PANEL(LOAD, 1) PANEL(LOAD, 2) PANEL(LOAD, 3)                                   \
        }                                                                                                 \
        STORE_PANEL(0) STORE_PANEL(1) STORE_PANEL(2) STORE_PANEL(3)                                       \
    }
#define PANEL(LOAD, i)                                                                                    \
    {                                                                                                     \
        PREFETCH_ROW(w + (i) * pstride, k)                                                                \
        LOAD(w + (i) * pstride, k)                                                                        \
        l##i = _mm256_fmadd_ps(xk, w0, l##i);                                                             \
        h##i = _mm256_fmadd_ps(xk, w1, h##i);                                                             \
    }
#define STORE_PANEL(i)                                                                                    \
    {                                                                                                     \
        const float *s = scale ? scale + (i) * NR : NULL, *b = bias ? bias + (i) * NR : NULL;            \
        const __m256 b0 = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();                                  \
        const __m256 b1 = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();                              \
        _mm256_storeu_ps(y + (i) * NR, s ? _mm256_fmadd_ps(l##i, _mm256_loadu_ps(s), b0) : _mm256_add_ps(l##i, b0)); \
        _mm256_storeu_ps(y + (i) * NR + 8, s ? _mm256_fmadd_ps(h##i, _mm256_loadu_ps(s + 8), b1) : _mm256_add_ps(h##i, b1)); \
    }

/* GGUF blocks in registers. SETUP_x(blk, i) reads block blk's scales as d0_i, d1_i (columns 0-7,
 * 8-15) and minimums m0_i, m1_i; LOADQ_x(blk, kk, i) dequantises row kk of the block into w0, w1. */
#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define SETUP_Q4_0(blk, i) const __m256 d0_##i = F16X8(blk), d1_##i = F16X8((blk) + 16);
#define SETUP_Q8_0(blk, i) SETUP_Q4_0(blk, i)
#define SETUP_Q4_1(blk, i) SETUP_Q4_0(blk, i) const __m256 m0_##i = F16X8((blk) + 32), m1_##i = F16X8((blk) + 48);
#define NIBBLES(blk, head, kk)                                                                            \
    const __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((blk) + (head) + (kk) * 8)));   \
    const __m256i lo = _mm256_and_si256(n, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(n, 4);
#define LOADQ_Q4_0(blk, kk, i)                                                                            \
    NIBBLES(blk, 32, kk)                                                                                  \
    const __m256 w0 = _mm256_mul_ps(d0_##i, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, _mm256_set1_epi32(8)))); \
    const __m256 w1 = _mm256_mul_ps(d1_##i, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, _mm256_set1_epi32(8))));
#define LOADQ_Q4_1(blk, kk, i)                                                                            \
    NIBBLES(blk, 64, kk)                                                                                  \
    const __m256 w0 = _mm256_add_ps(_mm256_mul_ps(d0_##i, _mm256_cvtepi32_ps(lo)), m0_##i);                \
    const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(d1_##i, _mm256_cvtepi32_ps(hi)), m1_##i);
#define LOADQ_Q8_0(blk, kk, i)                                                                            \
    const __m128i q = _mm_loadu_si128((const __m128i *)((blk) + 32 + (kk) * NR));                         \
    const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d0_##i);                  \
    const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))), d1_##i);

/* As KERNEL, block by block: the same FMA chain over k per output. */
#define KERNEL_Q(NAME, FMT, R)                                                                            \
    static void NAME##_##R(const float *restrict x, const void *restrict wv, float *restrict y,           \
                           const float *restrict scale, const float *restrict bias, int K, int ldy) {    \
        const uint8_t *restrict blk = wv;                                                                 \
        ACCUMULATORS                                                                                      \
        for (int k0 = 0; k0 < K; k0 += QK, blk += FMT##_BLOCK) {                                         \
            PREFETCH_BLOCK(blk, FMT##_BLOCK)                                                              \
            SETUP_##FMT(blk, 0)                                                                           \
            for (int k = k0; k < k0 + QK; k++) {                                                          \
                LOADQ_##FMT(blk, k - k0, 0)                                                               \
                ROW(0, R) ROW(1, R) ROW(2, R) ROW(3, R) ROW(4, R) ROW(5, R)                               \
            }                                                                                             \
        }                                                                                                 \
        EPILOGUE(R)                                                                                       \
    }
/* As KERNEL_WIDE: one row times WIDE panels (pstride bytes apart). */
#define KERNEL_WIDE_Q(NAME, FMT)                                                                          \
    static void NAME##_wide(const float *restrict x, const void *restrict wv, size_t pstride, float *restrict y, \
                            const float *restrict scale, const float *restrict bias, int K) {            \
        const uint8_t *restrict blk0 = wv;                                                                \
        __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;   \
        for (int k0 = 0; k0 < K; k0 += QK, blk0 += FMT##_BLOCK) {                                        \
            const uint8_t *blk1 = blk0 + pstride, *blk2 = blk1 + pstride, *blk3 = blk2 + pstride;        \
            SETUP_##FMT(blk0, 0) SETUP_##FMT(blk1, 1) SETUP_##FMT(blk2, 2) SETUP_##FMT(blk3, 3)          \
            for (int k = k0; k < k0 + QK; k++) {                                                          \
                const __m256 xk = _mm256_broadcast_ss(x + k);                                             \
                PANEL_Q(FMT, 0) PANEL_Q(FMT, 1) PANEL_Q(FMT, 2) PANEL_Q(FMT, 3)                           \
            }                                                                                             \
        }                                                                                                 \
        STORE_PANEL(0) STORE_PANEL(1) STORE_PANEL(2) STORE_PANEL(3)                                       \
    }
#define PANEL_Q(FMT, i)                                                                                   \
    {                                                                                                     \
        LOADQ_##FMT(blk##i, k - k0, i)                                                                    \
        l##i = _mm256_fmadd_ps(xk, w0, l##i);                                                             \
        h##i = _mm256_fmadd_ps(xk, w1, h##i);                                                             \
    }
#define KERNELS_FOR_Q(NAME, FMT)                                                                          \
    KERNEL_Q(NAME, FMT, 1) KERNEL_Q(NAME, FMT, 2) KERNEL_Q(NAME, FMT, 3)                                  \
    KERNEL_Q(NAME, FMT, 4) KERNEL_Q(NAME, FMT, 5) KERNEL_Q(NAME, FMT, 6)                                  \
    KERNEL_WIDE_Q(NAME, FMT)                                                                              \
    static const kernel_fn NAME##_table[MR + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};

#if defined(__AVX512F__)
/* Block-quantised weights times 7+ rows (a verify block, a tree, a batch, a prefill) with AVX-512: a row
 * of a block's 16 columns dequantises into one 512-bit vector, which then feeds up to MRQ = 16 rows'
 * FMAs, so the dequantisation is paid once per 16 rows, and no panel is widened into float32 first
 * (widening wrote and read back 4 bytes per weight). Default model (Q4_1), 2-core Intel VM, forwards of
 * 6 / 7 / 17 / 128 tokens at a context of 170 (costs.measure_forward_times): widened 14.1 / 24.9 /
 * 39.2 / 234 ms, in chunks of up to 16 rows 13.5 / 13.5 / 29.2 / 199 ms. Per output the arithmetic is
 * NAME##_R's and the float32 kernel's on the dequantised weight: the same weight (scale times value,
 * then plus minimum, unfused), one FMA per k in order, then the same epilogue; only the vector width
 * differs. */
#define MRQ 16
#define F16X16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define SETUP16_Q4_0(blk) const __m512 d = F16X16(blk);
#define SETUP16_Q8_0(blk) SETUP16_Q4_0(blk)
#define SETUP16_Q4_1(blk) SETUP16_Q4_0(blk) const __m512 m = F16X16((blk) + 32);
#define NIBBLES16(blk, head, kk)                                                                          \
    const __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((blk) + (head) + (kk) * 8)));   \
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(n, _mm256_set1_epi32(15))), \
                                         _mm256_srli_epi32(n, 4), 1);
#define LOAD16_Q4_0(blk, kk)                                                                              \
    NIBBLES16(blk, 32, kk)                                                                                \
    const __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))));
#define LOAD16_Q4_1(blk, kk)                                                                              \
    NIBBLES16(blk, 64, kk)                                                                                \
    const __m512 w = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), m);
#define LOAD16_Q8_0(blk, kk)                                                                              \
    const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((blk) + 32 + (kk) * NR)))), d);
#define ROW16(i, R)                                                                                       \
    if (i < R) a##i = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)i * K + k]), w, a##i);
#define STORE16(i, R)                                                                                     \
    if (i < R) _mm512_storeu_ps(y + (size_t)i * ldy, scale ? _mm512_fmadd_ps(a##i, s, b) : _mm512_add_ps(a##i, b));
#define ROWS16(OP, R)                                                                                     \
    OP(0, R) OP(1, R) OP(2, R) OP(3, R) OP(4, R) OP(5, R) OP(6, R) OP(7, R)                               \
    OP(8, R) OP(9, R) OP(10, R) OP(11, R) OP(12, R) OP(13, R) OP(14, R) OP(15, R)
/* One 16-row kernel: accumulators a0..a15, a walk over k that loads each weight row of the panel into w
 * and runs ROWS16(ROW16, R), then the epilogue. The walks differ by weight type only. */
#define KERNEL16(NAME, WALK, FMT, R)                                                                      \
    static void NAME##_16_##R(const float *restrict x, const void *restrict wv, float *restrict y,        \
                              const float *restrict scale, const float *restrict bias, int K, int ldy) { \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;   \
        __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;              \
        WALK(FMT, R)                                                                                      \
        const __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);                           \
        const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                              \
        ROWS16(STORE16, R)                                                                                \
    }
#define WALK16_Q(FMT, R)                                                                                  \
    const uint8_t *restrict blk = wv;                                                                     \
    for (int k0 = 0; k0 < K; k0 += QK, blk += FMT##_BLOCK) {                                              \
        PREFETCH_BLOCK(blk, FMT##_BLOCK)                                                                  \
        SETUP16_##FMT(blk)                                                                                \
        for (int k = k0; k < k0 + QK; k++) {                                                              \
            LOAD16_##FMT(blk, k - k0)                                                                     \
            ROWS16(ROW16, R)                                                                              \
        }                                                                                                 \
    }
/* float32 weights times 7+ rows with AVX-512 the same way: a row of a panel's 16 columns is one 512-bit
 * load feeding up to MRQ = 16 rows, so a verify block of 7-16 tokens reads the weights once where the
 * 6-row kernels read them two or three times. Default model in float32, 2-core AMD EPYC (AVX-512), a
 * forward of 9 tokens at a context of 256 (costs.measure_forward_times): 28.1-28.6 ms in chunks of 5 + 4
 * rows, 21.6-24.5 ms in one, against about 18 ms for one token. Per output the arithmetic is f32_R's
 * (one FMA per k in order, then the same epilogue); only the vector width differs. FMT is unused. */
#define WALK16_F32(FMT, R)                                                                                \
    const float *restrict wp = wv;                                                                        \
    for (int k = 0; k < K; k++) {                                                                         \
        PREFETCH_ROW(wp, k)                                                                               \
        const __m512 w = _mm512_loadu_ps(wp + (size_t)k * NR);                                            \
        ROWS16(ROW16, R)                                                                                  \
    }
#define KERNELS16(NAME, WALK, FMT)                                                                        \
    KERNEL16(NAME, WALK, FMT, 1) KERNEL16(NAME, WALK, FMT, 2) KERNEL16(NAME, WALK, FMT, 3)                \
    KERNEL16(NAME, WALK, FMT, 4) KERNEL16(NAME, WALK, FMT, 5) KERNEL16(NAME, WALK, FMT, 6)                \
    KERNEL16(NAME, WALK, FMT, 7) KERNEL16(NAME, WALK, FMT, 8) KERNEL16(NAME, WALK, FMT, 9)                \
    KERNEL16(NAME, WALK, FMT, 10) KERNEL16(NAME, WALK, FMT, 11) KERNEL16(NAME, WALK, FMT, 12)             \
    KERNEL16(NAME, WALK, FMT, 13) KERNEL16(NAME, WALK, FMT, 14) KERNEL16(NAME, WALK, FMT, 15)             \
    KERNEL16(NAME, WALK, FMT, 16)                                                                         \
    static const kernel_fn NAME##_16_table[MRQ + 1] = {0, NAME##_16_1, NAME##_16_2, NAME##_16_3, NAME##_16_4, \
        NAME##_16_5, NAME##_16_6, NAME##_16_7, NAME##_16_8, NAME##_16_9, NAME##_16_10, NAME##_16_11,      \
        NAME##_16_12, NAME##_16_13, NAME##_16_14, NAME##_16_15, NAME##_16_16};
#endif

/* Panel p0's QK-row blocks of a block-quantised weight, dequantised into buf [K, NR]. */
static void widen_blocks(const uint8_t *panel, int wtype, int K, float *buf) {
    for (int k0 = 0; k0 < K; k0 += QK) {
        const uint8_t *blk = panel + (size_t)(k0 / QK) * block_bytes_of(wtype);
#define WIDEN(FMT)                                                                                        \
        {                                                                                                 \
            SETUP_##FMT(blk, 0)                                                                           \
            for (int kk = 0; kk < QK; kk++) {                                                             \
                LOADQ_##FMT(blk, kk, 0)                                                                   \
                _mm256_storeu_ps(buf + (size_t)(k0 + kk) * NR, w0), _mm256_storeu_ps(buf + (size_t)(k0 + kk) * NR + 8, w1); \
            }                                                                                             \
        }
        if (wtype == W_Q4_0) WIDEN(Q4_0) else if (wtype == W_Q4_1) WIDEN(Q4_1) else WIDEN(Q8_0)
#undef WIDEN
    }
}
#else
const char *specdec_isa(void) { return "portable"; }

static const int BF16_COLUMN[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15}; /* where column j is stored */

#define WEIGHT_float(w, k, j) (w)[(size_t)(k) * NR + (j)]
#define WEIGHT_uint16_t(w, k, j) bf16_to_f32((w)[(size_t)(k) * NR + BF16_COLUMN[j]])
#define WEIGHT_int8_t(w, k, j) ((float)(w)[(size_t)(k) * NR + (j)])
typedef uint8_t q4_0_block, q4_1_block, q8_0_block; /* a panel of GGUF blocks, read through block_weight */
#define WEIGHT_q4_0_block(w, k, j) block_weight(w, W_Q4_0, k, j)
#define WEIGHT_q4_1_block(w, k, j) block_weight(w, W_Q4_1, k, j)
#define WEIGHT_q8_0_block(w, k, j) block_weight(w, W_Q8_0, k, j)
#define KERNEL(NAME, WTYPE, LOAD, R)                                                                      \
    static void NAME##_##R(const float *restrict x, const void *restrict wv, float *restrict y,           \
                           const float *restrict scale, const float *restrict bias, int K, int ldy) {    \
        const WTYPE *restrict w = wv;                                                                     \
        float acc[R][NR] = {{0}};                                                                         \
        for (int k = 0; k < K; k++)                                                                       \
            for (int i = 0; i < R; i++)                                                                   \
                for (int j = 0; j < NR; j++) acc[i][j] += x[(size_t)i * K + k] * WEIGHT_##WTYPE(w, k, j); \
        for (int i = 0; i < R; i++)                                                                       \
            for (int j = 0; j < NR; j++)                                                                  \
                y[(size_t)i * ldy + j] = scale ? acc[i][j] * scale[j] + (bias ? bias[j] : 0.0f) : acc[i][j] + (bias ? bias[j] : 0.0f); \
    }
#define KERNEL_WIDE(NAME, WTYPE, LOAD)                                                                    \
    static void NAME##_wide(const float *restrict x, const void *restrict wv, size_t pstride, float *restrict y, \
                            const float *restrict scale, const float *restrict bias, int K) {            \
        for (int i = 0; i < WIDE; i++)                                                                    \
            NAME##_1(x, (const WTYPE *)wv + i * pstride, y + i * NR, scale ? scale + i * NR : NULL, bias ? bias + i * NR : NULL, K, NR); \
    }
#define LOAD_F32(w, k)
#define LOAD_BF16(w, k)
#define LOAD_I8(w, k)
#define KERNELS_FOR_Q(NAME, FMT) KERNELS_FOR(NAME, NAME##_block, )

static void widen_blocks(const uint8_t *panel, int wtype, int K, float *buf) {
    for (int k = 0; k < K; k++)
        for (int j = 0; j < NR; j++) buf[(size_t)k * NR + j] = block_weight(panel, wtype, k, j);
}
#endif

#define KERNELS_FOR(NAME, WTYPE, LOAD)                                                                    \
    KERNEL(NAME, WTYPE, LOAD, 1)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 2)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 3)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 4)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 5)                                                                          \
    KERNEL(NAME, WTYPE, LOAD, 6)                                                                          \
    KERNEL_WIDE(NAME, WTYPE, LOAD)                                                                        \
    static const kernel_fn NAME##_table[MR + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};

typedef void (*kernel_fn)(const float *, const void *, float *, const float *, const float *, int, int);
typedef void (*wide_fn)(const float *, const void *, size_t, float *, const float *, const float *, int);
KERNELS_FOR(f32, float, LOAD_F32)
KERNELS_FOR(bf16, uint16_t, LOAD_BF16)
KERNELS_FOR(i8, int8_t, LOAD_I8)
KERNELS_FOR_Q(q4_0, Q4_0)
KERNELS_FOR_Q(q4_1, Q4_1)
KERNELS_FOR_Q(q8_0, Q8_0)

static const kernel_fn *const tables[WEIGHT_TYPES] = {f32_table, bf16_table, i8_table, q4_0_table, q4_1_table, q8_0_table};
#if defined(__AVX512F__)
KERNELS16(q4_0, WALK16_Q, Q4_0)
KERNELS16(q4_1, WALK16_Q, Q4_1)
KERNELS16(q8_0, WALK16_Q, Q8_0)
KERNELS16(f32, WALK16_F32, F32)
/* 7+ rows of a float32 or block-quantised weight: chunks of up to MRQ rows, without widening (see MRQ) */
static const kernel_fn *const tables16[WEIGHT_TYPES] = {f32_16_table, 0, 0, q4_0_16_table, q4_1_16_table, q8_0_16_table};
#else
#define MRQ MR
static const kernel_fn *const tables16[WEIGHT_TYPES] = {0};
#endif
static const wide_fn wides[WEIGHT_TYPES] = {f32_wide, bf16_wide, i8_wide, q4_0_wide, q4_1_wide, q8_0_wide};

/* Panels [p0, p1) of type wtype (bfloat16, int8 or a GGUF block type), widened to float32 into buf, in natural column
 * order (exact: the float32 kernels then compute the same products and sums). */
static void widen_panels(const void *packed, int wtype, int p0, int p1, int K, float *buf) {
    if (block_quantised(wtype)) {
        for (int p = p0; p < p1; p++)
            widen_blocks((const uint8_t *)packed + (size_t)p * panel_bytes_of(wtype, K), wtype, K, buf + (size_t)(p - p0) * K * NR);
        return;
    }
    const size_t rows = (size_t)(p1 - p0) * K, start = (size_t)p0 * K * NR; /* rows of NR weights */
#if defined(__AVX2__) && defined(__FMA__)
    if (wtype == W_BF16) {
        const uint16_t *w = (const uint16_t *)packed + start;
        for (size_t k = 0; k < rows; k++) {
            LOAD_BF16(w, k)
            _mm256_storeu_ps(buf + k * NR, w0), _mm256_storeu_ps(buf + k * NR + 8, w1);
        }
    } else {
        const int8_t *w = (const int8_t *)packed + start;
        for (size_t k = 0; k < rows; k++) {
            LOAD_I8(w, k)
            _mm256_storeu_ps(buf + k * NR, w0), _mm256_storeu_ps(buf + k * NR + 8, w1);
        }
    }
#else
    for (size_t k = 0; k < rows; k++)
        for (int j = 0; j < NR; j++)
            buf[k * NR + j] = wtype == W_BF16 ? WEIGHT_uint16_t((const uint16_t *)packed + start, k, j)
                                              : WEIGHT_int8_t((const int8_t *)packed + start, k, j);
#endif
}

/* How many panels one task covers. Decoding (one chunk of rows): whole groups of WIDE panels, about
 * 16 tasks per thread so that threads share out evenly whatever they are given of the CPU; larger
 * products: blocks of panels that fit in L2. */
static int panels_per_task(int panels, size_t panel_bytes, int M, int threads) {
    if (M > MR) {
        const int block = (int)(L2_BLOCK_BYTES / panel_bytes);
        return block < 1 ? 1 : block;
    }
    const int share = (panels + 16 * threads - 1) / (16 * threads);
    return (share + WIDE - 1) / WIDE * WIDE;
}

typedef struct {
    const float *x;
    const void *packed;
    const float *scale, *bias;
    void *y;
    int wtype, widen, rows16, y_bf16, M, K, N, panels, per_task;
} gemm_job;

/* Task t: all rows times panels [t * per_task, (t + 1) * per_task). */
static void gemm_task(void *arg, int task) {
    const gemm_job *g = arg;
    const int K = g->K, N = g->N, p0 = task * g->per_task;
    const int p1 = p0 + g->per_task < g->panels ? p0 + g->per_task : g->panels;
    const size_t panel_bytes = panel_bytes_of(g->wtype, K);
    /* the wide kernels step panels in elements of their weight type (bytes for the block types) */
    const size_t pstride = g->widen ? (size_t)K * NR : block_quantised(g->wtype) ? panel_bytes : (size_t)K * NR;
    const kernel_fn *table = g->rows16 ? tables16[g->wtype] : tables[g->widen ? W_F32 : g->wtype];
    const int most = g->rows16 ? MRQ : MR, chunk = (g->M + (g->M + most - 1) / most - 1) / ((g->M + most - 1) / most);
    /* rows per kernel call: as even as the chunks allow (17 rows: 9 + 8, not 16 + 1, which would pay a
     * second pass over the weights for one row) */
    const wide_fn wide_kernel = wides[g->widen ? W_F32 : g->wtype];
    float *wide = NULL;
    if (g->widen) {
        wide = specdec_scratch((size_t)(p1 - p0) * K * NR);
        widen_panels(g->packed, g->wtype, p0, p1, K, wide);
    }
    float tile[(MRQ > WIDE ? MRQ : WIDE) * NR];
    for (int m0 = 0; m0 < g->M; m0 += chunk) {
        const int mr = g->M - m0 < chunk ? g->M - m0 : chunk;
        for (int p = p0; p < p1;) {
            const int np = mr == 1 && p + WIDE <= p1 ? WIDE : 1; /* panels in this call */
            const void *w = wide ? (const void *)(wide + (size_t)(p - p0) * K * NR)
                                 : (const void *)((const char *)g->packed + (size_t)p * panel_bytes);
            const float *s = g->scale ? g->scale + (size_t)p * NR : NULL;
            const float *b = g->bias ? g->bias + (size_t)p * NR : NULL;
            float *out = g->y_bf16 ? tile : (float *)g->y + (size_t)m0 * N + (size_t)p * NR;
            const int ldo = g->y_bf16 ? np * NR : N;
            if (np == WIDE)
                wide_kernel(g->x + (size_t)m0 * K, w, pstride, out, s, b, K);
            else
                table[mr](g->x + (size_t)m0 * K, w, out, s, b, K, ldo);
            if (g->y_bf16) {
                uint16_t *y = (uint16_t *)g->y + (size_t)m0 * N + (size_t)p * NR;
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < ldo; j++) y[(size_t)i * N + j] = f32_to_bf16(tile[i * ldo + j]);
            }
            p += np;
        }
    }
}

/* x: [M, K] float32 or bfloat16 (x_bf16); packed: [N/NR, K, NR] of wtype (block types: N/NR panels of
 * K/QK blocks; K a multiple of QK); scale (int8 only), bias: [N]
 * float32 or NULL; y: [M, N] float32 or bfloat16 (y_bf16). N is a multiple of NR. Up to `threads`
 * threads. */
void skinny_gemm(const void *x_in, int x_bf16, const void *packed, int wtype, const float *scale, const float *bias,
                 void *y_out, int y_bf16, int M, int K, int N, int threads) {
    if (M == 0 || N == 0) return;
    float *x_wide = NULL;
    if (x_bf16) {
        x_wide = malloc((size_t)M * K * sizeof(float));
        if (!x_wide) abort();
        for (size_t i = 0; i < (size_t)M * K; i++) x_wide[i] = bf16_to_f32(((const uint16_t *)x_in)[i]);
    }
    if (int_dot(wtype)) {
        specdec_int_dot(x_wide ? x_wide : x_in, packed, wtype == W_Q4_1_A8, bias, y_out, y_bf16, M, K, N, threads);
        free(x_wide);
        return;
    }
    const int panels = N / NR, rows16 = M > MR && tables16[wtype] != NULL, widen = wtype != W_F32 && M > MR && !rows16;
    const size_t panel_bytes = widen ? (size_t)K * NR * sizeof(float) : panel_bytes_of(wtype, K); /* as the kernels read them */
    gemm_job g = {x_wide ? x_wide : x_in, packed, scale, bias, y_out, wtype, widen, rows16, y_bf16, M, K, N, panels,
                  panels_per_task(panels, panel_bytes, M, threads)};
    specdec_parallel((panels + g.per_task - 1) / g.per_task, threads, gemm_task, &g);
    free(x_wide);
}

/* out[i, :] = row rows[i] (an output column) of a block-quantised packed weight [N, K], dequantised to
 * float32 exactly as gguf's reference does it: a quantised embedding's lookups, and the dequantised
 * copy a user asks for. */
void specdec_dequantize_rows(const void *packed, int wtype, const int64_t *rows, int n, int K, float *out) {
    const size_t panel_bytes = panel_bytes_of(wtype, K);
    for (int i = 0; i < n; i++) {
        const uint8_t *panel = (const uint8_t *)packed + (size_t)(rows[i] / NR) * panel_bytes;
        for (int k = 0; k < K; k++) out[(size_t)i * K + k] = block_weight(panel, wtype, k, (int)(rows[i] % NR));
    }
}
