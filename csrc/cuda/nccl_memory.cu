// NCCL's own allocator (ncclMemAlloc: cuMem-backed memory that NCCL can map for NVLS and
// zero-copy peer access once registered) as the two C functions torch.cuda.memory's
// CUDAPluggableAllocator calls, for the memory pool behind nccl_ub. The functions come from the
// libnccl torch already loaded, found at run time: this library is built without NCCL's headers
// and uses the communicators' own NCCL, whatever version that is.
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

namespace {

using NcclMemAlloc = int (*)(void** ptr, size_t size);
using NcclMemFree = int (*)(void* ptr);
using NcclGetErrorString = const char* (*)(int result);

struct NcclMemoryApi {
  NcclMemAlloc alloc = nullptr;
  NcclMemFree free = nullptr;
  NcclGetErrorString error_string = nullptr;
};

void* find_symbol(const char* name) {
  if (void* symbol = dlsym(RTLD_DEFAULT, name)) return symbol;
  void* library = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);  // loaded by torch, not globally
  return library == nullptr ? nullptr : dlsym(library, name);
}

const NcclMemoryApi& nccl_memory_api() {
  static const NcclMemoryApi api = [] {
    NcclMemoryApi found;
    found.alloc = reinterpret_cast<NcclMemAlloc>(find_symbol("ncclMemAlloc"));
    found.free = reinterpret_cast<NcclMemFree>(find_symbol("ncclMemFree"));
    found.error_string = reinterpret_cast<NcclGetErrorString>(find_symbol("ncclGetErrorString"));
    return found;
  }();
  return api;
}

}  // namespace

extern "C" {

// 1 when the loaded NCCL offers ncclMemAlloc/ncclMemFree (NCCL 2.19 and later), else 0.
int megatron_fsdp_nccl_memory_available() {
  const auto& api = nccl_memory_api();
  return api.alloc != nullptr && api.free != nullptr && api.error_string != nullptr;
}

void* megatron_fsdp_nccl_alloc(size_t size, int device, void* /*stream*/) {
  const auto& api = nccl_memory_api();
  TORCH_CHECK(api.alloc != nullptr, "megatron_fsdp: the loaded NCCL has no ncclMemAlloc");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  const int result = api.alloc(&ptr, size);
  TORCH_CHECK(result == 0, "megatron_fsdp: ncclMemAlloc of ", size, " bytes on cuda:", device,
              " failed: ", api.error_string(result));
  return ptr;
}

void megatron_fsdp_nccl_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  const auto& api = nccl_memory_api();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int result = api.free(ptr);
  // Freeing runs where torch cannot take an exception (pool teardown): report and go on.
  if (result != 0) TORCH_WARN("megatron_fsdp: ncclMemFree failed: ", api.error_string(result));
}

}  // extern "C"
