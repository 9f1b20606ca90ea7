/*
 * ops_fp8.c: the fp8 ops in the torch glue (fp8_gemm, cast_fp8, fp8_amax, cast_from_fp8,
 * fp8_update_scales): arguments checked, then the kernels run.
 */
#include <math.h>

#include "call.h"

#define AMPC_FLT_MAX_D 3.4028234663852886e+38

// ---- fp8_gemm ----
// out[m, n] = a[m, k] @ b_t[n, k]^T * scale_inv_a * scale_inv_b + bias, on CUDA through
// cuBLASLt (csrc/cuda/fp8_gemm.cu). Returns 1 when the epilogue wrote amax, 0 when the
// caller must compute it. Its CPU kernel checks every argument like the CUDA one, then
// refuses: the CPU reference path is ampc.fp8.gemm's, in torch.

/* CUDA only: no CPU entry point (the op refuses CPU tensors before it would run). */
static ampc_status fp8_gemm_on_cuda(void *j, void *stream)
{
    return g_cuda->fp8_gemm(j, stream);
}

/* The sizes of a tensor that must have `dim` dimensions. */
static const int64_t *sizes_of(struct call *c, struct tensor *t, int64_t dim)
{
    char a[64];
    shape(c, t);
    if (t->dim != dim)
        fail(c, "%s must have %lld dimensions, got %lld", tensor_name(t, a, sizeof(a)),
             (long long)dim, (long long)t->dim);
    return t->sizes;
}

static void check_aligned(struct call *c, const struct tensor *t)
{
    char a[64];
    if ((uintptr_t)t->data % 16 != 0)
        fail(c, "%s must start at a 16-byte aligned address (cuBLASLt's FP8 kernels need "
             "it); call .clone() on it first", tensor_name(t, a, sizeof(a)));
}

void ampc_op_fp8_gemm(struct call *c, struct fp8_gemm_args *args)
{
    struct tensor *out = args->out;
    struct tensor *a = args->a;
    struct tensor *b = args->b_t;
    struct list *bias = args->bias;
    describe_all(c);
    char n1[32];
    if (!(out->dtype == aoti_torch_dtype_float32() || out->dtype == aoti_torch_dtype_bfloat16()))
        fail(c, "out must be torch.float32 or torch.bfloat16, got %s", dtype_name(out->dtype));
    for (int i = 0; i < 2; i++) {
        const struct tensor *t = i ? b : a;
        ampc_dtype d;
        if (!to_fp8_dtype(t->dtype, &d))
            fail(c, "%s must be torch.float8_e4m3fn or torch.float8_e5m2, got %s",
                 tensor_name(t, n1, sizeof(n1)), dtype_name(t->dtype));
    }
    if (a->dtype == aoti_torch_dtype_float8_e5m2() && b->dtype == aoti_torch_dtype_float8_e5m2())
        fail(c, "a and b_t are both torch.float8_e5m2; at least one must be "
             "torch.float8_e4m3fn (cuBLASLt has no e5m2 x e5m2 GEMM)");
    const int64_t *as = sizes_of(c, a, 2);
    const int64_t *bs = sizes_of(c, b, 2);
    const int64_t *os = sizes_of(c, out, 2);
    int64_t m = as[0], k = as[1], n = bs[0];
    if (bs[1] != k)
        fail(c, "b_t must be [n, k] with k = %lld like a's columns, got [%lld, %lld]",
             (long long)k, (long long)bs[0], (long long)bs[1]);
    if (k <= 0 || k % 16 != 0 || n <= 0 || n % 16 != 0)
        fail(c, "k (%lld) and n (%lld) must be positive multiples of 16", (long long)k,
             (long long)n);
    if (os[0] != m || os[1] != n)
        fail(c, "out must be [%lld, %lld], got [%lld, %lld]", (long long)m, (long long)n,
             (long long)os[0], (long long)os[1]);
    check_scalar(c, args->scale_inv_a, aoti_torch_dtype_float32(), 0);
    check_scalar(c, args->scale_inv_b, aoti_torch_dtype_float32(), 0);
    struct ampc_fp8_gemm_args g;
    memset(&g, 0, sizeof(g));
    if (bias->count > 1)
        fail(c, "bias must hold at most one tensor, got %lld", (long long)bias->count);
    if (bias->count == 1) {
        const struct tensor *t = &bias->t[0];
        if (t->dtype != aoti_torch_dtype_bfloat16() || t->numel != n)
            fail(c, "bias must be a torch.bfloat16 tensor of n = %lld elements, got %s with "
                 "%lld", (long long)n, dtype_name(t->dtype), (long long)t->numel);
        check_aligned(c, t);
        g.bias = t->data;
    }
    g.amax = option(c, args->amax, "amax", aoti_torch_dtype_float32());
    if (args->workspace->dtype != aoti_torch_dtype_uint8())
        fail(c, "workspace must be a torch.uint8 tensor, got %s",
             dtype_name(args->workspace->dtype));
    check_aligned(c, a);
    check_aligned(c, b);
    check_aligned(c, out);
    check_overlap(c);
    if (!c->on_cuda)
        fail(c, "runs on CUDA only (cuBLASLt); CPU tensors take ampc.fp8.gemm's reference path");
    g.out = out->data;
    g.a = a->data;
    g.b_t = b->data;
    g.scale_inv_a = args->scale_inv_a->data;
    g.scale_inv_b = args->scale_inv_b->data;
    g.workspace = args->workspace->data;
    g.workspace_bytes = args->workspace->numel;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a_e5m2 = a->dtype == aoti_torch_dtype_float8_e5m2();
    g.b_e5m2 = b->dtype == aoti_torch_dtype_float8_e5m2();
    g.out_dtype = out->dtype == aoti_torch_dtype_bfloat16() ? AMPC_BF16 : AMPC_F32;
    run(c, NULL, fp8_gemm_on_cuda, &g);
    c->ret = (StableIValue)g.amax_written;
}

// ---- the fp8 ops: cast_fp8, fp8_amax, cast_from_fp8, fp8_update_scales ----

/* A 1-D fp32 tensor of `count` values (scale, amax), `per` saying what each is for. */
static void check_values(struct call *c, struct tensor *t, int64_t count, const char *per)
{
    shape(c, t);
    if (t->dtype != aoti_torch_dtype_float32() || t->dim != 1 || t->numel != count)
        fail(c, "%s must be a 1-D torch.float32 tensor of %lld values (%s), got %s with %lld "
             "dimensions and %lld elements", t->name, (long long)count, per,
             dtype_name(t->dtype), (long long)t->dim, (long long)t->numel);
}

/* The values of tensor t as a list of pointers, one per position (value i of a [count]
 * tensor), which run_groups splits with the tensor lists. Held by the call, so freed with
 * it; its entries own no handle and take no part in the overlap check (t itself does). */
static struct ampc_list value_list(struct call *c, const struct tensor *t, int64_t count,
                                   struct list **out)
{
    struct list *ls = next_list(c);
    if (!alloc_list(ls, count))
        fail(c, "out of memory");
    for (int64_t i = 0; i < count; i++) {
        ls->t[i] = (struct tensor){ .name = t->name, .index = i, .dtype = t->dtype };
        ls->ptr[i] = (float *)t->data + i;
        ls->numel[i] = 1;
    }
    ls->count = count;
    *out = ls;
    return (struct ampc_list){ ls->ptr, ls->numel, count, AMPC_F32 };
}

struct fp8_job {
    struct ampc_list dst;
    struct ampc_list src;
    struct ampc_list scale;         /* scale (cast_fp8) or scale_inv (cast_from_fp8) */
    struct ampc_list amax;
};

ON_DEVICES(cast_fp8, fp8_job, &job->dst, &job->amax, &job->src, &job->scale)

ON_DEVICES(fp8_amax, fp8_job, &job->amax, &job->src)

ON_DEVICES(cast_from_fp8, fp8_job, &job->dst, &job->src, &job->scale)

void ampc_op_cast_fp8(struct call *c, struct cast_fp8_args *a)
{
    struct fp8_job job;
    struct list *scales;
    struct list *amaxes;
    int mixed = 0;
    describe_all(c);
    job.dst = fp8_list(c, a->dst, &mixed);
    job.src = float_list_mixed(c, a->src, &mixed);
    check_same_shapes(c, a->dst, "dst", a->src, "src");
    check_values(c, a->scale, a->src->count, "one per tensor of src");
    check_values(c, a->amax, a->src->count, "one per tensor of src");
    check_overlap(c);
    job.scale = value_list(c, a->scale, a->src->count, &scales);
    job.amax = value_list(c, a->amax, a->src->count, &amaxes);
    struct list *lists[4] = { a->dst, a->src, scales, amaxes };
    struct ampc_list *outs[4] = { &job.dst, &job.src, &job.scale, &job.amax };
    run_groups(c, mixed, lists, outs, 4, cast_fp8_on_cpu, cast_fp8_on_cuda, &job);
}

void ampc_op_fp8_amax(struct call *c, struct fp8_amax_args *a)
{
    struct fp8_job job;
    struct list *amaxes;
    int mixed = 0;
    describe_all(c);
    job.src = float_list_mixed(c, a->src, &mixed);
    check_values(c, a->amax, a->src->count, "one per tensor of src");
    check_overlap(c);
    job.amax = value_list(c, a->amax, a->src->count, &amaxes);
    struct list *lists[2] = { a->src, amaxes };
    struct ampc_list *outs[2] = { &job.src, &job.amax };
    run_groups(c, mixed, lists, outs, 2, fp8_amax_on_cpu, fp8_amax_on_cuda, &job);
}

void ampc_op_cast_from_fp8(struct call *c, struct cast_from_fp8_args *a)
{
    struct fp8_job job;
    struct list *scales;
    int mixed = 0;
    describe_all(c);
    job.dst = float_list_mixed(c, a->dst, &mixed);
    job.src = fp8_list(c, a->src, &mixed);
    check_same_shapes(c, a->dst, "dst", a->src, "src");
    check_values(c, a->scale_inv, a->src->count, "one per tensor of src");
    check_overlap(c);
    job.scale = value_list(c, a->scale_inv, a->src->count, &scales);
    struct list *lists[3] = { a->dst, a->src, scales };
    struct ampc_list *outs[3] = { &job.dst, &job.src, &job.scale };
    run_groups(c, mixed, lists, outs, 3, cast_from_fp8_on_cpu, cast_from_fp8_on_cuda, &job);
}

// ---- fp8_update_scales ----

struct fp8_scaling_job {
    float *amax_history;
    float *scale;
    float *scale_inv;
    const float *amax;
    struct ampc_fp8_scaling_args args;
};

ON_DEVICES(fp8_update_scales, fp8_scaling_job,
           job->amax_history, job->scale, job->scale_inv, job->amax, &job->args)

void ampc_op_fp8_update_scales(struct call *c, struct fp8_update_scales_args *a)
{
    struct fp8_scaling_job job;
    struct tensor *history = a->amax_history;
    describe_all(c);
    shape(c, history);
    if (history->dtype != aoti_torch_dtype_float32() || history->dim != 2 || history->sizes[0] < 1)
        fail(c, "amax_history must be a 2-D torch.float32 tensor [history length >= 1, "
             "number of tensors], got %s with %lld dimensions", dtype_name(history->dtype),
             (long long)history->dim);
    int64_t count = history->sizes[1];
    check_values(c, a->amax, count, "one per column of amax_history");
    check_values(c, a->scale, count, "one per column of amax_history");
    check_values(c, a->scale_inv, count, "one per column of amax_history");
    if (!(a->fmax <= AMPC_FLT_MAX_D && (float)a->fmax > 0))
        fail(c, "fmax must be a positive finite fp32 number, got %g", a->fmax);
    job.args.scaled_max = (float)a->fmax * exp2f(-(float)a->margin);
    if (!isfinite(a->margin) || !(job.args.scaled_max > 0 && isfinite(job.args.scaled_max)))
        fail(c, "margin must be finite and leave fmax * 2^-margin a positive finite fp32 "
             "number, got margin %g", a->margin);
    check_overlap(c);
    job.amax_history = history->data;
    job.scale = a->scale->data;
    job.scale_inv = a->scale_inv->data;
    job.amax = a->amax->data;
    job.args.rows = history->sizes[0];
    job.args.count = count;
    job.args.most_recent = a->most_recent;
    run(c, fp8_update_scales_on_cpu, fp8_update_scales_on_cuda, &job);
}
