/*
 * ops_scaler.c: the loss scaler's ops in the torch glue (unscale_check, check_norm,
 * update_scale): arguments checked, then the kernels run.
 */
#include <math.h>

#include "call.h"

// ---- unscale_check and check_norm ----

struct unscale_check_job {
    struct ampc_list grads;
    float *found_inf;
    const float *inv_scale;
};

ON_DEVICES(unscale_check, unscale_check_job, &job->grads, job->found_inf, job->inv_scale)

/* grads (of one dtype or mixed: *mixed is set when they mix), found_inf and inv_scale,
 * checked. */
static void check_grads(struct call *c, struct list *grads, struct tensor *found_inf,
                        struct tensor *inv_scale, struct ampc_list *out, int *mixed)
{
    describe_all(c);
    *out = float_list_mixed(c, grads, mixed);
    check_scalar(c, found_inf, aoti_torch_dtype_float32(), 0);
    check_scalar(c, inv_scale, aoti_torch_dtype_float32(), 0);
    check_overlap(c);
}

void ampc_op_unscale_check(struct call *c, struct unscale_check_args *a)
{
    struct unscale_check_job job;
    int mixed = 0;
    check_grads(c, a->grads, a->found_inf, a->inv_scale, &job.grads, &mixed);
    job.found_inf = a->found_inf->data;
    job.inv_scale = a->inv_scale->data;
    struct ampc_list *out = &job.grads;
    run_groups(c, mixed, &a->grads, &out, 1, unscale_check_on_cpu, unscale_check_on_cuda, &job);
}

struct check_norm_job {
    struct ampc_list grads;
    float *found_inf;
    const float *inv_scale;
    float *norm;            /* where the next run writes its norm */
};

/* each run moves job->norm on: the dtype groups of mixed grads write one norm each */
ON_DEVICES(check_norm, check_norm_job, &job->grads, job->found_inf, job->norm++,
           job->inv_scale)

/* A new fp32 tensor of `n` elements (0-dim for 0) on the device of the call, owned by the
 * call until the caller takes it back; its data into *data. */
static AtenTensorHandle new_f32(struct call *c, int64_t n, float **data)
{
    AtenTensorHandle h = NULL;
    int64_t stride = 1;
    shim(c, aoti_torch_empty_strided(n > 0, &n, &stride, aoti_torch_dtype_float32(),
                                     c->first->device_type, c->first->device_index, &h),
         "empty_strided");
    c->singles[c->n_singles++] = (struct tensor){ .h = h, .name = "norm" };
    shim(c, torch_get_mutable_data_ptr(h, (void **)data), "get_data_ptr");
    return h;
}

/* The number of dtypes among the tensors of ls. */
static int count_dtypes(const struct list *ls)
{
    int seen[3] = { 0, 0, 0 };
    for (int64_t i = 0; i < ls->count; i++) {
        ampc_dtype d = AMPC_F32;
        to_ampc_dtype(ls->t[i].dtype, &d);
        seen[d] = 1;
    }
    return seen[0] + seen[1] + seen[2];
}

/*
 * The norm of grads of several dtypes: each dtype group writes its norm (inv_scale
 * applied) to parts[g], then check_norm of the list [parts[0..groups)] with a factor of 1
 * is the norm of them all. parts[groups] holds that 1 (filled on the device: no host
 * sync) and parts[groups + 1] takes the found_inf of that last run, which is not the
 * grads'.
 */
static void check_norm_groups(struct call *c, struct check_norm_job *job, struct list *grads,
                              float *norm)
{
    int64_t groups = count_dtypes(grads);
    float *parts = NULL;
    AtenTensorHandle h = new_f32(c, groups + 2, &parts);
    shim(c, aoti_torch_aten_fill__Scalar(h, 1.0), "fill_");
    struct ampc_list *out = &job->grads;
    job->norm = parts;
    run_groups(c, 1, &grads, &out, 1, check_norm_on_cpu, check_norm_on_cuda, job);
    void *ptr = parts;
    job->grads = (struct ampc_list){ &ptr, &groups, 1, AMPC_F32 };
    job->inv_scale = parts + groups;
    job->found_inf = parts + groups + 1;
    job->norm = norm;
    run(c, check_norm_on_cpu, check_norm_on_cuda, job);
}

void ampc_op_check_norm(struct call *c, struct check_norm_args *a)
{
    struct check_norm_job job;
    int mixed = 0;
    float *norm = NULL;
    check_grads(c, a->grads, a->found_inf, a->inv_scale, &job.grads, &mixed);
    job.found_inf = a->found_inf->data;
    job.inv_scale = a->inv_scale->data;
    /* a 0-dim fp32 tensor on the grads' device, named by the tensor that fixed it */
    AtenTensorHandle h = new_f32(c, 0, &norm);
    int mine = c->n_singles - 1;
    job.norm = norm;
    if (mixed)
        check_norm_groups(c, &job, a->grads, norm);
    else
        run(c, check_norm_on_cpu, check_norm_on_cuda, &job);
    /* the norm goes to the caller: the call no longer frees it */
    c->singles[mine] = c->singles[--c->n_singles];
    c->ret = (StableIValue)(uintptr_t)h;
}

// ---- update_scale ----

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

/* The rules of the update's numbers; ampc.GradScaler asks them too, at construction. */
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
    if (!(a->max_scale > 0))
        fail(c, "max_scale must be > 0, got %g", a->max_scale);
}

void ampc_op_update_scale(struct call *c, struct update_scale_args *a)
{
    describe_all(c);
    struct update_scale_job job;
    job.args = (struct ampc_scale_args){ a->growth_factor, a->backoff_factor,
                                         a->growth_interval, a->hysteresis, a->min_scale,
                                         a->max_scale };
    check_update_scale_args(c, &job.args);
    check_scalar(c, a->scale, aoti_torch_dtype_float32(), 0);
    check_scalar(c, a->growth_tracker, aoti_torch_dtype_int32(), 0);
    /* the tracker is read only with hysteresis > 1; ampc.ops passes an empty one without */
    if (a->hysteresis > 1 && a->hysteresis_tracker->numel == 0)
        fail(c, "hysteresis_tracker is required when hysteresis > 1, got hysteresis=%lld",
             (long long)a->hysteresis);
    check_scalar(c, a->hysteresis_tracker, aoti_torch_dtype_int32(), a->hysteresis == 1);
    check_scalar(c, a->found_inf, aoti_torch_dtype_float32(), 0);
    check_overlap(c);
    job.scale = a->scale->data;
    job.growth_tracker = a->growth_tracker->data;
    job.hysteresis_tracker = a->hysteresis_tracker->data;
    job.found_inf = a->found_inf->data;
    run(c, update_scale_on_cpu, update_scale_on_cuda, &job);
}
