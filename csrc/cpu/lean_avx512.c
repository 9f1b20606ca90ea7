/*
 * lean_avx512.c: the lean step's loops (lean_loops.h) for AVX-512 (F and BW, as simd.h's AVX512). The target comes before
 * every header, so that the inline math of adam.h and lean.h is compiled for it too.
 * Without trapping math the compiler may compute both sides of a select (flags known only
 * at run time) and keep one, which vectorizes; no value changes.
 */
#pragma GCC target("avx512f,avx512bw")
#pragma GCC optimize("no-trapping-math")

#define LEAN_CHUNK ampc_lean_chunk_avx512
#include "lean_loops.h"
