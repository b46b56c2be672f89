// The element loops of adam_step_ and sgd_step_ on the host, over at::vec::Vectorized<float>.
// Like ATen's own CPU kernels they are compiled once per CPU capability: optimizer_step.cpp
// includes this file for the default capability, optimizer_step_avx2.cpp for AVX2, where
// at::vec::fmadd is one fused instruction as in ATen's AVX2 and AVX512 kernels. The loops have
// internal linkage, so the copies never meet; the entry points below are what each file exports.
//
// Each element goes through torch.optim's single-tensor update operation by operation, rounded
// to fp32 where ATen's vectorised CPU kernels round. A task's last partial vector runs the same
// vector code on zero padding (never stored), so results do not depend on where tasks split.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/optimizer_constants.h"

// GCC builds the AVX2 loops under a target pragma; other compilers build the default ones only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGATRON_FSDP_AVX2_LOOPS 1
#else
#define MEGATRON_FSDP_AVX2_LOOPS 0
#endif

namespace megatron_fsdp {

struct AdamBuffers {
  float* param;
  const void* grad;
  c10::ScalarType grad_dtype;  // Float, BFloat16 or Half
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr without amsgrad
};

struct SgdBuffers {
  float* param;
  const void* grad;
  c10::ScalarType grad_dtype;  // Float, BFloat16 or Half
  float* momentum_buffer;      // nullptr without momentum
};

// Update elements [begin, end) of the buffers.
void adam_range_default(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end);
void sgd_range_default(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end);
#if MEGATRON_FSDP_AVX2_LOOPS
void adam_range_avx2(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end);
void sgd_range_avx2(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end);
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();

inline Vec load(const float* data, int64_t count) {
  return count == kVecSize ? Vec::loadu(data) : Vec::loadu(data, count);
}

inline void store(float* data, const Vec& value, int64_t count) {
  if (count == kVecSize) {
    value.store(data);
  } else {
    value.store(data, static_cast<int>(count));
  }
}

// A low-precision gradient is upcast to fp32 first (exactly), as torch.optim sees it when handed
// the upcast gradient.
template <typename grad_t>
Vec load_grad(const grad_t* grad, int64_t count) {
  if constexpr (std::is_same_v<grad_t, float>) {
    return load(grad, count);
  } else if (count == kVecSize) {
    Vec out;
    at::vec::load_to_float(grad, out);
    return out;
  } else {
    // A reduced-precision vector holds twice as many elements as a float one: the first half.
    return std::get<0>(
        at::vec::convert_to_float<grad_t>(at::vec::Vectorized<grad_t>::loadu(grad, count)));
  }
}

template <typename grad_t>
void adam_loop(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  const grad_t* grad = static_cast<const grad_t*>(b.grad);
  const Vec weight_decay(c.weight_decay), decay(c.decay), lerp_weight(c.lerp_weight),
      lerp_weight_minus_one(c.lerp_weight_minus_one), beta2(c.beta2),
      square_weight(c.square_weight), neg_step_size(c.neg_step_size),
      bias_correction2_sqrt(c.bias_correction2_sqrt), eps(c.eps);
  for (int64_t i = begin; i < end; i += kVecSize) {
    const int64_t count = std::min(kVecSize, end - i);
    Vec g = load_grad(grad + i, count);
    if (c.maximize) g = g.neg();
    Vec p = load(b.param + i, count);
    if (c.decoupled) {
      p = p * decay;
    } else if (c.l2) {
      g = at::vec::fmadd(p, weight_decay, g);  // grad.add(param, alpha=weight_decay)
    }
    // exp_avg.lerp_(grad, 1 - beta1): ATen's vectorised lerp, one fmadd from the nearer end.
    Vec m = load(b.exp_avg + i, count);
    const Vec diff = g - m;
    m = c.lerp_from_exp_avg ? at::vec::fmadd(lerp_weight, diff, m)
                            : at::vec::fmadd(lerp_weight_minus_one, diff, g);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    Vec v = load(b.exp_avg_sq + i, count) * beta2;
    v = at::vec::fmadd(square_weight * g, g, v);
    Vec second_moment = v;
    if (b.max_exp_avg_sq != nullptr) {
      // torch.maximum: a NaN in either wins.
      second_moment = at::vec::maximum(load(b.max_exp_avg_sq + i, count), v);
      store(b.max_exp_avg_sq + i, second_moment, count);
    }
    const Vec denom = second_moment.sqrt() / bias_correction2_sqrt + eps;
    p = p + neg_step_size * m / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
    store(b.param + i, p, count);
    store(b.exp_avg + i, m, count);
    store(b.exp_avg_sq + i, v, count);
  }
}

template <typename grad_t>
void sgd_loop(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  const grad_t* grad = static_cast<const grad_t*>(b.grad);
  const Vec weight_decay(c.weight_decay), momentum(c.momentum_factor), grad_weight(c.grad_weight),
      neg_lr(c.neg_lr);
  for (int64_t i = begin; i < end; i += kVecSize) {
    const int64_t count = std::min(kVecSize, end - i);
    Vec g = load_grad(grad + i, count);
    if (c.maximize) g = g.neg();
    Vec p = load(b.param + i, count);
    if (c.l2) g = at::vec::fmadd(p, weight_decay, g);  // grad.add(param, alpha=weight_decay)
    if (c.momentum) {
      // The first step copies the gradient; later ones buf.mul_(momentum).add_(grad,
      // alpha=1 - dampening).
      const Vec buf = c.first_step ? g
                                   : at::vec::fmadd(g, grad_weight,
                                                    load(b.momentum_buffer + i, count) * momentum);
      store(b.momentum_buffer + i, buf, count);
      g = c.nesterov ? at::vec::fmadd(buf, momentum, g) : buf;  // grad.add(buf, alpha=momentum)
    }
    p = at::vec::fmadd(g, neg_lr, p);  // param.add_(grad, alpha=-lr)
    store(b.param + i, p, count);
  }
}

// The op has checked that grad_dtype is one of the three.
inline void adam_range(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case c10::ScalarType::BFloat16:
      return adam_loop<c10::BFloat16>(c, b, begin, end);
    case c10::ScalarType::Half:
      return adam_loop<c10::Half>(c, b, begin, end);
    default:
      return adam_loop<float>(c, b, begin, end);
  }
}

inline void sgd_range(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case c10::ScalarType::BFloat16:
      return sgd_loop<c10::BFloat16>(c, b, begin, end);
    case c10::ScalarType::Half:
      return sgd_loop<c10::Half>(c, b, begin, end);
    default:
      return sgd_loop<float>(c, b, begin, end);
  }
}

}  // namespace
}  // namespace megatron_fsdp
