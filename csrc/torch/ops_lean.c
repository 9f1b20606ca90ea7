/*
 * ops_lean.c: the lean Adam step in the torch glue (adam_lean): its arguments, read by the
 * code the op list generates, checked, then the kernel run.
 */
#include <math.h>

#include "call.h"
#include "lean.h"

// ---- adam_lean(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters,
//                Tensor(c!)[] compensations, Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs,
//                Tensor(f!)[] exp_avg_scales, Tensor(g!)[] exp_avg_sq_scales,
//                Tensor(h!)[] steps, Tensor[] lr_tensor, Tensor[] inv_scale,
//                Tensor[] clip_coef, Tensor[] found_inf, float lr, float beta1, float beta2,
//                float eps, float weight_decay, bool decoupled, bool maximize,
//                bool stochastic, int seed) ----

struct lean_job {
    struct ampc_lean_lists lists;
    struct ampc_adam_control control;
    struct ampc_lean_args args;
};

ON_DEVICES(adam_lean, lean_job, &job->lists, &job->control, &job->args)

enum { PARAMS, GRADS, MASTERS, COMPS, EXP_AVGS, EXP_AVG_SQS, M_SCALES, V_SCALES, STEPS,
       LR_TENSOR, INV_SCALE, CLIP_COEF, FOUND_INF, N_LISTS };

/* Every tensor of ls has torch dtype `dtype` (shown as `want` in messages). */
static void check_dtype(struct call *c, struct list *ls, int32_t dtype, const char *want)
{
    char a[64];
    for (int64_t i = 0; i < ls->count; i++)
        if (ls->t[i].dtype != dtype)
            fail(c, "%s must be %s, got %s", tensor_name(&ls->t[i], a, sizeof(a)), want,
                 dtype_name(ls->t[i].dtype));
}

static struct ampc_list as_list(struct list *ls, ampc_dtype dt)
{
    return (struct ampc_list){ ls->ptr, ls->numel, ls->count, dt };
}

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

/* 8-bit moments: one fp32 scale a block of AMPC_QBLOCK elements of each param. */
static void check_scales(struct call *c, struct list *scales, const char *name,
                         struct list *params)
{
    char a[64];
    if (scales->count != params->count)
        fail(c, "%s must have as many tensors as params (%lld) with 8-bit moments, got %lld",
             name, (long long)params->count, (long long)scales->count);
    check_dtype(c, scales, aoti_torch_dtype_float32(), "torch.float32");
    for (int64_t i = 0; i < scales->count; i++) {
        int64_t want = (params->numel[i] + AMPC_QBLOCK - 1) / AMPC_QBLOCK;
        if (scales->numel[i] != want)
            fail(c, "%s must hold %lld values (one a block of %d of params[%lld]), got %lld",
                 tensor_name(&scales->t[i], a, sizeof(a)), (long long)want, AMPC_QBLOCK,
                 (long long)i, (long long)scales->numel[i]);
    }
}

void ampc_op_adam_lean(struct call *c, struct adam_lean_args *a)
{
    struct list *ls[N_LISTS] = { a->params, a->grads, a->masters, a->compensations,
                                 a->exp_avgs, a->exp_avg_sqs, a->exp_avg_scales,
                                 a->exp_avg_sq_scales, a->steps, a->lr_tensor, a->inv_scale,
                                 a->clip_coef, a->found_inf };
    describe_all(c);
    struct lean_job job;
    struct ampc_lean_lists *l = &job.lists;
    l->params = float_list(c, ls[PARAMS]);
    l->grads = float_list(c, ls[GRADS]);
    check_same_shapes(c, ls[GRADS], "grads", ls[PARAMS], "params");
    l->masters = as_list(ls[MASTERS], AMPC_F32);
    if (ls[MASTERS]->count) {
        check_dtype(c, ls[MASTERS], aoti_torch_dtype_float32(), "torch.float32");
        check_same_shapes(c, ls[MASTERS], "masters", ls[PARAMS], "params");
    }
    l->compensations = as_list(ls[COMPS], AMPC_BF16);
    if (ls[COMPS]->count) {
        if (ls[MASTERS]->count)
            fail(c, "compensations and masters are two ways to keep the weight: give one");
        if (ls[PARAMS]->count && l->params.dtype != AMPC_BF16)
            fail(c, "compensations need torch.bfloat16 params, got %s",
                 dtype_name(ls[PARAMS]->t[0].dtype));
        check_dtype(c, ls[COMPS], aoti_torch_dtype_bfloat16(), "torch.bfloat16");
        check_same_shapes(c, ls[COMPS], "compensations", ls[PARAMS], "params");
    }
    job.args.moments = moments_kind(c, ls[EXP_AVGS], ls[EXP_AVG_SQS]);
    ampc_dtype mdt = job.args.moments == AMPC_MOMENTS_F32 ? AMPC_F32 : AMPC_BF16;
    l->exp_avgs = as_list(ls[EXP_AVGS], mdt);
    l->exp_avg_sqs = as_list(ls[EXP_AVG_SQS], mdt);
    check_same_shapes(c, ls[EXP_AVGS], "exp_avgs", ls[PARAMS], "params");
    check_same_shapes(c, ls[EXP_AVG_SQS], "exp_avg_sqs", ls[PARAMS], "params");
    l->exp_avg_scales = as_list(ls[M_SCALES], AMPC_F32);
    l->exp_avg_sq_scales = as_list(ls[V_SCALES], AMPC_F32);
    if (job.args.moments == AMPC_MOMENTS_Q8) {
        check_scales(c, ls[M_SCALES], "exp_avg_scales", ls[PARAMS]);
        check_scales(c, ls[V_SCALES], "exp_avg_sq_scales", ls[PARAMS]);
    } else if (ls[M_SCALES]->count || ls[V_SCALES]->count) {
        fail(c, "exp_avg_scales and exp_avg_sq_scales are for 8-bit (torch.uint8) moments "
             "only: give none with %s moments", dtype_name(ls[EXP_AVGS]->t[0].dtype));
    }
    l->steps = as_list(ls[STEPS], AMPC_F32);
    if (ls[STEPS]->count != ls[PARAMS]->count)
        fail(c, "steps must have as many tensors as params (%lld), got %lld",
             (long long)ls[PARAMS]->count, (long long)ls[STEPS]->count);
    for (int64_t i = 0; i < ls[STEPS]->count; i++)
        check_scalar(c, &ls[STEPS]->t[i], aoti_torch_dtype_float32(), 0);
    int32_t f32 = aoti_torch_dtype_float32();
    job.control.lr = option(c, ls[LR_TENSOR], "lr_tensor", f32);
    job.control.inv_scale = option(c, ls[INV_SCALE], "inv_scale", f32);
    job.control.clip_coef = option(c, ls[CLIP_COEF], "clip_coef", f32);
    job.control.found_inf = option(c, ls[FOUND_INF], "found_inf", f32);
    struct ampc_adam_args *adam = &job.args.adam;
    adam->lr = a->lr;
    adam->beta1 = a->beta1;
    adam->beta2 = a->beta2;
    adam->eps = a->eps;
    adam->weight_decay = a->weight_decay;
    adam->decoupled = a->decoupled;
    adam->maximize = a->maximize;
    adam->stochastic = a->stochastic;
    adam->seed = (uint64_t)a->seed;
    check_adam_args(c, adam, job.control.lr != NULL);
    check_overlap(c);
    run(c, adam_lean_on_cpu, adam_lean_on_cuda, &job);
}
