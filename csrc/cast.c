/*
 * cast.c: copy a list of tensors into a list of tensors of another float dtype.
 *
 * dst[i][k] = src[i][k] converted from src's dtype to dst's (fp32, fp16, bf16, any
 * pair, the same dtype included). Every conversion goes through fp32, which holds
 * fp16 and bf16 exactly, so there is exactly one rounding: round to nearest even by
 * default, bit-identical to Tensor.to(); stochastic rounding on request (see Note
 * [stochastic rounding] in ampc.h).
 */
#include <string.h>

#include "cpu.h"
#include "dtype.h"

struct cast_job {
    const struct ampc_list *dst;
    const struct ampc_list *src;
    const struct ampc_cast_args *args;
};

/* Auto-vectorized clones of the stochastic-rounding loop. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

CLONES static void store_bf16_stochastic(uint16_t *dst, const float *src, int64_t n,
                                         uint32_t key, uint32_t index_lo)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = ampc_f32_to_bf16_sr(src[i], ampc_random_bits_keyed(key, index_lo + (uint32_t)i));
}

/* fp16 rounding has too many cases to vectorize: scalar. */
static void store_f16_stochastic(uint16_t *dst, const float *src, int64_t n, uint32_t key,
                                 uint32_t index_lo)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = ampc_f32_to_f16_sr(src[i], ampc_random_bits_keyed(key, index_lo + (uint32_t)i));
}

/* Stochastic rounding of n fp32 values; element i uses the random bits of list-wide
 * element `index + i`. The run is split where the index's high half changes. */
static void store_stochastic(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n,
                             uint64_t seed, int64_t index)
{
    while (n > 0) {
        uint64_t k = (uint64_t)index;
        int64_t run = (int64_t)(((k >> 32) + 1) << 32) - index;  /* to the next 2^32 */
        run = run < n ? run : n;
        uint32_t key = ampc_random_key(seed, (uint32_t)(k >> 32));
        if (dtype == AMPC_F16)
            store_f16_stochastic(dst, src, run, key, (uint32_t)k);
        else
            store_bf16_stochastic(dst, src, run, key, (uint32_t)k);
        dst += run;
        src += run;
        index += run;
        n -= run;
    }
}

static void cast_span(void *ctx, const struct ampc_span *s)
{
    const struct cast_job *job = ctx;
    ampc_dtype sd = job->src->dtype;
    ampc_dtype dd = job->dst->dtype;
    const char *src = (const char *)job->src->ptr[s->tensor] + s->begin * ampc_dtype_size(sd);
    char *dst = (char *)job->dst->ptr[s->tensor] + s->begin * ampc_dtype_size(dd);
    int64_t n = s->end - s->begin;
    if (sd == dd) {
        memcpy(dst, src, (size_t)(n * ampc_dtype_size(sd)));
        return;
    }
    int stochastic = job->args->stochastic && dd != AMPC_F32;  /* widening is exact */
    float buf[AMPC_BLOCK];
    for (int64_t i = 0; i < n; i += AMPC_BLOCK) {
        int64_t m = n - i < AMPC_BLOCK ? n - i : AMPC_BLOCK;
        if (dd == AMPC_F32) {   /* widen straight into dst */
            ampc_load_block((float *)dst + i, src + i * ampc_dtype_size(sd), sd, m);
            continue;
        }
        const float *f = ampc_load_block(buf, src + i * ampc_dtype_size(sd), sd, m);
        if (stochastic)
            store_stochastic((uint16_t *)dst + i, dd, f, m, job->args->seed, s->index + i);
        else
            ampc_store_block(dst + i * ampc_dtype_size(dd), dd, f, m);
    }
}

ampc_status ampc_cast_cpu(const struct ampc_list *dst, const struct ampc_list *src,
                          const struct ampc_cast_args *args)
{
    struct cast_job job = { dst, src, args };
    return ampc_for_each_chunk(src, cast_span, &job);
}
