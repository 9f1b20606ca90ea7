/*
 * q8_cpu.h: what the 8-bit saved activations' loops (q8.c) take from the files compiled
 * per instruction set.
 */
#ifndef AMPC_Q8_CPU_H
#define AMPC_Q8_CPU_H

#include <stdint.h>

/* The codes of a block's n values x with its factor (ampc_q8_code_factor, not 0), written
 * as bytes to q, a vector at a time; returns how many it wrote (the rest: q8.c's loops). */
int64_t ampc_q8_codes_avx512(uint8_t *q, const float *x, int64_t n, float factor);
int64_t ampc_q8_codes_avx2(uint8_t *q, const float *x, int64_t n, float factor);

#endif /* AMPC_Q8_CPU_H */
