/*
 * lean_cpu.h: what the CPU lean step (lean.c) shares with its loops (lean_loops.h),
 * compiled once per instruction set.
 */
#ifndef AMPC_LEAN_CPU_H
#define AMPC_LEAN_CPU_H

#include "ampc.h"
#include "cpu.h"

/* How the weight is read and written. */
enum {
    WEIGHT_PARAM,           /* the param itself (fp32, or 16-bit without a master) */
    WEIGHT_MASTER,          /* the fp32 master; the param is written from it */
    WEIGHT_KAHAN,           /* the bf16 param plus its bf16 compensation */
};

/* How a 16-bit param is written from the fp32 weight (WEIGHT_PARAM, WEIGHT_MASTER). */
enum {
    WRITE_NEAREST,
    WRITE_SR,               /* bf16, stochastic rounding in the loop */
    WRITE_LATER,            /* fp16, stochastic rounding: through cast.c's loop */
};

struct ampc_adam_coef;

struct lean_job {
    const struct ampc_lean_lists *lists;
    const struct ampc_adam_coef *coef;      /* one per tensor */
    int moments;
    int weight;
    int write;
};

/* One chunk of the step, per instruction set (lean_loops.h). */
void ampc_lean_chunk_avx512(const struct lean_job *job, const struct ampc_span *s);
void ampc_lean_chunk_avx2(const struct lean_job *job, const struct ampc_span *s);
void ampc_lean_chunk_scalar(const struct lean_job *job, const struct ampc_span *s);

#endif /* AMPC_LEAN_CPU_H */
