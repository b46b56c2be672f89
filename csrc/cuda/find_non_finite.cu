// One flag per tensor: does it hold a NaN or an Inf. One multi-tensor launch per dtype; the
// flags stay on the device, so the host never waits.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"
#include "multi_tensor.cuh"

namespace megatron_fsdp {
namespace {

namespace mt = multi_tensor;

// Chunk table fields per tensor: data address, index of its flag.
constexpr int kFields = 2;

template <typename T>
__device__ __forceinline__ bool is_non_finite(T value) {
  // Widening half/bfloat16 to float keeps Inf and NaN, so the test is exact.
  return !::isfinite(static_cast<at::opmath_type<T>>(value));
}

template <typename T>
__global__ void find_non_finite_kernel(const int64_t* tensors, const int64_t* chunks,
                                       bool* flags) {
  const mt::Chunk chunk = mt::current_chunk(tensors, kFields, chunks);
  const T* data = mt::pointer_from<const T>(chunk.tensor[0]) + chunk.start;
  bool found = false;
  mt::for_each_element(data, static_cast<int>(chunk.count),
                       [&](T value) { found |= is_non_finite(value); });
  // One store per block that found something; blocks only ever write true, so races are benign.
  if (__syncthreads_or(found) && threadIdx.x == 0) {
    flags[chunk.tensor[1]] = true;
  }
}

at::Tensor find_non_finite_cuda(at::TensorList tensors) {
  check_same_device(tensors, "find_non_finite");
  if (tensors.empty()) return at::zeros({0}, at::kBool);  // no device to speak of, like the CPU op
  const at::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "find_non_finite: the tensors must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // A memset rather than at::zeros: no fill-kernel dispatch on the host's critical path.
  at::Tensor flags = at::empty({num_tensors}, at::TensorOptions().dtype(at::kBool).device(device));
  bool* flag_ptr = flags.mutable_data_ptr<bool>();
  C10_CUDA_CHECK(cudaMemsetAsync(flag_ptr, 0, flags.nbytes(), stream));

  // Strided tensors are scanned through contiguous temporaries that must outlive the launch.
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(tensors.size());
  for (const at::Tensor& t : tensors) contiguous.push_back(t.contiguous());

  mt::ChunkTableBuilder builder(kFields);
  const std::vector<mt::DtypeGroup> groups = builder.add_by_dtype(
      num_tensors, [&](int64_t i) { return contiguous[i].scalar_type(); },
      [&](mt::ChunkTableBuilder& table, int64_t i) {
        table.add({mt::address_of(contiguous[i].const_data_ptr()), i}, contiguous[i].numel());
      });
  if (groups.empty()) return flags;  // only zero-element tensors: nothing can be non-finite

  const mt::ChunkTable table = builder.upload(device);
  for (const mt::DtypeGroup& group : groups) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, group.dtype, "find_non_finite", [&] {
      find_non_finite_kernel<scalar_t>
          <<<static_cast<unsigned int>(group.num_chunks), mt::kBlockThreads, 0, stream>>>(
              table.tensors(), table.chunks(group.first_chunk), flag_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return flags;
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("find_non_finite", &megatron_fsdp::find_non_finite_cuda);
}
