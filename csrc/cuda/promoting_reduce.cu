// Sums [world, n] chunks in fp32 (fp64 when the chunks or the output are fp64) and writes or
// accumulates the scaled result into an output of another dtype. Memory-bound, so loads are
// 16-byte vectors when the layout allows it.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../common/checks.h"

namespace megatron_fsdp {
namespace {

constexpr int kThreads = 256;

// N consecutive elements moved as one (or a few) wide memory transactions.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// Round-to-nearest intrinsics are never fused into an FMA, so scale-then-accumulate rounds twice
// exactly like the CPU kernel.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// Each thread owns V consecutive columns (one vector) in each of kUnroll vectors per grid-stride
// step, and issues all their loads before any arithmetic: one vector in flight per thread leaves
// HBM idle (a bf16 -> fp32 copy ran at half bandwidth). V == 1 is the scalar fallback; V > 1
// requires n % V == 0 and both pointers aligned to their vector size.
// No __restrict__: out may be one of the chunk rows (an in-place reduce-scatter); each vector is
// read and written by one thread only, reads first.
constexpr int kUnroll = 4;

template <typename in_t, typename out_t, int V>
__global__ void promoting_reduce_kernel(const in_t* chunks, out_t* out,
                                        int64_t world, int64_t n, promoting_acc_t<in_t, out_t> scale,
                                        bool accumulate) {
  using acc_t = promoting_acc_t<in_t, out_t>;
  using InVec = Vec<in_t, V>;
  using OutVec = Vec<out_t, V>;
  const int64_t num_vecs = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  OutVec* dst = reinterpret_cast<OutVec*>(out);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < num_vecs;
       first += stride * kUnroll) {
    acc_t sum[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) sum[u][k] = acc_t(0);
    }
    // Rows in order 0..world-1, as on the CPU, so fp32 sums round the same way.
    for (int64_t r = 0; r < world; ++r) {
      const InVec* row = reinterpret_cast<const InVec*>(chunks + r * n);
      InVec x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (first + u * stride < num_vecs) x[u] = row[first + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (first + u * stride < num_vecs) {
#pragma unroll
          for (int k = 0; k < V; ++k) sum[u][k] += static_cast<acc_t>(x[u].val[k]);
        }
      }
    }
    OutVec y[kUnroll];
    if (accumulate) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (first + u * stride < num_vecs) y[u] = dst[first + u * stride];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * stride >= num_vecs) continue;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc_t value = mul_rn(sum[u][k], scale);
        if (accumulate) value = add_rn(value, static_cast<acc_t>(y[u].val[k]));
        y[u].val[k] = static_cast<out_t>(value);
      }
      dst[first + u * stride] = y[u];
    }
  }
}

bool is_aligned(const void* ptr, size_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

template <typename in_t, typename out_t, int V>
void launch(const in_t* chunks, out_t* out, int64_t world, int64_t n,
            promoting_acc_t<in_t, out_t> scale, bool accumulate) {
  const int64_t num_vecs = n / V;
  // Enough blocks to fill every SM once; the grid-stride loop covers the rest.
  const cudaDeviceProp* properties = at::cuda::getCurrentDeviceProperties();
  const int64_t max_blocks = static_cast<int64_t>(properties->multiProcessorCount) *
                             std::max(1, properties->maxThreadsPerMultiProcessor / kThreads);
  const int64_t blocks = std::min<int64_t>((num_vecs + kThreads * kUnroll - 1) / (kThreads * kUnroll), max_blocks);
  promoting_reduce_kernel<in_t, out_t, V>
      <<<static_cast<unsigned int>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          chunks, out, world, n, scale, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void promoting_reduce_cuda(const at::Tensor& chunks, double scale, bool accumulate,
                           const at::Tensor& out) {
  check_promoting_reduce(chunks, out);
  TORCH_CHECK(out.is_cuda(), "promoting_reduce: chunks and out must be CUDA tensors, got ",
              out.device());
  const int64_t world = chunks.size(0);
  const int64_t n = chunks.size(1);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, chunks.scalar_type(), "promoting_reduce_in", [&] {
    using in_t = scalar_t;
    const in_t* in = chunks.const_data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "promoting_reduce_out", [&] {
      using acc_t = promoting_acc_t<in_t, scalar_t>;
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      const acc_t factor = static_cast<acc_t>(scale);
      // 16-byte input vectors; every row start must be aligned too, hence n % V == 0.
      constexpr int V = 16 / sizeof(in_t);
      const bool vectorise = n % V == 0 && is_aligned(in, sizeof(in_t) * V) &&
                             is_aligned(dst, sizeof(scalar_t) * V);
      if (vectorise) {
        launch<in_t, scalar_t, V>(in, dst, world, n, factor, accumulate);
      } else {
        launch<in_t, scalar_t, 1>(in, dst, world, n, factor, accumulate);
      }
    });
  });
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("promoting_reduce", &megatron_fsdp::promoting_reduce_cuda);
}
