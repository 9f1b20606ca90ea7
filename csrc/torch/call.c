/*
 * call.c: the torch glue's shared call handling (call.h): taking tensor handles off torch's
 * boxed stack and freeing them, failing with a message that names the op and the
 * argument, reading and checking tensors (device, layout, dtype, shape, overlap), and
 * running a kernel on the CPU or through the CUDA library, once or per dtype group.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "dtype.h"          // defines: ampc_dtype_size
#include "lean.h"           // defines: AMPC_QBLOCK

// ---- freeing and failing ----

void call_free(struct call *c)
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
void fail(struct call *c, const char *fmt, ...)
{
    int n = snprintf(c->msg, sizeof(c->msg), "%s: ", c->op);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg + n, sizeof(c->msg) - (size_t)n, fmt, ap);
    va_end(ap);
    call_free(c);
    aoti_torch_check(false, c->op, __FILE__, __LINE__, c->msg);
}

void shim(struct call *c, AOTITorchError err, const char *what)
{
    if (err != 0)
        fail(c, "torch's C API failed in %s", what);
}

// ---- names for messages ----

const char *dtype_name(int32_t dtype)
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

const char *tensor_name(const struct tensor *t, char *buf, size_t size)
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
    int32_t layout = 0;
    /* a sparse or other non-strided tensor reaches here when ampc's Python calls the
     * backend's kernel straight (ops.py), not through the dispatcher, which refuses it */
    shim(c, aoti_torch_get_layout(t->h, &layout), "get_layout");
    if (layout != aoti_torch_layout_strided())
        fail(c, "%s must be a dense (strided) tensor, got layout %d",
             tensor_name(t, a, sizeof(a)), (int)layout);
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

struct list *next_list(struct call *c)
{
    struct list *ls = &c->lists[c->n_lists++];
    memset(ls, 0, sizeof(*ls));
    return ls;
}

int alloc_list(struct list *ls, int64_t n)
{
    ls->t = calloc(n ? n : 1, sizeof(*ls->t));
    ls->ptr = calloc(n ? n : 1, sizeof(*ls->ptr));
    ls->numel = calloc(n ? n : 1, sizeof(*ls->numel));
    return ls->t && ls->ptr && ls->numel;
}

/* Takes ownership of a Tensor[] argument and of each of its tensors. */
struct list *take_list(struct call *c, StableIValue v, const char *name, int written)
{
    StableListHandle lh = (StableListHandle)(uintptr_t)v;
    struct list *ls = next_list(c);
    size_t n = 0;
    if (torch_list_size(lh, &n) != 0) {
        torch_delete_list(lh);
        fail(c, "torch's C API failed in list_size");
    }
    int ok = alloc_list(ls, (int64_t)n);
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
struct list *take_option(struct call *c, StableIValue v, const char *name, int written)
{
    struct list *ls = take_list(c, v, name, written);
    for (int64_t i = 0; i < ls->count; i++)
        ls->t[i].index = -1;
    return ls;
}

struct tensor *take_tensor(struct call *c, StableIValue v, const char *name, int written)
{
    struct tensor *t = &c->singles[c->n_singles++];
    memset(t, 0, sizeof(*t));
    t->h = (AtenTensorHandle)(uintptr_t)v;
    t->name = name;
    t->index = -1;
    t->dim = -1;
    t->written = written;
    return t;
}

/* Once every handle is owned (so a failure frees them all): read and check them. */
void describe_all(struct call *c)
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

// ---- checks ----

int to_ampc_dtype(int32_t dtype, ampc_dtype *out)
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

int to_fp8_dtype(int32_t dtype, ampc_dtype *out)
{
    if (dtype == aoti_torch_dtype_float8_e4m3fn())
        *out = AMPC_F8E4M3;
    else if (dtype == aoti_torch_dtype_float8_e5m2())
        *out = AMPC_F8E5M2;
    else
        return 0;
    return 1;
}

/* Every tensor of the list has a dtype `convert` takes (`expected` names them): the list,
 * with the dtype of its first tensor (`empty` when it has none); *mixed is set when the
 * others do not all share it. */
static struct ampc_list typed_list(struct call *c, const struct list *ls, int *mixed,
                                   int (*convert)(int32_t, ampc_dtype *), ampc_dtype empty,
                                   const char *expected)
{
    char a[64];
    struct ampc_list out = { ls->ptr, ls->numel, ls->count, empty };
    for (int64_t i = 0; i < ls->count; i++) {
        const struct tensor *t = &ls->t[i];
        ampc_dtype d;
        if (!convert(t->dtype, &d))
            fail(c, "%s must be %s, got %s", tensor_name(t, a, sizeof(a)), expected,
                 dtype_name(t->dtype));
        *mixed |= t->dtype != ls->t[0].dtype;
    }
    if (ls->count > 0)
        convert(ls->t[0].dtype, &out.dtype);
    return out;
}

struct ampc_list float_list_mixed(struct call *c, const struct list *ls, int *mixed)
{
    return typed_list(c, ls, mixed, to_ampc_dtype, AMPC_F32,
                      "torch.float32, torch.float16 or torch.bfloat16");
}

struct ampc_list fp8_list(struct call *c, const struct list *ls, int *mixed)
{
    return typed_list(c, ls, mixed, to_fp8_dtype, AMPC_F8E4M3,
                      "torch.float8_e4m3fn or torch.float8_e5m2");
}

/* Every tensor of the list is fp32, fp16 or bf16, all the same one. */
struct ampc_list float_list(struct call *c, const struct list *ls)
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
void check_scalar(struct call *c, const struct tensor *t, int32_t dtype, int allow_empty)
{
    char a[64];
    if (t->dtype != dtype || !(t->numel == 1 || (allow_empty && t->numel == 0)))
        fail(c, "%s must be a 1-element %s tensor, got %s with %lld elements",
             tensor_name(t, a, sizeof(a)), dtype_name(dtype), dtype_name(t->dtype),
             (long long)t->numel);
}

/* Reads a tensor's shape once: a list may be compared with several others (Adam's
 * params with each list of state). */
void shape(struct call *c, struct tensor *t)
{
    if (t->dim >= 0)
        return;
    shim(c, aoti_torch_get_sizes(t->h, &t->sizes), "get_sizes");
    shim(c, aoti_torch_get_dim(t->h, &t->dim), "get_dim");
}

/* dst[i] has the shape of src[i] for every i. */
void check_dtype(struct call *c, struct list *ls, int32_t dtype, const char *want)
{
    char a[64];
    for (int64_t i = 0; i < ls->count; i++)
        if (ls->t[i].dtype != dtype)
            fail(c, "%s must be %s, got %s", tensor_name(&ls->t[i], a, sizeof(a)), want,
                 dtype_name(ls->t[i].dtype));
}

void check_count(struct call *c, struct list *a, const char *a_name, struct list *b,
                 const char *b_name)
{
    if (a->count != b->count)
        fail(c, "%s must have as many tensors as %s (%lld), got %lld", a_name, b_name,
             (long long)b->count, (long long)a->count);
}

void check_block_scales(struct call *c, struct list *scales, const char *name,
                        struct list *values, const char *values_name)
{
    char a[64];
    check_count(c, scales, name, values, values_name);
    check_dtype(c, scales, aoti_torch_dtype_float32(), "torch.float32");
    for (int64_t i = 0; i < scales->count; i++) {
        int64_t want = (values->numel[i] + AMPC_QBLOCK - 1) / AMPC_QBLOCK;
        if (scales->numel[i] != want)
            fail(c, "%s must hold %lld values (one a block of %d of %s[%lld]), got %lld",
                 tensor_name(&scales->t[i], a, sizeof(a)), (long long)want, AMPC_QBLOCK,
                 values_name, (long long)i, (long long)scales->numel[i]);
    }
}

void check_same_shapes(struct call *c, struct list *a, const char *a_name,
                              struct list *b, const char *b_name)
{
    char n[64];
    check_count(c, a, a_name, b, b_name);
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
void check_overlap(struct call *c)
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

// ---- running ----

/* Runs the kernel on the CPU or, through the CUDA library, on the call's device.
 * On failure it raises (freeing the call); on success the caller frees the call. */
void run(struct call *c, cpu_fn cpu, cuda_fn cuda, void *job)
{
    ampc_status st;
    const char *why = "out of memory";
    if (!c->on_cuda && !cpu) {
        st = AMPC_ERR_CUDA;     /* a CUDA-only kernel: its op refuses CPU tensors first */
    } else if (!c->on_cuda && !g_cuda_emulation) {
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
void run_groups(struct call *c, int mixed, struct list *const ls[],
                struct ampc_list *const out[], int n, cpu_fn cpu, cuda_fn cuda, void *job)
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

void start(struct call *c, const char *op, int on_cuda)
{
    memset(c, 0, sizeof(*c));
    c->op = op;
    c->on_cuda = on_cuda;
}

/* A list of zero or one 1-element tensor of `dtype` (a value that lives on the device):
 * its data, or NULL. An optional argument would need C++ to free on torch < 2.13 (Note in
 * stable_abi: optionals), so the schemas take such values as lists. */
void *option(struct call *c, struct list *ls, const char *name, int32_t dtype)
{
    if (ls->count == 0)
        return NULL;
    if (ls->count > 1)
        fail(c, "%s must hold at most one tensor, got %lld", name, (long long)ls->count);
    check_scalar(c, &ls->t[0], dtype, 0);
    return ls->t[0].data;
}

