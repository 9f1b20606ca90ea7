/*
 * ops_lean.c: the lean Adam step in the torch glue (adam_lean): its arguments, read by the
 * code the op list generates, checked, then the kernel run.
 */
#include "call.h"
#include "lean.h"

// ---- adam_lean (its schema: ampc_ops.h) ----

struct adam_lean_job {
    struct ampc_lean_lists lists;
    struct ampc_adam_control control;
    struct ampc_lean_args args;
};

ON_DEVICES(adam_lean, adam_lean_job, &job->lists, &job->control, &job->args)

/* The kind of moments, from exp_avgs[0]'s dtype; both moment lists are checked to share it. */
static int moments_kind(struct call *c, struct list *m, struct list *v)
{
    if (m->count == 0)
        return AMPC_MOMENTS_F32;
    int32_t dt = m->t[0].dtype;
    const char *name = dtype_name(dt);
    int kind = dt == aoti_torch_dtype_float32() ? AMPC_MOMENTS_F32
             : dt == aoti_torch_dtype_bfloat16() ? AMPC_MOMENTS_BF16
             : dt == aoti_torch_dtype_uint8() ? AMPC_MOMENTS_Q8 : -1;
    if (kind < 0)
        fail(c, "exp_avgs[0] must be torch.float32, torch.bfloat16 or torch.uint8 (8-bit "
             "codes), got %s", name);
    check_dtype(c, m, dt, name);
    check_dtype(c, v, dt, name);
    return kind;
}

void ampc_op_adam_lean(struct call *c, struct adam_lean_args *a)
{
    struct adam_lean_job job;
    struct ampc_lean_lists *l = &job.lists;
    take_params_grads(c, a->params, a->grads, &l->params, &l->grads);
    l->masters = as_list(a->masters, AMPC_F32);
    if (a->masters->count) {
        check_dtype(c, a->masters, aoti_torch_dtype_float32(), "torch.float32");
        check_same_shapes(c, a->masters, "masters", a->params, "params");
    }
    l->compensations = as_list(a->compensations, AMPC_BF16);
    if (a->compensations->count) {
        if (a->masters->count)
            fail(c, "compensations and masters are two ways to keep the weight: give one");
        if (a->params->count && l->params.dtype != AMPC_BF16)
            fail(c, "compensations need torch.bfloat16 params, got %s",
                 dtype_name(a->params->t[0].dtype));
        check_dtype(c, a->compensations, aoti_torch_dtype_bfloat16(), "torch.bfloat16");
        check_same_shapes(c, a->compensations, "compensations", a->params, "params");
    }
    job.args.moments = moments_kind(c, a->exp_avgs, a->exp_avg_sqs);
    ampc_dtype mdt = job.args.moments == AMPC_MOMENTS_F32 ? AMPC_F32 : AMPC_BF16;
    l->exp_avgs = as_list(a->exp_avgs, mdt);
    l->exp_avg_sqs = as_list(a->exp_avg_sqs, mdt);
    check_same_shapes(c, a->exp_avgs, "exp_avgs", a->params, "params");
    check_same_shapes(c, a->exp_avg_sqs, "exp_avg_sqs", a->params, "params");
    l->exp_avg_scales = as_list(a->exp_avg_scales, AMPC_F32);
    l->exp_avg_sq_scales = as_list(a->exp_avg_sq_scales, AMPC_F32);
    if (job.args.moments == AMPC_MOMENTS_Q8) {
        check_block_scales(c, a->exp_avg_scales, "exp_avg_scales", a->params, "params");
        check_block_scales(c, a->exp_avg_sq_scales, "exp_avg_sq_scales", a->params, "params");
    } else if (a->exp_avg_scales->count || a->exp_avg_sq_scales->count) {
        fail(c, "exp_avg_scales and exp_avg_sq_scales are for 8-bit (torch.uint8) moments "
             "only: give none with %s moments", dtype_name(a->exp_avgs->t[0].dtype));
    }
    l->steps = take_steps(c, a->steps, a->params);
    TAKE_ADAM_ARGS(c, &job.control, &job.args.adam, a);
    check_overlap(c);
    run(c, adam_lean_on_cpu, adam_lean_on_cuda, &job);
}
