/* cuda_bf16.h of the emulation build: no kernel uses its intrinsics (bf16 goes through
 * dtype.h), so the runtime is all it brings. */
#include "simt.h"
