/*
 * binding.c: the only place that knows about PyTorch. It registers torch.ops.ampc.*
 * through libtorch's stable C ABI (no ATen C++ API), checks every argument, turns
 * tensor handles into struct ampc_list and calls the CPU kernel or the CUDA one.
 *
 * A boxed kernel owns every tensor handle on its stack and must free them. Errors
 * reach Python as RuntimeError by throwing through aoti_torch_check, which unwinds
 * through these C frames (built with -fexceptions); so every check runs, and every
 * handle is freed, before anything is modified. Messages name the op and the
 * argument: "ampc.cast: dst[3] must be torch.float16 like dst[0], got torch.float32".
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ampc.h"
#include "dtype.h"          // defines: ampc_dtype_size
#include "torch_shim.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_LISTS 11
#define MAX_SINGLES 6
#define AMPC_FLT_MAX_D 3.4028234663852886e+38

static const struct ampc_cuda_api *g_cuda;
/* Why CUDA calls are refused while g_cuda is NULL. */
static char g_cuda_refusal[512] = "this build of ampc has no CUDA kernels (nvcc was not found "
                                  "when it was built)";

/* What the kernel knows of one tensor argument. */
struct tensor {
    AtenTensorHandle h;
    const char *name;       /* argument name */
    int64_t index;          /* position in its list, -1 for a single tensor */
    int32_t dtype;
    int32_t device_type;
    int32_t device_index;
    int64_t numel;
    void *data;
    int64_t dim;            /* -1 until shape() reads it with sizes */
    int64_t *sizes;
    int written;            /* the op writes it */
    int host;               /* read by the binding on the host (a CPU tensor on any call) */
};

struct list {
    struct tensor *t;
    int64_t count;
    void **ptr;             /* for struct ampc_list */
    int64_t *numel;
};

/* One call of an op: the handles it owns and the arguments checked so far. */
struct call {
    const char *op;
    int on_cuda;
    struct list lists[MAX_LISTS];
    int n_lists;
    struct tensor singles[MAX_SINGLES];
    int n_singles;
    const struct tensor *first;     /* the tensor that fixes the device */
    int soft;                       /* a tensor on another device or not contiguous sets */
    int unfit;                      /* unfit instead of failing the call (adam_packed) */
    void *scratch;                  /* freed with the call (the lists of dtype groups) */
    char msg[512];
};

// ---- freeing and failing ----

static void call_free(struct call *c)
{
    for (int l = 0; l < c->n_lists; l++) {
        struct list *ls = &c->lists[l];
        for (int64_t i = 0; i < ls->count; i++)
            if (ls->t[i].h)
                aoti_torch_delete_tensor_object(ls->t[i].h);
        free(ls->t);
        free(ls->ptr);
        free(ls->numel);
    }
    for (int s = 0; s < c->n_singles; s++)
        aoti_torch_delete_tensor_object(c->singles[s].h);
    free(c->scratch);
    c->scratch = NULL;
    c->n_lists = 0;
    c->n_singles = 0;
}

/* Frees everything the call owns and raises RuntimeError("<op>: <message>"). */
static void fail(struct call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(struct call *c, const char *fmt, ...)
{
    int n = snprintf(c->msg, sizeof(c->msg), "%s: ", c->op);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg + n, sizeof(c->msg) - (size_t)n, fmt, ap);
    va_end(ap);
    call_free(c);
    aoti_torch_check(false, c->op, __FILE__, __LINE__, c->msg);
}

static void shim(struct call *c, AOTITorchError err, const char *what)
{
    if (err != 0)
        fail(c, "torch's C API failed in %s", what);
}

// ---- names for messages ----

static const char *dtype_name(int32_t dtype)
{
    /* c10::ScalarType codes, which the stable ABI uses as is */
    static const char *names[] = {
        "torch.uint8", "torch.int8", "torch.int16", "torch.int32", "torch.int64",
        "torch.float16", "torch.float32", "torch.float64", "torch.complex32",
        "torch.complex64", "torch.complex128", "torch.bool", "torch.qint8", "torch.quint8",
        "torch.qint32", "torch.bfloat16",
    };
    if (dtype >= 0 && dtype < (int32_t)(sizeof(names) / sizeof(names[0])))
        return names[dtype];
    if (dtype == aoti_torch_dtype_float8_e4m3fn())
        return "torch.float8_e4m3fn";
    if (dtype == aoti_torch_dtype_float8_e5m2())
        return "torch.float8_e5m2";
    return "an unsupported dtype";
}

static const char *tensor_name(const struct tensor *t, char *buf, size_t size)
{
    if (t->index < 0)
        snprintf(buf, size, "%s", t->name);
    else
        snprintf(buf, size, "%s[%lld]", t->name, (long long)t->index);
    return buf;
}

static const char *device_name(int32_t type, int32_t index, char *buf, size_t size)
{
    if (type == aoti_torch_device_type_cpu())
        snprintf(buf, size, "cpu");
    else if (type == aoti_torch_device_type_cuda())
        snprintf(buf, size, "cuda:%d", (int)index);
    else
        snprintf(buf, size, "device type %d", (int)type);
    return buf;
}

// ---- taking arguments off the stack ----

/* Reads a tensor's metadata; the first tensor of the call fixes the device. */
static void describe(struct call *c, struct tensor *t)
{
    bool contiguous = false;
    char a[64];
    char b[64];
    char d1[32];
    char d2[32];
    shim(c, aoti_torch_get_dtype(t->h, &t->dtype), "get_dtype");
    shim(c, aoti_torch_get_device_type(t->h, &t->device_type), "get_device_type");
    shim(c, aoti_torch_get_device_index(t->h, &t->device_index), "get_device_index");
    shim(c, aoti_torch_get_numel(t->h, &t->numel), "get_numel");
    shim(c, aoti_torch_is_contiguous(t->h, &contiguous), "is_contiguous");
    shim(c, torch_get_mutable_data_ptr(t->h, &t->data), "get_data_ptr");
    if (t->host && t->device_type != aoti_torch_device_type_cpu())
        fail(c, "%s must be on the CPU, got %s", tensor_name(t, a, sizeof(a)),
             device_name(t->device_type, t->device_index, d1, sizeof(d1)));
    if (!c->first && !t->host)
        c->first = t;
    const struct tensor *f = t->host ? t : c->first;
    int misplaced = t->device_type != f->device_type || t->device_index != f->device_index;
    if (c->soft && !t->host && (misplaced || !contiguous)) {
        c->unfit = 1;
        return;
    }
    if (misplaced)
        fail(c, "%s must be on %s like %s, got %s", tensor_name(t, a, sizeof(a)),
             device_name(f->device_type, f->device_index, d1, sizeof(d1)),
             tensor_name(f, b, sizeof(b)),
             device_name(t->device_type, t->device_index, d2, sizeof(d2)));
    if (!contiguous)
        fail(c, "%s must be contiguous (call .contiguous() on it first)",
             tensor_name(t, a, sizeof(a)));
    /* FSDP frees a parameter's storage this way between uses */
    if (t->numel > 0 && !t->data)
        fail(c, "%s has %lld elements and no data (its storage was freed or resized to 0)",
             tensor_name(t, a, sizeof(a)), (long long)t->numel);
}

/* Takes ownership of a Tensor[] argument and of each of its tensors. */
static struct list *take_list(struct call *c, StableIValue v, const char *name, int written)
{
    StableListHandle lh = (StableListHandle)(uintptr_t)v;
    struct list *ls = &c->lists[c->n_lists++];
    size_t n = 0;
    memset(ls, 0, sizeof(*ls));
    if (torch_list_size(lh, &n) != 0) {
        torch_delete_list(lh);
        fail(c, "torch's C API failed in list_size");
    }
    ls->t = calloc(n ? n : 1, sizeof(*ls->t));
    ls->ptr = calloc(n ? n : 1, sizeof(*ls->ptr));
    ls->numel = calloc(n ? n : 1, sizeof(*ls->numel));
    int ok = ls->t && ls->ptr && ls->numel;
    for (size_t i = 0; ok && i < n; i++) {
        StableIValue item = 0;
        ok = torch_list_get_item(lh, i, &item) == 0;
        ls->t[i].h = (AtenTensorHandle)(uintptr_t)item;
        ls->count = (int64_t)i + 1;
    }
    torch_delete_list(lh);
    if (!ok)
        fail(c, "could not read %s (out of memory?)", name);
    for (int64_t i = 0; i < ls->count; i++) {
        ls->t[i].name = name;
        ls->t[i].index = i;
        ls->t[i].dim = -1;
        ls->t[i].written = written;
    }
    return ls;
}

/* A list of zero or one value that lives on the device (see option()): named without an
 * index in messages. */
static struct list *take_option(struct call *c, StableIValue v, const char *name)
{
    struct list *ls = take_list(c, v, name, 0);
    for (int64_t i = 0; i < ls->count; i++)
        ls->t[i].index = -1;
    return ls;
}

static struct tensor *take_tensor(struct call *c, StableIValue v, const char *name, int written)
{
    struct tensor *t = &c->singles[c->n_singles++];
    memset(t, 0, sizeof(*t));
    t->h = (AtenTensorHandle)(uintptr_t)v;
    t->name = name;
    t->index = -1;
    t->written = written;
    return t;
}

/* Once every handle is owned (so a failure frees them all): read and check them. */
static void describe_all(struct call *c)
{
    for (int l = 0; l < c->n_lists; l++) {
        struct list *ls = &c->lists[l];
        for (int64_t i = 0; i < ls->count; i++) {
            describe(c, &ls->t[i]);
            ls->ptr[i] = ls->t[i].data;
            ls->numel[i] = ls->t[i].numel;
        }
    }
    for (int s = 0; s < c->n_singles; s++)
        describe(c, &c->singles[s]);
    if (c->on_cuda && !g_cuda)
        fail(c, "%s", g_cuda_refusal);
}

static double take_double(StableIValue v)
{
    double d;
    memcpy(&d, &v, sizeof(d));
    return d;
}

// ---- checks ----

static int to_ampc_dtype(int32_t dtype, ampc_dtype *out)
{
    if (dtype == aoti_torch_dtype_float32())
        *out = AMPC_F32;
    else if (dtype == aoti_torch_dtype_float16())
        *out = AMPC_F16;
    else if (dtype == aoti_torch_dtype_bfloat16())
        *out = AMPC_BF16;
    else
        return 0;
    return 1;
}

static int to_fp8_dtype(int32_t dtype, ampc_dtype *out)
{
    if (dtype == aoti_torch_dtype_float8_e4m3fn())
        *out = AMPC_F8E4M3;
    else if (dtype == aoti_torch_dtype_float8_e5m2())
        *out = AMPC_F8E5M2;
    else
        return 0;
    return 1;
}

/* Every tensor of the list is fp32, fp16 or bf16: the list, with the dtype of its first
 * tensor; *mixed is set when the others do not all share it. */
static struct ampc_list float_list_mixed(struct call *c, const struct list *ls, int *mixed)
{
    char a[64];
    struct ampc_list out = { ls->ptr, ls->numel, ls->count, AMPC_F32 };
    for (int64_t i = 0; i < ls->count; i++) {
        const struct tensor *t = &ls->t[i];
        ampc_dtype d;
        if (!to_ampc_dtype(t->dtype, &d))
            fail(c, "%s must be torch.float32, torch.float16 or torch.bfloat16, got %s",
                 tensor_name(t, a, sizeof(a)), dtype_name(t->dtype));
        *mixed |= t->dtype != ls->t[0].dtype;
    }
    if (ls->count > 0)
        to_ampc_dtype(ls->t[0].dtype, &out.dtype);
    return out;
}

/* Every tensor of the list is fp32, fp16 or bf16, all the same one. */
static struct ampc_list float_list(struct call *c, const struct list *ls)
{
    char a[64];
    int mixed = 0;
    struct ampc_list out = float_list_mixed(c, ls, &mixed);
    for (int64_t i = 1; mixed && i < ls->count; i++) {
        const struct tensor *t = &ls->t[i];
        if (t->dtype != ls->t[0].dtype)
            fail(c, "%s must be %s like %s[0], got %s", tensor_name(t, a, sizeof(a)),
                 dtype_name(ls->t[0].dtype), t->name, dtype_name(t->dtype));
    }
    return out;
}

/* A 1-element tensor of the given dtype (found_inf, inv_scale, scale, trackers). */
static void check_scalar(struct call *c, const struct tensor *t, int32_t dtype, int allow_empty)
{
    char a[64];
    if (t->dtype != dtype || !(t->numel == 1 || (allow_empty && t->numel == 0)))
        fail(c, "%s must be a 1-element %s tensor, got %s with %lld elements",
             tensor_name(t, a, sizeof(a)), dtype_name(dtype), dtype_name(t->dtype),
             (long long)t->numel);
}

/* Reads a tensor's shape once: a list may be compared with several others (Adam's
 * params with each list of state). */
static void shape(struct call *c, struct tensor *t)
{
    if (t->dim >= 0)
        return;
    shim(c, aoti_torch_get_sizes(t->h, &t->sizes), "get_sizes");
    shim(c, aoti_torch_get_dim(t->h, &t->dim), "get_dim");
}

/* dst[i] has the shape of src[i] for every i. */
static void check_same_shapes(struct call *c, struct list *a, const char *a_name,
                              struct list *b, const char *b_name)
{
    char n[64];
    if (a->count != b->count)
        fail(c, "%s must have as many tensors as %s (%lld), got %lld", a_name, b_name,
             (long long)b->count, (long long)a->count);
    for (int64_t i = 0; i < a->count; i++) {
        struct tensor *ta = &a->t[i];
        struct tensor *tb = &b->t[i];
        shape(c, ta);
        shape(c, tb);
        if (ta->dim != tb->dim || memcmp(ta->sizes, tb->sizes, sizeof(int64_t) * (size_t)ta->dim))
            fail(c, "%s must have the shape of %s[%lld]", tensor_name(ta, n, sizeof(n)),
                 b_name, (long long)i);
    }
}

/* A byte range of one tensor, for the overlap check. */
struct range {
    uintptr_t begin;
    uintptr_t end;
    const struct tensor *t;
};

/*
 * Sorts r[0..n) by begin, using tmp[0..n); returns the sorted array (r or tmp). Each pass
 * merges pairs of the ascending runs already there, and a list's tensors mostly lie in
 * address order (allocated one after another, or views into one buffer), so a call takes
 * a few linear passes, not the n log n calls of a qsort comparator.
 */
static struct range *sort_ranges(struct range *r, struct range *tmp, size_t n)
{
    for (;;) {
        size_t runs = 0;
        for (size_t i = 0; i < n; runs++) {
            size_t mid = i + 1;
            while (mid < n && r[mid - 1].begin <= r[mid].begin)
                mid++;
            size_t end = mid < n ? mid + 1 : n;
            while (end < n && r[end - 1].begin <= r[end].begin)
                end++;
            size_t a = i;
            size_t b = mid;
            size_t o = i;
            while (a < mid && b < end)
                tmp[o++] = r[b].begin < r[a].begin ? r[b++] : r[a++];
            while (a < mid)
                tmp[o++] = r[a++];
            while (b < end)
                tmp[o++] = r[b++];
            i = end;
        }
        struct range *sorted = tmp;
        tmp = r;
        r = sorted;
        if (runs <= 1)
            return r;
    }
}

static size_t add_range(struct range *r, size_t n, const struct tensor *t)
{
    ampc_dtype d;
    int64_t size = to_ampc_dtype(t->dtype, &d) || to_fp8_dtype(t->dtype, &d) ? ampc_dtype_size(d)
                 : t->dtype == aoti_torch_dtype_int64() ? 8
                 : t->dtype == aoti_torch_dtype_int32() ? 4 : 1;    /* uint8 */
    if (t->numel == 0)
        return n;
    r[n].begin = (uintptr_t)t->data;
    r[n].end = r[n].begin + (uintptr_t)(t->numel * size);
    r[n].t = t;
    return n + 1;
}

/* No tensor the op writes may share memory with any other tensor argument. Sorting by
 * start address, an overlap shows up as a start below the furthest end seen so far. */
static void check_overlap(struct call *c)
{
    size_t cap = (size_t)c->n_singles;
    for (int l = 0; l < c->n_lists; l++)
        cap += (size_t)c->lists[l].count;
    struct range *buf = malloc(sizeof(*buf) * 2 * (cap ? cap : 1));
    if (!buf)
        fail(c, "out of memory");
    struct range *r = buf;
    size_t n = 0;
    for (int l = 0; l < c->n_lists; l++)
        for (int64_t i = 0; i < c->lists[l].count; i++)
            n = add_range(r, n, &c->lists[l].t[i]);
    for (int s = 0; s < c->n_singles; s++)
        n = add_range(r, n, &c->singles[s]);
    r = sort_ranges(r, buf + cap, n);
    const struct range *far = NULL;         /* furthest-reaching range so far */
    const struct range *far_written = NULL; /* the same among written ones */
    const struct tensor *x = NULL;
    const struct tensor *y = NULL;
    for (size_t i = 0; i < n && !x; i++) {
        if (r[i].t->written && far && r[i].begin < far->end) {
            x = r[i].t;
            y = far->t;
        } else if (far_written && r[i].begin < far_written->end) {
            x = far_written->t;
            y = r[i].t;
        }
        if (!far || r[i].end > far->end)
            far = &r[i];
        if (r[i].t->written && (!far_written || r[i].end > far_written->end))
            far_written = &r[i];
    }
    free(buf);
    if (x) {
        char a[64];
        char b[64];
        fail(c, "%s overlaps %s in memory; an output must not alias another argument",
             tensor_name(x, a, sizeof(a)), tensor_name(y, b, sizeof(b)));
    }
}

// ---- CUDA emulation (tests only; docs/cuda-emulation.md) ----
/* With the emulated CUDA library loaded as the CUDA library (AMPC_CUDA_EMU), set to 1:
 * calls on CPU tensors run the CUDA launchers, which the emulation runs on the CPU. */
static int g_cuda_emulation;

/* 0 when set; -1 when on is asked and no CUDA library is loaded. */
EXPORT int ampc_set_cuda_emulation(int on)
{
    if (on && !g_cuda)
        return -1;
    g_cuda_emulation = on != 0;
    return 0;
}
// ---- end of CUDA emulation ----

// ---- running ----

/* Runs the kernel on the CPU or, through the CUDA library, on the call's device.
 * On failure it raises (freeing the call); on success the caller frees the call. */
static void run(struct call *c, ampc_status (*cpu)(void *job),
                ampc_status (*cuda)(void *job, void *stream), void *job)
{
    ampc_status st;
    const char *why = "out of memory";
    if (!c->on_cuda && !g_cuda_emulation) {
        st = cpu(job);
    } else {
        void *guard = NULL;
        void *stream = NULL;
        int device = c->first ? c->first->device_index : 0;
        st = g_cuda->begin(device, &guard, &stream);
        if (st == AMPC_OK) {
            st = cuda(job, stream);
            g_cuda->end(guard);
        }
        if (st == AMPC_ERR_CUDA)
            why = g_cuda->last_error();
    }
    if (st == AMPC_ERR_THREADS)
        why = "torch's parallel_for failed";
    if (st != AMPC_OK)
        fail(c, "%s", why);
}

/* The dtype a tensor of a list counts as when positions are grouped (fp32 for the lists of
 * per-tensor values, value_list()). */
static ampc_dtype group_dtype(int32_t dtype)
{
    ampc_dtype d = AMPC_F32;
    if (!to_ampc_dtype(dtype, &d))
        to_fp8_dtype(dtype, &d);
    return d;
}

/*
 * Runs the kernel once when no list mixes dtypes. Lists that mix dtypes (`mixed`; checked
 * as a whole: devices, shapes, overlaps): the kernel runs once per group of positions
 * whose tensors share their dtypes in the first two lists (lists after them hold fp32
 * values, one per position), groups in dtype order, positions in list order. out[l] (the
 * job's lists) describe the group when the kernel runs; element numbering (Note
 * [stochastic rounding]) restarts in each group.
 */
static void run_groups(struct call *c, int mixed, struct list *const ls[],
                       struct ampc_list *const out[], int n, ampc_status (*cpu)(void *job),
                       ampc_status (*cuda)(void *job, void *stream), void *job)
{
    if (!mixed) {           /* one dtype per list: `out` already holds the whole lists */
        run(c, cpu, cuda, job);
        return;
    }
    int64_t count = ls[0]->count;
    void **ptr = malloc(sizeof(*ptr) * (size_t)(n * count) + sizeof(int64_t) * (size_t)(n * count));
    if (!ptr)
        fail(c, "out of memory");
    int64_t *numel = (int64_t *)(ptr + n * count);
    c->scratch = ptr;
    for (int key = 0; key < 25; key++) {    /* 5 * (dtype in list 0) + dtype in list 1 */
        int64_t m = 0;
        for (int64_t i = 0; i < count; i++) {
            ampc_dtype d0 = group_dtype(ls[0]->t[i].dtype);
            ampc_dtype d1 = n > 1 ? group_dtype(ls[1]->t[i].dtype) : AMPC_F32;
            if ((int)d0 * 5 + (int)d1 != key)
                continue;
            for (int l = 0; l < n; l++) {
                ptr[l * count + m] = ls[l]->ptr[i];
                numel[l * count + m] = ls[l]->numel[i];
            }
            m++;
        }
        for (int l = 0; m > 0 && l < n; l++)
            *out[l] = (struct ampc_list){ ptr + l * count, numel + l * count, m,
                                          l == 0 ? (ampc_dtype)(key / 5)
                                          : l == 1 ? (ampc_dtype)(key % 5) : AMPC_F32 };
        if (m > 0)
            run(c, cpu, cuda, job);
    }
}

static void start(struct call *c, const char *op, int on_cuda)
{
    memset(c, 0, sizeof(*c));
    c->op = op;
    c->on_cuda = on_cuda;
}

/* A list of zero or one 1-element tensor of `dtype` (a value that lives on the device):
 * its data, or NULL. An optional argument would need C++ to free on torch < 2.13 (Note in
 * stable_abi: optionals), so the schemas take such values as lists. */
static void *option(struct call *c, struct list *ls, const char *name, int32_t dtype)
{
    if (ls->count == 0)
        return NULL;
    if (ls->count > 1)
        fail(c, "%s must hold at most one tensor, got %lld", name, (long long)ls->count);
    check_scalar(c, &ls->t[0], dtype, 0);
    return ls->t[0].data;
}

// ---- cast(Tensor(a!)[] dst, Tensor[] src, Tensor[] seed_tensor, bool stochastic,
//           int seed) ----

struct cast_job {
    struct ampc_list dst;
    struct ampc_list src;
    struct ampc_cast_args args;
};

static ampc_status cast_on_cpu(void *j)
{
    struct cast_job *job = j;
    return ampc_cast_cpu(&job->dst, &job->src, &job->args);
}

static ampc_status cast_on_cuda(void *j, void *stream)
{
    struct cast_job *job = j;
    return g_cuda->cast(&job->dst, &job->src, &job->args, stream);
}

static void cast_kernel(StableIValue *stack, int on_cuda)
{
    struct call c;
    start(&c, "ampc.cast", on_cuda);
    struct list *dst = take_list(&c, stack[0], "dst", 1);
    struct list *src = take_list(&c, stack[1], "src", 0);
    struct list *seed = take_option(&c, stack[2], "seed_tensor");
    describe_all(&c);
    struct cast_job job;
    int mixed = 0;
    job.dst = float_list_mixed(&c, dst, &mixed);
    job.src = float_list_mixed(&c, src, &mixed);
    check_same_shapes(&c, dst, "dst", src, "src");
    job.args.seed_tensor = option(&c, seed, "seed_tensor", aoti_torch_dtype_int64());
    check_overlap(&c);
    job.args.stochastic = (stack[3] & 0xff) != 0;
    job.args.seed = (uint64_t)stack[4];
    struct list *lists[2] = { dst, src };
    struct ampc_list *outs[2] = { &job.dst, &job.src };
    run_groups(&c, mixed, lists, outs, 2, cast_on_cpu, cast_on_cuda, &job);
    call_free(&c);
}

// ---- unscale_check(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) ----

struct unscale_check_job {
    struct ampc_list grads;
    float *found_inf;
    const float *inv_scale;
};

static ampc_status unscale_check_on_cpu(void *j)
{
    struct unscale_check_job *job = j;
    return ampc_unscale_check_cpu(&job->grads, job->found_inf, job->inv_scale);
}

static ampc_status unscale_check_on_cuda(void *j, void *stream)
{
    struct unscale_check_job *job = j;
    return g_cuda->unscale_check(&job->grads, job->found_inf, job->inv_scale, stream);
}

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

static void unscale_check_kernel(StableIValue *stack, int on_cuda)
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

static ampc_status check_norm_on_cpu(void *j)
{
    struct check_norm_job *job = j;
    return ampc_check_norm_cpu(&job->grads, job->found_inf, job->norm, job->inv_scale);
}

static ampc_status check_norm_on_cuda(void *j, void *stream)
{
    struct check_norm_job *job = j;
    return g_cuda->check_norm(&job->grads, job->found_inf, job->norm, job->inv_scale, stream);
}

static void check_norm_kernel(StableIValue *stack, int on_cuda)
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

static ampc_status update_scale_on_cpu(void *j)
{
    struct update_scale_job *job = j;
    return ampc_update_scale_cpu(job->scale, job->growth_tracker, job->hysteresis_tracker,
                                 job->found_inf, &job->args);
}

static ampc_status update_scale_on_cuda(void *j, void *stream)
{
    struct update_scale_job *job = j;
    return g_cuda->update_scale(job->scale, job->growth_tracker, job->hysteresis_tracker,
                                job->found_inf, &job->args, stream);
}

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

static void update_scale_kernel(StableIValue *stack, int on_cuda)
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

static ampc_status adam_on_cpu(void *j)
{
    struct adam_job *job = j;
    return ampc_adam_cpu(&job->lists, &job->control, &job->args);
}

static ampc_status adam_on_cuda(void *j, void *stream)
{
    struct adam_job *job = j;
    if (!g_cuda->adam)
        return AMPC_ERR_CUDA;
    return g_cuda->adam(&job->lists, &job->control, &job->args, stream);
}

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

static void check_adam_args(struct call *c, const struct ampc_adam_args *a, int lr_on_device)
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
    job->args.decoupled = (v[5] & 0xff) != 0;
    job->args.maximize = (v[6] & 0xff) != 0;
    job->args.stochastic = (r[0] & 0xff) != 0;
    job->args.seed = (uint64_t)r[1];
    check_adam_args(c, &job->args, job->control.lr != NULL);
}

static void adam_kernel(StableIValue *stack, int on_cuda)
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

static void adam_packed_kernel(StableIValue *stack, int on_cuda)
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
    int amsgrad = (stack[16] & 0xff) != 0;
    int master = (stack[17] & 0xff) != 0;
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

static ampc_status fp8_gemm_on_cpu(void *j)
{
    return AMPC_ERR_CUDA;   /* never called: the CPU kernel refuses first */
}

static ampc_status fp8_gemm_on_cuda(void *j, void *stream)
{
    return g_cuda->fp8_gemm(j, stream);
}

// ---- fp8_gemm(Tensor(a!) out, Tensor a, Tensor b_t, Tensor scale_inv_a, Tensor scale_inv_b,
//               Tensor[] bias, Tensor(b!)[] amax, Tensor(c!) workspace) -> int ----
// out[m, n] = a[m, k] @ b_t[n, k]^T * scale_inv_a * scale_inv_b + bias, on CUDA through
// cuBLASLt (csrc/cuda/fp8_gemm.cu). Returns 1 when the epilogue wrote amax, 0 when the
// caller must compute it. Its CPU kernel checks every argument like the CUDA one, then
// refuses: the CPU reference path is ampc.fp8.gemm's, in torch.

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

static void fp8_gemm_kernel(StableIValue *stack, int on_cuda)
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
    run(&c, fp8_gemm_on_cpu, fp8_gemm_on_cuda, &g);
    call_free(&c);
    stack[0] = g.amax_written;
}

// ---- the fp8 ops: cast_fp8, fp8_amax, cast_from_fp8, fp8_update_scales ----

/* Every tensor of the list is torch.float8_e4m3fn or torch.float8_e5m2; *mixed is set when
 * they do not all share one. */
static struct ampc_list fp8_list(struct call *c, const struct list *ls, int *mixed)
{
    char a[64];
    struct ampc_list out = { ls->ptr, ls->numel, ls->count, AMPC_F8E4M3 };
    for (int64_t i = 0; i < ls->count; i++) {
        const struct tensor *t = &ls->t[i];
        ampc_dtype d;
        if (!to_fp8_dtype(t->dtype, &d))
            fail(c, "%s must be torch.float8_e4m3fn or torch.float8_e5m2, got %s",
                 tensor_name(t, a, sizeof(a)), dtype_name(t->dtype));
        *mixed |= t->dtype != ls->t[0].dtype;
    }
    if (ls->count > 0)
        to_fp8_dtype(ls->t[0].dtype, &out.dtype);
    return out;
}

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
    struct list *ls = &c->lists[c->n_lists++];
    memset(ls, 0, sizeof(*ls));
    ls->t = calloc(count ? count : 1, sizeof(*ls->t));
    ls->ptr = calloc(count ? count : 1, sizeof(*ls->ptr));
    ls->numel = calloc(count ? count : 1, sizeof(*ls->numel));
    if (!ls->t || !ls->ptr || !ls->numel)
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

static ampc_status cast_fp8_on_cpu(void *j)
{
    struct fp8_job *job = j;
    return ampc_cast_fp8_cpu(&job->dst, &job->amax, &job->src, &job->scale);
}

static ampc_status cast_fp8_on_cuda(void *j, void *stream)
{
    struct fp8_job *job = j;
    return g_cuda->cast_fp8(&job->dst, &job->amax, &job->src, &job->scale, stream);
}

static ampc_status fp8_amax_on_cpu(void *j)
{
    struct fp8_job *job = j;
    return ampc_fp8_amax_cpu(&job->amax, &job->src);
}

static ampc_status fp8_amax_on_cuda(void *j, void *stream)
{
    struct fp8_job *job = j;
    return g_cuda->fp8_amax(&job->amax, &job->src, stream);
}

static ampc_status cast_from_fp8_on_cpu(void *j)
{
    struct fp8_job *job = j;
    return ampc_cast_from_fp8_cpu(&job->dst, &job->src, &job->scale);
}

static ampc_status cast_from_fp8_on_cuda(void *j, void *stream)
{
    struct fp8_job *job = j;
    return g_cuda->cast_from_fp8(&job->dst, &job->src, &job->scale, stream);
}

// cast_fp8(Tensor(a!)[] dst, Tensor[] src, Tensor scale, Tensor(b!) amax)
static void cast_fp8_kernel(StableIValue *stack, int on_cuda)
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
static void fp8_amax_kernel(StableIValue *stack, int on_cuda)
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
static void cast_from_fp8_kernel(StableIValue *stack, int on_cuda)
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

static ampc_status fp8_update_scales_on_cpu(void *j)
{
    struct fp8_scaling_job *job = j;
    return ampc_fp8_update_scales_cpu(job->amax_history, job->scale, job->scale_inv, job->amax,
                                      &job->args);
}

static ampc_status fp8_update_scales_on_cuda(void *j, void *stream)
{
    struct fp8_scaling_job *job = j;
    return g_cuda->fp8_update_scales(job->amax_history, job->scale, job->scale_inv, job->amax,
                                     &job->args, stream);
}

static void fp8_update_scales_kernel(StableIValue *stack, int on_cuda)
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
    job.args.most_recent = (stack[6] & 0xff) != 0;
    run(&c, fp8_update_scales_on_cpu, fp8_update_scales_on_cuda, &job);
    call_free(&c);
}

// ---- boxed entry points ----

/* name_cpu and name_cuda, the boxed kernels torch calls, from name_kernel(stack, on_cuda) */
#define BOXED(name)                                                                       \
    static void name##_cpu(StableIValue *s, uint64_t n, uint64_t o) { name##_kernel(s, 0); } \
    static void name##_cuda(StableIValue *s, uint64_t n, uint64_t o) { name##_kernel(s, 1); }

BOXED(cast)
BOXED(unscale_check)
BOXED(check_norm)
BOXED(update_scale)
BOXED(adam)
BOXED(adam_packed)
BOXED(fp8_gemm)
BOXED(cast_fp8)
BOXED(fp8_amax)
BOXED(cast_from_fp8)
BOXED(fp8_update_scales)

struct op {
    const char *schema;
    const char *name;
    void (*cpu)(StableIValue *, uint64_t, uint64_t);
    void (*cuda)(StableIValue *, uint64_t, uint64_t);
};

static const struct op ops[] = {
    { "cast(Tensor(a!)[] dst, Tensor[] src, Tensor[] seed_tensor, bool stochastic=False, "
      "int seed=0) -> ()",
      "cast", cast_cpu, cast_cuda },
    { "unscale_check(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()",
      "unscale_check", unscale_check_cpu, unscale_check_cuda },
    { "check_norm(Tensor[] grads, Tensor(a!) found_inf, Tensor inv_scale) -> Tensor",
      "check_norm", check_norm_cpu, check_norm_cuda },
    { "update_scale(Tensor(a!) scale, Tensor(b!) growth_tracker, "
      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale) -> ()",
      "update_scale", update_scale_cpu, update_scale_cuda },
    { "adam_master(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "
      "Tensor(f!)[] steps, Tensor[] lr_tensor, Tensor[] inv_scale, Tensor[] clip_coef, "
      "Tensor[] found_inf, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, bool maximize, bool stochastic=False, "
      "int seed=0) -> ()",
      "adam_master", adam_cpu, adam_cuda },
    { "adam_packed(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) state, Tensor(c!) steps, "
      "Tensor layout, Tensor[] lr_tensor, Tensor[] inv_scale, Tensor[] clip_coef, "
      "Tensor[] found_inf, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, bool maximize, bool amsgrad, bool master, "
      "bool stochastic=False, int seed=0) -> int",
      "adam_packed", adam_packed_cpu, adam_packed_cuda },
    { "fp8_gemm(Tensor(a!) out, Tensor a, Tensor b_t, Tensor scale_inv_a, Tensor scale_inv_b, "
      "Tensor[] bias, Tensor(b!)[] amax, Tensor(c!) workspace) -> int",
      "fp8_gemm", fp8_gemm_cpu, fp8_gemm_cuda },
    { "cast_fp8(Tensor(a!)[] dst, Tensor[] src, Tensor scale, Tensor(b!) amax) -> ()",
      "cast_fp8", cast_fp8_cpu, cast_fp8_cuda },
    { "fp8_amax(Tensor[] src, Tensor(a!) amax) -> ()",
      "fp8_amax", fp8_amax_cpu, fp8_amax_cuda },
    { "cast_from_fp8(Tensor(a!)[] dst, Tensor[] src, Tensor scale_inv) -> ()",
      "cast_from_fp8", cast_from_fp8_cpu, cast_from_fp8_cuda },
    { "fp8_update_scales(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv, "
      "Tensor amax, float fmax, float margin=0., bool most_recent=False) -> ()",
      "fp8_update_scales", fp8_update_scales_cpu, fp8_update_scales_cuda },
};

#define N_OPS ((int)(sizeof(ops) / sizeof(ops[0])))

/* The library handles must live as long as the process: deleting one deregisters. */
static TorchLibraryHandle g_def;
static TorchLibraryHandle g_cpu;
static TorchLibraryHandle g_cuda_impl;

/* Defines the schemas and registers CPU and CUDA kernels; 0 on success, otherwise the
 * number of the step that failed. Called once from Python after loading. */
EXPORT int ampc_register(void)
{
    if (g_def)
        return 0;
    if (aoti_torch_abi_version() < AMPC_TORCH_ABI_VERSION)
        return 1;
    if (aoti_torch_library_init_def("ampc", __FILE__, __LINE__, &g_def))
        return 2;
    for (int i = 0; i < N_OPS; i++)
        if (aoti_torch_library_def(g_def, ops[i].schema))
            return 3;
    if (aoti_torch_library_init_impl("ampc", "CPU", __FILE__, __LINE__, &g_cpu))
        return 4;
    if (aoti_torch_library_init_impl("ampc", "CUDA", __FILE__, __LINE__, &g_cuda_impl))
        return 5;
    for (int i = 0; i < N_OPS; i++) {
        if (torch_library_impl(g_cpu, ops[i].name, ops[i].cpu, AMPC_TORCH_ABI_VERSION))
            return 6;
        if (torch_library_impl(g_cuda_impl, ops[i].name, ops[i].cuda, AMPC_TORCH_ABI_VERSION))
            return 7;
    }
    return 0;
}

/* CUDA calls are refused with this reason (the loader could not load the CUDA library). */
EXPORT void ampc_refuse_cuda(const char *why)
{
    g_cuda = NULL;
    snprintf(g_cuda_refusal, sizeof(g_cuda_refusal), "%s", why);
}

/* The reason CUDA calls are refused, or NULL when they run. */
EXPORT const char *ampc_cuda_refusal(void)
{
    return g_cuda ? NULL : g_cuda_refusal;
}

/*
 * Hands over the CUDA library's launchers (csrc/cuda/api.cu) once its probe says they can
 * run: the library links its CUDA runtime statically, and a runtime newer than the driver
 * fails every call ("CUDA driver version is insufficient") while torch, built for another
 * CUDA, works. Returns 0 when handed over (also without a driver: no CUDA tensor can
 * exist then), 1 when the driver is too old for the runtime (the loader warns once).
 */
EXPORT int ampc_set_cuda_api(const struct ampc_cuda_api *api)
{
    int driver = 0;
    int runtime = 0;
    api->probe(&driver, &runtime);
    if (driver > 0 && driver / 1000 < runtime / 1000) {
        snprintf(g_cuda_refusal, sizeof(g_cuda_refusal),
                 "ampc's CUDA kernels cannot run: they were built with CUDA runtime %d.%d, "
                 "which needs a driver for CUDA %d.0 or newer, and the NVIDIA driver supports "
                 "CUDA %d.%d; update the driver, or rebuild ampc with a CUDA toolkit of major "
                 "version %d", runtime / 1000, runtime % 1000 / 10, runtime / 1000,
                 driver / 1000, driver % 1000 / 10, driver / 1000);
        g_cuda = NULL;
        return 1;
    }
    g_cuda = api;
    return 0;
}
