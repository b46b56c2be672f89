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
#include <cstdint>
#include <limits>
#include <utility>
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

// The elements of out that no segment covers (padding), as [start, end) pairs: the cast writes
// zeros there, so out needs no memset beforehand (a whole extra pass over it).
std::vector<int64_t> uncovered_ranges(at::IntArrayRef bounds, int64_t numel) {
  std::vector<std::pair<int64_t, int64_t>> segments;
  for (size_t i = 0; i < bounds.size(); i += 2) {
    if (bounds[i] < bounds[i + 1]) segments.emplace_back(bounds[i], bounds[i + 1]);
  }
  std::sort(segments.begin(), segments.end());
  std::vector<int64_t> gaps;
  int64_t covered = 0;
  for (const auto& [start, end] : segments) {
    if (start > covered) gaps.insert(gaps.end(), {covered, start});
    covered = std::max(covered, end);
  }
  if (covered < numel) gaps.insert(gaps.end(), {covered, numel});
  return gaps;
}

// Four elements per load and store where both pointers allow it. One-byte stores after a memset
// took 8.5 ms a step for 8 layers of 8B width on an H200, where full bandwidth needs 3.6.
constexpr int64_t kVector = 4;
template <typename T>
struct alignas(sizeof(T) * kVector) Pack {
  T values[kVector];
};

template <typename T, typename Float8>
__device__ Float8 scaled_float8(T value, float scale, float largest) {
  // fminf/fmaxf would turn a NaN into the bound: keep it NaN, as the host kernel and torch do.
  const float scaled = static_cast<float>(value) * scale;
  return Float8(isnan(scaled) ? scaled : fminf(fmaxf(scaled, -largest), largest));
}

// Rows blockIdx.y < segments cast their segment with its scale; the rows after them zero one
// uncovered range each.
template <typename T, typename Float8>
__global__ void float8_cast_kernel(const T* data, const int64_t* bounds, int64_t segments, const float* scales,
                                   Float8* out, float largest, bool vectorized) {
  const int64_t start = bounds[2 * blockIdx.y];
  const int64_t end = bounds[2 * blockIdx.y + 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (blockIdx.y >= segments) {
    for (int64_t i = start + offset; i < end; i += stride) out[i] = Float8(0.0f);
    return;
  }
  const float scale = scales[blockIdx.y];
  // [start, body_start) and [body_end, end) one element at a time, the body kVector at a time.
  int64_t body_start = start, body_end = start;
  if (vectorized) {
    const int64_t first_aligned = (start + kVector - 1) / kVector * kVector;
    const int64_t last_aligned = end / kVector * kVector;
    body_start = first_aligned < end ? first_aligned : end;
    body_end = last_aligned > body_start ? last_aligned : body_start;
  }
  for (int64_t i = start + offset; i < body_start; i += stride) out[i] = scaled_float8<T, Float8>(data[i], scale, largest);
  for (int64_t i = body_end + offset; i < end; i += stride) out[i] = scaled_float8<T, Float8>(data[i], scale, largest);
  const auto* packs = reinterpret_cast<const Pack<T>*>(data);
  auto* out_packs = reinterpret_cast<Pack<Float8>*>(out);
  for (int64_t v = body_start / kVector + offset; v < body_end / kVector; v += stride) {
    const Pack<T> in = packs[v];
    Pack<Float8> cast;
#pragma unroll
    for (int k = 0; k < kVector; ++k) cast.values[k] = scaled_float8<T, Float8>(in.values[k], scale, largest);
    out_packs[v] = cast;
  }
}

bool aligned(const void* pointer, size_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

template <typename Float8>
void launch_cast(const at::Tensor& flat, const at::Tensor& device_bounds, int64_t segments, dim3 grid,
                 const at::Tensor& scales, at::Tensor& out, cudaStream_t stream) {
  const float largest = static_cast<float>(std::numeric_limits<Float8>::max());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "float8_cast_segments", [&] {
    const scalar_t* data = flat.const_data_ptr<scalar_t>();
    Float8* target = out.mutable_data_ptr<Float8>();
    const bool vectorized = aligned(data, sizeof(Pack<scalar_t>)) && aligned(target, sizeof(Pack<Float8>));
    float8_cast_kernel<scalar_t, Float8><<<grid, kThreads, 0, stream>>>(
        data, device_bounds.const_data_ptr<int64_t>(), segments, scales.const_data_ptr<float>(), target, largest,
        vectorized);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void float8_cast_segments_cuda(const at::Tensor& flat, at::IntArrayRef bounds, const at::Tensor& scales,
                               at::Tensor& out) {
  check_float8_cast(flat, bounds, scales, out);
  const c10::cuda::CUDAGuard guard(flat.device());
  const int64_t segments = static_cast<int64_t>(bounds.size() / 2);
  std::vector<int64_t> rows(bounds.begin(), bounds.end());
  const std::vector<int64_t> gaps = uncovered_ranges(bounds, out.numel());
  rows.insert(rows.end(), gaps.begin(), gaps.end());
  const int64_t grid_rows = static_cast<int64_t>(rows.size() / 2);
  TORCH_CHECK(grid_rows <= kMaxSegments, "float8_cast_segments: at most ", kMaxSegments,
              " segments and uncovered ranges together, got ", grid_rows);
  if (grid_rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor device_bounds = upload_bounds(rows, flat.device());
  const dim3 grid = segment_grid(rows);
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    launch_cast<c10::Float8_e4m3fn>(flat, device_bounds, segments, grid, scales, out, stream);
  } else {
    launch_cast<c10::Float8_e5m2>(flat, device_bounds, segments, grid, scales, out, stream);
  }
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("segment_amax", &megatron_fsdp::segment_amax_cuda);
  m.impl("float8_cast_segments", &megatron_fsdp::float8_cast_segments_cuda);
}
