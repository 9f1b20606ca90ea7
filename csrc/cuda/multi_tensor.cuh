/*
 * multi_tensor.cuh: run one kernel over every element of a list of tensors (or of two
 * lists walked in step, as dst and src of a cast) in a few launches.
 *
 * Launch shape: every tensor is cut into chunks of `chunk` elements (Note [chunk per call]
 * below: 4,096 to MT_CHUNK, a power of two); one block of
 * MT_THREADS threads works on one chunk. A launch covers as many consecutive non-empty
 * tensors as its table holds, with all their chunks (one launch for a single huge tensor),
 * so the grid has one block per chunk. Its table (pointers, numel, the list index of each
 * tensor's element 0, the first block of each tensor) travels by value as the kernel
 * argument, with no copy to the device and nothing to free, so the launches can be
 * captured in a CUDA graph. A block finds its
 * tensor with a binary search of the first-block column (all threads read the same
 * constant-bank words). Empty tensors are skipped and take no slot, which also keeps the
 * search valid. Sizes and offsets are 64-bit: a tensor may exceed 2^31 elements.
 *
 * The table is a template on its number of pointer lists and on the kernel parameter
 * space it fills (Note [kernel parameter space]), so that an op with more lists per tensor
 * (Adam: 7) keeps the same walk with fewer tensors a launch.
 */
#ifndef AMPC_CUDA_MULTI_TENSOR_CUH
#define AMPC_CUDA_MULTI_TENSOR_CUH

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

#define MT_CHUNK 65536          /* largest chunk: a multiple of 8, so chunks stay aligned */
#define MT_MIN_CHUNK 4096       /* smallest: 8 elements a thread of a 512-thread block */
#define MT_BLOCKS_PER_SM 4
#define MT_THREADS 512
#define MT_ILP 4                /* 16-byte vectors in flight per thread */

/*
 * Note [kernel parameter space]: every GPU and driver takes 4 KB of kernel arguments;
 * with CUDA 12.1 or newer (the toolkit that builds and the driver that runs) and sm_70 or
 * newer, 32,764 bytes. The 4 KB table of a two-list kernel holds 106 tensors (Adam's 7
 * lists: 50), the 32 KB one 902 (Adam: 427), so 1,000 tensors take 2 launches instead
 * of 10 (Adam: 3 instead of 20). Each kernel is built for both sizes (the parameter
 * space P is a template argument) and the call picks one at run time
 * (mt_large_params): the large table only when the list does not fit one small table and
 * the driver takes it, so the launches of small lists do not change.
 * AMPC_CUDA_SMALL_PARAMS=1 forces the 4 KB tables (read once per process).
 */
#define MT_PARAMS_SMALL 4096
#if CUDART_VERSION >= 12010
#define MT_PARAMS_LARGE 32764
#else
#define MT_PARAMS_LARGE MT_PARAMS_SMALL     /* this toolkit builds 4 KB kernels only */
#endif
#define MT_PARAMS_OTHER 256     /* kept for a kernel's arguments besides its table */

#if MT_PARAMS_LARGE > 4096 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "32 KB kernel parameters need sm_70 or newer: build for sm_70+ or with CUDA < 12.1"
#endif

/* Tensors a table of `lists` pointer lists holds within `bytes` of kernel parameters. */
constexpr int mt_capacity(int lists, int bytes)
{
    return (bytes - MT_PARAMS_OTHER - 24) / (8 * lists + 20);
}

template <int LISTS, int P>
struct mt_table_of {
    static constexpr int lists = LISTS;
    static constexpr int param_bytes = P;
    static constexpr int max_tensors = mt_capacity(LISTS, P);
    void *ptr[LISTS][max_tensors];      /* [0]: first list (the written one), then the others */
    int64_t numel[max_tensors];
    int64_t first[max_tensors];         /* list index of element 0 (Note [stochastic rounding]) */
    int32_t block_start[max_tensors];   /* first block of the launch on this tensor */
    int32_t count;
    int32_t chunk;                      /* elements per block, for the whole call */
    int64_t block_offset;               /* blocks of the earlier launches for the same list */
};

/* The table of the one- and two-list kernels (cast, unscale, norm). */
template <int P>
using mt_table = mt_table_of<2, P>;

/*
 * True when a call over `count` tensors with tables of `lists` lists takes the 32 KB
 * tables (Note [kernel parameter space]).
 */
inline bool mt_large_params(int64_t count, int lists)     /* inline: one `ok` per process */
{
    static int ok = -1;         /* threads may race to set it: all set the same */
    int v = __atomic_load_n(&ok, __ATOMIC_RELAXED);

    if (MT_PARAMS_LARGE == MT_PARAMS_SMALL || count <= mt_capacity(lists, MT_PARAMS_SMALL))
        return false;
    if (v < 0) {
        const char *force_small = getenv("AMPC_CUDA_SMALL_PARAMS");
        int driver = 0;
        v = (!force_small || !*force_small || strcmp(force_small, "0") == 0) &&
            cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010;
        cudaGetLastError();
        __atomic_store_n(&ok, v, __ATOMIC_RELAXED);
    }
    return v != 0;
}

/*
 * The chunk of the calling block: returns its tensor's slot t and sets *start (element
 * offset in tensor t) and *len (1..tab->chunk). Element i of the chunk has list index
 * tab->first[t] + *start + i.
 */
template <int L, int P>
__device__ __forceinline__ int mt_chunk(const struct mt_table_of<L, P> *tab, int64_t *start,
                                        int *len)
{
    int block = (int)blockIdx.x;
    int lo = 0;
    int hi = tab->count - 1;

    while (lo < hi) {           /* the last tensor whose first block is <= block */
        int mid = (lo + hi + 1) / 2;
        if (tab->block_start[mid] <= block)
            lo = mid;
        else
            hi = mid - 1;
    }
    *start = (int64_t)(block - tab->block_start[lo]) * tab->chunk;
    int64_t left = tab->numel[lo] - *start;
    *len = left < tab->chunk ? (int)left : tab->chunk;
    return lo;
}

/*
 * Whether elements [head, len) of in (dtype S) and out (dtype D, or NULL) can move as
 * vectors of W elements, and from which head: each vector access is aligned to its size
 * (to 16 bytes when that is less) on both sides. in and out are aligned to their
 * elements, as every tensor's data is; their element offsets within such an access must
 * agree modulo the smaller access's element count.
 */
template <ampc_dtype S, ampc_dtype D, int W>
__device__ __forceinline__ bool vec_head(const void *in, const void *out, int len, int *head)
{
    constexpr int s_size = elem_bytes<S>();
    constexpr int d_size = elem_bytes<D>();
    constexpr int s_align = W * s_size < 16 ? W * s_size : 16;
    constexpr int d_align = W * d_size < 16 ? W * d_size : 16;
    int s_head = (int)((s_align - (uintptr_t)in % s_align) % s_align) / s_size;
    int d_head = out ? (int)((d_align - (uintptr_t)out % d_align) % d_align) / d_size : s_head;
    int s_mod = s_align / s_size;       /* the heads that align each side recur every */
    int d_mod = d_align / d_size;       /* s_mod and d_mod elements (powers of two) */

    if ((s_head - d_head) % (s_mod < d_mod ? s_mod : d_mod) != 0)
        return false;
    *head = s_mod >= d_mod ? s_head : d_head;
    return *head < len;
}

/*
 * Elements [head, len) of the chunk as vectors of W elements, the first `head` one a
 * thread; returns where the vectors end. Each thread has MT_ILP vectors in flight, loaded
 * before the first is used (more of the narrow ones would cost the 16-byte path registers).
 */
template <ampc_dtype S, ampc_dtype D, int W, typename Op>
__device__ __forceinline__ int mt_visit_vectors(const char *in, char *out, int head, int len,
                                                Op op)
{
    constexpr int ilp = MT_ILP;

    for (int i = threadIdx.x; i < head; i += MT_THREADS) {
        uint32_t x = op(load1<S>(in, i), i);
        if (out)
            store1<D>(out, i, x);
    }
    const char *vin = in + head * ampc_dtype_size(S);
    char *vout = out ? out + head * ampc_dtype_size(D) : NULL;
    int nvec = (len - head) / W;
    for (int u0 = threadIdx.x; u0 < nvec; u0 += MT_THREADS * ilp) {
        uint32_t v[ilp][W];
#pragma unroll
        for (int j = 0; j < ilp; j++)
            if (u0 + j * MT_THREADS < nvec)
                loadw<S, W>(v[j], vin, u0 + j * MT_THREADS);
#pragma unroll
        for (int j = 0; j < ilp; j++) {
            int u = u0 + j * MT_THREADS;
            if (u >= nvec)
                break;
#pragma unroll
            for (int e = 0; e < W; e++)
                v[j][e] = op(v[j][e], head + W * u + e);
            if (vout)
                storew<D, W>(vout, u, v[j]);
        }
    }
    return head + nvec * W;
}

/*
 * Visits elements [0, len) of the calling block's chunk: x = op(x, i) on the raw bits x of
 * element i, read as dtype S from `in` and, unless `out` is NULL (a read-only visit),
 * written as dtype D to `out`. The widest vectors both pointers allow (Note [misaligned
 * views]), then the tail one element a thread. OFFSETS_DIFFER = false (an in-place or a
 * read-only visit: in and out never differ) leaves out the narrower vectors' code.
 *
 * Note [misaligned views]: a view into a flat buffer may start off a 16-byte boundary.
 * When the input and the output are off by the same number of elements (always so for
 * unscale_check, check_norm and a same-dtype copy), the first few elements go one a
 * thread and 16-byte vectors follow. When they are not (a cast between views at other
 * offsets), vectors of 4 or 2 elements, as wide as both allow, take the place of 8:
 * fp16 and bf16 views 4 elements apart move with 8-byte accesses, fp32 and bf16 views 2
 * apart with 8- and 4-byte ones; only offsets an odd number of elements apart leave one
 * element a thread.
 */
template <ampc_dtype S, ampc_dtype D, bool OFFSETS_DIFFER = true, typename Op>
__device__ __forceinline__ void mt_visit(const char *in, char *out, int len, Op op)
{
    int head = 0;
    int tail = 0;

    /* with fp32 on either side, 4 elements need what 8 need: 16-byte fp32 accesses */
    if (vec_head<S, D, 8>(in, out, len, &head))
        tail = mt_visit_vectors<S, D, 8>(in, out, head, len, op);
    else if (OFFSETS_DIFFER && S != AMPC_F32 && D != AMPC_F32 &&
             vec_head<S, D, 4>(in, out, len, &head))
        tail = mt_visit_vectors<S, D, 4>(in, out, head, len, op);
    else if (OFFSETS_DIFFER && vec_head<S, D, 2>(in, out, len, &head))
        tail = mt_visit_vectors<S, D, 2>(in, out, head, len, op);
    for (int i = tail + threadIdx.x; i < len; i += MT_THREADS) {
        uint32_t x = op(load1<S>(in, i), i);
        if (out)
            store1<D>(out, i, x);
    }
}

/* Chunks (blocks) needed for a whole list. */
static inline int64_t mt_list_chunks(const struct ampc_list *a, int64_t chunk)
{
    int64_t n = 0;
    for (int64_t i = 0; i < a->count; i++)
        n += CEIL_DIV(a->numel[i], chunk);
    return n;
}

/*
 * Note [chunk per call]: with a fixed 65,536-element chunk a list fills the 132 SMs of an
 * H100/H200 only from ~17M elements on. The chunk of a call is the largest power of two
 * from MT_MIN_CHUNK to MT_CHUNK that still gives MT_BLOCKS_PER_SM blocks per SM of the
 * current device (begin() made it the tensors' device). Cast, unscale_check and Adam
 * give the same bits whatever the chunk (element numbering and the per-element rules do not
 * depend on it); check_norm's sums follow the chunks, which the list and the device fix,
 * so it stays deterministic.
 */
static inline int64_t mt_chunk_size(const struct ampc_list *a)
{
    static int sm_count[64];    /* per device; threads may race to set it: all set the same */
    int64_t total = 0;
    int device = 0;

    for (int64_t i = 0; i < a->count; i++)
        total += a->numel[i];
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
        cudaGetLastError();     /* not this op's error: the launches report their own */
        return MT_CHUNK;
    }
    int sms = __atomic_load_n(&sm_count[device], __ATOMIC_RELAXED);
    if (sms <= 0) {
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
            sms <= 0) {
            cudaGetLastError();
            return MT_CHUNK;
        }
        __atomic_store_n(&sm_count[device], sms, __ATOMIC_RELAXED);
    }
    int64_t want = total / ((int64_t)MT_BLOCKS_PER_SM * sms);
    int64_t chunk = MT_MIN_CHUNK;
    while (chunk * 2 <= want && chunk < MT_CHUNK)
        chunk *= 2;
    return chunk;
}

/*
 * Fills tables of type Table from lists[0..Table::lists), whose i-th entries belong to one
 * tensor (lists[0] sets the numels and the element numbering; a NULL list or one of count 0
 * gives NULL pointers), and calls launch(table, number of blocks, ctx) for each full table
 * and for the last. Nothing is launched for a list without elements.
 */
template <typename Table>
static inline ampc_status mt_apply_lists(const struct ampc_list *const lists[], int64_t chunk,
                                         ampc_status (*launch)(const Table *, int, void *),
                                         void *ctx)
{
    static_assert(sizeof(Table) <= Table::param_bytes - MT_PARAMS_OTHER,
                  "table too large for its kernel parameter space");
    Table tab;
    int64_t first = 0;
    int blocks = 0;

    memset(&tab, 0, sizeof(tab));
    tab.chunk = (int32_t)chunk;
    for (int64_t i = 0; i < lists[0]->count; i++) {
        int64_t n = lists[0]->numel[i];
        int64_t chunks = CEIL_DIV(n, chunk);
        if (n == 0)
            continue;
        /* A tensor's chunks always fit one grid: INT_MAX chunks would be 2^43 elements. */
        if (tab.count == Table::max_tensors || (tab.count > 0 && chunks > INT_MAX - blocks)) {
            ampc_status st = launch(&tab, blocks, ctx);
            if (st != AMPC_OK)
                return st;
            tab.block_offset += blocks;
            tab.count = 0;
            blocks = 0;
        }
        int t = tab.count++;
        for (int l = 0; l < Table::lists; l++)
            tab.ptr[l][t] = lists[l] && lists[l]->count > 0 ? lists[l]->ptr[i] : NULL;
        tab.numel[t] = n;
        tab.first[t] = first;
        tab.block_start[t] = blocks;
        blocks += (int)chunks;
        first += n;
    }
    if (tab.count == 0)
        return AMPC_OK;
    return launch(&tab, blocks, ctx);
}

/* The launch of a one-list kernel that takes the table and two more arguments. */
template <int P, typename A, typename B>
struct mt_launch2 {
    void (*kernel)(const mt_table<P>, A, B);
    A a;
    B b;
    cudaStream_t stream;
};

template <int P, typename A, typename B>
static ampc_status mt_launch2_fn(const mt_table<P> *tab, int nblocks, void *ctx)
{
    const struct mt_launch2<P, A, B> *c = (const struct mt_launch2<P, A, B> *)ctx;
    AMPC_LAUNCH(c->kernel, nblocks, MT_THREADS, 0, c->stream)(*tab, c->a, c->b);
    return ampc_cuda_status(cudaGetLastError());
}

/* mt_apply_lists over list a (and b, same numels, or NULL) with the two-list table. */
template <int P>
static inline ampc_status mt_apply(const struct ampc_list *a, const struct ampc_list *b,
                                   int64_t chunk,
                                   ampc_status (*launch)(const mt_table<P> *, int, void *),
                                   void *ctx)
{
    const struct ampc_list *lists[2] = {a, b};
    return mt_apply_lists<mt_table<P>>(lists, chunk, launch, ctx);
}

#endif /* AMPC_CUDA_MULTI_TENSOR_CUH */
