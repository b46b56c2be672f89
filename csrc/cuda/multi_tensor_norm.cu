// Per tensor, sum(|x|^p) (not rooted) or, for p = inf, max(|x|). Two passes, nothing waits on the
// host: one multi-tensor launch per dtype reduces every chunk to a double partial (per-thread
// double sums, then a tree over the block), then one launch combines each tensor's partials.
// Fixed reduction orders make the results deterministic, and double sums leave only the final
// rounding to float32.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "multi_tensor.cuh"

namespace megatron_fsdp {

// Defined in cpu/multi_tensor_norm.cpp, which every build compiles: one set of messages for both.
void check_multi_tensor_norm_args(at::TensorList tensors, double norm_type);

namespace {

namespace mt = multi_tensor;

// Chunk table fields per tensor: data address, index of its result, index of its first chunk
// (its chunks are consecutive in the table, so chunk k's partial sits at first + k), chunk count.
constexpr int kFields = 4;
constexpr int kWarps = mt::kBlockThreads / 32;

enum class Norm { kOne, kTwo, kPower, kMax };

// Terms and sums in double: the kernel is memory-bound and Hopper's fp64 rate covers a conversion
// and an add per element several times over, while a float sum of each thread's 128 terms could be
// off by ~1e-6 relative.
template <Norm kNorm, typename T>
__device__ __forceinline__ double term(T value, double p) {
  const double x = ::fabs(static_cast<double>(static_cast<at::opmath_type<T>>(value)));
  if constexpr (kNorm == Norm::kTwo) {
    return x * x;
  } else if constexpr (kNorm == Norm::kPower) {
    return ::pow(x, p);
  } else {
    return x;
  }
}

// Sum, or a max that keeps NaN (fmax would drop it). Every term is >= 0, so 0 is the identity of
// both.
template <Norm kNorm>
__device__ __forceinline__ double combine(double acc, double value) {
  if constexpr (kNorm == Norm::kMax) {
    return (value > acc || ::isnan(value)) ? value : acc;
  } else {
    return acc + value;
  }
}

// Tree reduction over the block: shuffles within each warp, then the first warp over the warps'
// results. The result is valid in thread 0. Called once per kernel, so the shared array needs no
// barrier after it.
template <Norm kNorm>
__device__ double block_reduce(double value) {
  __shared__ double warp_results[kWarps];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = combine<kNorm>(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  if (lane == 0) warp_results[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? warp_results[lane] : 0.0;
#pragma unroll
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      value = combine<kNorm>(value, __shfl_down_sync(0xffffffffu, value, offset));
    }
  }
  return value;
}

// One block per chunk: writes the chunk's partial.
template <typename T, Norm kNorm>
__global__ void chunk_norms_kernel(const int64_t* tensors, const int64_t* chunks, double p,
                                   double* partials) {
  const mt::Chunk chunk = mt::current_chunk(tensors, kFields, chunks);
  const T* data = mt::pointer_from<const T>(chunk.tensor[0]) + chunk.start;
  // 0 is the identity of both combines, so starting from it changes no result.
  double acc = 0.0;
  mt::for_each_element(data, static_cast<int>(chunk.count),
                       [&](T value) { acc = combine<kNorm>(acc, term<kNorm>(value, p)); });
  const double total = block_reduce<kNorm>(acc);
  if (threadIdx.x == 0) {
    partials[chunk.tensor[2] + chunk.start / mt::kChunkSize] = total;
  }
}

// One block per tensor: combines its chunks' partials (none for an empty tensor: 0) into its
// float32 result. A sum beyond the float32 range rounds to Inf.
template <Norm kNorm>
__global__ void tensor_norms_kernel(const int64_t* tensors, const double* partials, float* norms) {
  const int64_t* row = tensors + static_cast<int64_t>(blockIdx.x) * kFields;
  const double* first = partials + row[2];
  const int64_t num_chunks = row[3];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < num_chunks; c += mt::kBlockThreads) {
    acc = combine<kNorm>(acc, first[c]);
  }
  const double total = block_reduce<kNorm>(acc);
  if (threadIdx.x == 0) norms[row[1]] = static_cast<float>(total);
}

// Calls launch(std::integral_constant<Norm, ...>) with the kernels' kind for norm_type.
template <typename Launch>
void dispatch_norm(double norm_type, const Launch& launch) {
  if (std::isinf(norm_type)) {
    launch(std::integral_constant<Norm, Norm::kMax>());
  } else if (norm_type == 1.0) {
    launch(std::integral_constant<Norm, Norm::kOne>());
  } else if (norm_type == 2.0) {
    launch(std::integral_constant<Norm, Norm::kTwo>());
  } else {
    launch(std::integral_constant<Norm, Norm::kPower>());
  }
}

at::Tensor multi_tensor_norm_cuda(at::TensorList tensors, double norm_type) {
  check_multi_tensor_norm_args(tensors, norm_type);
  if (tensors.empty()) return at::zeros({0}, at::kFloat);  // no device to speak of, like the CPU op
  const at::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "multi_tensor_norm: the tensors must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  mt::ChunkTableBuilder builder(kFields);
  const std::vector<mt::DtypeGroup> groups = builder.add_by_dtype(
      num_tensors, [&](int64_t i) { return tensors[i].scalar_type(); },
      [&](mt::ChunkTableBuilder& table, int64_t i) {
        const at::Tensor& t = tensors[i];
        const int64_t num_chunks = (t.numel() + mt::kChunkSize - 1) / mt::kChunkSize;
        table.add({mt::address_of(t.const_data_ptr()), i, table.num_chunks(), num_chunks}, t.numel());
      });

  const mt::ChunkTable table = builder.upload(device);
  const at::TensorOptions on_device = at::TensorOptions().device(device);
  at::Tensor partials = at::empty({table.num_chunks}, on_device.dtype(at::kDouble));
  at::Tensor norms = at::empty({num_tensors}, on_device.dtype(at::kFloat));
  double* partial_ptr = partials.mutable_data_ptr<double>();
  float* norm_ptr = norms.mutable_data_ptr<float>();
  dispatch_norm(norm_type, [&](auto norm) {
    constexpr Norm kNorm = decltype(norm)::value;
    for (const mt::DtypeGroup& group : groups) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, group.dtype, "multi_tensor_norm", [&] {
        chunk_norms_kernel<scalar_t, kNorm>
            <<<static_cast<unsigned int>(group.num_chunks), mt::kBlockThreads, 0, stream>>>(
                table.tensors(), table.chunks(group.first_chunk), norm_type, partial_ptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    // Every tensor has a row, so this writes every result, zero-element tensors' included.
    tensor_norms_kernel<kNorm><<<static_cast<unsigned int>(num_tensors), mt::kBlockThreads, 0,
                                 stream>>>(table.tensors(), partial_ptr, norm_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return norms;
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("multi_tensor_norm", &megatron_fsdp::multi_tensor_norm_cuda);
}
