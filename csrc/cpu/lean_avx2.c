/*
 * lean_avx2.c: the lean step's loops (lean_loops.h) for AVX2 with FMA and F16C (as simd.h's AVX2). The target comes before
 * every header, so that the inline math of adam.h and lean.h is compiled for it too.
 * Without trapping math the compiler may compute both sides of a select (flags known only
 * at run time) and keep one, which vectorizes; no value changes.
 */
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("no-trapping-math")

#define LEAN_CHUNK ampc_lean_chunk_avx2
#include "lean_loops.h"
