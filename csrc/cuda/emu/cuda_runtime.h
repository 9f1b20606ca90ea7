/* cuda_runtime.h of the emulation build: the runtime API is simt.h's. */
#include "simt.h"
