/*
 * lean_loops.h: the loops of the CPU lean step (lean.c), one body compiled once per
 * instruction set: lean_avx512.c and lean_avx2.c include it under a `#pragma GCC target`
 * placed before any header, so that adam.h's fmaf, inlined here, is compiled for that
 * target and vectorizes (an fmaf compiled for the baseline stays a call that no loop
 * around it can vectorize); lean.c includes it for the baseline. Each defines
 * LEAN_CHUNK, the name of its function that steps one chunk.
 *
 * A chunk (cpu.h; chunks start at multiples of AMPC_CHUNK, so at block boundaries) is
 * walked a block of AMPC_QBLOCK elements at a time, and one loop runs lean.h's
 * ampc_lean_element on each, all that an element needs on its own. 8-bit moments wait for
 * their block's new absmax: the loop leaves m, sqrt(v) and the element's random bits (v's
 * code rounds stochastically) in L1 buffers and the maxima in registers, and a second
 * loop codes them (Note [8-bit moments]) in 32-bit lanes, packed to bytes by a third.
 *
 * The common layouts are compiled with every kind a constant (a loop with no test in it),
 * and with the Adam flags constant too for plain AdamW (decoupled weight decay, beta1 >
 * 0.5, not maximizing: no select left per element); any other layout runs the same body
 * with the kinds read at run time. Every operation is exact or rounded on its own, so
 * every instruction set and layout gives the same bits.
 *
 * An instruction set may bring loops of its own for the lean preset's layout (lean_avx2.c
 * does): LEAN_STEP_PRESET steps a run of elements 8 at a time and LEAN_ENCODE_BOTH codes
 * both moments 8 at a time, each returning where it stopped; the loops here do the rest.
 */
#include <string.h>

#include "adam.h"
#include "lean.h"
#include "lean_cpu.h"
#include "simd.h"

/* A block of one tensor: pointers at its first element. */
struct lean_block {
    struct ampc_lean_at at;
    float *m_scale;         /* 8-bit moments: the block's scales */
    float *v_scale;
    int64_t index;          /* list-wide index of the first element */
};

/* A block's values that wait: m and sqrt(v) for their absmax with the random bits of v's
 * code, fp16 weights for cast.c. */
struct lean_bufs {
    float m[AMPC_QBLOCK];
    float s[AMPC_QBLOCK];
    uint32_t r[AMPC_QBLOCK];
    float w[AMPC_QBLOCK];
    uint32_t c[AMPC_QBLOCK];    /* 8-bit codes before they are packed */
};

// ---- the loops (one body, compiled per ISA and layout) ----

/* Elements [lo, hi) of a block: lean.h's step of each, and for 8-bit moments their new
 * values and maxima kept for the codes. Element i draws its random bits from index_lo =
 * base + i: all of [lo, hi) share the index's high half, whose keys are k. */
INLINE void step_loop(const struct lean_block *b, const struct ampc_adam_coef *c,
                      const struct ampc_lean_keys *k, uint32_t base, int64_t lo, int64_t hi,
                      struct lean_bufs *buf, uint32_t *mmax, uint32_t *vmax, const int moments,
                      const int weight, const int write, const ampc_dtype pt,
                      const ampc_dtype gt, const int plain)
{
    const struct ampc_adam_coef cc = *c;        /* local copies: no reloads */
    const struct ampc_lean_at at = b->at;
    const struct ampc_lean_keys kk = *k;
    /* amsgrad is known clear (no vmax); plain AdamW's flags are constants */
    const int flags = plain ? AMPC_ADAM_DECAY : cc.flags & ~AMPC_ADAM_AMSGRAD;
    const int small_w1 = plain ? 1 : cc.w1 < 0.5f;
    const float fm = moments == AMPC_MOMENTS_Q8 ? ampc_q8m_factor(*b->m_scale) : 0.0f;
    const float fv = moments == AMPC_MOMENTS_Q8 ? ampc_q8v_factor(*b->v_scale) : 0.0f;
    float *const mb = buf->m, *const sb = buf->s, *const wb = buf->w;
    uint32_t *const rb = buf->r;
    uint32_t mx = *mmax, vx = *vmax;
#ifdef LEAN_STEP_PRESET
    /* the lean preset's layout, 8 lanes at a time, in a loop written out by hand */
    if (moments == AMPC_MOMENTS_Q8 && weight == AMPC_WEIGHT_PARAM && write == AMPC_WRITE_SR &&
        pt == AMPC_BF16 && gt == AMPC_BF16 && plain)
        lo = LEAN_STEP_PRESET(&at, &cc, kk.w, base, lo, hi, fm, fv, mb, sb, rb, &mx, &vx);
#endif
#pragma omp simd reduction(max : mx, vx)
    for (int64_t i = lo; i < hi; i++) {
        float m, v, w;
        ampc_lean_element(&at, i, base + (uint32_t)i, &kk, &cc, flags, small_w1, moments,
                          weight, write, pt, gt, fm, fv, &m, &v, &w);
        if (moments == AMPC_MOMENTS_Q8) {
            mb[i] = m;
            sb[i] = sqrtf(v);           /* the step's own sqrt(v): the compiler shares it */
            /* the weight's random bits (the same call where it is written stochastically) */
            rb[i] = ampc_random_bits_keyed(kk.w, base + (uint32_t)i);
            uint32_t a = ampc_abs_bits(m), e = ampc_abs_bits(v);
            mx = a > mx ? a : mx;
            vx = e > vx ? e : vx;
        }
        if (write == AMPC_WRITE_LATER)
            wb[i] = w;
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
    uint8_t *const qm = b->at.m, *const qv = b->at.v;
    const float *const mb = buf->m, *const sb = buf->s;
    const uint32_t *const rb = buf->r;
    uint32_t *const cb = buf->c;
    /* sqrt is monotonic, so the largest sqrt(v) is the sqrt of the largest v */
    const float mmax = ampc_bits_f32(mbits), smax = sqrtf(ampc_bits_f32(vbits));
    *b->m_scale = mmax;
    *b->v_scale = smax;
    int64_t done = 0;
    /* lean.h's codes, each block's factor taken once, out of the loops */
    const float fm = ampc_q8_code_factor(AMPC_Q8M_MAX, mmax);
    const float fv = ampc_q8_code_factor(AMPC_Q8V_MAX, smax);
#ifdef LEAN_ENCODE_BOTH
    if (fm != 0.0f && fv != 0.0f)
        done = LEAN_ENCODE_BOTH(qm, qv, mb, sb, rb, n, fm, fv);
    if (done == n)
        return;
#endif
    if (ampc_q8_codes_zero(mmax)) {
        memset(qm, 0, (size_t)n);
    } else {
        if (fm != 0.0f) {
#pragma omp simd
            for (int64_t i = done; i < n; i++)
                cb[i] = ampc_q8m_code_by(mb[i], fm);
        } else {                        /* a tiny absmax: the divide (lean.h) */
            for (int64_t i = done; i < n; i++)
                cb[i] = ampc_q8m_code(mb[i], mmax);
        }
        pack_codes(qm + done, cb + done, n - done);
    }
    if (ampc_q8_codes_zero(smax)) {
        memset(qv, 0, (size_t)n);
    } else {
        if (fv != 0.0f) {
#pragma omp simd
            for (int64_t i = done; i < n; i++)
                cb[i] = ampc_q8v_code_by(sb[i], fv, rb[i]);
        } else {
            for (int64_t i = done; i < n; i++)
                cb[i] = ampc_q8v_code(sb[i], smax, rb[i]);
        }
        pack_codes(qv + done, cb + done, n - done);
    }
}

static void *at(const struct ampc_list *l, int64_t t, int64_t i, int64_t size)
{
    return l->count ? (char *)l->ptr[t] + i * size : NULL;
}

/* One chunk, block by block. */
INLINE void chunk_loop(const struct lean_chunks *job, const struct ampc_span *s,
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
        b.at.param = at(&l->params, t, i, ampc_dtype_size(pt));
        b.at.grad = at(&l->grads, t, i, ampc_dtype_size(gt));
        b.at.master = at(&l->masters, t, i, 4);
        b.at.comp = at(&l->compensations, t, i, 2);
        b.at.m = at(&l->exp_avgs, t, i, msize);
        b.at.v = at(&l->exp_avg_sqs, t, i, msize);
        b.m_scale = at(&l->exp_avg_scales, t, i / AMPC_QBLOCK, 4);
        b.v_scale = at(&l->exp_avg_sq_scales, t, i / AMPC_QBLOCK, 4);
        b.index = s->index + (i - s->begin);
        uint32_t mbits = 0, vbits = 0;
        /* new keys where the index's high half changes (once in 2^32 elements) */
        for (int64_t lo = 0, hi; lo < n; lo = hi) {
            const uint64_t k0 = (uint64_t)(b.index + lo);
            const int64_t room = (int64_t)((((k0 >> 32) + 1) << 32) - k0);
            hi = n - lo < room ? n : lo + room;
            const struct ampc_lean_keys k = ampc_lean_keys(c->seed, (uint32_t)(k0 >> 32));
            const uint32_t base = (uint32_t)k0 - (uint32_t)lo;
            if (plain)
                step_loop(&b, c, &k, base, lo, hi, &buf, &mbits, &vbits, moments, weight,
                          write, pt, gt, 1);
            else
                step_loop(&b, c, &k, base, lo, hi, &buf, &mbits, &vbits, moments, weight,
                          write, pt, gt, 0);
            if (write == AMPC_WRITE_LATER)
                ampc_store_stochastic((uint16_t *)b.at.param + lo, pt, buf.w + lo, hi - lo,
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
    CASE(fn, AMPC_MOMENTS_Q8, AMPC_WEIGHT_PARAM, AMPC_WRITE_SR, AMPC_BF16, AMPC_BF16);          \
    CASE(fn, AMPC_MOMENTS_F32, AMPC_WEIGHT_PARAM, AMPC_WRITE_SR, AMPC_BF16, AMPC_BF16);         \
    CASE(fn, AMPC_MOMENTS_BF16, AMPC_WEIGHT_PARAM, AMPC_WRITE_SR, AMPC_BF16, AMPC_BF16);        \
    CASE(fn, AMPC_MOMENTS_Q8, AMPC_WEIGHT_KAHAN, AMPC_WRITE_NEAREST, AMPC_BF16, AMPC_BF16);     \
    CASE(fn, AMPC_MOMENTS_F32, AMPC_WEIGHT_KAHAN, AMPC_WRITE_NEAREST, AMPC_BF16, AMPC_BF16);    \
    CASE(fn, AMPC_MOMENTS_BF16, AMPC_WEIGHT_KAHAN, AMPC_WRITE_NEAREST, AMPC_BF16, AMPC_BF16);   \
    CASE(fn, AMPC_MOMENTS_Q8, AMPC_WEIGHT_MASTER, AMPC_WRITE_NEAREST, AMPC_BF16, AMPC_BF16);    \
    CASE(fn, AMPC_MOMENTS_F32, AMPC_WEIGHT_MASTER, AMPC_WRITE_NEAREST, AMPC_BF16, AMPC_BF16);   \
    CASE(fn, AMPC_MOMENTS_Q8, AMPC_WEIGHT_MASTER, AMPC_WRITE_SR, AMPC_BF16, AMPC_BF16);         \
    CASE(fn, AMPC_MOMENTS_F32, AMPC_WEIGHT_PARAM, AMPC_WRITE_NEAREST, AMPC_F32, AMPC_F32)

void LEAN_CHUNK(const struct lean_chunks *job, const struct ampc_span *s)
{
    ampc_dtype pt = job->lists->params.dtype, gt = job->lists->grads.dtype;
    switch (LAYOUT(job->moments, job->weight, job->write, pt, gt)) {
    FAST_LAYOUTS(chunk_loop);
    default: chunk_loop(job, s, job->moments, job->weight, job->write, pt, gt);
    }
}
