/*
 * lean.c: the CPU lean Adam/AdamW step (ampc.h's struct ampc_lean_lists, lean.h), one
 * pass over memory.
 *
 * Each chunk (cpu.h; chunks start at multiples of AMPC_CHUNK, so at block boundaries) is
 * walked LEAN_SPAN elements (4 blocks of 8-bit moments) at a time: the fp32 weights and
 * moments of the span are put in L1 buffers (fp32 state is updated where it lies instead), adam.c's
 * SIMD loops take the step on them, and the span is written back: moments rounded to
 * bf16 stochastically or coded in 8 bits with a fresh scale, the weight to the master
 * and the param, to the param, or to the Kahan pair. The load and store loops are one
 * body compiled for AVX-512, AVX2 and the baseline (the compiler vectorizes them: every
 * operation is exact or rounded on its own, so every path gives the same bits).
 */
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "lean.h"
#include "simd.h"

/* Elements a pass over L1 buffers: 4 blocks of 8-bit moments, 12 KB of fp32 buffers (fewer
 * calls into the SIMD loops than one block at a time). A multiple of AMPC_QBLOCK that
 * divides AMPC_CHUNK, so every span starts on a block boundary. */
#define LEAN_SPAN (4 * AMPC_QBLOCK)

/* A span of LEAN_SPAN elements (or fewer, at a chunk's end) of one tensor: pointers at its
 * first element. */
struct lean_block {
    void *param;
    const void *grad;
    float *master;
    uint16_t *comp;
    void *m;
    void *v;
    float *m_scale;         /* 8-bit moments: the scales of its first block */
    float *v_scale;
    int64_t n;
    int64_t index;          /* list-wide index of the first element */
};

struct lean_job {
    const struct ampc_lean_lists *lists;
    const struct ampc_adam_coef *coef;      /* one per tensor */
    int moments;
    int stochastic;
};

// ---- the load and store loops (one body, compiled per ISA) ----

/* The block's fp32 weights into w (16-bit params without masters, with their
 * compensation when there is one). */
INLINE void widen_weights(float *w, const struct lean_block *b, ampc_dtype pt)
{
    const uint16_t *p = b->param;
    if (b->comp) {
        const uint16_t *c = b->comp;
#pragma omp simd
        for (int64_t i = 0; i < b->n; i++)
            w[i] = ampc_kahan_weight(p[i], c[i]);
    } else if (pt == AMPC_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < b->n; i++)
            w[i] = ampc_bf16_to_f32(p[i]);
    } else {
        for (int64_t i = 0; i < b->n; i++)
            w[i] = ampc_f16_to_f32(p[i]);
    }
}

INLINE void widen_bf16(float *dst, const uint16_t *src, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        dst[i] = ampc_bf16_to_f32(src[i]);
}

/* One 8-bit block's moments decoded: n values, scales ms and vs. */
INLINE void decode_block(float *m, float *v, const uint8_t *qm, const uint8_t *qv, float ms,
                         float vs, int64_t n)
{
    const float fm = ampc_q8m_factor(ms);
    const float fv = ampc_q8v_factor(vs);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        m[i] = ampc_q8m_decode(qm[i], fm);
        v[i] = ampc_q8v_decode(qv[i], fv);
    }
}

/* One 8-bit block's new moments coded with fresh scales (Note [8-bit moments]). */
INLINE void encode_block(uint8_t *qm, uint8_t *qv, float *ms, float *vs, const float *m,
                         const float *v, int64_t n)
{
    uint32_t mbits = 0, vbits = 0;
#pragma omp simd reduction(max : mbits, vbits)
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = ampc_abs_bits(m[i]);
        uint32_t c = ampc_abs_bits(v[i]);
        mbits = a > mbits ? a : mbits;
        vbits = c > vbits ? c : vbits;
    }
    const float mmax = ampc_bits_f32(mbits);
    const float smax = sqrtf(ampc_bits_f32(vbits));
    *ms = mmax;
    *vs = smax;
    if (ampc_q8_codes_zero(mmax))
        memset(qm, 0, (size_t)n);
    else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            qm[i] = ampc_q8m_encode(m[i], mmax);
    }
    if (ampc_q8_codes_zero(smax))
        memset(qv, 0, (size_t)n);
    else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            qv[i] = ampc_q8v_encode(sqrtf(v[i]), smax);
    }
}

/* The span's 8-bit blocks (it starts on a block boundary), decoded or encoded. */
INLINE void decode_moments(float *m, float *v, const struct lean_block *b)
{
    for (int64_t j = 0, k = 0; j < b->n; j += AMPC_QBLOCK, k++) {
        int64_t n = b->n - j < AMPC_QBLOCK ? b->n - j : AMPC_QBLOCK;
        decode_block(m + j, v + j, (const uint8_t *)b->m + j, (const uint8_t *)b->v + j,
                     b->m_scale[k], b->v_scale[k], n);
    }
}

INLINE void encode_moments(const struct lean_block *b, const float *m, const float *v)
{
    for (int64_t j = 0, k = 0; j < b->n; j += AMPC_QBLOCK, k++) {
        int64_t n = b->n - j < AMPC_QBLOCK ? b->n - j : AMPC_QBLOCK;
        encode_block((uint8_t *)b->m + j, (uint8_t *)b->v + j, &b->m_scale[k], &b->v_scale[k],
                     m + j, v + j, n);
    }
}

INLINE void store_kahan(const struct lean_block *b, const float *w)
{
    uint16_t *p = b->param;
    uint16_t *c = b->comp;
#pragma omp simd
    for (int64_t i = 0; i < b->n; i++)
        ampc_kahan_store(w[i], &p[i], &c[i]);
}

/* The loops of one ISA: `what` picks the loop, the same in every instantiation. */
enum { WIDEN_WEIGHTS, WIDEN_MOMENTS, DECODE, ENCODE, KAHAN };

INLINE void loops(int what, const struct lean_block *b, ampc_dtype pt, float *w, float *m,
                  float *v)
{
    switch (what) {
    case WIDEN_WEIGHTS: widen_weights(w, b, pt); break;
    case WIDEN_MOMENTS: widen_bf16(m, b->m, b->n); widen_bf16(v, b->v, b->n); break;
    case DECODE: decode_moments(m, v, b); break;
    case ENCODE: encode_moments(b, m, v); break;
    default: store_kahan(b, w);
    }
}

AVX512 static void loops_avx512(int what, const struct lean_block *b, ampc_dtype pt, float *w,
                                float *m, float *v)
{
    loops(what, b, pt, w, m, v);
}

AVX2 static void loops_avx2(int what, const struct lean_block *b, ampc_dtype pt, float *w,
                            float *m, float *v)
{
    loops(what, b, pt, w, m, v);
}

static void loops_scalar(int what, const struct lean_block *b, ampc_dtype pt, float *w,
                         float *m, float *v)
{
    loops(what, b, pt, w, m, v);
}

static void run_loops(int what, const struct lean_block *b, ampc_dtype pt, float *w, float *m,
                      float *v)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: loops_avx512(what, b, pt, w, m, v); break;
    case ISA_AVX2: loops_avx2(what, b, pt, w, m, v); break;
    default: loops_scalar(what, b, pt, w, m, v);
    }
}

// ---- one block ----

static void lean_step_block(const struct lean_job *job, const struct lean_block *b,
                            const struct ampc_adam_coef *c)
{
    const struct ampc_lean_lists *l = job->lists;
    ampc_dtype pt = l->params.dtype;
    float wbuf[LEAN_SPAN], mbuf[LEAN_SPAN], vbuf[LEAN_SPAN];
    /* fp32 state is stepped where it lies */
    float *w = b->master ? b->master : pt == AMPC_F32 ? (float *)b->param : wbuf;
    float *m = job->moments == AMPC_MOMENTS_F32 ? (float *)b->m : mbuf;
    float *v = job->moments == AMPC_MOMENTS_F32 ? (float *)b->v : vbuf;
    if (w == wbuf)
        run_loops(WIDEN_WEIGHTS, b, pt, w, m, v);
    if (job->moments == AMPC_MOMENTS_BF16)
        run_loops(WIDEN_MOMENTS, b, pt, w, m, v);
    else if (job->moments == AMPC_MOMENTS_Q8)
        run_loops(DECODE, b, pt, w, m, v);
    ampc_adam_buffers(w, m, v, b->grad, l->grads.dtype, b->n, c);
    if (job->moments == AMPC_MOMENTS_BF16) {
        ampc_store_stochastic(b->m, AMPC_BF16, m, b->n, c->seed ^ AMPC_SEED_EXP_AVG, b->index);
        ampc_store_stochastic(b->v, AMPC_BF16, v, b->n, c->seed ^ AMPC_SEED_EXP_AVG_SQ,
                              b->index);
    } else if (job->moments == AMPC_MOMENTS_Q8) {
        run_loops(ENCODE, b, pt, w, m, v);
    }
    if (pt == AMPC_F32)
        return;
    if (b->comp)
        run_loops(KAHAN, b, pt, w, m, v);
    else if (job->stochastic)
        ampc_store_stochastic(b->param, pt, w, b->n, c->seed, b->index);
    else
        ampc_cast_block(b->param, pt, w, AMPC_F32, b->n, 0);
}

static void *at(const struct ampc_list *l, int64_t t, int64_t i, int64_t size)
{
    return l->count ? (char *)l->ptr[t] + i * size : NULL;
}

static void lean_span(void *ctx, const struct ampc_span *s)
{
    const struct lean_job *job = ctx;
    const struct ampc_lean_lists *l = job->lists;
    int64_t t = s->tensor;
    int64_t msize = job->moments == AMPC_MOMENTS_F32 ? 4 : job->moments == AMPC_MOMENTS_BF16 ? 2 : 1;
    for (int64_t i = s->begin; i < s->end; i += LEAN_SPAN) {
        struct lean_block b;
        b.n = s->end - i < LEAN_SPAN ? s->end - i : LEAN_SPAN;
        b.index = s->index + (i - s->begin);
        b.param = at(&l->params, t, i, ampc_dtype_size(l->params.dtype));
        b.grad = at(&l->grads, t, i, ampc_dtype_size(l->grads.dtype));
        b.master = at(&l->masters, t, i, 4);
        b.comp = at(&l->compensations, t, i, 2);
        b.m = at(&l->exp_avgs, t, i, msize);
        b.v = at(&l->exp_avg_sqs, t, i, msize);
        b.m_scale = at(&l->exp_avg_scales, t, i / AMPC_QBLOCK, 4);
        b.v_scale = at(&l->exp_avg_sq_scales, t, i / AMPC_QBLOCK, 4);
        lean_step_block(job, &b, &job->coef[t]);
    }
}

ampc_status ampc_adam_lean_cpu(const struct ampc_lean_lists *lists,
                               const struct ampc_adam_control *control,
                               const struct ampc_lean_args *args)
{
    if (control->found_inf && *control->found_inf != 0.0f)
        return AMPC_OK;     /* skipped: nothing moves, the step counts included */
    struct ampc_adam_coef *coef = ampc_adam_step_coefs(&lists->steps, control, &args->adam, 0);
    if (!coef)
        return AMPC_ERR_NOMEM;
    struct lean_job job = { lists, coef, args->moments, args->adam.stochastic };
    ampc_status st = ampc_for_each_chunk(&lists->params, lean_span, &job);
    if (st == AMPC_OK)
        for (int64_t t = 0; t < lists->steps.count; t++)
            *(float *)lists->steps.ptr[t] += 1.0f;
    free(coef);
    return st;
}
