/*
 * unscale.c: the fused gradient unscale plus inf/nan check, and its read-only twin.
 *
 * unscale_check: g = g * inv_scale in place, found_inf = 1 if any g was inf or nan.
 * Mirrors torch._amp_foreach_non_finite_check_and_unscale_: the check looks at the
 * input value, the product is one fp32 multiply, 16-bit grads are widened to fp32 and
 * rounded back to nearest even. One pass: each element is read and written once.
 *
 * check_norm: the same check without writing, plus the global L2 norm of the
 * unscaled grads, |inv_scale| * sqrt(sum g^2). Squares are summed in double (SIMD lanes
 * within a block), in a fixed order across blocks and chunks (deterministic, see cpu.h).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

/* Auto-vectorized clones: the loops below are plain C on purpose. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

struct unscale_job {
    const struct ampc_list *grads;
    float inv_scale;
    int found;              /* set (never cleared) by any thread that sees inf/nan */
    double *sumsq;          /* check_norm: one partial sum per chunk */
};

/* out = x * s; returns nonzero when any x was inf or nan (all exponent bits set). */
CLONES static int scale_and_check(float *out, const float *x, float s, int64_t n)
{
    const uint32_t *u = (const uint32_t *)x;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
        out[i] = x[i] * s;
    }
    return bad != 0;
}

/* *sum += sum of x^2, in double SIMD lanes: the square of a finite fp32 value can
 * overflow or underflow fp32 (scaled grads of 2^64), never a double. Nonzero on inf/nan. */
CLONES static int square_sum_and_check(const float *x, int64_t n, double *sum)
{
    const uint32_t *u = (const uint32_t *)x;
    double s = 0;
    uint32_t bad = 0;
#pragma omp simd reduction(+ : s) reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
        s += (double)x[i] * x[i];
    }
    *sum += s;
    return bad != 0;
}

static void unscale_span(void *ctx, const struct ampc_span *s)
{
    struct unscale_job *job = ctx;
    ampc_dtype dt = job->grads->dtype;
    char *g = (char *)job->grads->ptr[s->tensor] + s->begin * ampc_dtype_size(dt);
    int64_t n = s->end - s->begin;
    float buf[AMPC_BLOCK];
    double sumsq = 0;
    int found = 0;
    for (int64_t i = 0; i < n; i += AMPC_BLOCK) {
        int64_t m = n - i < AMPC_BLOCK ? n - i : AMPC_BLOCK;
        char *p = g + i * ampc_dtype_size(dt);
        const float *f = ampc_load_block(buf, p, dt, m);
        if (job->sumsq) {
            found |= square_sum_and_check(f, m, &sumsq);
        } else {
            /* fp32 grads are scaled where they lie, 16-bit ones through buf */
            float *out = dt == AMPC_F32 ? (float *)p : buf;
            found |= scale_and_check(out, f, job->inv_scale, m);
            ampc_store_block(p, dt, out, m);
        }
    }
    if (found)
        __atomic_store_n(&job->found, 1, __ATOMIC_RELAXED);
    if (job->sumsq)
        job->sumsq[s->chunk] = sumsq;
}

ampc_status ampc_unscale_check_cpu(const struct ampc_list *grads, float *found_inf,
                                   const float *inv_scale)
{
    struct unscale_job job = { grads, *inv_scale, 0, NULL };
    ampc_status st = ampc_for_each_chunk(grads, unscale_span, &job);
    if (st == AMPC_OK && job.found)
        *found_inf = 1.0f;
    return st;
}

ampc_status ampc_check_norm_cpu(const struct ampc_list *grads, float *found_inf,
                                float *norm, const float *inv_scale)
{
    int64_t chunks = ampc_chunk_count(grads);
    struct unscale_job job = { grads, *inv_scale, 0, NULL };
    job.sumsq = malloc(sizeof(double) * (size_t)(chunks > 0 ? chunks : 1));
    if (!job.sumsq)
        return AMPC_ERR_NOMEM;
    ampc_status st = ampc_for_each_chunk(grads, unscale_span, &job);
    if (st == AMPC_OK) {
        double total = 0;
        for (int64_t c = 0; c < chunks; c++)
            total += job.sumsq[c];
        *norm = (float)(fabs((double)job.inv_scale) * sqrt(total));
        if (job.found)
            *found_inf = 1.0f;
    }
    free(job.sumsq);
    return st;
}
