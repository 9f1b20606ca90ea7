/*
 * adam.h: one Adam/AdamW step of one element, shared by the CPU kernel (adam.c, whose
 * SIMD loops do the same operations lane by lane) and the CUDA one.
 *
 * The order of operations is torch's fused Adam kernel's (its vectorized CPU path, as
 * its compiler emits it, FMAs included), every other operation rounded to fp32 on its
 * own (the C build does not contract a * b + c into an FMA, nor does nvcc with
 * --fmad=false), so an fp32 parameter ends bit for bit where
 * torch.optim.AdamW(fused=True) puts it:
 *
 *     g = grad * inv_scale * clip_coef        (then g = -g when maximizing)
 *     Adam:  g = fma(p, wd, g)                AdamW: p = p * (1 - lr * wd)
 *     m = fma(1 - beta1, g - m, m)            torch's lerp; for beta1 <= 0.5 it is
 *                                             fma((1 - beta1) - 1, g - m, g)
 *     v = fma((1 - beta2) * g, g, v * beta2)  torch's build contracts this one
 *     d = sqrt(v) / sqrt(1 - beta2^t) + eps   (amsgrad: vmax = max(vmax, v), sqrt(vmax))
 *     p = p + (-(lr / (1 - beta1^t)) * m) / d
 *
 * The scalars are computed in double from the step t and rounded to fp32 once, as torch
 * does. Only the weight decay terms are skipped when weight_decay is 0 (so an inf
 * weight is not turned into nan by 0 * inf); multiplying by an inv_scale or clip
 * coefficient of 1 changes no value.
 */
#ifndef AMPC_ADAM_H
#define AMPC_ADAM_H

#include <math.h>

#include "ampc.h"
#include "cast.h"           // defines: ampc_step_seed, ampc_round_bits

enum {
    AMPC_ADAM_MAXIMIZE = 1,
    AMPC_ADAM_L2 = 2,           /* Adam with weight decay */
    AMPC_ADAM_DECAY = 4,        /* AdamW with weight decay */
    AMPC_ADAM_AMSGRAD = 8,
};

/* The fp32 constants of one tensor's step. */
struct ampc_adam_coef {
    float inv_scale;
    float clip_coef;
    float wd;                   /* Adam: g = fma(p, wd, g) */
    float decay;                /* AdamW: p *= decay = 1 - lr * wd */
    float w1;                   /* 1 - beta1, the weight of m's lerp toward g */
    float beta2;
    float w2;                   /* 1 - beta2 */
    float bc2_sqrt;             /* sqrt(1 - beta2^t) */
    float eps;
    float neg_step_size;        /* -lr / (1 - beta1^t) */
    int flags;
    uint64_t seed;              /* stochastic rounding: ampc_step_seed(args seed, t) */
};

AMPC_HD struct ampc_adam_coef ampc_adam_coef(const struct ampc_adam_args *a, double lr,
                                             double step, float inv_scale, float clip_coef,
                                             int amsgrad)
{
    struct ampc_adam_coef c;
    double bc1 = 1.0 - pow(a->beta1, step);
    double bc2 = 1.0 - pow(a->beta2, step);
    c.inv_scale = inv_scale;
    c.clip_coef = clip_coef;
    c.wd = (float)a->weight_decay;
    c.decay = (float)(1.0 - lr * a->weight_decay);
    c.w1 = (float)(1.0 - a->beta1);
    c.beta2 = (float)a->beta2;
    c.w2 = (float)(1.0 - a->beta2);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)a->eps;
    c.neg_step_size = (float)(-(lr / bc1));
    c.flags = (a->maximize ? AMPC_ADAM_MAXIMIZE : 0) | (amsgrad ? AMPC_ADAM_AMSGRAD : 0);
    c.seed = ampc_step_seed(a->seed, (float)step);
    if (a->weight_decay != 0)
        c.flags |= a->decoupled ? AMPC_ADAM_DECAY : AMPC_ADAM_L2;
    return c;
}

/* A tensor's constants on its next step: the step count as stored (fp32) plus one, and
 * the control values that live on the device, or their defaults when absent. */
AMPC_HD struct ampc_adam_coef ampc_adam_tensor_coef(const struct ampc_adam_args *a,
                                                    const struct ampc_adam_control *ctl,
                                                    float stored_step, int amsgrad)
{
    double lr = ctl->lr ? (double)*ctl->lr : a->lr;
    float inv_scale = ctl->inv_scale ? *ctl->inv_scale : 1.0f;
    float clip = ctl->clip_coef ? *ctl->clip_coef : 1.0f;
    float step = stored_step + 1.0f;        /* in fp32, as the count is stored */
    return ampc_adam_coef(a, lr, (double)step, inv_scale, clip, amsgrad);
}

/* One tensor's pointers at element `start` (m = exp_avg, v = exp_avg_sq, vmax =
 * max_exp_avg_sq); master is NULL when the param is the weight, vmax without amsgrad. */
struct ampc_adam_ptrs {
    char *param;
    const char *grad;
    float *master;
    float *m;
    float *v;
    float *vmax;
};

AMPC_HD struct ampc_adam_ptrs ampc_adam_ptrs_at(void *param, ampc_dtype pd, const void *grad,
                                                ampc_dtype gd, void *master, void *m, void *v,
                                                void *vmax, int64_t start)
{
    struct ampc_adam_ptrs q;
    q.param = (char *)param + start * ampc_dtype_size(pd);
    q.grad = (const char *)grad + start * ampc_dtype_size(gd);
    q.master = master ? (float *)master + start : NULL;
    q.m = (float *)m + start;
    q.v = (float *)v + start;
    q.vmax = vmax ? (float *)vmax + start : NULL;
    return q;
}

/* max that keeps a nan, like torch.maximum. */
AMPC_HD float ampc_max_nan(float a, float b)
{
    return (a != a || b != b) ? a + b : (a > b ? a : b);
}

/* One element: g is the grad widened to fp32, *p the fp32 weight (the master weight, or
 * the param itself). Updates *p, *m, *v and, with amsgrad, *vmax. ampc_adam_element_as
 * takes c's flags and whether c->w1 < 0.5 as arguments, so that a loop that knows them
 * at compile time has no select left for them. */
AMPC_HD void ampc_adam_element_as(float g, float *p, float *m, float *v, float *vmax,
                                  const struct ampc_adam_coef *c, const int flags,
                                  const int small_w1)
{
    /* Each choice is computed both ways and selected (the unused value is dropped), so a
     * loop that calls this with the flags unknown at compile time still vectorizes: a
     * compiler may not run an fma only under a condition that varies per lane. */
    float w = *p;
    g = g * c->inv_scale;
    g = g * c->clip_coef;
    g = (flags & AMPC_ADAM_MAXIMIZE) ? -g : g;
    float g_l2 = fmaf(w, c->wd, g);
    g = (flags & AMPC_ADAM_L2) ? g_l2 : g;
    float w_decayed = w * c->decay;
    w = (flags & AMPC_ADAM_DECAY) ? w_decayed : w;
    float mm = *m;
    float m_from_m = fmaf(c->w1, g - mm, mm);
    float m_from_g = fmaf(c->w1 - 1.0f, g - mm, g);
    mm = small_w1 ? m_from_m : m_from_g;
    float vv = fmaf(c->w2 * g, g, *v * c->beta2);
    *m = mm;
    *v = vv;
    if (flags & AMPC_ADAM_AMSGRAD) {
        vv = ampc_max_nan(*vmax, vv);
        *vmax = vv;
    }
    float denom = sqrtf(vv) / c->bc2_sqrt + c->eps;
    *p = w + (c->neg_step_size * mm) / denom;
}

AMPC_HD void ampc_adam_element(float g, float *p, float *m, float *v, float *vmax,
                               const struct ampc_adam_coef *c)
{
    ampc_adam_element_as(g, p, m, v, vmax, c, c->flags, c->w1 < 0.5f);
}

#endif /* AMPC_ADAM_H */
