/*
 * ampc_ops.h: the one list of ampc's kernels and torch ops.
 *
 * A file that needs something per op defines the macros it uses, includes this file and
 * gets one expansion per entry; a macro it leaves undefined expands to nothing, and all
 * are undefined again at the end (so no include guard: it is included many times).
 * Users: ampc.h (CPU prototypes, the slots of struct ampc_cuda_api), cuda/common.cuh
 * (launcher prototypes), cuda/api.cu (the table, filled by slot name), torch/call.h and
 * torch/register.c (op entry points, boxed kernels, schemas), tests/kernels/test_build.py
 * (the ops torch must have).
 *
 * AMPC_KERNEL(name, params...): a C kernel: ampc_<name>_cpu(params) (cpu/<name>.c) and its
 *     launcher ampc_<name>_cuda_impl(params, void *stream) (cuda/<name>.cu), reached
 *     through slot <name> of struct ampc_cuda_api.
 * AMPC_CUDA_KERNEL(name, params...): the same without a CPU entry point.
 * AMPC_OP(name, ret, args): torch.ops.ampc.<name>, returning ret (NONE, TENSOR or INT),
 *     with the arguments `args`, a run of AMPC_ARG(kind, name[, default]) in schema order.
 *     From it the glue generates the schema, struct <name>_args (one field per argument)
 *     and the code that fills it from torch's boxed stack (torch/register.c), then runs
 *     ampc_op_<name>(call, args) (torch/ops_<area>.c). Kinds (torch/call.h): TENSORS and
 *     TENSORS_OUT (Tensor[], the op writes the _OUT ones), TENSOR and TENSOR_OUT, HOST_TENSOR
 *     (a Tensor read on the host), OPTION and OPTION_OUT (a Tensor[] of zero or one
 *     tensor, named without an index), FLOAT, INT, BOOL. A default is schema text.
 *
 * The argument structs and the conventions the kernels share are in ampc.h.
 */
#ifndef AMPC_KERNEL
#define AMPC_KERNEL(name, ...)
#endif
#ifndef AMPC_CUDA_KERNEL
#define AMPC_CUDA_KERNEL(name, ...)
#endif
#ifndef AMPC_OP
#define AMPC_OP(name, ret, args)
#endif
#ifndef AMPC_ARG
#define AMPC_ARG(kind, name, ...)
#endif

// ---- kernels ----

/* dst[i] = src[i] converted to dst->dtype. dst and src have equal counts and numels. */
AMPC_KERNEL(cast, const struct ampc_list *dst, const struct ampc_list *src,
            const struct ampc_cast_args *args)

/*
 * grads[i] *= *inv_scale in place, and *found_inf = 1.0f when any element of the
 * input was inf or nan (checked before the multiply, as torch does).
 * Note [found_inf is sticky]: found_inf is only ever set, never cleared.
 */
AMPC_KERNEL(unscale_check, const struct ampc_list *grads, float *found_inf,
            const float *inv_scale)

/*
 * Read-only twin of unscale_check: sets *found_inf like it (sticky), leaves grads
 * untouched and writes *norm = |inv_scale| * sqrt(sum of grads^2), the global L2 norm
 * of the unscaled grads. Squares never overflow or underflow unnoticed (runs of them
 * are summed in fp32 only where that is safe, in double otherwise: Note [fp32 squares
 * when safe] in check_norm.h), in a fixed order, so the result does not depend on the
 * thread count.
 */
AMPC_KERNEL(check_norm, const struct ampc_list *grads, float *found_inf, float *norm,
            const float *inv_scale)

/* One dynamic loss-scale step on 1-element state, see update_scale.h. */
AMPC_KERNEL(update_scale, float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
            const float *found_inf, const struct ampc_scale_args *args)

/* Adam and AdamW over lists whose i-th entries belong to one parameter (ampc.h, adam.h). */
AMPC_KERNEL(adam, const struct ampc_adam_lists *lists, const struct ampc_adam_control *control,
            const struct ampc_adam_args *args)

/* The lean Adam/AdamW step: compact moments and weights without fp32 masters (ampc.h,
 * lean.h). */
AMPC_KERNEL(adam_lean, const struct ampc_lean_lists *lists,
            const struct ampc_adam_control *control, const struct ampc_lean_args *args)

/* The fp8 casts and the amax (ampc.h, fp8.h). */
AMPC_KERNEL(cast_fp8, const struct ampc_list *dst, const struct ampc_list *amax,
            const struct ampc_list *src, const struct ampc_list *scale)
AMPC_KERNEL(cast_from_fp8, const struct ampc_list *dst, const struct ampc_list *src,
            const struct ampc_list *scale_inv)
AMPC_KERNEL(fp8_amax, const struct ampc_list *amax, const struct ampc_list *src)

/* Tensors kept in 8 bits (a saved activation, ampc.memory): codes[i] holds one byte an
 * element of src[i] in lean.h's exp_avg codes (Note [8-bit moments]), scales[i] one fp32
 * absmax a block of AMPC_QBLOCK elements; decode_q8 writes the values into dst[i] (fp32,
 * fp16 or bf16). */
AMPC_KERNEL(encode_q8, const struct ampc_list *codes, const struct ampc_list *scales,
            const struct ampc_list *src)
AMPC_KERNEL(decode_q8, const struct ampc_list *dst, const struct ampc_list *codes,
            const struct ampc_list *scales)

/* Delayed scaling of n fp8 tensors, see fp8_scaling.h for the exact rule. amax_history:
 * [H, n] fp32, row 0 newest; scale, scale_inv, amax: [n] fp32. */
AMPC_KERNEL(fp8_update_scales, float *amax_history, float *scale, float *scale_inv,
            const float *amax, const struct ampc_fp8_scaling_args *args)

/* One FP8 GEMM through cuBLASLt (struct ampc_fp8_gemm_args); the CPU reference is torch's. */
AMPC_CUDA_KERNEL(fp8_gemm, struct ampc_fp8_gemm_args *args)

// ---- torch.ops.ampc.* ----

AMPC_OP(cast, NONE,
        AMPC_ARG(TENSORS_OUT, dst) AMPC_ARG(TENSORS, src) AMPC_ARG(OPTION, seed_tensor)
        AMPC_ARG(BOOL, stochastic, False) AMPC_ARG(INT, seed, 0))
AMPC_OP(unscale_check, NONE,
        AMPC_ARG(TENSORS_OUT, grads) AMPC_ARG(TENSOR_OUT, found_inf)
        AMPC_ARG(TENSOR, inv_scale))
AMPC_OP(check_norm, TENSOR,
        AMPC_ARG(TENSORS, grads) AMPC_ARG(TENSOR_OUT, found_inf) AMPC_ARG(TENSOR, inv_scale))
AMPC_OP(update_scale, NONE,
        AMPC_ARG(TENSOR_OUT, scale) AMPC_ARG(TENSOR_OUT, growth_tracker)
        AMPC_ARG(TENSOR_OUT, hysteresis_tracker) AMPC_ARG(TENSOR, found_inf)
        AMPC_ARG(FLOAT, growth_factor) AMPC_ARG(FLOAT, backoff_factor)
        AMPC_ARG(INT, growth_interval) AMPC_ARG(INT, hysteresis) AMPC_ARG(FLOAT, min_scale)
        AMPC_ARG(FLOAT, max_scale))
/* What both Adam ops take after their tensors (adam_packed adds amsgrad and master before
 * the rounding): values on the device as lists of zero or one tensor, then the numbers. */
#ifndef AMPC_ADAM_CONTROL
#define AMPC_ADAM_CONTROL                                                                 \
    AMPC_ARG(OPTION, lr_tensor) AMPC_ARG(OPTION, inv_scale) AMPC_ARG(OPTION, clip_coef)   \
    AMPC_ARG(OPTION, found_inf) AMPC_ARG(FLOAT, lr) AMPC_ARG(FLOAT, beta1)                \
    AMPC_ARG(FLOAT, beta2) AMPC_ARG(FLOAT, eps) AMPC_ARG(FLOAT, weight_decay)             \
    AMPC_ARG(BOOL, decoupled) AMPC_ARG(BOOL, maximize)
#define AMPC_ADAM_ROUNDING AMPC_ARG(BOOL, stochastic, False) AMPC_ARG(INT, seed, 0)
#endif
AMPC_OP(adam_master, NONE,
        AMPC_ARG(TENSORS_OUT, params) AMPC_ARG(TENSORS, grads) AMPC_ARG(TENSORS_OUT, masters)
        AMPC_ARG(TENSORS_OUT, exp_avgs) AMPC_ARG(TENSORS_OUT, exp_avg_sqs)
        AMPC_ARG(TENSORS_OUT, max_exp_avg_sqs) AMPC_ARG(TENSORS_OUT, steps)
        AMPC_ADAM_CONTROL AMPC_ADAM_ROUNDING)
AMPC_OP(adam_packed, INT,
        AMPC_ARG(TENSORS_OUT, params) AMPC_ARG(TENSORS, grads) AMPC_ARG(TENSOR_OUT, state)
        AMPC_ARG(TENSOR_OUT, steps) AMPC_ARG(HOST_TENSOR, layout)
        AMPC_ADAM_CONTROL AMPC_ARG(BOOL, amsgrad) AMPC_ARG(BOOL, master) AMPC_ADAM_ROUNDING)
AMPC_OP(adam_lean, NONE,
        AMPC_ARG(TENSORS_OUT, params) AMPC_ARG(TENSORS, grads) AMPC_ARG(TENSORS_OUT, masters)
        AMPC_ARG(TENSORS_OUT, compensations) AMPC_ARG(TENSORS_OUT, exp_avgs)
        AMPC_ARG(TENSORS_OUT, exp_avg_sqs) AMPC_ARG(TENSORS_OUT, exp_avg_scales)
        AMPC_ARG(TENSORS_OUT, exp_avg_sq_scales) AMPC_ARG(TENSORS_OUT, steps)
        AMPC_ADAM_CONTROL AMPC_ADAM_ROUNDING)
AMPC_OP(adam_lean_packed, INT,
        AMPC_ARG(TENSORS_OUT, params) AMPC_ARG(TENSORS, grads) AMPC_ARG(TENSOR_OUT, moments)
        AMPC_ARG(TENSOR_OUT, scales) AMPC_ARG(TENSOR_OUT, steps) AMPC_ARG(HOST_TENSOR, layout)
        AMPC_ADAM_CONTROL AMPC_ADAM_ROUNDING)
AMPC_OP(encode_q8, NONE,
        AMPC_ARG(TENSORS_OUT, codes) AMPC_ARG(TENSORS_OUT, scales) AMPC_ARG(TENSORS, src))
AMPC_OP(decode_q8, NONE,
        AMPC_ARG(TENSORS_OUT, dst) AMPC_ARG(TENSORS, codes) AMPC_ARG(TENSORS, scales))
AMPC_OP(fp8_gemm, INT,
        AMPC_ARG(TENSOR_OUT, out) AMPC_ARG(TENSOR, a) AMPC_ARG(TENSOR, b_t)
        AMPC_ARG(TENSOR, scale_inv_a) AMPC_ARG(TENSOR, scale_inv_b) AMPC_ARG(OPTION, bias)
        AMPC_ARG(OPTION_OUT, amax) AMPC_ARG(TENSOR_OUT, workspace))
AMPC_OP(cast_fp8, NONE,
        AMPC_ARG(TENSORS_OUT, dst) AMPC_ARG(TENSORS, src) AMPC_ARG(TENSOR, scale)
        AMPC_ARG(TENSOR_OUT, amax))
AMPC_OP(fp8_amax, NONE, AMPC_ARG(TENSORS, src) AMPC_ARG(TENSOR_OUT, amax))
AMPC_OP(cast_from_fp8, NONE,
        AMPC_ARG(TENSORS_OUT, dst) AMPC_ARG(TENSORS, src) AMPC_ARG(TENSOR, scale_inv))
AMPC_OP(fp8_update_scales, NONE,
        AMPC_ARG(TENSOR_OUT, amax_history) AMPC_ARG(TENSOR_OUT, scale)
        AMPC_ARG(TENSOR_OUT, scale_inv) AMPC_ARG(TENSOR, amax) AMPC_ARG(FLOAT, fmax)
        AMPC_ARG(FLOAT, margin, 0.) AMPC_ARG(BOOL, most_recent, False))

#undef AMPC_KERNEL
#undef AMPC_CUDA_KERNEL
#undef AMPC_OP
#undef AMPC_ARG
