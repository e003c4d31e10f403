/* A stack of decoder layers over a KV cache on the CPU, in one call from Python.
 *
 * Per layer, for the M = B * T new tokens:
 *     h = rms_norm(x)                    (input_layernorm; absent in EAGLE's layer 0)
 *     q, k, v = h @ Wqkv (+ bias)        (skinny_gemm: one fixed-order sum per output)
 *     q, k = rms_norm per head           (Qwen3's q_norm / k_norm, where present)
 *     q, k = RoPE(q, k); k, v -> cache   (at slots lengths[b] + t)
 *     a = attention(q, cache)            (specdec_attend_slots: each query over the slots it sees)
 *     x = x + a @ Wo (+ bias)
 *     h = rms_norm(x)                    (post_attention_layernorm)
 *     x = x + (silu(g) * u) @ Wdown, with g, u = h @ Wgate_up (+ biases)
 * The maths of the PyTorch path of specdec/models/llama.py with the C kernels (packed Linear layers,
 * cpu_attention: the same products and attention, bit for bit), without its ~40 small PyTorch
 * operations per layer (each ~10-50 us on a 2-core CPU, more than the arithmetic they do). The
 * elementwise stages agree with PyTorch's within a few roundings, not bitwise: other summation order
 * in RMSNorm, libm's cosf / sinf and a vectorised exp in SiLU.
 *
 * Exactness: every stage works on one token row, one head or one query at a time, and every sum runs
 * in one fixed order that depends only on the model's dimensions: RMSNorm's sum of squares in 8
 * fixed lanes, combined in a fixed tree; the products in skinny_gemm's order; attention in
 * cpu_attention's. So a token's outputs (hidden state, K, V) are bitwise the same whatever T, B, the
 * tree around it or the threads, as with the C kernels one by one.
 *
 * Arithmetic in float32 throughout. With bfloat16 activations (bf16 = 1), values are rounded to
 * bfloat16 (nearest even) exactly where the PyTorch path holds a bfloat16 tensor:
 *     rms_norm:   round(w * round(x * r))                  (fused.rms_norm)
 *     products:   round(acc + bias)                        (Linear)
 *     RoPE:       round(x * cos + rot(x) * sin)            (one rounding, float32 cos and sin: PyTorch
 *                                                           rounds cos and sin, and each * and +, to
 *                                                           bfloat16; here only the result)
 *     attention:  round(out)                               (cpu_attention)
 *     residuals:  round(x + round(y))
 *     SiLU * mul: round(round(silu(g)) * u)                (fused.silu_mul)
 * In float32 every rounding is the identity. Keys and values go to the cache in its dtype (the values
 * rounded above, so exactly).
 *
 * The products and attention run on up to `threads` threads (cpu_threads.c), the elementwise stages
 * on the calling thread (a few microseconds a row). Built into one library with the other kernels by
 * specdec/models/cpu_gemm.py.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define PARALLEL_WORK (1 << 16) /* attention multiply-adds below which one thread is faster, as cpu_attention.c */

/* skinny_gemm.c, cpu_attention.c, cpu_threads.c */
void skinny_gemm(const void *x, int x_bf16, const void *packed, int wtype, const float *scale, const float *bias, void *y,
                 int y_bf16, int M, int K, int N, int threads);
void specdec_attend_slots(const float *q, const void *k, const void *v, ptrdiff_t k_ss, ptrdiff_t v_ss, const int *slot,
                          int n, int Dh, int bf16, float scale, float *p, float *o);
void specdec_exp(float *p, int n);
void specdec_parallel(int tasks, int threads, void (*fn)(void *ctx, int task), void *ctx);
float *specdec_scratch(size_t n);

typedef struct {
    const void *packed;        /* [N / 16, K, 16] panels (cpu_gemm.pack / pack_int8) */
    const float *scale, *bias; /* [N] or NULL */
    int wtype, N;              /* skinny_gemm's weight type; padded outputs (the row stride of the result) */
} linear_args;

typedef struct {
    const void *weight; /* [dim] in the activation dtype; NULL: no norm (the identity) */
    float eps;
} norm_args;

typedef struct {
    norm_args input_norm, post_norm, q_norm, k_norm;
    linear_args qkv, o, gate_up, down;
} layer_args;

typedef struct {
    int B, T, D, H, Hkv, Dh, I, bf16, threads;
    const int64_t *positions, *lengths; /* [B, T] RoPE positions, [B] slots before this forward */
    const uint8_t *mask;                /* [B, T, W] tree mask (True = sees), or NULL: causal block */
    int W;
    int64_t window;                     /* sliding window, or 0 */
    const float *inv_freq;              /* [Dh / 2] */
    float rope_factor;                  /* multiplies cos and sin (YaRN) */
    void *k, *v;                        /* caches [L, B, Hkv, S, Dh] in the activation dtype, strides below */
    int64_t s_layer, s_row, s_head, s_slot, S;
} stack_args;


/* f as the activation dtype holds it: rounded to bfloat16 (kept in a float), or f itself. */
static inline float as_act(float f, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline float load_act(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_act(void *p, size_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* out[:n] = RMSNorm of x[:n] (in place allowed), as fused.rms_norm: the sum of squares in 8 lanes
 * (lane i takes elements i, i+8, ...), combined as ((0+4)+(2+6))+((1+5)+(3+7)); then
 * round(w * round(x * r)), r = 1 / sqrt(mean + eps). */
static void rms_norm_row(const float *x, float *out, int n, norm_args norm, int bf16) {
    float lane[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += x[i + l] * x[i + l];
    for (int l = 0; i < n; i++, l++) lane[l] += x[i] * x[i];
    const float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    const float r = 1.0f / sqrtf(sum / (float)n + norm.eps);
    for (i = 0; i < n; i++) out[i] = as_act(load_act(norm.weight, i, bf16) * as_act(x[i] * r, bf16), bf16);
}

/* h [M, D] = the norm of each row of x [M, D] (a copy where there is no norm). */
static void norm_rows(const float *x, float *h, int M, int D, norm_args norm, int bf16) {
    if (!norm.weight) {
        memcpy(h, x, (size_t)M * D * sizeof(float));
        return;
    }
    for (int m = 0; m < M; m++) rms_norm_row(x + (size_t)m * D, h + (size_t)m * D, D, norm, bf16);
}

/* y [M, lin.N] = x [M, K] @ W + bias, each output as the activation dtype holds it. */
static void product(const float *x, linear_args lin, float *y, int M, int K, int bf16, int threads) {
    skinny_gemm(x, 0, lin.packed, lin.wtype, lin.scale, lin.bias, y, 0, M, K, lin.N, threads);
    if (bf16)
        for (size_t i = 0; i < (size_t)M * lin.N; i++) y[i] = as_act(y[i], bf16);
}

/* x [M, D] += y [M, ldy] (the first D columns), as the activation dtype rounds the sum. */
static void add_rows(float *x, const float *y, int M, int D, int ldy, int bf16) {
    for (int m = 0; m < M; m++)
        for (int i = 0; i < D; i++) x[(size_t)m * D + i] = as_act(x[(size_t)m * D + i] + y[(size_t)m * ldy + i], bf16);
}

/* cos, sin [M, Dh / 2] of each token's angles position * inv_freq (float32, as rope_cos_sin), times the
 * attention factor. */
static void rope_tables(const stack_args *f, float *cos_t, float *sin_t) {
    const int half = f->Dh / 2, M = f->B * f->T;
    for (int m = 0; m < M; m++)
        for (int i = 0; i < half; i++) {
            const float angle = (float)f->positions[m] * f->inv_freq[i];
            cos_t[(size_t)m * half + i] = cosf(angle) * f->rope_factor;
            sin_t[(size_t)m * half + i] = sinf(angle) * f->rope_factor;
        }
}

/* x[:Dh] rotated in place, rotate-half layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static void rotate(float *restrict x, const float *restrict c, const float *restrict s, int Dh, int bf16) {
    const int half = Dh / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = as_act(x1 * c[i] - x2 * s[i], bf16);
        x[i + half] = as_act(x2 * c[i] + x1 * s[i], bf16);
    }
}

/* For every token: q and k heads normed (q_norm / k_norm, where present) and rotated in place in qkv
 * [M, ldq]; k and v stored at the token's slot of layer l's cache. */
static void rope_and_store(const stack_args *f, const layer_args *layer, int l, float *qkv, int ldq, const float *cos_t,
                           const float *sin_t) {
    const int Dh = f->Dh, half = Dh / 2, bf16 = f->bf16;
    const size_t elem = bf16 ? 2 : 4;
    for (int b = 0; b < f->B; b++)
        for (int t = 0; t < f->T; t++) {
            const size_t m = (size_t)b * f->T + t;
            float *row = qkv + m * ldq;
            for (int h = 0; h < f->H + f->Hkv; h++) {
                const norm_args norm = h < f->H ? layer->q_norm : layer->k_norm;
                if (norm.weight) rms_norm_row(row + h * Dh, row + h * Dh, Dh, norm, bf16);
                rotate(row + h * Dh, cos_t + m * half, sin_t + m * half, Dh, bf16);
            }
            const int64_t slot = f->lengths[b] + t;
            for (int h = 0; h < f->Hkv; h++) {
                const size_t at = (size_t)(l * f->s_layer + b * f->s_row + h * f->s_head + slot * f->s_slot);
                const float *k = row + (f->H + h) * Dh, *v = row + (f->H + f->Hkv + h) * Dh;
                for (int d = 0; d < Dh; d++) {
                    store_act((char *)f->k + at * elem, d, k[d], bf16);
                    store_act((char *)f->v + at * elem, d, v[d], bf16);
                }
            }
        }
}

/* The slots token (b, t) sees, in slot order, into slot[]; returns how many. As build_attention_mask
 * (specdec/models/llama.py): every slot before the last W of the block is seen, those W per the tree
 * mask (or causally), and with a sliding window only keys fewer than `window` positions back (a new
 * token's key at its position, any other at its slot). */
static int seen_slots(const stack_args *f, int b, int t, int *slot) {
    const int W = f->mask ? f->W : f->T;
    const int64_t length = f->lengths[b], first = length + f->T - W; /* the masked window's first slot */
    const int64_t position = f->positions[(size_t)b * f->T + t];
    const uint8_t *sees = f->mask ? f->mask + ((size_t)b * f->T + t) * W : NULL;
    int n = 0;
    for (int64_t s = 0; s < length + f->T; s++) {
        const int64_t r = s - first;
        if (r >= 0 && !(sees ? sees[r] : r <= t)) continue;
        if (f->window) {
            const int64_t key = s >= length ? f->positions[(size_t)b * f->T + (s - length)] : s;
            if (position - key >= f->window) continue;
        }
        slot[n++] = (int)s;
    }
    return n;
}

typedef struct {
    const stack_args *f;
    int l, ldq, per_task;
    float scale;      /* 1 / sqrt(Dh), rounded from double as cpu_attention.py passes it */
    const float *qkv; /* [M, ldq]: rotated queries first */
    float *out;       /* [M, H * Dh] */
} attention_job;

/* Task i: queries (b, t, h) number i * per_task .. (i + 1) * per_task - 1, h fastest (the heads of a
 * token share its slot list). */
static void attention_task(void *arg, int task) {
    const attention_job *a = arg;
    const stack_args *f = a->f;
    const int H = f->H, Dh = f->Dh, units = f->B * f->T * H, first = task * a->per_task;
    const int last = first + a->per_task < units ? first + a->per_task : units;
    const size_t elem = f->bf16 ? 2 : 4;
    float *p = specdec_scratch(2 * (size_t)f->S + Dh), *o = p + f->S;
    int *slot = (int *)(o + Dh), n = 0, token = -1; /* sizeof(int) == sizeof(float) */
    for (int unit = first; unit < last; unit++) {
        const int m = unit / H, h = unit % H, b = m / f->T, t = m % f->T, kh = h / (H / f->Hkv);
        if (m != token) n = seen_slots(f, b, t, slot), token = m;
        float *out = a->out + (size_t)m * H * Dh + (size_t)h * Dh;
        if (n == 0) {
            memset(out, 0, (size_t)Dh * sizeof(float));
            continue;
        }
        const size_t at = (size_t)(a->l * f->s_layer + b * f->s_row + kh * f->s_head);
        specdec_attend_slots(a->qkv + (size_t)m * a->ldq + (size_t)h * Dh, (const char *)f->k + at * elem,
                             (const char *)f->v + at * elem, f->s_slot, f->s_slot, slot, n, Dh, f->bf16,
                             a->scale, p, o);
        for (int d = 0; d < Dh; d++) out[d] = as_act(o[d], f->bf16);
    }
}

/* out [M, H * Dh] = every query's attention over layer l's cache. */
static void attention(const stack_args *f, int l, const float *qkv, int ldq, float *out) {
    const int units = f->B * f->T * f->H;
    int64_t work = 0;
    for (int b = 0; b < f->B; b++) work += (f->lengths[b] + f->T) * f->T * f->H * f->Dh;
    const int threads = work > PARALLEL_WORK ? f->threads : 1;
    const int per_task = units / (8 * threads) > 1 ? units / (8 * threads) : 1;
    attention_job a = {f, l, ldq, per_task, (float)(1.0 / sqrt((double)f->Dh)), qkv, out};
    specdec_parallel((units + per_task - 1) / per_task, threads, attention_task, &a);
}

/* e where g's sign bit is set, else 1, by bit operations (a select the compiler vectorises, where it
 * keeps a comparison of floats as a branch). */
static inline float one_or(float g, float e) {
    uint32_t gb, eb;
    memcpy(&gb, &g, 4), memcpy(&eb, &e, 4);
    const uint32_t negative = (uint32_t)((int32_t)gb >> 31), pick = (eb & negative) | (0x3f800000u & ~negative);
    float s;
    memcpy(&s, &pick, 4);
    return s;
}

/* a [M, I] = round(round(silu(g)) * u) for gu [M, ldg] = [g | u | padding], with
 * silu(g) = g * s / (1 + e), e = exp(-|g|) (never overflows), s = 1 for g >= 0 and e below, from
 * the attention's vectorised exp (a few ulp from expf; one value's result never depends on its
 * neighbours). Scratch e [I]. */
static void silu_mul(const float *restrict gu, int ldg, float *restrict a, int M, int I, int bf16, float *restrict e) {
    for (int m = 0; m < M; m++) {
        const float *restrict g = gu + (size_t)m * ldg, *restrict u = g + I;
        float *restrict out = a + (size_t)m * I;
        for (int i = 0; i < I; i++) e[i] = -fabsf(g[i]);
        specdec_exp(e, I);
        for (int i = 0; i < I; i++) out[i] = g[i] * one_or(g[i], e[i]) / (1.0f + e[i]);
        if (bf16)
            for (int i = 0; i < I; i++) out[i] = as_act(as_act(out[i], 1) * u[i], 1);
        else
            for (int i = 0; i < I; i++) out[i] *= u[i];
    }
}

/* x [M, D] (float32, in place) through layer l. Work buffers: h [M, D], qkv [M, qkv.N], att [M, H * Dh],
 * y [M, max(o.N, down.N)], gu [M, gate_up.N], act [M, I], e [I]; cos and sin [M, Dh / 2]. */
static void run_layer(const stack_args *f, const layer_args *layer, int l, float *x, float *h, float *qkv, float *att,
                      float *y, float *gu, float *act, float *e, const float *cos_t, const float *sin_t) {
    const int M = f->B * f->T, D = f->D, bf16 = f->bf16, threads = f->threads;
    norm_rows(x, h, M, D, layer->input_norm, bf16);
    product(h, layer->qkv, qkv, M, D, bf16, threads);
    rope_and_store(f, layer, l, qkv, layer->qkv.N, cos_t, sin_t);
    attention(f, l, qkv, layer->qkv.N, att);
    product(att, layer->o, y, M, f->H * f->Dh, bf16, threads);
    add_rows(x, y, M, D, layer->o.N, bf16);
    norm_rows(x, h, M, D, layer->post_norm, bf16);
    product(h, layer->gate_up, gu, M, D, bf16, threads);
    silu_mul(gu, layer->gate_up.N, act, M, f->I, bf16, e);
    product(act, layer->down, y, M, f->I, bf16, threads);
    add_rows(x, y, M, D, layer->down.N, bf16);
}

/* x_out [B, T, D] = x_in [B, T, D] (activation dtype; may be the same buffer) through layers[0 .. L-1],
 * layer l's keys and values written into cache layer l. Returns 0, or -1 (nothing written) when a row's
 * new tokens would not fit in the cache's S slots. */
int specdec_layers(const layer_args *layers, int L, const stack_args *f, const void *x_in, void *x_out) {
    const int M = f->B * f->T, D = f->D, half = f->Dh / 2;
    for (int b = 0; b < f->B; b++)
        if (f->lengths[b] < 0 || f->lengths[b] + f->T > f->S) return -1;
    if (M == 0) return 0;
    int widest_qkv = 0, widest_y = D, widest_gu = 0;
    for (int l = 0; l < L; l++) {
        widest_qkv = layers[l].qkv.N > widest_qkv ? layers[l].qkv.N : widest_qkv;
        widest_y = layers[l].o.N > widest_y ? layers[l].o.N : widest_y;
        widest_y = layers[l].down.N > widest_y ? layers[l].down.N : widest_y;
        widest_gu = layers[l].gate_up.N > widest_gu ? layers[l].gate_up.N : widest_gu;
    }
    const size_t per_row = 2 * (size_t)D + widest_qkv + (size_t)f->H * f->Dh + widest_y + widest_gu + f->I + 2 * half;
    float *x = malloc(((size_t)M * per_row + f->I) * sizeof(float));
    if (!x) abort();
    float *h = x + (size_t)M * D, *qkv = h + (size_t)M * D, *att = qkv + (size_t)M * widest_qkv;
    float *y = att + (size_t)M * f->H * f->Dh, *gu = y + (size_t)M * widest_y, *act = gu + (size_t)M * widest_gu;
    float *cos_t = act + (size_t)M * f->I, *sin_t = cos_t + (size_t)M * half, *e = sin_t + (size_t)M * half;
    for (size_t i = 0; i < (size_t)M * D; i++) x[i] = load_act(x_in, i, f->bf16);
    rope_tables(f, cos_t, sin_t);
    for (int l = 0; l < L; l++) run_layer(f, &layers[l], l, x, h, qkv, att, y, gu, act, e, cos_t, sin_t);
    for (size_t i = 0; i < (size_t)M * D; i++) store_act(x_out, i, x[i], f->bf16);
    free(x);
    return 0;
}

/* out [M, D] = each row of x [M, D] (activation dtype; may be the same buffer) through the RMSNorm
 * (weight [D], activation dtype), as the layers' norms: the model's final norm. */
void specdec_rms_norm(const void *x, void *out, int M, int D, const void *weight, float eps, int bf16) {
    float *row = malloc((size_t)D * sizeof(float));
    if (!row) abort();
    const norm_args norm = {weight, eps};
    for (int m = 0; m < M; m++) {
        for (int i = 0; i < D; i++) row[i] = load_act(x, (size_t)m * D + i, bf16);
        rms_norm_row(row, row, D, norm, bf16);
        for (int i = 0; i < D; i++) store_act(out, (size_t)m * D + i, row[i], bf16);
    }
    free(row);
}
