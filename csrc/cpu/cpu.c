/*
 * cpu.c: what every CPU kernel shares: the chunked, threaded walk over a list of
 * tensors (see cpu.h; the threads are the pool the torch glue hands over), the SIMD
 * path chosen once at run time (simd.h) and the size of the last-level cache (Note
 * [streaming stores]).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "simd.h"

/* Below this many elements a parallel region costs more than it saves. */
#define SERIAL_ELEMS (1 << 17)

/* Set once, when the ops are registered (before any of them can run). */
static ampc_parallel_for_fn g_parallel_for;

void ampc_set_parallel_for(ampc_parallel_for_fn parallel_for)
{
    g_parallel_for = parallel_for;
}

struct walk {
    const struct ampc_list *list;
    const int64_t *first;       /* first[i] = number of the first chunk of tensor i */
    const int64_t *index;       /* index[i] = list-wide index of tensor i's element 0 */
    ampc_span_fn fn;
    void *ctx;
};

/* The last-level cache, as the C library reports it (32 MB when it cannot tell);
 * AMPC_STREAM_BYTES overrides it, so the tests can reach the streaming path. */
/* exported for ampc.ops.stream_bytes() */
__attribute__((visibility("default"))) int64_t ampc_cache_bytes(void)
{
    static int64_t bytes = -1;  /* threads may race to set it: all set the same */
    int64_t seen = __atomic_load_n(&bytes, __ATOMIC_RELAXED);
    if (seen < 0) {
        const char *env = getenv("AMPC_STREAM_BYTES");
        long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
        seen = l3 > 0 ? l3 : (int64_t)32 << 20;
        if (env && *env)
            seen = strtoll(env, NULL, 10);
        __atomic_store_n(&bytes, seen, __ATOMIC_RELAXED);
    }
    return seen;
}

static int64_t chunks_of(int64_t numel)
{
    return (numel + AMPC_CHUNK - 1) / AMPC_CHUNK;
}

int64_t ampc_chunk_count(const struct ampc_list *list)
{
    int64_t n = 0;
    for (int64_t i = 0; i < list->count; i++)
        n += chunks_of(list->numel[i]);
    return n;
}

/* Runs chunks [begin, end): find the tensor holding chunk `begin`, then walk on. */
static void walk_range(int64_t begin, int64_t end, void *arg)
{
    const struct walk *w = arg;
    int64_t lo = 0;
    int64_t hi = w->list->count - 1;
    while (lo < hi) {           /* last tensor whose first chunk is <= begin */
        int64_t mid = (lo + hi + 1) / 2;
        if (w->first[mid] <= begin)
            lo = mid;
        else
            hi = mid - 1;
    }
    for (int64_t t = lo, c = begin; c < end; t++) {
        int64_t numel = w->list->numel[t];
        for (; c < end && c < w->first[t + 1]; c++) {
            struct ampc_span s;
            s.tensor = t;
            s.begin = (c - w->first[t]) * AMPC_CHUNK;
            s.end = s.begin + AMPC_CHUNK < numel ? s.begin + AMPC_CHUNK : numel;
            s.chunk = c;
            s.index = w->index[t] + s.begin;
            w->fn(w->ctx, &s);
        }
    }
}

ampc_status ampc_for_each_chunk(const struct ampc_list *list, ampc_span_fn fn, void *ctx)
{
    int64_t count = list->count;
    int64_t *first = malloc(sizeof(*first) * (size_t)(2 * count + 1));
    if (!first)
        return AMPC_ERR_NOMEM;
    int64_t *index = first + count + 1;
    int64_t total = 0;
    first[0] = 0;
    for (int64_t i = 0; i < count; i++) {
        index[i] = total;
        total += list->numel[i];
        first[i + 1] = first[i] + chunks_of(list->numel[i]);
    }
    struct walk w = { list, first, index, fn, ctx };
    int64_t chunks = first[count];
    ampc_status st = AMPC_OK;
    if (chunks > 0 && (total < SERIAL_ELEMS || !g_parallel_for))
        walk_range(0, chunks, &w);
    else if (chunks > 0 && g_parallel_for(0, chunks, 1, walk_range, &w) != 0)
        st = AMPC_ERR_THREADS;
    free(first);
    return st;
}

// ---- the SIMD path ----

/* AMPC_CPU_ISA caps the choice, so the tests can check every path on one machine. */
enum ampc_isa ampc_cpu_isa(void)
{
    static int isa = ISA_UNKNOWN;       /* threads may race to set it: all set the same */
    enum ampc_isa seen = __atomic_load_n(&isa, __ATOMIC_RELAXED);
    if (seen == ISA_UNKNOWN) {
        const char *cap = getenv("AMPC_CPU_ISA");
        enum ampc_isa best = ISA_SCALAR;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
            best = ISA_AVX512;      /* BW: fp8.c's packs (every AVX-512 CPU but Xeon Phi) */
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c"))
            best = ISA_AVX2;
        if (cap && strcmp(cap, "scalar") == 0)
            best = ISA_SCALAR;
        else if (cap && strcmp(cap, "avx2") == 0 && best > ISA_AVX2)
            best = ISA_AVX2;
        __atomic_store_n(&isa, best, __ATOMIC_RELAXED);
        seen = best;
    }
    return seen;
}

/* The path's name, for ampc.ops.cpu_isa() (tests and CI check which path ran). */
__attribute__((visibility("default"))) const char *ampc_cpu_isa_name(void)
{
    switch (ampc_cpu_isa()) {
    case ISA_AVX512: return "avx512";
    case ISA_AVX2: return "avx2";
    default: return "scalar";
    }
}
