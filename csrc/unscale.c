/*
 * unscale.c: the fused gradient unscale plus inf/nan check, and its read-only twin.
 *
 * unscale_check: g = g * inv_scale in place, found_inf = 1 if any g was inf or nan.
 * Mirrors torch._amp_foreach_non_finite_check_and_unscale_: the check looks at the
 * input value, the product is one fp32 multiply, 16-bit grads are widened to fp32 and
 * rounded back to nearest even. One pass: each element is read and written once.
 *
 * check_norm: the same check without writing, plus the global L2 norm of the
 * unscaled grads, |inv_scale| * sqrt(sum g^2). A chunk's squares are summed without
 * overflow (Note [fp32 squares when safe] in simd.c) and the chunks' sums in double, in
 * chunk order (deterministic, see cpu.h).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

struct unscale_job {
    const struct ampc_list *grads;
    float inv_scale;
    int found;              /* set (never cleared) by any thread that sees inf/nan */
    double *sumsq;          /* check_norm: one partial sum per chunk */
};

static void unscale_span(void *ctx, const struct ampc_span *s)
{
    struct unscale_job *job = ctx;
    ampc_dtype dt = job->grads->dtype;
    char *g = (char *)job->grads->ptr[s->tensor] + s->begin * ampc_dtype_size(dt);
    int64_t n = s->end - s->begin;
    int found;
    if (job->sumsq) {
        job->sumsq[s->chunk] = 0;
        found = ampc_square_sum_block(g, dt, n, &job->sumsq[s->chunk]);
    } else {
        found = ampc_unscale_block(g, dt, job->inv_scale, n);
    }
    if (found)
        __atomic_store_n(&job->found, 1, __ATOMIC_RELAXED);
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
