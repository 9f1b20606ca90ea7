/*
 * ops_adam.c: the optimizer's ops in the torch glue (adam_master, and adam_packed, its
 * step with the state of all params packed in one buffer): arguments checked, then the
 * Adam kernel run.
 */
#include <stdlib.h>

#include "call.h"

// ---- adam_master ----
// The four device values are lists of zero or one tensor (see option()).

struct adam_job {
    struct ampc_adam_lists lists;
    struct ampc_adam_control control;
    struct ampc_adam_args args;
};

ON_DEVICES(adam, adam_job, &job->lists, &job->control, &job->args)

/* A list of fp32 tensors with the shapes of `like` (or, when `optional`, no tensor). */
static struct ampc_list f32_list(struct call *c, struct list *ls, const char *name,
                                 struct list *like, const char *like_name, int optional)
{
    char a[64];
    struct ampc_list out = { ls->ptr, ls->numel, ls->count, AMPC_F32 };
    if (optional && ls->count == 0)
        return out;
    for (int64_t i = 0; i < ls->count; i++)
        if (ls->t[i].dtype != aoti_torch_dtype_float32())
            fail(c, "%s must be torch.float32, got %s", tensor_name(&ls->t[i], a, sizeof(a)),
                 dtype_name(ls->t[i].dtype));
    check_same_shapes(c, ls, name, like, like_name);
    return out;
}

void ampc_op_adam_master(struct call *c, struct adam_master_args *a)
{
    struct adam_job job;
    struct ampc_adam_lists *l = &job.lists;
    take_params_grads(c, a->params, a->grads, &l->params, &l->grads);
    l->masters = f32_list(c, a->masters, "masters", a->params, "params", 1);
    l->exp_avgs = f32_list(c, a->exp_avgs, "exp_avgs", a->params, "params", 0);
    l->exp_avg_sqs = f32_list(c, a->exp_avg_sqs, "exp_avg_sqs", a->params, "params", 0);
    l->max_exp_avg_sqs = f32_list(c, a->max_exp_avg_sqs, "max_exp_avg_sqs", a->params,
                                  "params", 1);
    l->steps = take_steps(c, a->steps, a->params);
    TAKE_ADAM_ARGS(c, &job.control, &job.args, a);
    check_overlap(c);
    run(c, adam_on_cpu, adam_on_cuda, &job);
}

// ---- adam_packed ----
// adam_master's step with the state of all params packed: `state` is fp32, its sections
// (exp_avg, exp_avg_sq, then max_exp_avg_sq with amsgrad, then master with master
// weights) of equal size one after the other; `steps` holds fp32 step counts; `layout`
// (int64, on the CPU) holds for each param its offset in every section, its numel and the
// index of its step count, offsets and indices increasing. Two tensor lists cross into C
// instead of seven. Returns 1, having done nothing, when the params and grads do not fit
// the packing (params or grads of mixed dtypes, not contiguous, not all on one device,
// or of a numel the layout does not say): the caller then takes the unpacked
// path, whose checks name what is wrong. Returns 0 after the step.

/* Points job's state lists into the packed buffers; 0 when a param's numel is not the
 * layout's. Raises on a layout that does not describe disjoint ranges inside them. */
static int packed_lists(struct call *c, struct adam_job *job, const struct list *params,
                        const struct tensor *state, const struct tensor *steps,
                        const struct tensor *layout, int amsgrad, int master)
{
    int64_t count = params->count;
    int64_t sections = 2 + amsgrad + master;
    if (state->dtype != aoti_torch_dtype_float32() || steps->dtype != aoti_torch_dtype_float32())
        fail(c, "state and steps must be torch.float32, got %s and %s",
             dtype_name(state->dtype), dtype_name(steps->dtype));
    if (state->numel % sections != 0)
        fail(c, "state must hold %lld sections of equal size, got %lld elements",
             (long long)sections, (long long)state->numel);
    int64_t size = state->numel / sections;
    if (!packed_layout_fits(c, params, layout, size, steps->numel, 1))
        return 0;
    const int64_t *lay = layout->data;
    void **ptr = malloc(sizeof(*ptr) * (size_t)(5 * (count ? count : 1)));
    if (!ptr)
        fail(c, "out of memory");
    c->scratch = ptr;
    float *base = state->data;
    float *sec[4] = { NULL, NULL, NULL, NULL };     /* m, v, vmax, master */
    sec[0] = base;
    sec[1] = base + size;
    if (amsgrad)
        sec[2] = base + 2 * size;
    if (master)
        sec[3] = base + (2 + amsgrad) * size;
    for (int64_t i = 0; i < count; i++) {
        for (int k = 0; k < 4; k++)
            ptr[k * count + i] = sec[k] ? sec[k] + lay[3 * i] : NULL;
        ptr[4 * count + i] = (float *)steps->data + lay[3 * i + 2];
    }
    struct ampc_adam_lists *l = &job->lists;
    l->exp_avgs = (struct ampc_list){ ptr, params->numel, count, AMPC_F32 };
    l->exp_avg_sqs = (struct ampc_list){ ptr + count, params->numel, count, AMPC_F32 };
    l->max_exp_avg_sqs = (struct ampc_list){ ptr + 2 * count, params->numel,
                                             amsgrad ? count : 0, AMPC_F32 };
    l->masters = (struct ampc_list){ ptr + 3 * count, params->numel, master ? count : 0,
                                     AMPC_F32 };
    l->steps = (struct ampc_list){ ptr + 4 * count, params->numel, count, AMPC_F32 };
    return 1;
}

void ampc_op_adam_packed(struct call *c, struct adam_packed_args *a)
{
    c->soft = 1;
    describe_all(c);
    struct adam_job job;
    int mixed = 0;
    memset(&job, 0, sizeof(job));
    job.lists.params = float_list_mixed(c, a->params, &mixed);
    job.lists.grads = float_list_mixed(c, a->grads, &mixed);
    c->ret = 1;             /* unfit until the step has run */
    if (c->unfit || mixed)
        return;
    check_same_shapes(c, a->grads, "grads", a->params, "params");
    if (!packed_lists(c, &job, a->params, a->state, a->steps, a->layout, a->amsgrad, a->master))
        return;
    TAKE_ADAM_ARGS(c, &job.control, &job.args, a);
    check_overlap(c);
    run(c, adam_on_cpu, adam_on_cuda, &job);
    c->ret = 0;
}
