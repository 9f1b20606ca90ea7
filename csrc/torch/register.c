/*
 * register.c: defines torch.ops.ampc.* through libtorch's stable C ABI and hands the CPU
 * kernels torch's intra-op thread pool. Everything per op is generated from the list in
 * ampc_ops.h: the schema, and the boxed CPU and CUDA kernels, which take each argument
 * off torch's stack into the op's struct <op>_args in schema order, run ampc_op_<op> and
 * put what it returns back on the stack.
 */
#include <stdio.h>

#include "call.h"

#define EXPORT __attribute__((visibility("default")))

/* One argument of a schema: its type, [] for a list, (x!) when the op writes it. */
struct schema_arg {
    const char *type;
    int list;
    int written;
    const char *name;
    const char *fallback;   /* the default, schema text; "" for none */
};

#define SCHEMA_TENSORS "Tensor", 1, 0
#define SCHEMA_TENSORS_OUT "Tensor", 1, 1
#define SCHEMA_OPTION "Tensor", 1, 0
#define SCHEMA_OPTION_OUT "Tensor", 1, 1
#define SCHEMA_TENSOR "Tensor", 0, 0
#define SCHEMA_TENSOR_OUT "Tensor", 0, 1
#define SCHEMA_HOST_TENSOR "Tensor", 0, 0
#define SCHEMA_FLOAT "float", 0, 0
#define SCHEMA_INT "int", 0, 0
#define SCHEMA_BOOL "bool", 0, 0

#define RETURNS_NONE "()"
#define RETURNS_TENSOR "Tensor"
#define RETURNS_INT "int"

/* Puts the op's result on the stack (nothing for an op that returns ()). */
#define GIVE_NONE(stack, c)
#define GIVE_TENSOR(stack, c) stack[0] = (c)->ret;
#define GIVE_INT(stack, c) stack[0] = (c)->ret;

/*
 * Per op: <op>_schema (its arguments), <op>_take (fills struct <op>_args from the stack,
 * one argument after the other: the position of each is its place in the list) and the
 * boxed kernels <op>_boxed_cpu and <op>_boxed_cuda that torch calls. Torch gives a boxed
 * kernel as many values as its schema has arguments; the count is checked all the same,
 * since a reader that took another count would free handles it does not own.
 */
#define AMPC_ARG(kind, name, ...) { SCHEMA_##kind, #name, #__VA_ARGS__ },
#define AMPC_OP(op, ret, args) static const struct schema_arg op##_schema[] = { args };
#include "ampc_ops.h"

#define AMPC_ARG(kind, name, ...) a->name = take_##kind(c, stack[i++], #name);
#define AMPC_OP(op, ret, args)                                                            \
    static void op##_take(struct call *c, StableIValue *stack, struct op##_args *a)       \
    {                                                                                     \
        uint64_t i = 0;                                                                   \
        args                                                                              \
    }                                                                                     \
    static void op##_boxed(StableIValue *stack, uint64_t n_args, int on_cuda)             \
    {                                                                                     \
        struct call c;                                                                    \
        struct op##_args a;                                                               \
        start(&c, "ampc." #op, on_cuda);                                                  \
        if (n_args != sizeof(op##_schema) / sizeof(op##_schema[0]))                       \
            fail(&c, "torch passed %llu arguments, the schema has %zu",                   \
                 (unsigned long long)n_args, sizeof(op##_schema) / sizeof(op##_schema[0])); \
        op##_take(&c, stack, &a);                                                         \
        ampc_op_##op(&c, &a);                                                             \
        call_free(&c);                                                                    \
        GIVE_##ret(stack, &c)                                                             \
    }                                                                                     \
    static void op##_boxed_cpu(StableIValue *s, uint64_t n, uint64_t o)                   \
    {                                                                                     \
        op##_boxed(s, n, 0);                                                              \
    }                                                                                     \
    static void op##_boxed_cuda(StableIValue *s, uint64_t n, uint64_t o)                  \
    {                                                                                     \
        op##_boxed(s, n, 1);                                                              \
    }
#include "ampc_ops.h"

struct op {
    const char *name;
    const struct schema_arg *args;
    size_t n_args;
    const char *returns;
    void (*cpu)(StableIValue *, uint64_t, uint64_t);
    void (*cuda)(StableIValue *, uint64_t, uint64_t);
};

static const struct op ops[] = {
#define AMPC_OP(op, ret, args)                                                            \
    { #op, op##_schema, sizeof(op##_schema) / sizeof(op##_schema[0]), RETURNS_##ret,      \
      op##_boxed_cpu, op##_boxed_cuda },
#include "ampc_ops.h"
};

#define N_OPS ((int)(sizeof(ops) / sizeof(ops[0])))

/* "name(Tensor(a!)[] dst, Tensor[] src, bool stochastic=False) -> ()" into buf, written
 * arguments in alias sets a, b, c ... of their own; 0 when it does not fit. */
static int schema_text(const struct op *op, char *buf, size_t size)
{
    size_t len = (size_t)snprintf(buf, size, "%s(", op->name);
    char alias = 'a';
    for (size_t i = 0; i < op->n_args && len < size; i++) {
        const struct schema_arg *a = &op->args[i];
        char set[8] = "";
        if (a->written)
            snprintf(set, sizeof(set), "(%c!)", alias++);
        len += (size_t)snprintf(buf + len, size - len, "%s%s%s%s %s%s%s", i ? ", " : "",
                                a->type, set, a->list ? "[]" : "", a->name,
                                a->fallback[0] ? "=" : "", a->fallback);
    }
    if (len < size)
        len += (size_t)snprintf(buf + len, size - len, ") -> %s", op->returns);
    return len < size;
}

/* The library handles must live as long as the process: deleting one deregisters. */
static TorchLibraryHandle g_def;
static TorchLibraryHandle g_cpu;
static TorchLibraryHandle g_cuda_impl;

/* Defines the schemas and registers CPU and CUDA kernels; 0 on success, otherwise the
 * number of the step that failed. Called once from Python after loading. */
EXPORT int ampc_register(void)
{
    char schema[1024];
    if (g_def)
        return 0;
    if (aoti_torch_abi_version() < AMPC_TORCH_ABI_VERSION)
        return 1;
    ampc_set_parallel_for(torch_parallel_for);
    if (aoti_torch_library_init_def("ampc", __FILE__, __LINE__, &g_def))
        return 2;
    for (int i = 0; i < N_OPS; i++)
        if (!schema_text(&ops[i], schema, sizeof(schema))
            || aoti_torch_library_def(g_def, schema))
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
