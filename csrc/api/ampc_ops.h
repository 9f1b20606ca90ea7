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
 * AMPC_OP(name, signature): torch.ops.ampc.<name> with schema "<name><signature>", run
 *     by ampc_op_<name>(stack, on_cuda) of the torch glue (torch/ops_<area>.c).
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
#define AMPC_OP(name, signature)
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

/* Delayed scaling of n fp8 tensors, see fp8_scaling.h for the exact rule. amax_history:
 * [H, n] fp32, row 0 newest; scale, scale_inv, amax: [n] fp32. */
AMPC_KERNEL(fp8_update_scales, float *amax_history, float *scale, float *scale_inv,
            const float *amax, const struct ampc_fp8_scaling_args *args)

/* One FP8 GEMM through cuBLASLt (struct ampc_fp8_gemm_args); the CPU reference is torch's. */
AMPC_CUDA_KERNEL(fp8_gemm, struct ampc_fp8_gemm_args *args)

// ---- torch.ops.ampc.* ----

AMPC_OP(cast, "(Tensor(a!)[] dst, Tensor[] src, Tensor[] seed_tensor, bool stochastic=False, "
              "int seed=0) -> ()")
AMPC_OP(unscale_check, "(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()")
AMPC_OP(check_norm, "(Tensor[] grads, Tensor(a!) found_inf, Tensor inv_scale) -> Tensor")
AMPC_OP(update_scale, "(Tensor(a!) scale, Tensor(b!) growth_tracker, "
                      "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
                      "float backoff_factor, int growth_interval, int hysteresis, "
                      "float min_scale, float max_scale) -> ()")
AMPC_OP(adam_master, "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
                     "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
                     "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] steps, Tensor[] lr_tensor, "
                     "Tensor[] inv_scale, Tensor[] clip_coef, Tensor[] found_inf, float lr, "
                     "float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
                     "bool maximize, bool stochastic=False, int seed=0) -> ()")
AMPC_OP(adam_packed, "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) state, "
                     "Tensor(c!) steps, Tensor layout, Tensor[] lr_tensor, Tensor[] inv_scale, "
                     "Tensor[] clip_coef, Tensor[] found_inf, float lr, float beta1, "
                     "float beta2, float eps, float weight_decay, bool decoupled, "
                     "bool maximize, bool amsgrad, bool master, bool stochastic=False, "
                     "int seed=0) -> int")
AMPC_OP(adam_lean, "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
                   "Tensor(c!)[] compensations, Tensor(d!)[] exp_avgs, "
                   "Tensor(e!)[] exp_avg_sqs, Tensor(f!)[] exp_avg_scales, "
                   "Tensor(g!)[] exp_avg_sq_scales, Tensor(h!)[] steps, Tensor[] lr_tensor, "
                   "Tensor[] inv_scale, Tensor[] clip_coef, Tensor[] found_inf, float lr, "
                   "float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
                   "bool maximize, bool stochastic=False, int seed=0) -> ()")
AMPC_OP(fp8_gemm, "(Tensor(a!) out, Tensor a, Tensor b_t, Tensor scale_inv_a, "
                  "Tensor scale_inv_b, Tensor[] bias, Tensor(b!)[] amax, "
                  "Tensor(c!) workspace) -> int")
AMPC_OP(cast_fp8, "(Tensor(a!)[] dst, Tensor[] src, Tensor scale, Tensor(b!) amax) -> ()")
AMPC_OP(fp8_amax, "(Tensor[] src, Tensor(a!) amax) -> ()")
AMPC_OP(cast_from_fp8, "(Tensor(a!)[] dst, Tensor[] src, Tensor scale_inv) -> ()")
AMPC_OP(fp8_update_scales, "(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv, "
                           "Tensor amax, float fmax, float margin=0., bool most_recent=False) "
                           "-> ()")

#undef AMPC_KERNEL
#undef AMPC_CUDA_KERNEL
#undef AMPC_OP
