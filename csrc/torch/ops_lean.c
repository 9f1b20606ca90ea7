/*
 * ops_lean.c: the lean Adam step in the torch glue (adam_lean): its arguments, read by the
 * code the op list generates, checked, then the kernel run.
 */
#include <stdlib.h>

#include "call.h"
#include "lean.h"

// ---- adam_lean (its schema: ampc_ops.h) ----

struct adam_lean_job {
    struct ampc_lean_lists lists;
    struct ampc_adam_control control;
    struct ampc_lean_args args;
};

ON_DEVICES(adam_lean, adam_lean_job, &job->lists, &job->control, &job->args)

/* The kind of moments a torch dtype holds; raises naming `what` for any other dtype. */
static int kind_of(struct call *c, int32_t dt, const char *what)
{
    int kind = dt == aoti_torch_dtype_float32() ? AMPC_MOMENTS_F32
             : dt == aoti_torch_dtype_bfloat16() ? AMPC_MOMENTS_BF16
             : dt == aoti_torch_dtype_uint8() ? AMPC_MOMENTS_Q8 : -1;
    if (kind < 0)
        fail(c, "%s must be torch.float32, torch.bfloat16 or torch.uint8 (8-bit codes), got %s",
             what, dtype_name(dt));
    return kind;
}

/* The kind of moments, from exp_avgs[0]'s dtype; both moment lists are checked to share it. */
static int moments_kind(struct call *c, struct list *m, struct list *v)
{
    if (m->count == 0)
        return AMPC_MOMENTS_F32;
    int32_t dt = m->t[0].dtype;
    const char *name = dtype_name(dt);
    int kind = kind_of(c, dt, "exp_avgs[0]");
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

// ---- adam_lean_packed ----
// adam_lean's step, the param its own weight (no masters or compensations), with the
// state of all params packed: `moments` holds two sections of equal size, exp_avg then
// exp_avg_sq, of fp32, bf16 or 8-bit codes (uint8); with codes, `scales` (fp32) holds two
// sections of one scale a block of AMPC_QBLOCK, every offset a multiple of AMPC_QBLOCK so
// that a param's scales start at offset / AMPC_QBLOCK; `steps` and `layout` as adam_packed
// takes them. Two tensor lists cross into C instead of eight. Returns 1, having done
// nothing, where adam_packed does; 0 after the step.

void ampc_op_adam_lean_packed(struct call *c, struct adam_lean_packed_args *a)
{
    c->soft = 1;
    describe_all(c);
    struct adam_lean_job job;
    memset(&job, 0, sizeof(job));
    struct ampc_lean_lists *l = &job.lists;
    int mixed = 0;
    l->params = float_list_mixed(c, a->params, &mixed);
    l->grads = float_list_mixed(c, a->grads, &mixed);
    c->ret = 1;             /* unfit until the step has run */
    if (c->unfit || mixed)
        return;
    check_same_shapes(c, a->grads, "grads", a->params, "params");
    int kind = kind_of(c, a->moments->dtype, "moments");
    if (a->steps->dtype != aoti_torch_dtype_float32() || a->scales->dtype != aoti_torch_dtype_float32())
        fail(c, "steps and scales must be torch.float32, got %s and %s",
             dtype_name(a->steps->dtype), dtype_name(a->scales->dtype));
    int64_t align = kind == AMPC_MOMENTS_Q8 ? AMPC_QBLOCK : 1;
    int64_t size = a->moments->numel / 2;
    int64_t want_scales = kind == AMPC_MOMENTS_Q8 ? 2 * (size / AMPC_QBLOCK) : 0;
    if (a->moments->numel % (2 * align) != 0 || a->scales->numel != want_scales)
        fail(c, "moments must hold 2 sections of equal size (a multiple of %lld elements) "
             "and scales %lld values (one a block of %d of each section), got %lld and %lld",
             (long long)align, (long long)want_scales, AMPC_QBLOCK,
             (long long)a->moments->numel, (long long)a->scales->numel);
    if (!packed_layout_fits(c, a->params, a->layout, size, a->steps->numel, align))
        return;
    int64_t count = a->params->count;
    void **ptr = malloc(sizeof(*ptr) * (size_t)(5 * (count ? count : 1)));
    if (!ptr)
        fail(c, "out of memory");
    c->scratch = ptr;
    size_t width = kind == AMPC_MOMENTS_F32 ? 4 : kind == AMPC_MOMENTS_BF16 ? 2 : 1;
    int64_t *n = a->params->numel, q8 = kind == AMPC_MOMENTS_Q8 ? count : 0;
    char *m = a->moments->data;
    float *s = a->scales->data;
    const int64_t *lay = a->layout->data;
    for (int64_t i = 0; i < count; i++) {
        int64_t off = lay[3 * i];
        ptr[i] = m + width * (size_t)off;
        ptr[count + i] = m + width * (size_t)(size + off);
        ptr[2 * count + i] = q8 ? s + off / align : NULL;
        ptr[3 * count + i] = q8 ? s + size / align + off / align : NULL;
        ptr[4 * count + i] = (float *)a->steps->data + lay[3 * i + 2];
    }
    ampc_dtype mdt = kind == AMPC_MOMENTS_F32 ? AMPC_F32 : AMPC_BF16;
    l->exp_avgs = (struct ampc_list){ ptr, n, count, mdt };
    l->exp_avg_sqs = (struct ampc_list){ ptr + count, n, count, mdt };
    l->exp_avg_scales = (struct ampc_list){ ptr + 2 * count, n, q8, AMPC_F32 };
    l->exp_avg_sq_scales = (struct ampc_list){ ptr + 3 * count, n, q8, AMPC_F32 };
    l->steps = (struct ampc_list){ ptr + 4 * count, n, count, AMPC_F32 };
    job.args.moments = kind;
    TAKE_ADAM_ARGS(c, &job.control, &job.args.adam, a);
    check_overlap(c);
    run(c, adam_lean_on_cpu, adam_lean_on_cuda, &job);
    c->ret = 0;
}
