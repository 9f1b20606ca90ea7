/*
 * torch_shim.h: C declarations of the few functions of libtorch's stable C ABI
 * ("shim", torch >= 2.10) that ampc calls.
 *
 * torch's own shim headers are C++, so they cannot be included from C. These
 * prototypes must stay identical to torch's: tests/kernels/test_shim_header.py compiles this
 * file together with torch's real headers, so any drift is a compile error there.
 *
 * The libraries are linked without torch; the symbols resolve at load time against
 * the libtorch that `import torch` already loaded (ampc/_lib.py makes it global).
 * Functions newer than 2.10 are declared weak and checked for NULL before use.
 */
#ifndef AMPC_TORCH_SHIM_H
#define AMPC_TORCH_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t AOTITorchError;             /* 0 = success */
typedef uint64_t StableIValue;
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef struct TorchLibraryOpaque *TorchLibraryHandle;
typedef struct StableListOpaque *StableListHandle;
typedef void (*ParallelFunc)(int64_t begin, int64_t end, void *ctx);

/* The stable-ABI version whose encodings and schemas ampc implements: 2.10.0. */
#define AMPC_TORCH_ABI_VERSION 0x020A000000000000ULL

// ---- library registration ----
AOTITorchError aoti_torch_library_init_def(const char *ns, const char *file, uint32_t line,
                                           TorchLibraryHandle *ret_new_torch_lib);
AOTITorchError aoti_torch_library_init_impl(const char *ns, const char *k, const char *file,
                                            uint32_t line, TorchLibraryHandle *ret_new_torch_lib);
AOTITorchError aoti_torch_library_def(TorchLibraryHandle self, const char *schema);
AOTITorchError torch_library_impl(TorchLibraryHandle self, const char *name,
                                  void (*fn)(StableIValue *, uint64_t, uint64_t),
                                  uint64_t extension_build_version);
uint64_t aoti_torch_abi_version(void);

// ---- errors ----
void aoti_torch_check(bool cond, const char *func, const char *file, uint32_t line,
                      const char *msg);

// ---- lists ----
AOTITorchError torch_list_size(StableListHandle list_handle, size_t *size);
AOTITorchError torch_list_get_item(StableListHandle list_handle, size_t index,
                                   StableIValue *element);
AOTITorchError torch_delete_list(StableListHandle list_handle);

// ---- tensors ----
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle tensor);
AOTITorchError aoti_torch_get_dim(AtenTensorHandle tensor, int64_t *ret_dim);
AOTITorchError aoti_torch_get_numel(AtenTensorHandle tensor, int64_t *ret_numel);
AOTITorchError aoti_torch_get_sizes(AtenTensorHandle tensor, int64_t **ret_sizes);
AOTITorchError aoti_torch_get_dtype(AtenTensorHandle tensor, int32_t *ret_dtype);
AOTITorchError aoti_torch_get_device_type(AtenTensorHandle tensor, int32_t *ret_device_type);
AOTITorchError aoti_torch_get_device_index(AtenTensorHandle tensor, int32_t *ret_device_index);
AOTITorchError aoti_torch_get_layout(AtenTensorHandle tensor, int32_t *ret_layout);
AOTITorchError aoti_torch_is_contiguous(AtenTensorHandle tensor, bool *ret_is_contiguous);
AOTITorchError torch_get_mutable_data_ptr(AtenTensorHandle tensor, void **ret_data_ptr);
AOTITorchError aoti_torch_empty_strided(int64_t ndim, const int64_t *sizes_ptr,
                                        const int64_t *strides_ptr, int32_t dtype,
                                        int32_t device_type, int32_t device_index,
                                        AtenTensorHandle *ret_new_tensor);
/* generated/c_shim_aten.h (2.9): torch's fill_ on the tensor's device and current stream */
AOTITorchError aoti_torch_aten_fill__Scalar(AtenTensorHandle self, double value);
int32_t aoti_torch_dtype_float16(void);
int32_t aoti_torch_dtype_bfloat16(void);
int32_t aoti_torch_dtype_float32(void);
int32_t aoti_torch_dtype_float8_e4m3fn(void);
int32_t aoti_torch_dtype_float8_e5m2(void);
int32_t aoti_torch_dtype_int32(void);
int32_t aoti_torch_dtype_int64(void);
int32_t aoti_torch_dtype_uint8(void);
int32_t aoti_torch_dtype_float8_e4m3fn(void);
int32_t aoti_torch_dtype_float8_e5m2(void);
int32_t aoti_torch_device_type_cpu(void);
int32_t aoti_torch_layout_strided(void);
int32_t aoti_torch_device_type_cuda(void);

// ---- CPU threads (torch's intra-op pool, sized by torch.get_num_threads()) ----
AOTITorchError torch_parallel_for(int64_t begin, int64_t end, int64_t grain_size,
                                  ParallelFunc func, void *ctx);

// ---- CUDA (libtorch_cuda; only the CUDA library calls these) ----
typedef struct CUDAGuardOpaque *CUDAGuardHandle;
AOTITorchError aoti_torch_create_cuda_guard(int32_t device_index, CUDAGuardHandle *ret_guard);
AOTITorchError aoti_torch_delete_cuda_guard(CUDAGuardHandle guard);
AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void **ret_stream);
AOTITorchError aoti_torch_cuda_caching_allocator_raw_alloc(uint64_t nbytes, void **ret_ptr);
AOTITorchError aoti_torch_cuda_caching_allocator_raw_delete(void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* AMPC_TORCH_SHIM_H */
