/*
 * adam_args.c: what the Adam ops (ops_adam.c, ops_lean.c) check alike: the params and
 * grads, the step counts, the numbers.
 */
#include <math.h>

#include "call.h"

void take_params_grads(struct call *c, struct list *params, struct list *grads,
                       struct ampc_list *p, struct ampc_list *g)
{
    describe_all(c);
    *p = float_list(c, params);
    *g = float_list(c, grads);
    check_same_shapes(c, grads, "grads", params, "params");
}

struct ampc_list take_steps(struct call *c, struct list *steps, struct list *params)
{
    if (steps->count != params->count)
        fail(c, "steps must have as many tensors as params (%lld), got %lld",
             (long long)params->count, (long long)steps->count);
    for (int64_t i = 0; i < steps->count; i++)
        check_scalar(c, &steps->t[i], aoti_torch_dtype_float32(), 0);
    return as_list(steps, AMPC_F32);
}

void check_adam_args(struct call *c, const struct ampc_adam_args *a, int lr_on_device)
{
    if (!lr_on_device && !(a->lr >= 0 && isfinite(a->lr)))
        fail(c, "lr must be a finite number >= 0, got %g", a->lr);
    if (!(a->beta1 >= 0 && a->beta1 < 1))
        fail(c, "beta1 must be in [0, 1), got %g", a->beta1);
    if (!(a->beta2 >= 0 && a->beta2 < 1))
        fail(c, "beta2 must be in [0, 1), got %g", a->beta2);
    if (!(a->eps >= 0 && isfinite(a->eps)))
        fail(c, "eps must be a finite number >= 0, got %g", a->eps);
    if (!(a->weight_decay >= 0 && isfinite(a->weight_decay)))
        fail(c, "weight_decay must be a finite number >= 0, got %g", a->weight_decay);
}
