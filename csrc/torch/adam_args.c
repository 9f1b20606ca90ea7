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

int packed_layout_fits(struct call *c, const struct list *params, const struct tensor *layout,
                       int64_t size, int64_t steps, int64_t align)
{
    int64_t count = params->count;
    if (layout->dtype != aoti_torch_dtype_int64() || layout->numel != 3 * count)
        fail(c, "layout must be a torch.int64 tensor of 3 values a param (%lld), got %s with "
             "%lld", (long long)(3 * count), dtype_name(layout->dtype), (long long)layout->numel);
    const int64_t *lay = layout->data;
    for (int64_t i = 0; i < count; i++) {
        int64_t off = lay[3 * i];
        int64_t n = lay[3 * i + 1];
        int64_t s = lay[3 * i + 2];
        int64_t end = i > 0 ? lay[3 * i - 3] + lay[3 * i - 2] : 0;
        if (off < end || off % align != 0 || n < 0 || n > size - off
            || s < (i > 0 ? lay[3 * i - 1] + 1 : 0) || s >= steps)
            fail(c, "layout of param %lld (offset %lld, numel %lld, step %lld) is not inside "
                 "the state (%lld a section) and steps (%lld), after the previous param's "
                 "and at a multiple of %lld", (long long)i, (long long)off, (long long)n,
                 (long long)s, (long long)size, (long long)steps, (long long)align);
    }
    for (int64_t i = 0; i < count; i++)
        if (lay[3 * i + 1] != params->numel[i])
            return 0;
    return 1;
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
