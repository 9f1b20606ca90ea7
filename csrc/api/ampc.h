/*
 * ampc.h: the C API of ampc's kernels.
 *
 * Raw pointers, element counts and scalars only: no torch types and no CUDA types
 * (a CUDA stream travels as `void *stream`). Every op has a CPU entry point here and
 * a CUDA twin with otherwise identical arguments, reached through struct ampc_cuda_api
 * (the CUDA library is loaded at run time, only when torch has CUDA).
 *
 * The entry points and the table's slots are generated from the list of kernels
 * (ampc_ops.h), where each kernel's contract is written next to its arguments.
 *
 * Argument order: written-to first, then read-only inputs, then the args struct.
 * All inputs are validated by the torch glue (csrc/torch/) before any of these is called:
 * tensors are contiguous, dtypes are the ones named, lists have equal lengths and
 * matching element counts, and outputs overlap no input.
 */
#ifndef AMPC_H
#define AMPC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The fp8 dtypes (torch.float8_e4m3fn, torch.float8_e5m2) only appear in the fp8 ops. */
typedef enum {
    AMPC_F32 = 0,
    AMPC_F16 = 1,
    AMPC_BF16 = 2,
    AMPC_F8E4M3 = 3,
    AMPC_F8E5M2 = 4,
} ampc_dtype;

typedef enum {
    AMPC_OK = 0,
    AMPC_ERR_NOMEM = 1,
    AMPC_ERR_CUDA = 2,
    AMPC_ERR_THREADS = 3,   /* torch's parallel_for failed */
} ampc_status;

/* A list of contiguous tensors that share one dtype. numel may be 0 and may exceed 2^31. */
struct ampc_list {
    void **ptr;             /* ptr[i] -> first element of tensor i */
    const int64_t *numel;   /* numel[i] = element count of tensor i */
    int64_t count;          /* number of tensors */
    ampc_dtype dtype;
};

/*
 * Note [stochastic rounding]: when `stochastic` is set, a value that is not exactly
 * representable in the 16-bit destination rounds away from zero with probability
 * (distance to the value toward zero) / (gap between the two neighbours), so the
 * rounding is unbiased. The random bits of element k of the list (k counts elements
 * across all tensors of the list, in order) are ampc_random_bits(seed, k): the result
 * depends on the seed only, not on threads, chunking or the device.
 */
struct ampc_cast_args {
    int stochastic;         /* 0: round to nearest even (bit-identical to Tensor.to) */
    uint64_t seed;
    const int64_t *seed_tensor; /* NULL, or read on the device at run time in place of seed
                                 * (Note [random bits that advance on the device], dtype.h) */
};

/* Dynamic loss-scale update, see update_scale.h for the exact rule. */
struct ampc_scale_args {
    double growth_factor;
    double backoff_factor;
    int64_t growth_interval;
    int64_t hysteresis;     /* 1 = back off on the first non-finite step, as torch */
    double min_scale;       /* 0 = no lower bound */
    double max_scale;       /* +inf = no upper bound */
};


/*
 * Adam and AdamW (torch.optim's rule, computed in fp32 in the order of torch's fused
 * kernel: adam.h) over lists whose i-th entries belong to one parameter.
 */
struct ampc_adam_args {
    double lr;              /* used when ampc_adam_control.lr is NULL */
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    int decoupled;          /* 1: AdamW, p *= 1 - lr * wd; 0: Adam, g += wd * p */
    int maximize;           /* g = -g */
    int stochastic;         /* 16-bit params written with stochastic rounding */
    uint64_t seed;          /* a param's bits on step t (its count after the step):
                             * Note [stochastic rounding] with seed ampc_step_seed(seed, t),
                             * counting elements of params (dtype.h) */
};

/* Values that live on the device, read there (no host sync); each NULL when absent. */
struct ampc_adam_control {
    const float *lr;        /* replaces args.lr, so a schedule can live on the device */
    const float *inv_scale; /* the grad is multiplied by it, */
    const float *clip_coef; /* then by it (unscale, then clip, as torch does them) */
    const float *found_inf; /* nonzero: skip the whole step, step counts included */
};

/*
 * params: written. Without masters they are the weights updated (any float dtype);
 *     with masters they receive the updated master weight, rounded to their dtype.
 * grads: read only, any float dtype (16-bit grads are never widened in memory).
 * masters: fp32 master weights, or count 0 for none.
 * exp_avgs, exp_avg_sqs: fp32 moments. max_exp_avg_sqs: fp32, or count 0 without amsgrad.
 * steps: 1-element fp32 step counts, one per param; step k + 1 is taken with bias
 *     corrections for k + 1, and the count becomes k + 1 only when the step is not skipped.
 * master-weight traffic: grad 2 + master 8 + moments 16 + param 2 = 28 bytes a parameter.
 */
struct ampc_adam_lists {
    struct ampc_list params;
    struct ampc_list grads;
    struct ampc_list masters;
    struct ampc_list exp_avgs;
    struct ampc_list exp_avg_sqs;
    struct ampc_list max_exp_avg_sqs;
    struct ampc_list steps;
};

/*
 * The lean step (adam_lean): Adam/AdamW as above, with the state at the floor of what
 * training needs (lean.h). Lists whose i-th entries belong to one parameter:
 * params: written, fp32, fp16 or bf16. With masters (fp32) they receive the master rounded
 *     (to nearest even, or stochastically with args.adam.stochastic); with compensations
 *     (bf16 params and bf16 compensations, Note [Kahan-compensated bf16 weights]) the pair
 *     is the weight; with neither the param itself is the weight, written back rounded.
 * grads: read only, any float dtype.
 * exp_avgs, exp_avg_sqs: moments of kind args.moments: fp32; bf16 (written with stochastic
 *     rounding); or 8-bit codes (uint8) with one fp32 scale a block of AMPC_QBLOCK in
 *     exp_avg_scales, exp_avg_sq_scales (ceil(numel / AMPC_QBLOCK) each; Note [8-bit
 *     moments]). The scale lists have count 0 for the other kinds.
 * steps: 1-element fp32 step counts, as for adam.
 */
struct ampc_lean_lists {
    struct ampc_list params;
    struct ampc_list grads;
    struct ampc_list masters;
    struct ampc_list compensations;
    struct ampc_list exp_avgs;
    struct ampc_list exp_avg_sqs;
    struct ampc_list exp_avg_scales;
    struct ampc_list exp_avg_sq_scales;
    struct ampc_list steps;
};

struct ampc_lean_args {
    struct ampc_adam_args adam;
    int moments;            /* AMPC_MOMENTS_F32, _BF16 or _Q8 (lean.h) */
};

/*
 * One FP8 GEMM, row-major: out[m, n] = (a[m, k] @ b_t[n, k]^T) * (*scale_inv_a) *
 * (*scale_inv_b) + bias[n], accumulated in fp32, rounded once to out's dtype. a and b_t
 * are e4m3fn or e5m2 (not both e5m2), k and n multiples of 16, every pointer 16-byte
 * aligned (checked by the torch glue). CUDA only (cuBLASLt); the CPU reference is torch's.
 */
struct ampc_fp8_gemm_args {
    void *out;              /* fp32 or bf16 [m, n] */
    const void *a;          /* fp8 [m, k] */
    const void *b_t;        /* fp8 [n, k] */
    const float *scale_inv_a;   /* 1 element, on the device */
    const float *scale_inv_b;
    const void *bias;       /* bf16 [n], or NULL */
    float *amax;            /* NULL, or 1 element: max |out| before rounding, when offered */
    void *workspace;
    int64_t workspace_bytes;
    int64_t m, n, k;
    int a_e5m2, b_e5m2;     /* 0: e4m3fn */
    ampc_dtype out_dtype;   /* AMPC_F32 or AMPC_BF16 */
    int amax_written;       /* set by the launcher: 1 when the epilogue wrote *amax */
};

/*
 * The fp8 casts, per element as fp8.h says. dst and src have equal counts and numels;
 * scale, scale_inv and amax are lists of one fp32 value per tensor (ptr[i] -> the value of
 * tensor i, numel 1), read and written where they live (on the device for CUDA).
 * cast_fp8: dst[i] (fp8) = saturate(src[i] * scale[i]), *amax[i] = max |src[i]| from the
 *     same read (0 for an empty tensor, NaN when src[i] holds a NaN).
 * cast_from_fp8: dst[i] (fp32/fp16/bf16) = src[i] (fp8) * scale_inv[i], rounded.
 * fp8_amax: *amax[i] = max |src[i]| only.
 */

/* Delayed scaling of n fp8 tensors, see fp8_scaling.h for the exact rule. */
struct ampc_fp8_scaling_args {
    int64_t rows;           /* H, the history length */
    int64_t count;          /* n, the number of tensors */
    float scaled_max;       /* fmax * 2^-margin, rounded to fp32 */
    int most_recent;        /* 1: the newest amax, 0: the max over the history */
};

/*
 * The thread pool the CPU kernels spread their chunks over: a parallel_for that calls
 * body(lo, hi, ctx) on disjoint ranges covering [begin, end) and returns 0 on success.
 * The torch glue hands it torch's intra-op pool when it registers the ops; without one,
 * the chunks run on the calling thread.
 */
typedef int32_t (*ampc_parallel_for_fn)(int64_t begin, int64_t end, int64_t grain_size,
                                        void (*body)(int64_t lo, int64_t hi, void *ctx),
                                        void *ctx);
void ampc_set_parallel_for(ampc_parallel_for_fn parallel_for);

/* The CPU entry points, ampc_<name>_cpu, one per kernel of the list. */
#define AMPC_KERNEL(name, ...) ampc_status ampc_##name##_cpu(__VA_ARGS__);
#include "ampc_ops.h"

/*
 * The CUDA library fills this table (ampc_cuda_get_api in cuda/api.cu, each slot by its
 * name). Every launcher runs on `stream`, on the device made current by begin(), reads control
 * values (inv_scale, found_inf, scale) on the device and never synchronizes.
 */
struct ampc_cuda_api {
    /* The CUDA versions of the installed driver (0: none) and of the runtime the library
     * was built with (1000 * major + 10 * minor); creates no context. First in the table,
     * so a loader can check it before touching the rest. */
    void (*probe)(int *driver_version, int *runtime_version);
    /* Makes `device` current through torch's CUDA guard (*guard restores the previous
     * device in end()) and returns torch's current stream on it. Clears an error left
     * by earlier work and refuses to start when the context is broken, so a failure is
     * reported before any kernel of the op is queued. */
    ampc_status (*begin)(int device, void **guard, void **stream);
    void (*end)(void *guard);
    /* Text of the last CUDA error seen by a launcher of this thread. */
    const char *(*last_error)(void);
    /* One launcher per kernel of the list, in the slot named after it. */
#define AMPC_KERNEL(name, ...) ampc_status (*name)(__VA_ARGS__, void *stream);
#define AMPC_CUDA_KERNEL(name, ...) AMPC_KERNEL(name, __VA_ARGS__)
#include "ampc_ops.h"
};

#ifdef __cplusplus
}
#endif

#endif /* AMPC_H */
