/*
 * q8.c: tensors kept in 8 bits on the CPU (encode_q8, decode_q8): one byte an element and
 * one fp32 scale, the block's absmax, a block of AMPC_QBLOCK elements, in lean.h's exp_avg
 * codes (Note [8-bit moments]: a sign and a small float of 4 exponent and 3 mantissa bits,
 * relative precision kept over 19 binades below the block's absmax). What ampc.memory
 * keeps of a saved activation.
 *
 * Chunks start at multiples of AMPC_CHUNK, so at block boundaries. A block's 16-bit values
 * are widened first (cast.c's SIMD loops), so the loops here see fp32 only: the absmax as
 * a max of bits (Note [amax as bits]), then the codes: on AVX-512 and AVX2 written out by
 * hand and narrowed to bytes in registers (q8_avx512.c, q8_avx2.c), elsewhere (and for a
 * block's tail) in 32-bit lanes, packed to bytes by a loop of their own (a loop that stores
 * bytes narrows all its arithmetic to bytes). Each loop here is compiled for AVX-512, AVX2
 * and the baseline (target_clones); every operation is exact or rounded on its own, so all
 * give the same bits, and CUDA's (cuda/q8.cu) too.
 */
#include <string.h>

#include "lean.h"
#include "q8_cpu.h"
#include "simd.h"       // defines: ampc_cpu_isa

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

struct q8_job {
    const struct ampc_list *values;     /* src of encode, dst of decode */
    const struct ampc_list *codes;
    const struct ampc_list *scales;
};

CLONES static uint32_t absmax_bits(const float *x, int64_t n)
{
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = ampc_abs_bits(x[i]);
        m = b > m ? b : m;
    }
    return m;
}

CLONES static void codes_of(uint32_t *c, const float *x, int64_t n, float absmax)
{
    const float factor = ampc_q8_code_factor(AMPC_Q8M_MAX, absmax);  /* once, out of the loop */
    if (factor != 0.0f) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            c[i] = ampc_q8m_code_by(x[i], factor);
        return;
    }
    for (int64_t i = 0; i < n; i++)     /* a tiny absmax: the divide (lean.h) */
        c[i] = ampc_q8m_code(x[i], absmax);
}

CLONES static void pack(uint8_t *q, const uint32_t *c, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        q[i] = (uint8_t)c[i];
}

CLONES static void values_of(float *x, const uint8_t *q, int64_t n, float factor)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        x[i] = ampc_q8m_decode(q[i], factor);
}

/* The block's codes a vector at a time, written as bytes, by the best instruction set
 * there is (q8_avx512.c, q8_avx2.c); returns how many (none under a tiny absmax, whose
 * codes divide: lean.h). */
static int64_t codes_by_isa(uint8_t *q, const float *x, int64_t n, float absmax)
{
    const float factor = ampc_q8_code_factor(AMPC_Q8M_MAX, absmax);
    if (factor == 0.0f)
        return 0;
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return ampc_q8_codes_avx512(q, x, n, factor);
    case ISA_AVX2: return ampc_q8_codes_avx2(q, x, n, factor);
    default: return 0;
    }
}

static void encode_span(void *ctx, const struct ampc_span *s)
{
    const struct q8_job *job = ctx;
    const ampc_dtype st = job->values->dtype;
    const char *src = job->values->ptr[s->tensor];
    uint8_t *codes = job->codes->ptr[s->tensor];
    float *scales = job->scales->ptr[s->tensor];
    float buf[AMPC_QBLOCK];
    uint32_t c[AMPC_QBLOCK];
    for (int64_t i = s->begin; i < s->end; i += AMPC_QBLOCK) {
        const int64_t n = s->end - i < AMPC_QBLOCK ? s->end - i : AMPC_QBLOCK;
        const float *x = (const float *)src + i;
        if (st != AMPC_F32) {
            ampc_cast_block(buf, AMPC_F32, src + i * ampc_dtype_size(st), st, n, 0);
            x = buf;
        }
        const float absmax = ampc_bits_f32(absmax_bits(x, n));
        scales[i / AMPC_QBLOCK] = absmax;
        if (ampc_q8_codes_zero(absmax)) {
            memset(codes + i, 0, (size_t)n);
            continue;
        }
        const int64_t done = codes_by_isa(codes + i, x, n, absmax);
        codes_of(c, x + done, n - done, absmax);
        pack(codes + i + done, c, n - done);
    }
}

static void decode_span(void *ctx, const struct ampc_span *s)
{
    const struct q8_job *job = ctx;
    const ampc_dtype dt = job->values->dtype;
    char *dst = job->values->ptr[s->tensor];
    const uint8_t *codes = job->codes->ptr[s->tensor];
    const float *scales = job->scales->ptr[s->tensor];
    float buf[AMPC_QBLOCK];
    for (int64_t i = s->begin; i < s->end; i += AMPC_QBLOCK) {
        const int64_t n = s->end - i < AMPC_QBLOCK ? s->end - i : AMPC_QBLOCK;
        float *x = dt == AMPC_F32 ? (float *)dst + i : buf;
        values_of(x, codes + i, n, ampc_q8m_factor(scales[i / AMPC_QBLOCK]));
        if (dt != AMPC_F32)
            ampc_cast_block(dst + i * ampc_dtype_size(dt), dt, buf, AMPC_F32, n, 0);
    }
}

ampc_status ampc_encode_q8_cpu(const struct ampc_list *codes, const struct ampc_list *scales,
                               const struct ampc_list *src)
{
    struct q8_job job = { src, codes, scales };
    return ampc_for_each_chunk(src, encode_span, &job);
}

ampc_status ampc_decode_q8_cpu(const struct ampc_list *dst, const struct ampc_list *codes,
                               const struct ampc_list *scales)
{
    struct q8_job job = { dst, codes, scales };
    return ampc_for_each_chunk(dst, decode_span, &job);
}
