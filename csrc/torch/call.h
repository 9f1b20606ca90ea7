/*
 * call.h: what the torch glue's op bodies (ops_<area>.c) share: one call of an op, with
 * the tensor handles it owns taken off torch's boxed stack, the argument checks, the
 * errors, and the run of the kernel on the CPU or through the CUDA library (call.c).
 *
 * A boxed kernel owns every tensor handle on its stack and must free them. Errors
 * reach Python as RuntimeError by throwing through aoti_torch_check, which unwinds
 * through these C frames (built with -fexceptions); so every check runs, and every
 * handle is freed, before anything is modified. Messages name the op and the
 * argument: "ampc.cast: dst[3] must be torch.float16 like dst[0], got torch.float32".
 */
#ifndef AMPC_TORCH_CALL_H
#define AMPC_TORCH_CALL_H

#include <string.h>

#include "ampc.h"
#include "torch_shim.h"

#define MAX_LISTS 13
#define MAX_SINGLES 6

/* The CUDA library's launchers, or NULL while CUDA calls are refused for the reason in
 * g_cuda_refusal (cuda_lib.c). */
extern const struct ampc_cuda_api *g_cuda;
extern char g_cuda_refusal[512];
/* 1 while CPU tensors go to the emulated CUDA launchers (tests only, cuda_lib.c). */
extern int g_cuda_emulation;

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
    int host;               /* read by the glue on the host (a CPU tensor on any call) */
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
    StableIValue ret;               /* what the op returns (an int, or a tensor it owns) */
    char msg[512];
};

/* A kernel's work on one device: the CPU entry point, or the CUDA launcher on a stream. */
typedef ampc_status (*cpu_fn)(void *job);
typedef ampc_status (*cuda_fn)(void *job, void *stream);

/*
 * name_on_cpu(job) and name_on_cuda(job, stream): kernel `name` of ampc_ops.h called with
 * the arguments that follow, written in terms of `job` (a struct job_type *).
 */
#define ON_DEVICES(name, job_type, ...)                                                   \
    static ampc_status name##_on_cpu(void *j)                                             \
    {                                                                                     \
        struct job_type *job = j;                                                         \
        return ampc_##name##_cpu(__VA_ARGS__);                                            \
    }                                                                                     \
    static ampc_status name##_on_cuda(void *j, void *stream)                              \
    {                                                                                     \
        struct job_type *job = j;                                                         \
        return g_cuda->name(__VA_ARGS__, stream);                                         \
    }

// ---- the ops' arguments and entry points, one per op of ampc_ops.h ----

/* The C type each kind of AMPC_ARG is unboxed into (register.c takes them off the stack). */
#define ARG_TYPE_TENSORS struct list *
#define ARG_TYPE_TENSORS_OUT struct list *
#define ARG_TYPE_OPTION struct list *
#define ARG_TYPE_OPTION_OUT struct list *
#define ARG_TYPE_TENSOR struct tensor *
#define ARG_TYPE_TENSOR_OUT struct tensor *
#define ARG_TYPE_HOST_TENSOR struct tensor *
#define ARG_TYPE_FLOAT double
#define ARG_TYPE_INT int64_t
#define ARG_TYPE_BOOL int

/* struct <op>_args: the op's arguments, named as in its schema, in schema order; and
 * ampc_op_<op> (ops_<area>.c), which checks them (describe_all first, once every handle is
 * owned), runs the kernel and leaves what the op returns in c->ret. */
#define AMPC_ARG(kind, name, ...) ARG_TYPE_##kind name;
#define AMPC_OP(op, ret, args)                                                            \
    struct op##_args {                                                                    \
        args                                                                              \
    };                                                                                    \
    void ampc_op_##op(struct call *c, struct op##_args *a);
#include "ampc_ops.h"

// ---- starting, failing and ending a call ----

void start(struct call *c, const char *op, int on_cuda);
/* Frees everything the call owns (the caller ends a call that succeeded with it). */
void call_free(struct call *c);
/* Frees everything the call owns and raises RuntimeError("<op>: <message>"). */
void fail(struct call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Fails the call when a torch C API function returned an error. */
void shim(struct call *c, AOTITorchError err, const char *what);

// ---- names for messages ----

const char *dtype_name(int32_t dtype);
/* "name" or "name[index]" into buf. */
const char *tensor_name(const struct tensor *t, char *buf, size_t size);

// ---- taking arguments off the stack ----

/* The call's next list, empty; it is freed with the call. */
struct list *next_list(struct call *c);
/* Room for n tensors in ls (count stays 0); 0 when out of memory. */
int alloc_list(struct list *ls, int64_t n);
/* Takes ownership of a Tensor[] argument and of each of its tensors. */
struct list *take_list(struct call *c, StableIValue v, const char *name, int written);
/* A list of zero or one value that lives on the device (see option()): named without an
 * index in messages. */
struct list *take_option(struct call *c, StableIValue v, const char *name, int written);
struct tensor *take_tensor(struct call *c, StableIValue v, const char *name, int written);
/* Once every handle is owned (so a failure frees them all): read and check them. */
void describe_all(struct call *c);

static inline double take_double(StableIValue v)
{
    double d;
    memcpy(&d, &v, sizeof(d));
    return d;
}

static inline int take_bool(StableIValue v)
{
    return (v & 0xff) != 0;
}

static inline struct tensor *take_host_tensor(struct call *c, StableIValue v, const char *name)
{
    struct tensor *t = take_tensor(c, v, name, 0);
    t->host = 1;
    return t;
}

/* take_<kind>(c, value, name): one argument of an AMPC_ARG kind off the stack (register.c). */
#define take_TENSORS(c, v, name) take_list(c, v, name, 0)
#define take_TENSORS_OUT(c, v, name) take_list(c, v, name, 1)
#define take_OPTION(c, v, name) take_option(c, v, name, 0)
#define take_OPTION_OUT(c, v, name) take_option(c, v, name, 1)
#define take_TENSOR(c, v, name) take_tensor(c, v, name, 0)
#define take_TENSOR_OUT(c, v, name) take_tensor(c, v, name, 1)
#define take_HOST_TENSOR(c, v, name) take_host_tensor(c, v, name)
#define take_FLOAT(c, v, name) take_double(v)
#define take_INT(c, v, name) ((int64_t)(v))
#define take_BOOL(c, v, name) take_bool(v)

// ---- checks ----

/* The ampc dtype of a torch fp32/fp16/bf16 (or fp8) dtype code; 0 when it is none. */
int to_ampc_dtype(int32_t dtype, ampc_dtype *out);
int to_fp8_dtype(int32_t dtype, ampc_dtype *out);
/* Every tensor of the list is fp32, fp16 or bf16: the list, with the dtype of its first
 * tensor; *mixed is set when the others do not all share it. */
struct ampc_list float_list_mixed(struct call *c, const struct list *ls, int *mixed);
/* The same for torch.float8_e4m3fn and torch.float8_e5m2. */
struct ampc_list fp8_list(struct call *c, const struct list *ls, int *mixed);
/* Every tensor of the list is fp32, fp16 or bf16, all the same one. */
struct ampc_list float_list(struct call *c, const struct list *ls);
/* A 1-element tensor of the given dtype (found_inf, inv_scale, scale, trackers). */
void check_scalar(struct call *c, const struct tensor *t, int32_t dtype, int allow_empty);
/* Reads a tensor's shape once into t->dim and t->sizes. */
void shape(struct call *c, struct tensor *t);
/* a[i] has the shape of b[i] for every i. */
void check_same_shapes(struct call *c, struct list *a, const char *a_name, struct list *b,
                       const char *b_name);
/* No tensor the op writes shares memory with any other tensor argument. */
void check_overlap(struct call *c);
/* a and b have as many tensors. */
void check_count(struct call *c, struct list *a, const char *a_name, struct list *b,
                 const char *b_name);
/* Every tensor of ls has torch dtype `dtype` (shown as `want` in messages). */
void check_dtype(struct call *c, struct list *ls, int32_t dtype, const char *want);
/* The scales of 8-bit codes (lean.h): as many fp32 tensors as `values`, scales[i] holding
 * one value a block of AMPC_QBLOCK elements of values[i]. */
void check_block_scales(struct call *c, struct list *scales, const char *name,
                        struct list *values, const char *values_name);
/* ls as a kernel's list of dtype dt. */
static inline struct ampc_list as_list(struct list *ls, ampc_dtype dt)
{
    return (struct ampc_list){ ls->ptr, ls->numel, ls->count, dt };
}
/* A list of zero or one 1-element tensor of `dtype`: its data, or NULL. */
void *option(struct call *c, struct list *ls, const char *name, int32_t dtype);

/* What the Adam ops check alike (adam_args.c). The params and grads: float lists of equal
 * shapes, every argument described for errors first. */
void take_params_grads(struct call *c, struct list *params, struct list *grads,
                       struct ampc_list *p, struct ampc_list *g);
/* One fp32 step count a param, as a kernel's list. */
struct ampc_list take_steps(struct call *c, struct list *steps, struct list *params);
/* A packed state's layout (adam_packed, adam_lean_packed): int64, 3 values a param (its
 * offset in every section, its numel, the index of its step count), offsets and indices
 * increasing, each param's range inside a section of `size` elements and its offset a
 * multiple of `align`; it raises on one that is not. Returns 0 when a param's numel is
 * not the layout's (the params do not fit the packing), else 1. */
int packed_layout_fits(struct call *c, const struct list *params, const struct tensor *layout,
                       int64_t size, int64_t steps, int64_t align);
/* lr (unless it lives on the device), betas, eps and weight_decay are in range. */
void check_adam_args(struct call *c, const struct ampc_adam_args *a, int lr_on_device);

/* The arguments every Adam op shares (ampc_ops.h's AMPC_ADAM_CONTROL, AMPC_ADAM_ROUNDING)
 * from its struct <op>_args `a` into a struct ampc_adam_control and ampc_adam_args,
 * checked: the device values (lists of zero or one fp32 tensor), the numbers, the
 * rounding. */
#define TAKE_ADAM_ARGS(c, control, args, a)                                               \
    do {                                                                                  \
        int32_t f32_ = aoti_torch_dtype_float32();                                        \
        (control)->lr = option(c, (a)->lr_tensor, "lr_tensor", f32_);                     \
        (control)->inv_scale = option(c, (a)->inv_scale, "inv_scale", f32_);              \
        (control)->clip_coef = option(c, (a)->clip_coef, "clip_coef", f32_);              \
        (control)->found_inf = option(c, (a)->found_inf, "found_inf", f32_);              \
        (args)->lr = (a)->lr;                                                             \
        (args)->beta1 = (a)->beta1;                                                       \
        (args)->beta2 = (a)->beta2;                                                       \
        (args)->eps = (a)->eps;                                                           \
        (args)->weight_decay = (a)->weight_decay;                                         \
        (args)->decoupled = (a)->decoupled;                                               \
        (args)->maximize = (a)->maximize;                                                 \
        (args)->stochastic = (a)->stochastic;                                             \
        (args)->seed = (uint64_t)(a)->seed;                                               \
        check_adam_args(c, (args), (control)->lr != NULL);                                \
    } while (0)

// ---- running ----

/* Runs the kernel on the CPU or, through the CUDA library, on the call's device.
 * On failure it raises (freeing the call); on success the caller frees the call. */
void run(struct call *c, cpu_fn cpu, cuda_fn cuda, void *job);
/* run() once per group of positions whose first two lists share their dtypes (call.c). */
void run_groups(struct call *c, int mixed, struct list *const ls[],
                struct ampc_list *const out[], int n, cpu_fn cpu, cuda_fn cuda, void *job);

#endif /* AMPC_TORCH_CALL_H */
