/*
 * cuda_fp16.h of the emulation build: the half type and the conversions the kernels use.
 * __half2float is exact, as the GPU's cvt.f32.f16; a NaN keeps its payload, quieted.
 */
#ifndef AMPC_CUDA_EMU_FP16_H
#define AMPC_CUDA_EMU_FP16_H

#include <stdint.h>
#include <string.h>

#include "simt.h"

struct __half {
    unsigned short x;
};

inline __half __ushort_as_half(unsigned short bits)
{
    __half h;
    h.x = bits;
    return h;
}

inline float __half2float(__half h)
{
    uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16;
    uint32_t exp = (h.x >> 10) & 0x1fu;
    uint32_t man = h.x & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {                          /* inf, or NaN made quiet */
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                    /* subnormal: normalize */
        int e = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

#endif /* AMPC_CUDA_EMU_FP16_H */
