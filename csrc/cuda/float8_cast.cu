// The float8 weight ops on the GPU: per-segment amax of a flat buffer, and its cast to float8
// with one scale per segment. One launch each, blockIdx.y picking the segment; the results stay
// on the device, so the host never waits.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "../common/segment_checks.h"

namespace megatron_fsdp {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerSegment = 1024;
constexpr int64_t kMaxSegments = 65535;  // gridDim.y

// The bounds as int64 pairs on the device, copied from pinned memory on the current stream.
at::Tensor upload_bounds(at::IntArrayRef bounds, at::Device device) {
  at::Tensor host = at::empty({static_cast<int64_t>(bounds.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(bounds.begin(), bounds.end(), host.mutable_data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

// Enough blocks to cover the longest segment, at most kMaxBlocksPerSegment (they stride).
dim3 segment_grid(at::IntArrayRef bounds) {
  int64_t longest = 0;
  for (size_t i = 0; i < bounds.size(); i += 2) longest = std::max(longest, bounds[i + 1] - bounds[i]);
  const int64_t blocks = std::min(kMaxBlocksPerSegment, std::max<int64_t>(1, (longest + kThreads - 1) / kThreads));
  return dim3(static_cast<unsigned int>(blocks), static_cast<unsigned int>(bounds.size() / 2));
}

template <typename T>
__global__ void segment_amax_kernel(const T* data, const int64_t* bounds, unsigned int* amax_bits) {
  const int64_t start = bounds[2 * blockIdx.y];
  const int64_t end = bounds[2 * blockIdx.y + 1];
  // |x| is non-negative, so its float bits order like the values; a NaN's bits (exponent all
  // ones, non-zero mantissa) are above +Inf's, so a NaN wins the max.
  unsigned int running = 0;
  for (int64_t i = start + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    running = max(running, __float_as_uint(fabsf(static_cast<float>(data[i]))));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    running = max(running, __shfl_down_sync(0xffffffffu, running, offset));
  }
  __shared__ unsigned int warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = running;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) running = max(running, warp_max[w]);
    atomicMax(&amax_bits[blockIdx.y], running);
  }
}

at::Tensor segment_amax_cuda(const at::Tensor& flat, at::IntArrayRef bounds) {
  check_segment_bounds(flat, bounds, "segment_amax");
  const c10::cuda::CUDAGuard guard(flat.device());
  const int64_t segments = static_cast<int64_t>(bounds.size() / 2);
  TORCH_CHECK(segments <= kMaxSegments, "segment_amax: at most ", kMaxSegments, " segments, got ", segments);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor amax = at::empty({segments}, flat.options().dtype(at::kFloat));
  if (segments == 0) return amax;
  C10_CUDA_CHECK(cudaMemsetAsync(amax.mutable_data_ptr(), 0, amax.nbytes(), stream));  // bits of 0.0f
  const at::Tensor device_bounds = upload_bounds(bounds, flat.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "segment_amax", [&] {
    segment_amax_kernel<scalar_t><<<segment_grid(bounds), kThreads, 0, stream>>>(
        flat.const_data_ptr<scalar_t>(), device_bounds.const_data_ptr<int64_t>(),
        reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<float>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return amax;
}

template <typename T, typename Float8>
__global__ void float8_cast_kernel(const T* data, const int64_t* bounds, const float* scales, Float8* out,
                                   float largest) {
  const int64_t start = bounds[2 * blockIdx.y];
  const int64_t end = bounds[2 * blockIdx.y + 1];
  const float scale = scales[blockIdx.y];
  for (int64_t i = start + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    // fminf/fmaxf would turn a NaN into the bound: keep it NaN, as the host kernel and torch do.
    const float scaled = static_cast<float>(data[i]) * scale;
    const float clamped = isnan(scaled) ? scaled : fminf(fmaxf(scaled, -largest), largest);
    out[i] = Float8(clamped);
  }
}

template <typename Float8>
void launch_cast(const at::Tensor& flat, const at::Tensor& device_bounds, at::IntArrayRef bounds,
                 const at::Tensor& scales, at::Tensor& out, cudaStream_t stream) {
  const float largest = static_cast<float>(std::numeric_limits<Float8>::max());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "float8_cast_segments", [&] {
    float8_cast_kernel<scalar_t, Float8><<<segment_grid(bounds), kThreads, 0, stream>>>(
        flat.const_data_ptr<scalar_t>(), device_bounds.const_data_ptr<int64_t>(),
        scales.const_data_ptr<float>(), out.mutable_data_ptr<Float8>(), largest);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void float8_cast_segments_cuda(const at::Tensor& flat, at::IntArrayRef bounds, const at::Tensor& scales,
                               at::Tensor& out) {
  check_float8_cast(flat, bounds, scales, out);
  const c10::cuda::CUDAGuard guard(flat.device());
  const int64_t segments = static_cast<int64_t>(bounds.size() / 2);
  TORCH_CHECK(segments <= kMaxSegments, "float8_cast_segments: at most ", kMaxSegments, " segments, got ",
              segments);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Zero bytes are float8 zeros: what no segment covers (padding) reads as zero.
  C10_CUDA_CHECK(cudaMemsetAsync(out.mutable_data_ptr(), 0, out.nbytes(), stream));
  if (segments == 0) return;
  const at::Tensor device_bounds = upload_bounds(bounds, flat.device());
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    launch_cast<c10::Float8_e4m3fn>(flat, device_bounds, bounds, scales, out, stream);
  } else {
    launch_cast<c10::Float8_e5m2>(flat, device_bounds, bounds, scales, out, stream);
  }
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("segment_amax", &megatron_fsdp::segment_amax_cuda);
  m.impl("float8_cast_segments", &megatron_fsdp::float8_cast_segments_cuda);
}
