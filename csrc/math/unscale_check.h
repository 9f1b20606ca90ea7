/*
 * unscale_check.h: one gradient element of unscale_check, shared by the CPU loops
 * (unscale_check.c, whose SIMD lanes do the same) and the CUDA kernel
 * (cuda/unscale_check.cu).
 *
 * As torch._amp_foreach_non_finite_check_and_unscale_: the inf/nan check looks at the
 * input, the product is one fp32 multiply. Note [found_inf is sticky]: the flag is only
 * ever set.
 */
#ifndef AMPC_UNSCALE_CHECK_H
#define AMPC_UNSCALE_CHECK_H

#include "dtype.h"

/* g * inv_scale; *bad set when g is inf or nan. A factor of 1 leaves g as it is, NaN
 * payload included, as torch's kernels do. */
AMPC_HD float ampc_unscale_element(float g, float inv_scale, int *bad)
{
    *bad |= ampc_non_finite(g);
    return inv_scale == 1.0f ? g : g * inv_scale;
}

#endif /* AMPC_UNSCALE_CHECK_H */
