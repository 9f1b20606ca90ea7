/*
 * cpu.h: how the CPU kernels walk many tensors at once.
 *
 * A list of tensors is cut into chunks of at most AMPC_CHUNK elements (a chunk never
 * spans two tensors; empty tensors have none). Chunks are numbered in list order and
 * handed out to torch's intra-op thread pool (torch_parallel_for, sized by
 * torch.get_num_threads()), so 1,000 small tensors cost one parallel region, not
 * 1,000 calls. Chunk numbers are fixed by the list alone, so per-chunk partial
 * results (a norm) combine in the same order whatever the thread count.
 *
 * Within a chunk, elements are processed in blocks of AMPC_BLOCK fp32 values that
 * stay in L1: load_block widens 16-bit inputs to fp32, store_block narrows them back
 * (round to nearest even), each with AVX-512, AVX2+F16C or scalar code chosen at run
 * time.
 */
#ifndef AMPC_CPU_H
#define AMPC_CPU_H

#include "ampc.h"

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

/* Size of one element of a dtype in bytes. */
int64_t ampc_dtype_size(ampc_dtype dtype);

/* Returns n (<= AMPC_BLOCK) elements of src as fp32: src itself when it is fp32,
 * otherwise `buf` filled with the widened values. */
const float *ampc_load_block(float *buf, const void *src, ampc_dtype dtype, int64_t n);

/* Writes n fp32 values to dst in its dtype, rounding to nearest even. */
void ampc_store_block(void *dst, ampc_dtype dtype, const float *src, int64_t n);

#endif /* AMPC_CPU_H */
