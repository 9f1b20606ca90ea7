/*
 * cpu.h: how the CPU kernels walk many tensors at once.
 *
 * A list of tensors is cut into chunks of at most AMPC_CHUNK elements (a chunk never
 * spans two tensors; empty tensors have none). Chunks are numbered in list order and
 * handed out to torch's intra-op thread pool (sized by torch.get_num_threads(); the
 * torch glue hands it over through ampc_set_parallel_for), so 1,000 small tensors cost
 * one parallel region, not 1,000 calls. Chunk numbers are fixed by the list alone, so
 * per-chunk partial results (a norm) combine in the same order whatever the thread count.
 *
 * Within a chunk, each op's SIMD loops (<op>.c, built from simd.h) do the work: each
 * loads, widens, computes, narrows and stores in registers, with AVX-512, AVX2+F16C or
 * scalar code chosen at run time. Stochastic rounding goes through an L1 buffer of
 * AMPC_BLOCK fp32 values.
 */
#ifndef AMPC_CPU_H
#define AMPC_CPU_H

#include "ampc.h"
#include "dtype.h"      // defines: ampc_dtype_size

#define AMPC_CHUNK 65536
#define AMPC_BLOCK 1024

/* One chunk: elements [begin, end) of tensor `tensor`; `index` is the list-wide index
 * of element `begin` (elements counted across all tensors in order). */
struct ampc_span {
    int64_t tensor;
    int64_t begin;
    int64_t end;
    int64_t chunk;
    int64_t index;
};

typedef void (*ampc_span_fn)(void *ctx, const struct ampc_span *span);

/* Number of chunks of a list (the size of a per-chunk result array). */
int64_t ampc_chunk_count(const struct ampc_list *list);

/* Calls fn once per chunk, in parallel. fn must not throw or fail. */
ampc_status ampc_for_each_chunk(const struct ampc_list *list, ampc_span_fn fn, void *ctx);

/*
 * Note [streaming stores]: when a call moves more bytes (read plus written) than the
 * last-level cache holds, its output cannot stay in the cache, so writing it through
 * the cache only costs an extra read of every line (the cache fetches a line before it
 * takes a write). Such outputs are written with streaming stores, as memcpy does for
 * large copies; smaller ones stay in the cache for the reader that usually comes next.
 */
int64_t ampc_cache_bytes(void);

// ---- cast's loops, which Adam also writes its 16-bit params with (cast.c) ----

/* dst[0..n) = src[0..n) converted from st to dt, rounding to nearest even; with
 * `stream`, through streaming stores where the CPU path has them. */
void ampc_cast_block(void *dst, ampc_dtype dt, const void *src, ampc_dtype st, int64_t n,
                     int stream);

/* Stochastic rounding of n fp32 values to 16-bit dtype; element i uses the random bits
 * of list-wide element `index + i` (Note [stochastic rounding]). */
void ampc_store_stochastic(uint16_t *dst, ampc_dtype dtype, const float *src, int64_t n,
                           uint64_t seed, int64_t index);

// ---- Adam's loops, which the lean step runs on its L1 buffers (adam.c) ----

struct ampc_adam_coef;

/* The constants of each param's next step (adam.h), from its stored step count: an array
 * of steps->count to free(), or NULL when out of memory. */
struct ampc_adam_coef *ampc_adam_step_coefs(const struct ampc_list *steps,
                                            const struct ampc_adam_control *control,
                                            const struct ampc_adam_args *args, int amsgrad);

/* n elements of adam.h's step without amsgrad, in place: w the fp32 weights, m and v the
 * fp32 moments, grad of dtype gt. */
void ampc_adam_buffers(float *w, float *m, float *v, const void *grad, ampc_dtype gt,
                       int64_t n, const struct ampc_adam_coef *c);

#endif /* AMPC_CPU_H */
