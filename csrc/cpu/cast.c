/*
 * cast.c: copy a list of tensors into a list of tensors of another float dtype, on the
 * CPU.
 *
 * dst[i][k] = src[i][k] converted from src's dtype to dst's (fp32, fp16, bf16, any
 * pair, the same dtype included). Every conversion goes through fp32, which holds
 * fp16 and bf16 exactly, so there is exactly one rounding: round to nearest even by
 * default, bit-identical to Tensor.to(); stochastic rounding on request (cast.h).
 *
 * The loops are fused: an element is loaded, widened, narrowed and stored in registers,
 * with the best SIMD the CPU has (simd.h): AVX-512 (16 lanes), AVX2 + F16C (8 lanes) or
 * scalar, the tails in scalar code that gives the same bits. Each (ISA, dtype pair) gets
 * its own branch-free loop: the bodies take the dtypes as arguments and are always
 * inlined into a switch over constant dtypes.
 */
#include <string.h>

#include "cast.h"
#include "simd.h"

// ---- scalar: the reference, and the tails of the vector loops ----

static void cast_scalar(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t i,
                        int64_t n)
{
    for (; i < n; i++)
        ampc_store(dst, dt, i, ampc_load(src, st, i));
}

// ---- AVX-512: 16 lanes ----

AVX512 INLINE void cast_loop16(void *dst, ampc_dtype dt, const void *src, ampc_dtype st,
                               int64_t n, int stream)
{
    int64_t i = 0;
    if (stream && ((uintptr_t)dst & 63) == 0) {
        for (; i + 32 <= n; i += 32) {  /* two vectors: whole 64-byte lines of 16-bit out */
            __m512 a = load16(src, st, i);
            __m512 b = load16(src, st, i + 16);
            store16_to(dst, dt, i, a, 1);
            store16_to(dst, dt, i + 16, b, 1);
        }
        _mm_sfence();                   /* streamed lines are visible before we return */
    }
    for (; i + 32 <= n; i += 32) {
        __m512 a = load16(src, st, i);
        __m512 b = load16(src, st, i + 16);
        store16(dst, dt, i, a);
        store16(dst, dt, i + 16, b);
    }
    for (; i + 16 <= n; i += 16)
        store16(dst, dt, i, load16(src, st, i));
    cast_scalar(dst, dt, src, st, i, n);
}

// ---- AVX2 + F16C: 8 lanes ----

AVX2 INLINE void cast_loop8(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                            int stream)
{
    int64_t i = 0;
    if (stream && ((uintptr_t)dst & 63) == 0) {
        for (; i + 8 <= n; i += 8)
            store8_to(dst, dt, i, load8(src, st, i), 1);
        _mm_sfence();
    }
    for (; i + 8 <= n; i += 8)
        store8(dst, dt, i, load8(src, st, i));
    cast_scalar(dst, dt, src, st, i, n);
}

// ---- one specialised loop per (ISA, dtype pair) ----

#define PAIR(s, d) ((s) * 3 + (d))

AVX512 static void cast_avx512(void *dst, ampc_dtype dt, const void *src, ampc_dtype st,
                               int64_t n, int stream)
{
    switch (PAIR(st, dt)) {
    case PAIR(AMPC_F32, AMPC_F16): cast_loop16(dst, AMPC_F16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F32, AMPC_BF16): cast_loop16(dst, AMPC_BF16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F16, AMPC_F32): cast_loop16(dst, AMPC_F32, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_F16, AMPC_BF16): cast_loop16(dst, AMPC_BF16, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F32): cast_loop16(dst, AMPC_F32, src, AMPC_BF16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F16): cast_loop16(dst, AMPC_F16, src, AMPC_BF16, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

AVX2 static void cast_avx2(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                           int stream)
{
    switch (PAIR(st, dt)) {
    case PAIR(AMPC_F32, AMPC_F16): cast_loop8(dst, AMPC_F16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F32, AMPC_BF16): cast_loop8(dst, AMPC_BF16, src, AMPC_F32, n, stream); break;
    case PAIR(AMPC_F16, AMPC_F32): cast_loop8(dst, AMPC_F32, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_F16, AMPC_BF16): cast_loop8(dst, AMPC_BF16, src, AMPC_F16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F32): cast_loop8(dst, AMPC_F32, src, AMPC_BF16, n, stream); break;
    case PAIR(AMPC_BF16, AMPC_F16): cast_loop8(dst, AMPC_F16, src, AMPC_BF16, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

void ampc_cast_block(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                     int stream)
{
    if (st == dt) {
        memcpy(dst, src, (size_t)(n * ampc_dtype_size(st)));
        return;
    }
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: cast_avx512(dst, dt, src, st, n, stream); break;
    case ISA_AVX2: cast_avx2(dst, dt, src, st, n, stream); break;
    default: cast_scalar(dst, dt, src, st, 0, n);
    }
}

// ---- stochastic rounding and the walk over the list ----

struct cast_job {
    const struct ampc_list *dst;
    const struct ampc_list *src;
    int stochastic;
    uint64_t seed;          /* args->seed, or the value of args->seed_tensor */
    int stream;             /* Note [streaming stores] */
};

/* Auto-vectorized clones of the stochastic-rounding loop. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

CLONES static void store_bf16_stochastic(uint16_t *dst, const float *src, int64_t n,
                                         uint32_t key, uint32_t index_lo)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = ampc_f32_to_bf16_sr(src[i], ampc_random_bits_keyed(key, index_lo + (uint32_t)i));
}

/* The stochastically rounded fp16 values, still as fp32 (cast.h's ampc_f16_sr_value: exact
 * in fp16, so the round-to-nearest store that follows only packs them). */
CLONES static void f16_stochastic_values(float *out, const float *src, int64_t n,
                                         uint32_t key, uint32_t index_lo)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = ampc_f16_sr_value(src[i], ampc_random_bits_keyed(key, index_lo + (uint32_t)i));
}

/* The run is split where the index's high half changes (a new key). */
void ampc_store_stochastic(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n,
                             uint64_t seed, int64_t index)
{
    while (n > 0) {
        uint64_t k = (uint64_t)index;
        int64_t run = (int64_t)(((k >> 32) + 1) << 32) - index;  /* to the next 2^32 */
        run = run < n ? run : n;
        uint32_t key = ampc_random_key(seed, (uint32_t)(k >> 32));
        if (dtype == AMPC_F16) {
            float buf[AMPC_BLOCK];
            for (int64_t i = 0; i < run; i += AMPC_BLOCK) {
                int64_t m = run - i < AMPC_BLOCK ? run - i : AMPC_BLOCK;
                f16_stochastic_values(buf, src + i, m, key, (uint32_t)k + (uint32_t)i);
                ampc_cast_block(dst + i, AMPC_F16, buf, AMPC_F32, m, 0);
            }
        } else {
            store_bf16_stochastic(dst, src, run, key, (uint32_t)k);
        }
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
    if (!job->stochastic || dd == AMPC_F32 || sd == dd) {    /* nothing random */
        ampc_cast_block(dst, dd, src, sd, n, job->stream);
        return;
    }
    float buf[AMPC_BLOCK];
    for (int64_t i = 0; i < n; i += AMPC_BLOCK) {
        int64_t m = n - i < AMPC_BLOCK ? n - i : AMPC_BLOCK;
        const float *f = (const float *)src + i;
        if (sd != AMPC_F32) {
            ampc_cast_block(buf, AMPC_F32, src + i * ampc_dtype_size(sd), sd, m, 0);
            f = buf;
        }
        ampc_store_stochastic((uint16_t *)dst + i, dd, f, m, job->seed, s->index + i);
    }
}

ampc_status ampc_cast_cpu(const struct ampc_list *dst, const struct ampc_list *src,
                          const struct ampc_cast_args *args)
{
    int64_t moved = 0;      /* bytes read plus written */
    for (int64_t i = 0; i < dst->count; i++)
        moved += dst->numel[i] * (ampc_dtype_size(dst->dtype) + ampc_dtype_size(src->dtype));
    uint64_t seed = args->seed_tensor ? (uint64_t)*args->seed_tensor : args->seed;
    struct cast_job job = { dst, src, args->stochastic, seed, moved > ampc_cache_bytes() };
    return ampc_for_each_chunk(src, cast_span, &job);
}
