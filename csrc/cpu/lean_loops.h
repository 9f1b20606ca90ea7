/*
 * lean_loops.h: the loops of the CPU lean step (lean.c), one body compiled once per
 * instruction set: lean_avx512.c and lean_avx2.c include it under a `#pragma GCC target`
 * placed before any header, so that adam.h's fmaf, inlined here, is compiled for that
 * target and vectorizes (an fmaf compiled for the baseline stays a call that no loop
 * around it can vectorize); lean.c includes it for the baseline. Each defines
 * LEAN_CHUNK, the name of its function that steps one chunk.
 *
 * A chunk (cpu.h; chunks start at multiples of AMPC_CHUNK, so at block boundaries) is
 * walked a block of AMPC_QBLOCK elements at a time, and one loop does all that an element
 * needs on its own: read the weight (master, param or Kahan pair), the grad and the
 * moments (decoded from their codes), take adam.h's step, write the weight (to nearest,
 * stochastically or as the Kahan pair) and fp32 or bf16 moments. 8-bit moments wait for
 * their block's new absmax: the loop leaves m and sqrt(v) in L1 buffers and their maxima
 * in registers, and a second loop codes them (Note [8-bit moments]) in 32-bit lanes,
 * packed to bytes by a third.
 *
 * The common layouts are compiled with every kind a constant (a loop with no test in it),
 * and with the Adam flags constant too for plain AdamW (decoupled weight decay, beta1 >
 * 0.5, not maximizing: no select left per element); any other layout runs the same body
 * with the kinds read at run time. Every operation is exact or rounded on its own, so
 * every instruction set and layout gives the same bits.
 */
#include <string.h>

#include "adam.h"
#include "lean.h"
#include "lean_cpu.h"
#include "simd.h"

/* A block of one tensor: pointers at its first element. */
struct lean_block {
    void *param;
    const void *grad;
    float *master;
    uint16_t *comp;
    void *m;
    void *v;
    float *m_scale;         /* 8-bit moments: the block's scales */
    float *v_scale;
    int64_t index;          /* list-wide index of the first element */
};

/* The random bits of elements lo.. of a block, which share the index's high half: keys of
 * the weight's stream and of the bf16 moments' streams, and `base` such that element i
 * draws from index_lo = base + i (Note [stochastic rounding]). */
struct lean_keys {
    uint32_t w, m, v;
    uint32_t base;
};

/* A block's values that wait: m and sqrt(v) for their absmax, fp16 weights for cast.c. */
struct lean_bufs {
    float m[AMPC_QBLOCK];
    float s[AMPC_QBLOCK];
    float w[AMPC_QBLOCK];
    uint32_t c[AMPC_QBLOCK];    /* 8-bit codes before they are packed */
};

// ---- the loops (one body, compiled per ISA and layout) ----

/* Elements [lo, hi) of a block: everything but the 8-bit codes. */
INLINE void step_loop(const struct lean_block *b, const struct ampc_adam_coef *c,
                      const struct lean_keys *k, int64_t lo, int64_t hi, struct lean_bufs *buf,
                      uint32_t *mmax, uint32_t *vmax, const int moments, const int weight,
                      const int write, const ampc_dtype pt, const ampc_dtype gt,
                      const int plain)
{
    const struct ampc_adam_coef cc = *c;        /* a local copy: no reloads */
    /* amsgrad is known clear (no vmax); plain AdamW's flags are constants */
    const int flags = plain ? AMPC_ADAM_DECAY : cc.flags & ~AMPC_ADAM_AMSGRAD;
    const int small_w1 = plain ? 1 : cc.w1 < 0.5f;
    void *const param = b->param;
    uint16_t *const p16 = b->param;
    const void *const grad = b->grad;
    float *const master = b->master;
    uint16_t *const comp = b->comp;
    float *const m32 = b->m, *const v32 = b->v;
    uint16_t *const m16 = b->m, *const v16 = b->v;
    const uint8_t *const m8 = b->m, *const v8 = b->v;
    const float fm = moments == AMPC_MOMENTS_Q8 ? ampc_q8m_factor(*b->m_scale) : 0.0f;
    const float fv = moments == AMPC_MOMENTS_Q8 ? ampc_q8v_factor(*b->v_scale) : 0.0f;
    float *const mb = buf->m, *const sb = buf->s, *const wb = buf->w;
    const uint32_t kw = k->w, km = k->m, kv = k->v, base = k->base;
    uint32_t mx = *mmax, vx = *vmax;
#pragma omp simd reduction(max : mx, vx)
    for (int64_t i = lo; i < hi; i++) {
        const uint32_t idx = base + (uint32_t)i;
        float w;
        if (weight == WEIGHT_MASTER)
            w = master[i];
        else if (weight == WEIGHT_KAHAN)
            w = ampc_kahan_weight(p16[i], comp[i]);
        else
            w = load1(param, pt, i);
        float m, v;
        if (moments == AMPC_MOMENTS_Q8) {
            m = ampc_q8m_decode(m8[i], fm);
            v = ampc_q8v_decode(v8[i], fv);
        } else if (moments == AMPC_MOMENTS_BF16) {
            m = ampc_bf16_to_f32(m16[i]);
            v = ampc_bf16_to_f32(v16[i]);
        } else {
            m = m32[i];
            v = v32[i];
        }
        ampc_adam_element_as(load1(grad, gt, i), &w, &m, &v, NULL, &cc, flags, small_w1);
        if (moments == AMPC_MOMENTS_Q8) {
            mb[i] = m;
            sb[i] = sqrtf(v);           /* the step's own sqrt(v): the compiler shares it */
            uint32_t a = ampc_abs_bits(m), e = ampc_abs_bits(v);
            mx = a > mx ? a : mx;
            vx = e > vx ? e : vx;
        } else if (moments == AMPC_MOMENTS_BF16) {
            m16[i] = ampc_f32_to_bf16_sr(m, ampc_random_bits_keyed(km, idx));
            v16[i] = ampc_f32_to_bf16_sr(v, ampc_random_bits_keyed(kv, idx));
        } else {
            m32[i] = m;
            v32[i] = v;
        }
        if (weight == WEIGHT_MASTER)
            master[i] = w;
        if (weight == WEIGHT_KAHAN)
            ampc_kahan_store(w, &p16[i], &comp[i]);
        else if (pt == AMPC_F32)
            ((float *)param)[i] = w;
        else if (write == WRITE_SR)
            p16[i] = ampc_f32_to_bf16_sr(w, ampc_random_bits_keyed(kw, idx));
        else if (write == WRITE_LATER)
            wb[i] = w;
        else
            store1(param, pt, i, w);
    }
    *mmax = mx;
    *vmax = vx;
}

/* n codes, computed in 32-bit lanes, to bytes: a loop of its own, since a loop that
 * stores bytes narrows every step of the code's arithmetic to bytes (many packs). */
INLINE void pack_codes(uint8_t *q, const uint32_t *c, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        q[i] = (uint8_t)c[i];
}

/* A block's 8-bit codes and fresh scales, from its new m and sqrt(v). */
INLINE void encode_loop(const struct lean_block *b, struct lean_bufs *buf, int64_t n,
                        uint32_t mbits, uint32_t vbits)
{
    uint8_t *const qm = b->m, *const qv = b->v;
    const float *const mb = buf->m, *const sb = buf->s;
    uint32_t *const cb = buf->c;
    /* sqrt is monotonic, so the largest sqrt(v) is the sqrt of the largest v */
    const float mmax = ampc_bits_f32(mbits), smax = sqrtf(ampc_bits_f32(vbits));
    *b->m_scale = mmax;
    *b->v_scale = smax;
    if (ampc_q8_codes_zero(mmax)) {
        memset(qm, 0, (size_t)n);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            cb[i] = ampc_q8m_code(mb[i], mmax);
        pack_codes(qm, cb, n);
    }
    if (ampc_q8_codes_zero(smax)) {
        memset(qv, 0, (size_t)n);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            cb[i] = ampc_q8v_code(sb[i], smax);
        pack_codes(qv, cb, n);
    }
}

static void *at(const struct ampc_list *l, int64_t t, int64_t i, int64_t size)
{
    return l->count ? (char *)l->ptr[t] + i * size : NULL;
}

/* One chunk, block by block. */
INLINE void chunk_loop(const struct lean_job *job, const struct ampc_span *s,
                       const int moments, const int weight, const int write,
                       const ampc_dtype pt, const ampc_dtype gt)
{
    const struct ampc_lean_lists *l = job->lists;
    const int64_t t = s->tensor;
    const struct ampc_adam_coef *c = &job->coef[t];
    const int64_t msize = moments == AMPC_MOMENTS_F32 ? 4 : moments == AMPC_MOMENTS_BF16 ? 2 : 1;
    /* AdamW with weight decay, beta1 > 0.5, not maximizing: the flags as constants */
    const int plain = c->flags == AMPC_ADAM_DECAY && c->w1 < 0.5f;
    struct lean_bufs buf;
    for (int64_t i = s->begin; i < s->end; i += AMPC_QBLOCK) {
        const int64_t n = s->end - i < AMPC_QBLOCK ? s->end - i : AMPC_QBLOCK;
        struct lean_block b;
        b.param = at(&l->params, t, i, ampc_dtype_size(pt));
        b.grad = at(&l->grads, t, i, ampc_dtype_size(gt));
        b.master = at(&l->masters, t, i, 4);
        b.comp = at(&l->compensations, t, i, 2);
        b.m = at(&l->exp_avgs, t, i, msize);
        b.v = at(&l->exp_avg_sqs, t, i, msize);
        b.m_scale = at(&l->exp_avg_scales, t, i / AMPC_QBLOCK, 4);
        b.v_scale = at(&l->exp_avg_sq_scales, t, i / AMPC_QBLOCK, 4);
        b.index = s->index + (i - s->begin);
        uint32_t mbits = 0, vbits = 0;
        /* a new key where the index's high half changes (once in 2^32 elements) */
        for (int64_t lo = 0, hi; lo < n; lo = hi) {
            const uint64_t k0 = (uint64_t)(b.index + lo);
            const int64_t room = (int64_t)((((k0 >> 32) + 1) << 32) - k0);
            hi = n - lo < room ? n : lo + room;
            const uint32_t top = (uint32_t)(k0 >> 32);
            struct lean_keys k = { 0, 0, 0, (uint32_t)k0 - (uint32_t)lo };
            if (write == WRITE_SR)
                k.w = ampc_random_key(c->seed, top);
            if (moments == AMPC_MOMENTS_BF16) {
                k.m = ampc_random_key(c->seed ^ AMPC_SEED_EXP_AVG, top);
                k.v = ampc_random_key(c->seed ^ AMPC_SEED_EXP_AVG_SQ, top);
            }
            if (plain)
                step_loop(&b, c, &k, lo, hi, &buf, &mbits, &vbits, moments, weight, write, pt,
                          gt, 1);
            else
                step_loop(&b, c, &k, lo, hi, &buf, &mbits, &vbits, moments, weight, write, pt,
                          gt, 0);
            if (write == WRITE_LATER)
                ampc_store_stochastic((uint16_t *)b.param + lo, pt, buf.w + lo, hi - lo,
                                      c->seed, (int64_t)k0);
        }
        if (moments == AMPC_MOMENTS_Q8)
            encode_loop(&b, &buf, n, mbits, vbits);
    }
}

/* The layouts compiled with every kind a constant: the lean preset (8-bit moments, or
 * fp32 for small and 1-d params, bf16 params written stochastically), Kahan pairs, master
 * weights with 8-bit moments, fp32 params (norms kept fp32); bf16 grads, or fp32 with
 * fp32 params. Any other layout runs chunk_loop with the kinds read at run time. */
#define LAYOUT(mo, we, wr, p, g) (((((mo) * 3 + (we)) * 3 + (wr)) * 3 + (p)) * 3 + (g))
#define CASE(fn, mo, we, wr, p, g)                                                    \
    case LAYOUT(mo, we, wr, p, g): fn(job, s, mo, we, wr, p, g); return
#define FAST_LAYOUTS(fn)                                                              \
    CASE(fn, AMPC_MOMENTS_Q8, WEIGHT_PARAM, WRITE_SR, AMPC_BF16, AMPC_BF16);          \
    CASE(fn, AMPC_MOMENTS_F32, WEIGHT_PARAM, WRITE_SR, AMPC_BF16, AMPC_BF16);         \
    CASE(fn, AMPC_MOMENTS_BF16, WEIGHT_PARAM, WRITE_SR, AMPC_BF16, AMPC_BF16);        \
    CASE(fn, AMPC_MOMENTS_Q8, WEIGHT_KAHAN, WRITE_NEAREST, AMPC_BF16, AMPC_BF16);     \
    CASE(fn, AMPC_MOMENTS_F32, WEIGHT_KAHAN, WRITE_NEAREST, AMPC_BF16, AMPC_BF16);    \
    CASE(fn, AMPC_MOMENTS_BF16, WEIGHT_KAHAN, WRITE_NEAREST, AMPC_BF16, AMPC_BF16);   \
    CASE(fn, AMPC_MOMENTS_Q8, WEIGHT_MASTER, WRITE_NEAREST, AMPC_BF16, AMPC_BF16);    \
    CASE(fn, AMPC_MOMENTS_F32, WEIGHT_MASTER, WRITE_NEAREST, AMPC_BF16, AMPC_BF16);   \
    CASE(fn, AMPC_MOMENTS_Q8, WEIGHT_MASTER, WRITE_SR, AMPC_BF16, AMPC_BF16);         \
    CASE(fn, AMPC_MOMENTS_F32, WEIGHT_PARAM, WRITE_NEAREST, AMPC_F32, AMPC_F32)

void LEAN_CHUNK(const struct lean_job *job, const struct ampc_span *s)
{
    ampc_dtype pt = job->lists->params.dtype, gt = job->lists->grads.dtype;
    switch (LAYOUT(job->moments, job->weight, job->write, pt, gt)) {
    FAST_LAYOUTS(chunk_loop);
    default: chunk_loop(job, s, job->moments, job->weight, job->write, pt, gt);
    }
}
