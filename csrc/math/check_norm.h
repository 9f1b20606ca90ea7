/*
 * check_norm.h: the per-element math of check_norm, shared by the CPU loops
 * (check_norm.c) and the CUDA kernel (cuda/check_norm.cu): the inf/nan check of
 * unscale_check, and squares summed so that none overflows or underflows unnoticed.
 *
 * Note [fp32 squares when safe]: widening to double costs more than the memory read of
 * a 16-bit grad, so a run of elements (512 on the CPU, one thread's share of a chunk on
 * CUDA) is summed in fp32 while the largest |g| of the run is tracked: below 2^58 no
 * square nor the run's sum can overflow, and from 2^-40 up any square that underflows
 * is below 2^-46 of the largest one. A run outside those bounds (including any inf or
 * nan) is summed again in double.
 */
#ifndef AMPC_CHECK_NORM_H
#define AMPC_CHECK_NORM_H

#include "dtype.h"

#define AMPC_SQUARE_SAFE_MAX 0x5c800000u     /* 2^58 */
#define AMPC_SQUARE_SAFE_MIN 0x2b800000u     /* 2^-40 */

/* Whether a run whose largest |g| has the fp32 bits `top` may be summed in fp32. */
AMPC_HD int ampc_squares_safe_in_f32(uint32_t top)
{
    return top < AMPC_SQUARE_SAFE_MAX && (top >= AMPC_SQUARE_SAFE_MIN || top == 0);
}

/* The square of g in double: exact, and never overflows. */
AMPC_HD double ampc_square(float g)
{
    return (double)g * g;
}

#endif /* AMPC_CHECK_NORM_H */
