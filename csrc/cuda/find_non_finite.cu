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
  constexpr int kVec = static_cast<int>(16 / sizeof(T));
  using Vec = mt::Vec<T, kVec>;
  constexpr int kLoads = mt::loads_in_flight(static_cast<int>(sizeof(Vec)));
  const mt::Chunk chunk = mt::current_chunk(tensors, kFields, chunks);
  const T* data = mt::pointer_from<const T>(chunk.tensor[0]) + chunk.start;
  const int count = static_cast<int>(chunk.count);

  // Scalar head up to the first 16-byte boundary (tensors are aligned to their element size),
  // then 16-byte vectors, several loads in flight per thread, then a scalar tail.
  int head = static_cast<int>((16 - mt::misalignment(data, 16)) % 16 / sizeof(T));
  if (head > count) head = count;
  const int num_vecs = (count - head) / kVec;
  const int tail = head + num_vecs * kVec + static_cast<int>(threadIdx.x);  // after the vectors
  // Head and tail are each shorter than kVec, so one element per thread covers them.
  bool found = static_cast<int>(threadIdx.x) < head && is_non_finite(data[threadIdx.x]);
  if (tail < count) found |= is_non_finite(data[tail]);

  const Vec* vecs = reinterpret_cast<const Vec*>(data + head);
  for (int base = static_cast<int>(threadIdx.x); base < num_vecs;
       base += kLoads * mt::kBlockThreads) {
    Vec in[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = base + k * mt::kBlockThreads;
      if (i < num_vecs) in[k] = vecs[i];
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (base + k * mt::kBlockThreads < num_vecs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) found |= is_non_finite(in[k].val[j]);
      }
    }
  }
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

  constexpr at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
  struct Group {
    at::ScalarType dtype;
    int64_t first_chunk;
    int64_t num_chunks;
  };
  mt::ChunkTableBuilder builder(kFields);
  std::vector<Group> groups;
  for (at::ScalarType dtype : kDtypes) {
    const int64_t first = builder.num_chunks();
    for (int64_t i = 0; i < num_tensors; ++i) {
      if (contiguous[i].scalar_type() == dtype) {
        builder.add({mt::address_of(contiguous[i].const_data_ptr()), i}, contiguous[i].numel());
      }
    }
    if (builder.num_chunks() > first) {
      groups.push_back({dtype, first, builder.num_chunks() - first});
    }
  }
  if (groups.empty()) return flags;  // only zero-element tensors: nothing can be non-finite

  const mt::ChunkTable table = builder.upload(device);
  for (const Group& group : groups) {
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
