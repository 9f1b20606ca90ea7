/*
 * adam_loop.h: the SIMD loop of the CPU Adam step (adam.c), one body for both vector
 * widths. adam.c includes it once per instruction set, after defining:
 *   ADAM_LOOP      the function's name          ADAM_TARGET  its target attribute (simd.h)
 *   VEC            the vector type              LANES        floats a vector
 *   ALIGN_MASK     address bits that must be 0 for streaming stores of a 16-bit param
 *   V_SET1, V_LOADU, V_STOREU, V_ADD, V_SUB, V_MUL, V_DIV, V_SQRT, V_FMADD: the float ops
 *   V_LOAD, V_STORE_TO  simd.h's load and store of a dtype    V_NEG  the sign bit flipped
 *   V_MAX_NAN      max that keeps a nan of either side (torch's amsgrad max)
 * and undefines them after. Every lane does adam.h's operations in the same order with the
 * same roundings as adam_scalar, so both widths give the scalar's bits.
 */
ADAM_TARGET INLINE void ADAM_LOOP(const struct adam_ptrs *q, ampc_dtype pt, ampc_dtype gt,
                                  int64_t n, const struct ampc_adam_coef *c, const int flags,
                                  const int has_master, const int small)
{
    const struct ampc_adam_ptrs at = q->at;     /* a local copy: no reloads */
    float *const out = q->out;
    const VEC inv_scale = V_SET1(c->inv_scale);
    const VEC clip = V_SET1(c->clip_coef);
    const VEC wd = V_SET1(c->wd);
    const VEC decay = V_SET1(c->decay);
    const VEC w1 = V_SET1(small ? c->w1 : c->w1 - 1.0f);
    const VEC beta2 = V_SET1(c->beta2);
    const VEC w2 = V_SET1(c->w2);
    const VEC bc2_sqrt = V_SET1(c->bc2_sqrt);
    const VEC eps = V_SET1(c->eps);
    const VEC neg_step_size = V_SET1(c->neg_step_size);
    /* with masters a 16-bit param is only written: streaming skips reading it first */
    const int stream = q->stream && has_master && pt != AMPC_F32 &&
                       ((uintptr_t)at.param & ALIGN_MASK) == 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        VEC g = V_MUL(V_MUL(V_LOAD(at.grad, gt, i), inv_scale), clip);
        if (flags & AMPC_ADAM_MAXIMIZE)
            g = V_NEG(g);
        VEC w = has_master ? V_LOADU(at.master + i) : V_LOAD(at.param, pt, i);
        if (flags & AMPC_ADAM_L2)
            g = V_FMADD(w, wd, g);
        if (flags & AMPC_ADAM_DECAY)
            w = V_MUL(w, decay);
        VEC m = V_LOADU(at.m + i);
        m = V_FMADD(w1, V_SUB(g, m), small ? m : g);
        VEC v = V_FMADD(V_MUL(w2, g), g, V_MUL(V_LOADU(at.v + i), beta2));
        V_STOREU(at.m + i, m);
        V_STOREU(at.v + i, v);
        if (flags & AMPC_ADAM_AMSGRAD) {
            v = V_MAX_NAN(V_LOADU(at.vmax + i), v);
            V_STOREU(at.vmax + i, v);
        }
        VEC d = V_ADD(V_DIV(V_SQRT(v), bc2_sqrt), eps);
        w = V_ADD(w, V_DIV(V_MUL(neg_step_size, m), d));
        if (has_master)
            V_STOREU(at.master + i, w);
        if (out)
            V_STOREU(out + i, w);
        else
            V_STORE_TO(at.param, pt, i, w, stream);
    }
    if (stream)
        _mm_sfence();
    adam_scalar(q, pt, gt, i, n, c);
}
