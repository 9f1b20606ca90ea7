/*
 * ops_scaler.c: the loss scaler's ops in the torch glue (unscale_check, check_norm,
 * update_scale): arguments taken off the stack and checked, then the kernels run.
 */
#include <math.h>

#include "call.h"

// ---- unscale_check(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) ----

struct unscale_check_job {
    struct ampc_list grads;
    float *found_inf;
    const float *inv_scale;
};

ON_DEVICES(unscale_check, unscale_check_job, &job->grads, job->found_inf, job->inv_scale)

/* grads (written when `written`), found_inf and inv_scale, taken and checked; grads may
 * mix dtypes when `mixed` is not NULL (it is set when they do). */
static struct list *take_grads(struct call *c, StableIValue *stack, int written,
                               struct ampc_list *out, int *mixed, float **found_inf,
                               const float **inv_scale)
{
    struct list *grads = take_list(c, stack[0], "grads", written);
    struct tensor *found = take_tensor(c, stack[1], "found_inf", 1);
    struct tensor *inv = take_tensor(c, stack[2], "inv_scale", 0);
    describe_all(c);
    *out = mixed ? float_list_mixed(c, grads, mixed) : float_list(c, grads);
    check_scalar(c, found, aoti_torch_dtype_float32(), 0);
    check_scalar(c, inv, aoti_torch_dtype_float32(), 0);
    check_overlap(c);
    *found_inf = found->data;
    *inv_scale = inv->data;
    return grads;
}

void ampc_op_unscale_check(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct unscale_check_job job;
    int mixed = 0;
    start(&c, "ampc.unscale_check", on_cuda);
    struct list *grads = take_grads(&c, stack, 1, &job.grads, &mixed, &job.found_inf,
                                    &job.inv_scale);
    struct ampc_list *out = &job.grads;
    run_groups(&c, mixed, &grads, &out, 1, unscale_check_on_cpu, unscale_check_on_cuda, &job);
    call_free(&c);
}

// ---- check_norm(Tensor[] grads, Tensor(a!) found_inf, Tensor inv_scale) -> Tensor ----

struct check_norm_job {
    struct ampc_list grads;
    float *found_inf;
    const float *inv_scale;
    float *norm;
};

ON_DEVICES(check_norm, check_norm_job, &job->grads, job->found_inf, job->norm, job->inv_scale)

void ampc_op_check_norm(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct check_norm_job job;
    AtenTensorHandle norm = NULL;
    start(&c, "ampc.check_norm", on_cuda);
    take_grads(&c, stack, 0, &job.grads, NULL, &job.found_inf, &job.inv_scale);
    /* a 0-dim fp32 tensor on the grads' device, named by the tensor that fixed it */
    shim(&c, aoti_torch_empty_strided(0, NULL, NULL, aoti_torch_dtype_float32(),
                                      c.first->device_type, c.first->device_index, &norm),
         "empty_strided");
    /* owned by the call until the kernel succeeds, so a failure frees it */
    c.singles[c.n_singles++] = (struct tensor){ .h = norm, .name = "norm" };
    shim(&c, torch_get_mutable_data_ptr(norm, (void **)&job.norm), "get_data_ptr");
    run(&c, check_norm_on_cpu, check_norm_on_cuda, &job);
    c.n_singles--;          /* the norm goes to the caller */
    call_free(&c);
    stack[0] = (StableIValue)(uintptr_t)norm;
}

// ---- update_scale(Tensor(a!) scale, Tensor(b!) growth_tracker,
//                   Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor,
//                   float backoff_factor, int growth_interval, int hysteresis,
//                   float min_scale, float max_scale) ----

struct update_scale_job {
    float *scale;
    int32_t *growth_tracker;
    int32_t *hysteresis_tracker;
    const float *found_inf;
    struct ampc_scale_args args;
};

ON_DEVICES(update_scale, update_scale_job,
           job->scale, job->growth_tracker, job->hysteresis_tracker, job->found_inf,
           &job->args)

static void check_update_scale_args(struct call *c, const struct ampc_scale_args *a)
{
    if (!(a->growth_factor > 0 && isfinite(a->growth_factor)))
        fail(c, "growth_factor must be a positive finite number, got %g", a->growth_factor);
    if (!(a->backoff_factor > 0 && isfinite(a->backoff_factor)))
        fail(c, "backoff_factor must be a positive finite number, got %g", a->backoff_factor);
    if (a->growth_interval < 1 || a->growth_interval > INT32_MAX)
        fail(c, "growth_interval must be in [1, 2^31), got %lld", (long long)a->growth_interval);
    if (a->hysteresis < 1 || a->hysteresis > INT32_MAX)
        fail(c, "hysteresis must be in [1, 2^31), got %lld", (long long)a->hysteresis);
    if (!(a->min_scale >= 0 && a->min_scale <= a->max_scale))
        fail(c, "min_scale and max_scale must satisfy 0 <= min_scale <= max_scale, got %g "
                "and %g", a->min_scale, a->max_scale);
}

void ampc_op_update_scale(StableIValue *stack, int on_cuda)
{
    struct call c;
    start(&c, "ampc.update_scale", on_cuda);
    struct tensor *scale = take_tensor(&c, stack[0], "scale", 1);
    struct tensor *growth = take_tensor(&c, stack[1], "growth_tracker", 1);
    struct tensor *hyst = take_tensor(&c, stack[2], "hysteresis_tracker", 1);
    struct tensor *found_inf = take_tensor(&c, stack[3], "found_inf", 0);
    describe_all(&c);
    struct update_scale_job job;
    job.args.growth_factor = take_double(stack[4]);
    job.args.backoff_factor = take_double(stack[5]);
    job.args.growth_interval = (int64_t)stack[6];
    job.args.hysteresis = (int64_t)stack[7];
    job.args.min_scale = take_double(stack[8]);
    job.args.max_scale = take_double(stack[9]);
    check_scalar(&c, scale, aoti_torch_dtype_float32(), 0);
    check_scalar(&c, growth, aoti_torch_dtype_int32(), 0);
    check_scalar(&c, hyst, aoti_torch_dtype_int32(), job.args.hysteresis == 1);
    check_scalar(&c, found_inf, aoti_torch_dtype_float32(), 0);
    check_update_scale_args(&c, &job.args);
    check_overlap(&c);
    job.scale = scale->data;
    job.growth_tracker = growth->data;
    job.hysteresis_tracker = hyst->data;
    job.found_inf = found_inf->data;
    run(&c, update_scale_on_cpu, update_scale_on_cuda, &job);
    call_free(&c);
}

