/*
 * lean.c: the CPU lean Adam/AdamW step (ampc.h's struct ampc_lean_lists, lean.h), one
 * pass over memory: the chunks of all tensors on torch's thread pool (cpu.h), each
 * stepped by the loops of the best instruction set there is (lean_loops.h).
 */
#include <stdlib.h>

#include "simd.h"       // defines: ampc_cpu_isa

#define LEAN_CHUNK ampc_lean_chunk_scalar
#include "lean_loops.h"

static void lean_span(void *ctx, const struct ampc_span *s)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: ampc_lean_chunk_avx512(ctx, s); break;
    case ISA_AVX2: ampc_lean_chunk_avx2(ctx, s); break;
    default: ampc_lean_chunk_scalar(ctx, s);
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
    ampc_dtype pt = lists->params.dtype;
    struct lean_chunks job = { lists, coef, args->moments, AMPC_WEIGHT_PARAM, AMPC_WRITE_NEAREST };
    if (lists->masters.count)
        job.weight = AMPC_WEIGHT_MASTER;
    else if (lists->compensations.count)
        job.weight = AMPC_WEIGHT_KAHAN;      /* the pair is written to nearest, always */
    if (args->adam.stochastic && pt != AMPC_F32 && job.weight != AMPC_WEIGHT_KAHAN)
        job.write = pt == AMPC_BF16 ? AMPC_WRITE_SR : AMPC_WRITE_LATER;
    ampc_status st = ampc_for_each_chunk(&lists->params, lean_span, &job);
    if (st == AMPC_OK)
        for (int64_t t = 0; t < lists->steps.count; t++)
            *(float *)lists->steps.ptr[t] += 1.0f;
    free(coef);
    return st;
}

/* The 8-bit moments' layout (lean.h) for the Python side (ampc.ops.QBLOCK, the codes'
 * tables), so that it is written once. */
__attribute__((visibility("default"))) void ampc_lean_layout(int64_t *qblock, float *m_max,
                                                            float *v_max)
{
    *qblock = AMPC_QBLOCK;
    *m_max = AMPC_Q8M_MAX;
    *v_max = AMPC_Q8V_MAX;
}
