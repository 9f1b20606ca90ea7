/*
 * lean_cpu.h: what the CPU lean step (lean.c) shares with its loops (lean_loops.h),
 * compiled once per instruction set.
 */
#ifndef AMPC_LEAN_CPU_H
#define AMPC_LEAN_CPU_H

#include "ampc.h"
#include "cpu.h"

struct ampc_adam_coef;

/* What every chunk of the CPU step shares. */
struct lean_chunks {
    const struct ampc_lean_lists *lists;
    const struct ampc_adam_coef *coef;      /* one per tensor */
    int moments;
    int weight;             /* AMPC_WEIGHT_* (lean.h) */
    int write;              /* AMPC_WRITE_* */
};

/* One chunk of the step, per instruction set (lean_loops.h). */
void ampc_lean_chunk_avx512(const struct lean_chunks *job, const struct ampc_span *s);
void ampc_lean_chunk_avx2(const struct lean_chunks *job, const struct ampc_span *s);
void ampc_lean_chunk_scalar(const struct lean_chunks *job, const struct ampc_span *s);

#endif /* AMPC_LEAN_CPU_H */
