/*
 * adam.c: the CPU Adam/AdamW step over lists of tensors (ampc.h), with master weights
 * or without, in one pass over memory.
 *
 * Each tensor's fp32 constants are computed once from its step count (adam.h); the
 * chunks of all tensors then run on torch's thread pool (cpu.h). The SIMD loops do
 * adam.h's operations lane by lane in the same order, with the same roundings, so
 * every path (AVX-512, AVX2, scalar) gives the same bits. A 16-bit param is written
 * from the new fp32 value in the same pass; with stochastic rounding the new values go
 * through an L1 buffer to the rounding loop of cast.c.
 */
#include <stdlib.h>

#include "adam.h"
#include "simd.h"

/* A chunk's pointers, at its first element. */
struct adam_ptrs {
    struct ampc_adam_ptrs at;
    float *out;             /* stochastic rounding: new weights go here, not to param */
    int stream;             /* 16-bit params through streaming stores (Note [streaming stores]) */
};

static void *ptr_or_null(const struct ampc_list *l, int64_t t)
{
    return l->count ? l->ptr[t] : NULL;
}

static struct adam_ptrs ptrs_at(const struct ampc_adam_lists *l, int64_t t, int64_t i)
{
    struct adam_ptrs q;
    q.at = ampc_adam_ptrs_at(l->params.ptr[t], l->params.dtype, l->grads.ptr[t], l->grads.dtype,
                             ptr_or_null(&l->masters, t), l->exp_avgs.ptr[t],
                             l->exp_avg_sqs.ptr[t], ptr_or_null(&l->max_exp_avg_sqs, t), i);
    q.out = NULL;
    q.stream = 0;
    return q;
}

// ---- scalar: the reference, and the tails ----

INLINE void adam_scalar(const struct adam_ptrs *q, ampc_dtype pt, ampc_dtype gt, int64_t i,
                        int64_t n, const struct ampc_adam_coef *c)
{
    for (; i < n; i++) {
        float w = q->at.master ? q->at.master[i] : ampc_load(q->at.param, pt, i);
        ampc_adam_element(ampc_load(q->at.grad, gt, i), &w, &q->at.m[i], &q->at.v[i],
                          q->at.vmax ? &q->at.vmax[i] : NULL, c);
        if (q->at.master)
            q->at.master[i] = w;
        if (q->out)
            q->out[i] = w;
        else
            ampc_store(q->at.param, pt, i, w);
    }
}

/*
 * Note [hoisted loop state]
 * The unaligned SIMD stores may alias anything, so a loop that reads its pointers,
 * flags or constants through q or c reloads them on every iteration and tests every
 * flag per vector. Each loop below copies them into locals first and takes the flags,
 * the master and lerp choice as arguments: called with constants (adam_shapes), the
 * common AdamW step compiles to a loop with no test in it. On AVX2 (16 registers, a
 * slower divider on older cores) the reloads and tests cost a quarter of the step.
 */

// ---- AVX-512: 16 lanes ----

AVX512 INLINE __m512 max_nan16(__m512 a, __m512 b)
{
    __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_add_ps(_mm512_max_ps(a, b), nan, a, b);
}

#define ADAM_LOOP adam_loop16
#define ADAM_TARGET AVX512
#define VEC __m512
#define LANES 16
#define ALIGN_MASK 31
#define V_SET1 _mm512_set1_ps
#define V_LOADU _mm512_loadu_ps
#define V_STOREU _mm512_storeu_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MUL _mm512_mul_ps
#define V_DIV _mm512_div_ps
#define V_SQRT _mm512_sqrt_ps
#define V_FMADD _mm512_fmadd_ps
#define V_LOAD load16
#define V_STORE_TO store16_to
/* AVX-512 F has no float xor: the sign bit flipped in the integer domain */
#define V_NEG(x) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), \
                                                      _mm512_set1_epi32((int)0x80000000u)))
#define V_MAX_NAN max_nan16
#include "adam_loop.h"
#include "adam_loop_undef.h"

// ---- AVX2 + F16C: 8 lanes ----

AVX2 INLINE __m256 max_nan8(__m256 a, __m256 b)
{
    __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b), nan);
}

#define ADAM_LOOP adam_loop8
#define ADAM_TARGET AVX2
#define VEC __m256
#define LANES 8
#define ALIGN_MASK 15
#define V_SET1 _mm256_set1_ps
#define V_LOADU _mm256_loadu_ps
#define V_STOREU _mm256_storeu_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MUL _mm256_mul_ps
#define V_DIV _mm256_div_ps
#define V_SQRT _mm256_sqrt_ps
#define V_FMADD _mm256_fmadd_ps
#define V_LOAD load8
#define V_STORE_TO store8_to
#define V_NEG(x) _mm256_xor_ps(x, _mm256_set1_ps(-0.0f))
#define V_MAX_NAN max_nan8
#include "adam_loop.h"
#include "adam_loop_undef.h"

// ---- one specialised loop per (ISA, grad dtype, param dtype) ----

/* The shapes compiled with no test in the loop (Note [hoisted loop state]): Adam without
 * weight decay and AdamW, with masters or without, m's lerp from m (beta1 >= 0.5). Any
 * other step takes the same loop with its flags tested per vector. */
#define SHAPES(loop, p, g)                                                            \
    do {                                                                              \
        const int master_ = q->at.master != NULL;                                     \
        const int plain_ = c->w1 < 0.5f && (c->flags & ~AMPC_ADAM_DECAY) == 0;        \
        if (plain_ && c->flags && master_)                                            \
            loop(q, p, g, n, c, AMPC_ADAM_DECAY, 1, 1);                               \
        else if (plain_ && c->flags)                                                  \
            loop(q, p, g, n, c, AMPC_ADAM_DECAY, 0, 1);                               \
        else if (plain_ && master_)                                                   \
            loop(q, p, g, n, c, 0, 1, 1);                                             \
        else if (plain_)                                                              \
            loop(q, p, g, n, c, 0, 0, 1);                                             \
        else                                                                          \
            loop(q, p, g, n, c, c->flags, master_, c->w1 < 0.5f);                     \
    } while (0)

#define PAIR(g, p) ((g) * 3 + (p))
#define CASE(loop, g, p) case PAIR(g, p): SHAPES(loop, p, g); break
#define ALL_PAIRS(loop)                                                               \
    CASE(loop, AMPC_F32, AMPC_F32); CASE(loop, AMPC_F32, AMPC_F16);                   \
    CASE(loop, AMPC_F32, AMPC_BF16); CASE(loop, AMPC_F16, AMPC_F32);                  \
    CASE(loop, AMPC_F16, AMPC_F16); CASE(loop, AMPC_F16, AMPC_BF16);                  \
    CASE(loop, AMPC_BF16, AMPC_F32); CASE(loop, AMPC_BF16, AMPC_F16);                 \
    CASE(loop, AMPC_BF16, AMPC_BF16)

AVX512 static void adam_avx512(const struct adam_ptrs *q, ampc_dtype pt, ampc_dtype gt,
                               int64_t n, const struct ampc_adam_coef *c)
{
    switch (PAIR(gt, pt)) {
    ALL_PAIRS(adam_loop16);
    default: adam_scalar(q, pt, gt, 0, n, c);
    }
}

AVX2 static void adam_avx2(const struct adam_ptrs *q, ampc_dtype pt, ampc_dtype gt, int64_t n,
                           const struct ampc_adam_coef *c)
{
    switch (PAIR(gt, pt)) {
    ALL_PAIRS(adam_loop8);
    default: adam_scalar(q, pt, gt, 0, n, c);
    }
}

static void adam_block(const struct adam_ptrs *q, ampc_dtype pt, ampc_dtype gt, int64_t n,
                       const struct ampc_adam_coef *c)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: adam_avx512(q, pt, gt, n, c); break;
    case ISA_AVX2: adam_avx2(q, pt, gt, n, c); break;
    default: adam_scalar(q, pt, gt, 0, n, c);
    }
}

void ampc_adam_buffers(float *w, float *m, float *v, const void *grad, ampc_dtype gt,
                       int64_t n, const struct ampc_adam_coef *c)
{
    struct adam_ptrs q;
    q.at = ampc_adam_ptrs_at(w, AMPC_F32, grad, gt, w, m, v, NULL, 0);
    q.out = w;
    q.stream = 0;
    adam_block(&q, AMPC_F32, gt, n, c);
}

// ---- the walk over all chunks ----

struct adam_job {
    const struct ampc_adam_lists *lists;
    const struct ampc_adam_coef *coef;      /* one per tensor */
    const struct ampc_adam_args *args;
    int stream;
};

static void adam_span(void *ctx, const struct ampc_span *s)
{
    const struct adam_job *job = ctx;
    const struct ampc_adam_lists *l = job->lists;
    const struct ampc_adam_coef *c = &job->coef[s->tensor];
    ampc_dtype pt = l->params.dtype;
    ampc_dtype gt = l->grads.dtype;
    int64_t n = s->end - s->begin;
    if (!job->args->stochastic || pt == AMPC_F32) {
        struct adam_ptrs q = ptrs_at(l, s->tensor, s->begin);
        q.stream = job->stream;
        adam_block(&q, pt, gt, n, c);
        return;
    }
    float buf[AMPC_BLOCK];
    for (int64_t i = 0; i < n; i += AMPC_BLOCK) {
        int64_t k = n - i < AMPC_BLOCK ? n - i : AMPC_BLOCK;
        struct adam_ptrs q = ptrs_at(l, s->tensor, s->begin + i);
        q.out = buf;
        adam_block(&q, pt, gt, k, c);
        ampc_store_stochastic((uint16_t *)q.at.param, pt, buf, k, c->seed, s->index + i);
    }
}

/* Bytes read plus written by the step (Note [streaming stores] in cpu.h). */
static int64_t bytes_moved(const struct ampc_adam_lists *l)
{
    int64_t param = ampc_dtype_size(l->params.dtype) * (l->masters.count ? 1 : 2);
    int64_t per_elem = ampc_dtype_size(l->grads.dtype) + param + 16 +
                       (l->masters.count ? 8 : 0) + (l->max_exp_avg_sqs.count ? 8 : 0);
    int64_t numel = 0;
    for (int64_t t = 0; t < l->params.count; t++)
        numel += l->params.numel[t];
    return numel * per_elem;
}

struct ampc_adam_coef *ampc_adam_step_coefs(const struct ampc_list *steps,
                                            const struct ampc_adam_control *control,
                                            const struct ampc_adam_args *args, int amsgrad)
{
    int64_t count = steps->count;
    struct ampc_adam_coef *coef = malloc(sizeof(*coef) * (size_t)(count ? count : 1));
    if (!coef)
        return NULL;
    for (int64_t t = 0; t < count; t++) {
        float stored = *(const float *)steps->ptr[t];
        if (t > 0 && stored == *(const float *)steps->ptr[t - 1])
            coef[t] = coef[t - 1];  /* params usually share their step: two pow()s saved */
        else
            coef[t] = ampc_adam_tensor_coef(args, control, stored, amsgrad);
    }
    return coef;
}

ampc_status ampc_adam_cpu(const struct ampc_adam_lists *lists,
                          const struct ampc_adam_control *control,
                          const struct ampc_adam_args *args)
{
    if (control->found_inf && *control->found_inf != 0.0f)
        return AMPC_OK;     /* skipped: nothing moves, the step counts included */
    struct ampc_adam_coef *coef = ampc_adam_step_coefs(&lists->steps, control, args,
                                                       lists->max_exp_avg_sqs.count > 0);
    if (!coef)
        return AMPC_ERR_NOMEM;
    struct adam_job job = { lists, coef, args, bytes_moved(lists) > ampc_cache_bytes() };
    ampc_status st = ampc_for_each_chunk(&lists->params, adam_span, &job);
    if (st == AMPC_OK)
        for (int64_t t = 0; t < lists->steps.count; t++)
            *(float *)lists->steps.ptr[t] += 1.0f;
    free(coef);
    return st;
}
