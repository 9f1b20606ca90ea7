/*
 * register.c: defines torch.ops.ampc.* through libtorch's stable C ABI (schemas and CPU
 * and CUDA boxed kernels, all from the list in ampc_ops.h) and hands the CPU kernels
 * torch's intra-op thread pool.
 */
#include "call.h"

#define EXPORT __attribute__((visibility("default")))

/* <name>_boxed_cpu and <name>_boxed_cuda, the boxed kernels torch calls, one pair per op. */
#define AMPC_OP(name, signature)                                                          \
    static void name##_boxed_cpu(StableIValue *s, uint64_t n, uint64_t o)                 \
    {                                                                                     \
        ampc_op_##name(s, 0);                                                             \
    }                                                                                     \
    static void name##_boxed_cuda(StableIValue *s, uint64_t n, uint64_t o)                \
    {                                                                                     \
        ampc_op_##name(s, 1);                                                             \
    }
#include "ampc_ops.h"

struct op {
    const char *schema;
    const char *name;
    void (*cpu)(StableIValue *, uint64_t, uint64_t);
    void (*cuda)(StableIValue *, uint64_t, uint64_t);
};

static const struct op ops[] = {
#define AMPC_OP(name, signature) { #name signature, #name, name##_boxed_cpu, name##_boxed_cuda },
#include "ampc_ops.h"
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
    ampc_set_parallel_for(torch_parallel_for);
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
