/*
 * unscale_check.c: the fused gradient unscale plus inf/nan check, on the CPU.
 *
 * g = g * inv_scale in place, found_inf = 1 if any g was inf or nan. Mirrors
 * torch._amp_foreach_non_finite_check_and_unscale_: the check looks at the input value,
 * the product is one fp32 multiply (unscale_check.h), 16-bit grads are widened to fp32
 * and rounded back to nearest even. One pass: each element is read and written once,
 * with the best SIMD the CPU has (simd.h); the tails in scalar code.
 */
#include "simd.h"
#include "unscale_check.h"

// ---- scalar: the reference, and the tails of the vector loops ----

static int unscale_scalar(void *g, ampc_dtype t, float s, int64_t i, int64_t n)
{
    int bad = 0;
    for (; i < n; i++)
        ampc_store(g, t, i, ampc_unscale_element(ampc_load(g, t, i), s, &bad));
    return bad;
}

// ---- AVX-512: 16 lanes ----

AVX512 INLINE int unscale_loop16(void *g, ampc_dtype t, float s, int64_t n)
{
    __m512 vs = _mm512_set1_ps(s);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = load16(g, t, i);
        bad |= nonfinite16(f);
        store16(g, t, i, _mm512_mul_ps(f, vs));
    }
    return (bad != 0) | unscale_scalar(g, t, s, i, n);
}

// ---- AVX2 + F16C: 8 lanes ----

AVX2 INLINE int unscale_loop8(void *g, ampc_dtype t, float s, int64_t n)
{
    __m256 vs = _mm256_set1_ps(s);
    int bad = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = load8(g, t, i);
        bad |= nonfinite8(f);
        store8(g, t, i, _mm256_mul_ps(f, vs));
    }
    return (bad != 0) | unscale_scalar(g, t, s, i, n);
}

// ---- one specialised loop per (ISA, dtype) ----

AVX512 static int unscale_avx512(void *g, ampc_dtype t, float s, int64_t n)
{
    switch (t) {
    case AMPC_F32: return unscale_loop16(g, AMPC_F32, s, n);
    case AMPC_F16: return unscale_loop16(g, AMPC_F16, s, n);
    default: return unscale_loop16(g, AMPC_BF16, s, n);
    }
}

AVX2 static int unscale_avx2(void *g, ampc_dtype t, float s, int64_t n)
{
    switch (t) {
    case AMPC_F32: return unscale_loop8(g, AMPC_F32, s, n);
    case AMPC_F16: return unscale_loop8(g, AMPC_F16, s, n);
    default: return unscale_loop8(g, AMPC_BF16, s, n);
    }
}

static int unscale_block(void *g, ampc_dtype dtype, float s, int64_t n)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return unscale_avx512(g, dtype, s, n);
    case ISA_AVX2: return unscale_avx2(g, dtype, s, n);
    default: return unscale_scalar(g, dtype, s, 0, n);
    }
}

// ---- the walk over the list ----

struct unscale_job {
    const struct ampc_list *grads;
    float inv_scale;
    int found;              /* set (never cleared) by any thread that sees inf/nan */
};

static void unscale_span(void *ctx, const struct ampc_span *s)
{
    struct unscale_job *job = ctx;
    ampc_dtype dt = job->grads->dtype;
    char *g = (char *)job->grads->ptr[s->tensor] + s->begin * ampc_dtype_size(dt);
    if (unscale_block(g, dt, job->inv_scale, s->end - s->begin))
        __atomic_store_n(&job->found, 1, __ATOMIC_RELAXED);
}

ampc_status ampc_unscale_check_cpu(const struct ampc_list *grads, float *found_inf,
                                   const float *inv_scale)
{
    struct unscale_job job = { grads, *inv_scale, 0 };
    ampc_status st = ampc_for_each_chunk(grads, unscale_span, &job);
    if (st == AMPC_OK && job.found)
        *found_inf = 1.0f;
    return st;
}
