/*
 * update_scale.c: dynamic loss-scale update on the CPU; the rule lives in update_scale.h.
 */
#include "update_scale.h"

ampc_status ampc_update_scale_cpu(float *scale, int32_t *growth_tracker,
                                  int32_t *hysteresis_tracker, const float *found_inf,
                                  const struct ampc_scale_args *args)
{
    ampc_update_scale_step(scale, growth_tracker, hysteresis_tracker, *found_inf, args);
    return AMPC_OK;
}
