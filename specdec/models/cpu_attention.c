/* Attention of new queries over a KV cache on the CPU, one fixed-order computation per query.
 *
 * For each (row b, head h, query t), alone: the keys it sees (mask) are taken in slot order, and
 *     scores[j] = (q . k_j) * scale,  p_j = exp(scores[j] - max),  out = (sum_j p_j v_j) / (sum_j p_j)
 * with every sum sequential over j (and over d in one fixed pattern). Nothing depends on how many
 * queries or rows are computed together, nor on where the seen keys sit in the cache: masked slots are
 * skipped, not weighted by zero, so a tree node and the same token decoded plainly (other slots, same
 * keys) get the same bits. PyTorch's scaled_dot_product_attention gives no such guarantee: its CPU
 * kernels block queries and keys by shape (measured: a query alone and inside an 8-query block differ).
 *
 * q, k, v: float32 or bfloat16 (all the same), read through strides (the last dimension contiguous);
 * arithmetic in float32; out [B, T, H, Dh] contiguous, float32 or bfloat16 (rounded to nearest even).
 * GQA: query head h reads key/value head h / (H / Hkv). A query that sees no key gets zeros.
 *
 * Queries are shared out to threads (cpu_threads.c) whole. Built with skinny_gemm.c into one library
 * by specdec/models/cpu_gemm.py (same flags).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define PARALLEL_WORK (1 << 16) /* multiply-adds below which one thread is faster than waking others */

/* cpu_threads.c */
void specdec_parallel(int tasks, int threads, void (*fn)(void *ctx, int task), void *ctx);
float *specdec_scratch(size_t n);

static inline float load_one(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_one(void *p, size_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8(const void *p, size_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The 8 lanes of acc summed in one fixed order: (l0+l4 + l2+l6) + (l1+l5 + l3+l7). */
static inline float sum_lanes(__m256 acc) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* p[j] = (q . k[slot[j]]) * scale for j < n. Each dot: one accumulator over d in steps of 8, then
 * sum_lanes, then the d % 8 tail; four keys at a time only to overlap their latencies (every key
 * gets the same operations in the same order, grouped or not). */
static void score(const float *q, const void *k, ptrdiff_t k_ss, const int *slot, int n, int Dh, int bf16, float scale, float *p) {
    const size_t row = (size_t)k_ss * (bf16 ? 2 : 4);
    const int d8 = Dh / 8 * 8;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const char *k0 = (const char *)k + slot[j] * row, *k1 = (const char *)k + slot[j + 1] * row;
        const char *k2 = (const char *)k + slot[j + 2] * row, *k3 = (const char *)k + slot[j + 3] * row;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d = 0; d < d8; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, load8(k0, d, bf16), a0);
            a1 = _mm256_fmadd_ps(qd, load8(k1, d, bf16), a1);
            a2 = _mm256_fmadd_ps(qd, load8(k2, d, bf16), a2);
            a3 = _mm256_fmadd_ps(qd, load8(k3, d, bf16), a3);
        }
        float s0 = sum_lanes(a0), s1 = sum_lanes(a1), s2 = sum_lanes(a2), s3 = sum_lanes(a3);
        for (int d = d8; d < Dh; d++) {
            s0 += q[d] * load_one(k0, d, bf16);
            s1 += q[d] * load_one(k1, d, bf16);
            s2 += q[d] * load_one(k2, d, bf16);
            s3 += q[d] * load_one(k3, d, bf16);
        }
        p[j] = s0 * scale, p[j + 1] = s1 * scale, p[j + 2] = s2 * scale, p[j + 3] = s3 * scale;
    }
    for (; j < n; j++) {
        const char *k0 = (const char *)k + slot[j] * row;
        __m256 a0 = _mm256_setzero_ps();
        for (int d = 0; d < d8; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k0, d, bf16), a0);
        float s0 = sum_lanes(a0);
        for (int d = d8; d < Dh; d++) s0 += q[d] * load_one(k0, d, bf16);
        p[j] = s0 * scale;
    }
}

/* exp for x <= 0 (Cephes' polynomial, as in avx_mathfun): a few ulp from expf; results below 2^-126
 * (x below about -87.3) come out as 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* p[j] = exp(p[j] - max) for j < n, in place; the tail goes through the same 8-lane exp. */
static void exponentiate(float *p, int n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), m)));
    if (j < n) {
        float tail[8] = {0};
        memcpy(tail, p + j, (size_t)(n - j) * sizeof(float));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), m)));
        memcpy(p + j, tail, (size_t)(n - j) * sizeof(float));
    }
}

/* o[d] = sum_j p[j] v[slot[j]][d], sequential over j for every d: 64 columns at a time in registers,
 * then 8 at a time, then one at a time (which columns go which way depends only on Dh). */
static void accumulate(const float *p, const void *v, ptrdiff_t v_ss, const int *slot, int n, int Dh, int bf16, float *o) {
    const size_t row = (size_t)v_ss * (bf16 ? 2 : 4);
    int d = 0;
    for (; d + 64 <= Dh; d += 64) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
        for (int j = 0; j < n; j++) {
            const char *vj = (const char *)v + slot[j] * row;
            const __m256 pj = _mm256_set1_ps(p[j]);
            o0 = _mm256_fmadd_ps(pj, load8(vj, d, bf16), o0);
            o1 = _mm256_fmadd_ps(pj, load8(vj, d + 8, bf16), o1);
            o2 = _mm256_fmadd_ps(pj, load8(vj, d + 16, bf16), o2);
            o3 = _mm256_fmadd_ps(pj, load8(vj, d + 24, bf16), o3);
            o4 = _mm256_fmadd_ps(pj, load8(vj, d + 32, bf16), o4);
            o5 = _mm256_fmadd_ps(pj, load8(vj, d + 40, bf16), o5);
            o6 = _mm256_fmadd_ps(pj, load8(vj, d + 48, bf16), o6);
            o7 = _mm256_fmadd_ps(pj, load8(vj, d + 56, bf16), o7);
        }
        _mm256_storeu_ps(o + d, o0), _mm256_storeu_ps(o + d + 8, o1), _mm256_storeu_ps(o + d + 16, o2);
        _mm256_storeu_ps(o + d + 24, o3), _mm256_storeu_ps(o + d + 32, o4), _mm256_storeu_ps(o + d + 40, o5);
        _mm256_storeu_ps(o + d + 48, o6), _mm256_storeu_ps(o + d + 56, o7);
    }
    for (; d + 8 <= Dh; d += 8) {
        __m256 o0 = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8((const char *)v + slot[j] * row, d, bf16), o0);
        _mm256_storeu_ps(o + d, o0);
    }
    for (; d < Dh; d++) {
        o[d] = 0.0f;
        for (int j = 0; j < n; j++) o[d] += p[j] * load_one((const char *)v + slot[j] * row, d, bf16);
    }
}
#else
static void score(const float *q, const void *k, ptrdiff_t k_ss, const int *slot, int n, int Dh, int bf16, float scale, float *p) {
    const size_t row = (size_t)k_ss * (bf16 ? 2 : 4);
    for (int j = 0; j < n; j++) {
        float sum = 0.0f;
        for (int d = 0; d < Dh; d++) sum += q[d] * load_one((const char *)k + slot[j] * row, d, bf16);
        p[j] = sum * scale;
    }
}

static void exponentiate(float *p, int n, float max) {
    for (int j = 0; j < n; j++) p[j] = expf(p[j] - max);
}

static void accumulate(const float *p, const void *v, ptrdiff_t v_ss, const int *slot, int n, int Dh, int bf16, float *o) {
    const size_t row = (size_t)v_ss * (bf16 ? 2 : 4);
    for (int d = 0; d < Dh; d++) {
        o[d] = 0.0f;
        for (int j = 0; j < n; j++) o[d] += p[j] * load_one((const char *)v + slot[j] * row, d, bf16);
    }
}
#endif

/* p[j] = exp(p[j]) for j < n, for p[j] <= 0, in place: the softmax's exp, for cpu_layer.c's SiLU. */
void specdec_exp(float *p, int n) { exponentiate(p, n, 0.0f); }

/* One query q [Dh] (float32) over the keys at slots slot[0 .. n-1], in that order (n >= 1):
 * o[:Dh] = softmax of (q . k) * scale, times v, in float32. Scratch p [n]. Shared with cpu_layer.c,
 * so that the whole-layer path attends with the same bits as `attend`. */
void specdec_attend_slots(const float *q, const void *k, const void *v, ptrdiff_t k_ss, ptrdiff_t v_ss, const int *slot,
                          int n, int Dh, int bf16, float scale, float *p, float *o) {
    score(q, k, k_ss, slot, n, Dh, bf16, scale, p);
    float max = p[0], sum = 0.0f;
    for (int j = 1; j < n; j++) max = p[j] > max ? p[j] : max;
    exponentiate(p, n, max);
    for (int j = 0; j < n; j++) sum += p[j];
    accumulate(p, v, v_ss, slot, n, Dh, bf16, o);
    for (int d = 0; d < Dh; d++) o[d] /= sum;
}

/* One query: out[:Dh] = softmax over the seen keys of (q . k) * scale, times v. Scratch: p, slot [S]; o, qf [Dh]. */
static void attend_one(const void *q, const void *k, const void *v, const uint8_t *seen, void *out, int bf16, int S,
                       int Dh, float scale, ptrdiff_t k_ss, ptrdiff_t v_ss, float *p, int *slot, float *o, float *qf) {
    int n = 0;
    for (int s = 0; s < S; s++)
        if (seen[s]) slot[n++] = s;
    if (n == 0) {
        for (int d = 0; d < Dh; d++) store_one(out, d, 0.0f, bf16);
        return;
    }
    for (int d = 0; d < Dh; d++) qf[d] = load_one(q, d, bf16);
    specdec_attend_slots(qf, k, v, k_ss, v_ss, slot, n, Dh, bf16, scale, p, o);
    for (int d = 0; d < Dh; d++) store_one(out, d, o[d], bf16);
}

typedef struct {
    const void *q, *k, *v;
    const uint8_t *mask;
    void *out;
    int bf16, B, H, Hkv, T, S, Dh, per_task;
    float scale;
    ptrdiff_t q_sb, q_sh, q_st, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, m_sb, m_st;
} attention_job;

/* Task i: queries (b, h, t) number i * per_task .. (i + 1) * per_task - 1, t fastest. */
static void attention_task(void *arg, int task) {
    const attention_job *a = arg;
    const size_t elem = a->bf16 ? 2 : 4;
    const int units = a->B * a->H * a->T, first = task * a->per_task;
    const int last = first + a->per_task < units ? first + a->per_task : units;
    float *p = specdec_scratch(2 * (size_t)a->S + 2 * (size_t)a->Dh), *o = p + a->S, *qf = o + a->Dh;
    int *slot = (int *)(qf + a->Dh); /* sizeof(int) == sizeof(float) */
    for (int unit = first; unit < last; unit++) {
        const int t = unit % a->T, h = unit / a->T % a->H, b = unit / a->T / a->H, kh = h / (a->H / a->Hkv);
        attend_one((const char *)a->q + (size_t)(b * a->q_sb + h * a->q_sh + t * a->q_st) * elem,
                   (const char *)a->k + (size_t)(b * a->k_sb + kh * a->k_sh) * elem,
                   (const char *)a->v + (size_t)(b * a->v_sb + kh * a->v_sh) * elem, a->mask + b * a->m_sb + t * a->m_st,
                   (char *)a->out + ((((size_t)b * a->T + t) * a->H + h) * a->Dh) * elem, a->bf16, a->S, a->Dh, a->scale,
                   a->k_ss, a->v_ss, p, slot, o, qf);
    }
}

/* q [B, H, T, Dh], k and v [B, Hkv, S, Dh] (strides in elements for b, h and t or s), mask [B, T, S]
 * (strides for b and t; True = sees), out [B, T, H, Dh] contiguous. Up to `threads` threads. */
void attend(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int bf16, int B, int H,
            int Hkv, int T, int S, int Dh, float scale, ptrdiff_t q_sb, ptrdiff_t q_sh, ptrdiff_t q_st, ptrdiff_t k_sb,
            ptrdiff_t k_sh, ptrdiff_t k_ss, ptrdiff_t v_sb, ptrdiff_t v_sh, ptrdiff_t v_ss, ptrdiff_t m_sb,
            ptrdiff_t m_st, int threads) {
    const int units = B * H * T;
    if (units == 0) return;
    threads = (long)units * S * Dh > PARALLEL_WORK ? threads : 1;
    const int per_task = units / (8 * threads) > 1 ? units / (8 * threads) : 1;
    attention_job a = {q, k, v, mask, out, bf16, B, H, Hkv, T, S, Dh, per_task, scale,
                       q_sb, q_sh, q_st, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, m_sb, m_st};
    specdec_parallel((units + per_task - 1) / per_task, threads, attention_task, &a);
}
