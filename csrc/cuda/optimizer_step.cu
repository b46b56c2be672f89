// adam_step_ and sgd_step_ on CUDA: one elementwise grid-stride kernel each, on the current
// stream, with 16-byte loads of the fp32 buffers where every buffer is aligned for them.
// The arithmetic is torch.optim's default on CUDA, the foreach path (_multi_tensor_adam,
// _multi_tensor_sgd), rounded step by step as its kernels round; the _rn intrinsics pin each
// rounding and each fused multiply-add, so nvcc's contraction cannot move them. weights_out, when
// given, gets the updated param through static_cast, the conversion of Tensor.to's CUDA kernel.
#include <ATen/Dispatch_v2.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "../common/optimizer_step.h"
#include "multi_tensor.cuh"

namespace megatron_fsdp {
namespace {

namespace mt = multi_tensor;

constexpr int kThreads = 256;
// Elements per thread and loop step when aligned: one 16-byte load of each fp32 buffer.
constexpr int kVecElements = 4;

// torch.maximum: a NaN in either wins.
__device__ __forceinline__ float maximum(float a, float b) { return (a > b || isnan(a)) ? a : b; }

__device__ __forceinline__ void adam_element(const AdamConstants& c, float& p, float g, float& m,
                                             float& v, float* max_v) {
  if (c.maximize) g = -g;
  if (c.decoupled) {
    p = __fmul_rn(p, c.decay);  // _foreach_mul_(params, 1 - lr * weight_decay)
  } else if (c.l2) {
    g = __fmaf_rn(c.weight_decay, p, g);  // _foreach_add(grads, params, alpha=weight_decay)
  }
  // _foreach_lerp_(exp_avgs, grads, 1 - beta1), from the nearer end as ATen's lerp.
  const float diff = __fsub_rn(g, m);
  m = c.lerp_from_exp_avg ? __fmaf_rn(c.lerp_weight, diff, m)
                          : __fmaf_rn(c.lerp_weight_minus_one, diff, g);
  // _foreach_mul_(exp_avg_sqs, beta2); _foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
  v = __fmaf_rn(c.square_weight, __fmul_rn(g, g), __fmul_rn(v, c.beta2));
  float second_moment = v;
  if (max_v != nullptr) {
    *max_v = maximum(*max_v, v);
    second_moment = *max_v;
  }
  // sqrt, _foreach_div_ by sqrt(1 - beta2^step), _foreach_add_ eps, then
  // _foreach_addcdiv_(params, exp_avgs, denom, -step_size): param + s * (exp_avg / denom).
  const float denom =
      __fadd_rn(__fdiv_rn(__fsqrt_rn(second_moment), c.bias_correction2_sqrt), c.eps);
  p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), p);
}

__device__ __forceinline__ void sgd_element(const SgdConstants& c, float& p, float g, float* buf) {
  if (c.maximize) g = -g;
  if (c.l2) g = __fmaf_rn(c.weight_decay, p, g);  // _foreach_add(grads, params, alpha=wd)
  if (c.momentum) {
    // The first step clones the gradient; later ones _foreach_mul_(bufs, momentum) and
    // _foreach_add_(bufs, grads, alpha=1 - dampening).
    *buf = c.first_step ? g : __fmaf_rn(c.grad_weight, g, __fmul_rn(*buf, c.momentum_factor));
    g = c.nesterov ? __fmaf_rn(c.momentum_factor, *buf, g) : *buf;
  }
  p = __fmaf_rn(c.neg_lr, g, p);  // _foreach_add_(params, grads, alpha=-lr)
}

// The updated params in the weights' dtype.
template <typename weights_t, int V>
__device__ __forceinline__ mt::Vec<weights_t, V> cast_weights(const mt::Vec<float, V>& p) {
  mt::Vec<weights_t, V> w;
#pragma unroll
  for (int k = 0; k < V; ++k) w.val[k] = static_cast<weights_t>(p.val[k]);
  return w;
}

// V == 1 is the fallback for unaligned buffers; with V > 1 the first n / V * V elements go in
// vectors and the last n % V one per thread. weights_out may be nullptr (weights_t is then float).
template <typename grad_t, typename weights_t, int V>
__global__ void adam_kernel(AdamConstants c, float* __restrict__ param,
                            const grad_t* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, float* __restrict__ max_exp_avg_sq,
                            weights_t* __restrict__ weights_out, int64_t n) {
  using FloatVec = mt::Vec<float, V>;
  using GradVec = mt::Vec<grad_t, V>;
  using WeightsVec = mt::Vec<weights_t, V>;
  const int64_t num_vecs = n / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < num_vecs; i += stride) {
    FloatVec p = reinterpret_cast<const FloatVec*>(param)[i];
    const GradVec g = reinterpret_cast<const GradVec*>(grad)[i];
    FloatVec m = reinterpret_cast<const FloatVec*>(exp_avg)[i];
    FloatVec v = reinterpret_cast<const FloatVec*>(exp_avg_sq)[i];
    FloatVec max_v;
    if (max_exp_avg_sq != nullptr) max_v = reinterpret_cast<const FloatVec*>(max_exp_avg_sq)[i];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      adam_element(c, p.val[k], static_cast<float>(g.val[k]), m.val[k], v.val[k],
                   max_exp_avg_sq != nullptr ? &max_v.val[k] : nullptr);
    }
    reinterpret_cast<FloatVec*>(param)[i] = p;
    reinterpret_cast<FloatVec*>(exp_avg)[i] = m;
    reinterpret_cast<FloatVec*>(exp_avg_sq)[i] = v;
    if (max_exp_avg_sq != nullptr) reinterpret_cast<FloatVec*>(max_exp_avg_sq)[i] = max_v;
    if (weights_out != nullptr) {
      reinterpret_cast<WeightsVec*>(weights_out)[i] = cast_weights<weights_t>(p);
    }
  }
  for (int64_t i = num_vecs * V + first; i < n; i += stride) {
    adam_element(c, param[i], static_cast<float>(grad[i]), exp_avg[i], exp_avg_sq[i],
                 max_exp_avg_sq != nullptr ? &max_exp_avg_sq[i] : nullptr);
    if (weights_out != nullptr) weights_out[i] = static_cast<weights_t>(param[i]);
  }
}

template <typename grad_t, typename weights_t, int V>
__global__ void sgd_kernel(SgdConstants c, float* __restrict__ param,
                           const grad_t* __restrict__ grad, float* __restrict__ momentum_buffer,
                           weights_t* __restrict__ weights_out, int64_t n) {
  using FloatVec = mt::Vec<float, V>;
  using GradVec = mt::Vec<grad_t, V>;
  using WeightsVec = mt::Vec<weights_t, V>;
  const int64_t num_vecs = n / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < num_vecs; i += stride) {
    FloatVec p = reinterpret_cast<const FloatVec*>(param)[i];
    const GradVec g = reinterpret_cast<const GradVec*>(grad)[i];
    FloatVec buf;
    // A first step overwrites the buffer without reading it.
    if (c.momentum && !c.first_step) buf = reinterpret_cast<const FloatVec*>(momentum_buffer)[i];
#pragma unroll
    for (int k = 0; k < V; ++k) sgd_element(c, p.val[k], static_cast<float>(g.val[k]), &buf.val[k]);
    reinterpret_cast<FloatVec*>(param)[i] = p;
    if (c.momentum) reinterpret_cast<FloatVec*>(momentum_buffer)[i] = buf;
    if (weights_out != nullptr) {
      reinterpret_cast<WeightsVec*>(weights_out)[i] = cast_weights<weights_t>(p);
    }
  }
  for (int64_t i = num_vecs * V + first; i < n; i += stride) {
    sgd_element(c, param[i], static_cast<float>(grad[i]),
                c.momentum ? &momentum_buffer[i] : nullptr);
    if (weights_out != nullptr) weights_out[i] = static_cast<weights_t>(param[i]);
  }
}

bool is_aligned(const void* ptr, size_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

// Whether a buffer (nullptr: absent) allows V-element vector accesses.
template <typename T>
bool vector_aligned(const T* buffer) {
  return buffer == nullptr || is_aligned(buffer, sizeof(T) * kVecElements);
}

// Whether the gradient, weights_out and every fp32 buffer allow V-element vector accesses.
template <typename grad_t, typename weights_t>
bool vectorisable(const grad_t* grad, const weights_t* weights_out,
                  std::initializer_list<const float*> buffers) {
  if (!vector_aligned(grad) || !vector_aligned(weights_out)) return false;
  for (const float* buffer : buffers) {
    if (!vector_aligned(buffer)) return false;
  }
  return true;
}

// Calls f with weights_out's data pointer, typed by its dtype, or a null float pointer without it.
template <typename F>
void with_weights_out(const std::optional<at::Tensor>& weights_out, const F& f) {
  const at::ScalarType dtype = weights_out ? weights_out->scalar_type() : at::kFloat;
  AT_DISPATCH_V2(dtype, "weights_out", AT_WRAP([&] {
    f(weights_out ? weights_out->mutable_data_ptr<scalar_t>() : static_cast<scalar_t*>(nullptr));
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// Enough blocks to fill every SM once (the grid-stride loop covers the rest), at least one.
unsigned int grid_size(int64_t work_items) {
  const int device = c10::cuda::current_device();
  int sm_count = 0;
  int threads_per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  const int64_t max_blocks =
      static_cast<int64_t>(sm_count) * std::max(1, threads_per_sm / kThreads);
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(wanted, max_blocks)));
}

void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t step, bool decoupled_weight_decay, bool amsgrad, bool maximize,
                    const std::optional<at::Tensor>& weights_out) {
  const AdamConstants c =
      check_adam_args(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps,
                      weight_decay, step, decoupled_weight_decay, amsgrad, maximize, weights_out);
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* p = param.mutable_data_ptr<float>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  float* max_v = amsgrad ? max_exp_avg_sq->mutable_data_ptr<float>() : nullptr;
  AT_DISPATCH_V2(grad.scalar_type(), "adam_step_", AT_WRAP([&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    with_weights_out(weights_out, [&](auto* w) {
      using weights_t = std::remove_pointer_t<decltype(w)>;
      if (vectorisable(g, w, {p, m, v, max_v})) {
        adam_kernel<scalar_t, weights_t, kVecElements>
            <<<grid_size(n / kVecElements), kThreads, 0, stream>>>(c, p, g, m, v, max_v, w, n);
      } else {
        adam_kernel<scalar_t, weights_t, 1>
            <<<grid_size(n), kThreads, 0, stream>>>(c, p, g, m, v, max_v, w, n);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

void sgd_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                   const std::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool maximize,
                   bool first_step, const std::optional<at::Tensor>& weights_out) {
  const SgdConstants c = check_sgd_args(param, grad, momentum_buffer, lr, momentum, dampening,
                                        weight_decay, nesterov, maximize, first_step, weights_out);
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* p = param.mutable_data_ptr<float>();
  float* buf = c.momentum ? momentum_buffer->mutable_data_ptr<float>() : nullptr;
  AT_DISPATCH_V2(grad.scalar_type(), "sgd_step_", AT_WRAP([&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    with_weights_out(weights_out, [&](auto* w) {
      using weights_t = std::remove_pointer_t<decltype(w)>;
      if (vectorisable(g, w, {p, buf})) {
        sgd_kernel<scalar_t, weights_t, kVecElements>
            <<<grid_size(n / kVecElements), kThreads, 0, stream>>>(c, p, g, buf, w, n);
      } else {
        sgd_kernel<scalar_t, weights_t, 1>
            <<<grid_size(n), kThreads, 0, stream>>>(c, p, g, buf, w, n);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace
}  // namespace megatron_fsdp

TORCH_LIBRARY_IMPL(megatron_fsdp, CUDA, m) {
  m.impl("adam_step_", &megatron_fsdp::adam_step_cuda);
  m.impl("sgd_step_", &megatron_fsdp::sgd_step_cuda);
}
