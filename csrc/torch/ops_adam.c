/*
 * ops_adam.c: the optimizer's ops in the torch glue (adam_master, and adam_packed, its
 * step with the state of all params packed in one buffer): arguments taken off the stack
 * and checked, then the Adam kernel run.
 */
#include <math.h>
#include <stdlib.h>

#include "call.h"

// ---- adam_master(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters,
//                  Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs,
//                  Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] steps, Tensor[] lr_tensor,
//                  Tensor[] inv_scale, Tensor[] clip_coef, Tensor[] found_inf, float lr,
//                  float beta1, float beta2, float eps, float weight_decay, bool decoupled,
//                  bool maximize, bool stochastic, int seed) ----
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

/* A list of zero or one 1-element fp32 tensor: its data, or NULL. */
static const float *f32_option(struct call *c, struct list *ls, const char *name)
{
    return option(c, ls, name, aoti_torch_dtype_float32());
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

/* The control values (lists lr_tensor, inv_scale, clip_coef, found_inf), the numbers
 * (lr, beta1, beta2, eps, weight_decay, decoupled, maximize at v) and the rounding
 * (stochastic, seed at r) of both Adam ops, checked. */
static void take_adam_args(struct call *c, struct adam_job *job, struct list *const opt[4],
                           const StableIValue *v, const StableIValue *r)
{
    job->control.lr = f32_option(c, opt[0], "lr_tensor");
    job->control.inv_scale = f32_option(c, opt[1], "inv_scale");
    job->control.clip_coef = f32_option(c, opt[2], "clip_coef");
    job->control.found_inf = f32_option(c, opt[3], "found_inf");
    job->args.lr = take_double(v[0]);
    job->args.beta1 = take_double(v[1]);
    job->args.beta2 = take_double(v[2]);
    job->args.eps = take_double(v[3]);
    job->args.weight_decay = take_double(v[4]);
    job->args.decoupled = take_bool(v[5]);
    job->args.maximize = take_bool(v[6]);
    job->args.stochastic = take_bool(r[0]);
    job->args.seed = (uint64_t)r[1];
    check_adam_args(c, &job->args, job->control.lr != NULL);
}

void ampc_op_adam_master(StableIValue *stack, int on_cuda)
{
    static const char *names[] = { "params", "grads", "masters", "exp_avgs", "exp_avg_sqs",
                                   "max_exp_avg_sqs", "steps", "lr_tensor", "inv_scale",
                                   "clip_coef", "found_inf" };
    static const int written[] = { 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0 };
    enum { N_LISTS = sizeof(names) / sizeof(names[0]), FIRST_OPTION = 7 };
    struct call c;
    struct list *ls[N_LISTS];
    start(&c, "ampc.adam_master", on_cuda);
    for (int i = 0; i < N_LISTS; i++)
        ls[i] = i < FIRST_OPTION ? take_list(&c, stack[i], names[i], written[i])
                                 : take_option(&c, stack[i], names[i]);
    describe_all(&c);
    struct adam_job job;
    struct ampc_adam_lists *l = &job.lists;
    l->params = float_list(&c, ls[0]);
    l->grads = float_list(&c, ls[1]);
    check_same_shapes(&c, ls[1], "grads", ls[0], "params");
    l->masters = f32_list(&c, ls[2], "masters", ls[0], "params", 1);
    l->exp_avgs = f32_list(&c, ls[3], "exp_avgs", ls[0], "params", 0);
    l->exp_avg_sqs = f32_list(&c, ls[4], "exp_avg_sqs", ls[0], "params", 0);
    l->max_exp_avg_sqs = f32_list(&c, ls[5], "max_exp_avg_sqs", ls[0], "params", 1);
    l->steps = (struct ampc_list){ ls[6]->ptr, ls[6]->numel, ls[6]->count, AMPC_F32 };
    if (ls[6]->count != ls[0]->count)
        fail(&c, "steps must have as many tensors as params (%lld), got %lld",
             (long long)ls[0]->count, (long long)ls[6]->count);
    for (int64_t i = 0; i < ls[6]->count; i++)
        check_scalar(&c, &ls[6]->t[i], aoti_torch_dtype_float32(), 0);
    take_adam_args(&c, &job, ls + 7, stack + 11, stack + 18);
    check_overlap(&c);
    run(&c, adam_on_cpu, adam_on_cuda, &job);
    call_free(&c);
}

// ---- adam_packed(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) state, Tensor(c!) steps,
//                  Tensor layout, Tensor[] lr_tensor, Tensor[] inv_scale, Tensor[] clip_coef,
//                  Tensor[] found_inf, float lr, float beta1, float beta2, float eps,
//                  float weight_decay, bool decoupled, bool maximize, bool amsgrad,
//                  bool master, bool stochastic, int seed) -> int ----
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
    if (layout->dtype != aoti_torch_dtype_int64() || layout->numel != 3 * count)
        fail(c, "layout must be a torch.int64 tensor of 3 values a param (%lld), got %s with "
             "%lld", (long long)(3 * count), dtype_name(layout->dtype), (long long)layout->numel);
    if (state->numel % sections != 0)
        fail(c, "state must hold %lld sections of equal size, got %lld elements",
             (long long)sections, (long long)state->numel);
    int64_t size = state->numel / sections;
    const int64_t *lay = layout->data;
    for (int64_t i = 0; i < count; i++) {
        int64_t off = lay[3 * i];
        int64_t n = lay[3 * i + 1];
        int64_t s = lay[3 * i + 2];
        int64_t end = i > 0 ? lay[3 * i - 3] + lay[3 * i - 2] : 0;
        if (off < end || n < 0 || n > size - off || s < (i > 0 ? lay[3 * i - 1] + 1 : 0)
            || s >= steps->numel)
            fail(c, "layout of param %lld (offset %lld, numel %lld, step %lld) is not inside "
                 "the state (%lld a section) and steps (%lld), after the previous param's",
                 (long long)i, (long long)off, (long long)n, (long long)s, (long long)size,
                 (long long)steps->numel);
        if (n != params->numel[i])
            return 0;
    }
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

void ampc_op_adam_packed(StableIValue *stack, int on_cuda)
{
    static const char *options[] = { "lr_tensor", "inv_scale", "clip_coef", "found_inf" };
    struct call c;
    struct list *opt[4];
    start(&c, "ampc.adam_packed", on_cuda);
    struct list *params = take_list(&c, stack[0], "params", 1);
    struct list *grads = take_list(&c, stack[1], "grads", 0);
    struct tensor *state = take_tensor(&c, stack[2], "state", 1);
    struct tensor *steps = take_tensor(&c, stack[3], "steps", 1);
    struct tensor *layout = take_tensor(&c, stack[4], "layout", 0);
    for (int i = 0; i < 4; i++)
        opt[i] = take_option(&c, stack[5 + i], options[i]);
    layout->host = 1;
    c.soft = 1;
    describe_all(&c);
    struct adam_job job;
    int mixed = 0;
    memset(&job, 0, sizeof(job));
    job.lists.params = float_list_mixed(&c, params, &mixed);
    job.lists.grads = float_list_mixed(&c, grads, &mixed);
    int amsgrad = take_bool(stack[16]);
    int master = take_bool(stack[17]);
    if (c.unfit || mixed) {
        call_free(&c);
        stack[0] = 1;
        return;
    }
    check_same_shapes(&c, grads, "grads", params, "params");
    if (!packed_lists(&c, &job, params, state, steps, layout, amsgrad, master)) {
        call_free(&c);
        stack[0] = 1;
        return;
    }
    take_adam_args(&c, &job, opt, stack + 9, stack + 18);
    check_overlap(&c);
    run(&c, adam_on_cpu, adam_on_cuda, &job);
    call_free(&c);
    stack[0] = 0;
}

