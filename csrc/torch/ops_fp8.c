/*
 * ops_fp8.c: the fp8 ops in the torch glue (fp8_gemm, cast_fp8, fp8_amax, cast_from_fp8,
 * fp8_update_scales): arguments taken off the stack and checked, then the kernels run.
 */
#include <math.h>

#include "call.h"

#define AMPC_FLT_MAX_D 3.4028234663852886e+38

// ---- fp8_gemm(Tensor(a!) out, Tensor a, Tensor b_t, Tensor scale_inv_a, Tensor scale_inv_b,
//               Tensor[] bias, Tensor(b!)[] amax, Tensor(c!) workspace) -> int ----
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
static const int64_t *sizes_of(struct call *c, const struct tensor *t, int64_t dim)
{
    char a[64];
    int64_t d = 0;
    int64_t *sizes = NULL;
    shim(c, aoti_torch_get_dim(t->h, &d), "get_dim");
    shim(c, aoti_torch_get_sizes(t->h, &sizes), "get_sizes");
    if (d != dim)
        fail(c, "%s must have %lld dimensions, got %lld", tensor_name(t, a, sizeof(a)),
             (long long)dim, (long long)d);
    return sizes;
}

static void check_aligned(struct call *c, const struct tensor *t)
{
    char a[64];
    if ((uintptr_t)t->data % 16 != 0)
        fail(c, "%s must start at a 16-byte aligned address (cuBLASLt's FP8 kernels need "
             "it); call .clone() on it first", tensor_name(t, a, sizeof(a)));
}

void ampc_op_fp8_gemm(StableIValue *stack, int on_cuda)
{
    struct call c;
    start(&c, "ampc.fp8_gemm", on_cuda);
    struct tensor *out = take_tensor(&c, stack[0], "out", 1);
    struct tensor *a = take_tensor(&c, stack[1], "a", 0);
    struct tensor *b = take_tensor(&c, stack[2], "b_t", 0);
    struct tensor *sa = take_tensor(&c, stack[3], "scale_inv_a", 0);
    struct tensor *sb = take_tensor(&c, stack[4], "scale_inv_b", 0);
    struct list *bias = take_option(&c, stack[5], "bias");
    struct list *amax = take_option(&c, stack[6], "amax");
    struct tensor *ws = take_tensor(&c, stack[7], "workspace", 1);
    for (int64_t i = 0; i < amax->count; i++)
        amax->t[i].written = 1;
    describe_all(&c);
    char n1[32];
    if (!(out->dtype == aoti_torch_dtype_float32() || out->dtype == aoti_torch_dtype_bfloat16()))
        fail(&c, "out must be torch.float32 or torch.bfloat16, got %s", dtype_name(out->dtype));
    for (int i = 0; i < 2; i++) {
        const struct tensor *t = i ? b : a;
        ampc_dtype d;
        if (!to_fp8_dtype(t->dtype, &d))
            fail(&c, "%s must be torch.float8_e4m3fn or torch.float8_e5m2, got %s",
                 tensor_name(t, n1, sizeof(n1)), dtype_name(t->dtype));
    }
    if (a->dtype == aoti_torch_dtype_float8_e5m2() && b->dtype == aoti_torch_dtype_float8_e5m2())
        fail(&c, "a and b_t are both torch.float8_e5m2; at least one must be "
             "torch.float8_e4m3fn (cuBLASLt has no e5m2 x e5m2 GEMM)");
    const int64_t *as = sizes_of(&c, a, 2);
    const int64_t *bs = sizes_of(&c, b, 2);
    const int64_t *os = sizes_of(&c, out, 2);
    int64_t m = as[0], k = as[1], n = bs[0];
    if (bs[1] != k)
        fail(&c, "b_t must be [n, k] with k = %lld like a's columns, got [%lld, %lld]",
             (long long)k, (long long)bs[0], (long long)bs[1]);
    if (k <= 0 || k % 16 != 0 || n <= 0 || n % 16 != 0)
        fail(&c, "k (%lld) and n (%lld) must be positive multiples of 16", (long long)k,
             (long long)n);
    if (os[0] != m || os[1] != n)
        fail(&c, "out must be [%lld, %lld], got [%lld, %lld]", (long long)m, (long long)n,
             (long long)os[0], (long long)os[1]);
    check_scalar(&c, sa, aoti_torch_dtype_float32(), 0);
    check_scalar(&c, sb, aoti_torch_dtype_float32(), 0);
    struct ampc_fp8_gemm_args g;
    memset(&g, 0, sizeof(g));
    if (bias->count > 1)
        fail(&c, "bias must hold at most one tensor, got %lld", (long long)bias->count);
    if (bias->count == 1) {
        const struct tensor *t = &bias->t[0];
        if (t->dtype != aoti_torch_dtype_bfloat16() || t->numel != n)
            fail(&c, "bias must be a torch.bfloat16 tensor of n = %lld elements, got %s with "
                 "%lld", (long long)n, dtype_name(t->dtype), (long long)t->numel);
        check_aligned(&c, t);
        g.bias = t->data;
    }
    g.amax = option(&c, amax, "amax", aoti_torch_dtype_float32());
    if (ws->dtype != aoti_torch_dtype_uint8())
        fail(&c, "workspace must be a torch.uint8 tensor, got %s", dtype_name(ws->dtype));
    check_aligned(&c, a);
    check_aligned(&c, b);
    check_aligned(&c, out);
    check_overlap(&c);
    if (!on_cuda)
        fail(&c, "runs on CUDA only (cuBLASLt); CPU tensors take ampc.fp8.gemm's reference path");
    g.out = out->data;
    g.a = a->data;
    g.b_t = b->data;
    g.scale_inv_a = sa->data;
    g.scale_inv_b = sb->data;
    g.workspace = ws->data;
    g.workspace_bytes = ws->numel;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a_e5m2 = a->dtype == aoti_torch_dtype_float8_e5m2();
    g.b_e5m2 = b->dtype == aoti_torch_dtype_float8_e5m2();
    g.out_dtype = out->dtype == aoti_torch_dtype_bfloat16() ? AMPC_BF16 : AMPC_F32;
    run(&c, NULL, fp8_gemm_on_cuda, &g);
    call_free(&c);
    stack[0] = g.amax_written;
}

// ---- the fp8 ops: cast_fp8, fp8_amax, cast_from_fp8, fp8_update_scales ----

/* A 1-D fp32 tensor of `count` values (scale, amax), `per` saying what each is for. */
static void check_values(struct call *c, const struct tensor *t, int64_t count, const char *per)
{
    int64_t dim = 0;
    shim(c, aoti_torch_get_dim(t->h, &dim), "get_dim");
    if (t->dtype != aoti_torch_dtype_float32() || dim != 1 || t->numel != count)
        fail(c, "%s must be a 1-D torch.float32 tensor of %lld values (%s), got %s with %lld "
             "dimensions and %lld elements", t->name, (long long)count, per,
             dtype_name(t->dtype), (long long)dim, (long long)t->numel);
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

// cast_fp8(Tensor(a!)[] dst, Tensor[] src, Tensor scale, Tensor(b!) amax)
void ampc_op_cast_fp8(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct fp8_job job;
    struct list *scales;
    struct list *amaxes;
    int mixed = 0;
    start(&c, "ampc.cast_fp8", on_cuda);
    struct list *dst = take_list(&c, stack[0], "dst", 1);
    struct list *src = take_list(&c, stack[1], "src", 0);
    struct tensor *scale = take_tensor(&c, stack[2], "scale", 0);
    struct tensor *amax = take_tensor(&c, stack[3], "amax", 1);
    describe_all(&c);
    job.dst = fp8_list(&c, dst, &mixed);
    job.src = float_list_mixed(&c, src, &mixed);
    check_same_shapes(&c, dst, "dst", src, "src");
    check_values(&c, scale, src->count, "one per tensor of src");
    check_values(&c, amax, src->count, "one per tensor of src");
    check_overlap(&c);
    job.scale = value_list(&c, scale, src->count, &scales);
    job.amax = value_list(&c, amax, src->count, &amaxes);
    struct list *lists[4] = { dst, src, scales, amaxes };
    struct ampc_list *outs[4] = { &job.dst, &job.src, &job.scale, &job.amax };
    run_groups(&c, mixed, lists, outs, 4, cast_fp8_on_cpu, cast_fp8_on_cuda, &job);
    call_free(&c);
}

// fp8_amax(Tensor[] src, Tensor(a!) amax)
void ampc_op_fp8_amax(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct fp8_job job;
    struct list *amaxes;
    int mixed = 0;
    start(&c, "ampc.fp8_amax", on_cuda);
    struct list *src = take_list(&c, stack[0], "src", 0);
    struct tensor *amax = take_tensor(&c, stack[1], "amax", 1);
    describe_all(&c);
    job.src = float_list_mixed(&c, src, &mixed);
    check_values(&c, amax, src->count, "one per tensor of src");
    check_overlap(&c);
    job.amax = value_list(&c, amax, src->count, &amaxes);
    struct list *lists[2] = { src, amaxes };
    struct ampc_list *outs[2] = { &job.src, &job.amax };
    run_groups(&c, mixed, lists, outs, 2, fp8_amax_on_cpu, fp8_amax_on_cuda, &job);
    call_free(&c);
}

// cast_from_fp8(Tensor(a!)[] dst, Tensor[] src, Tensor scale_inv)
void ampc_op_cast_from_fp8(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct fp8_job job;
    struct list *scales;
    int mixed = 0;
    start(&c, "ampc.cast_from_fp8", on_cuda);
    struct list *dst = take_list(&c, stack[0], "dst", 1);
    struct list *src = take_list(&c, stack[1], "src", 0);
    struct tensor *scale_inv = take_tensor(&c, stack[2], "scale_inv", 0);
    describe_all(&c);
    job.dst = float_list_mixed(&c, dst, &mixed);
    job.src = fp8_list(&c, src, &mixed);
    check_same_shapes(&c, dst, "dst", src, "src");
    check_values(&c, scale_inv, src->count, "one per tensor of src");
    check_overlap(&c);
    job.scale = value_list(&c, scale_inv, src->count, &scales);
    struct list *lists[3] = { dst, src, scales };
    struct ampc_list *outs[3] = { &job.dst, &job.src, &job.scale };
    run_groups(&c, mixed, lists, outs, 3, cast_from_fp8_on_cpu, cast_from_fp8_on_cuda, &job);
    call_free(&c);
}

// fp8_update_scales(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv,
//                   Tensor amax, float fmax, float margin, bool most_recent)

struct fp8_scaling_job {
    float *amax_history;
    float *scale;
    float *scale_inv;
    const float *amax;
    struct ampc_fp8_scaling_args args;
};

ON_DEVICES(fp8_update_scales, fp8_scaling_job,
           job->amax_history, job->scale, job->scale_inv, job->amax, &job->args)

void ampc_op_fp8_update_scales(StableIValue *stack, int on_cuda)
{
    struct call c;
    struct fp8_scaling_job job;
    int64_t dim = 0;
    int64_t *sizes = NULL;
    start(&c, "ampc.fp8_update_scales", on_cuda);
    struct tensor *history = take_tensor(&c, stack[0], "amax_history", 1);
    struct tensor *scale = take_tensor(&c, stack[1], "scale", 1);
    struct tensor *scale_inv = take_tensor(&c, stack[2], "scale_inv", 1);
    struct tensor *amax = take_tensor(&c, stack[3], "amax", 0);
    describe_all(&c);
    double fmax = take_double(stack[4]);
    double margin = take_double(stack[5]);
    shim(&c, aoti_torch_get_dim(history->h, &dim), "get_dim");
    shim(&c, aoti_torch_get_sizes(history->h, &sizes), "get_sizes");
    if (history->dtype != aoti_torch_dtype_float32() || dim != 2 || sizes[0] < 1)
        fail(&c, "amax_history must be a 2-D torch.float32 tensor [history length >= 1, "
             "number of tensors], got %s with %lld dimensions", dtype_name(history->dtype),
             (long long)dim);
    check_values(&c, amax, sizes[1], "one per column of amax_history");
    check_values(&c, scale, sizes[1], "one per column of amax_history");
    check_values(&c, scale_inv, sizes[1], "one per column of amax_history");
    if (!(fmax <= AMPC_FLT_MAX_D && (float)fmax > 0))
        fail(&c, "fmax must be a positive finite fp32 number, got %g", fmax);
    job.args.scaled_max = (float)fmax * exp2f(-(float)margin);
    if (!isfinite(margin) || !(job.args.scaled_max > 0 && isfinite(job.args.scaled_max)))
        fail(&c, "margin must be finite and leave fmax * 2^-margin a positive finite fp32 "
             "number, got margin %g", margin);
    check_overlap(&c);
    job.amax_history = history->data;
    job.scale = scale->data;
    job.scale_inv = scale_inv->data;
    job.amax = amax->data;
    job.args.rows = sizes[0];
    job.args.count = sizes[1];
    job.args.most_recent = take_bool(stack[6]);
    run(&c, fp8_update_scales_on_cpu, fp8_update_scales_on_cuda, &job);
    call_free(&c);
}

