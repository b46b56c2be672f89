// The element loops of adam_step_ and sgd_step_ on the host, over at::vec::Vectorized<float>.
// Like ATen's own CPU kernels they are compiled once per CPU capability: optimizer_step.cpp
// includes this file for the default capability, optimizer_step_avx2.cpp for AVX2, where
// at::vec::fmadd is one fused instruction as in ATen's AVX2 and AVX512 kernels. The loops have
// internal linkage, so the copies never meet; the entry points below are what each file exports.
//
// Each element goes through torch.optim's single-tensor update operation by operation, rounded
// to fp32 where ATen's vectorised CPU kernels round. A task's last partial vector runs the same
// vector code on zero padding (never stored), so results do not depend on where tasks split.
// Given weights_out, each updated param vector is also stored there, cast by at::vec's conversion
// (round to nearest even, as Tensor.to's CPU kernel): one pass instead of a second cast.
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
  void* weights_out;      // nullptr without weights_out
  c10::ScalarType weights_dtype;  // Float, BFloat16 or Half (Float without weights_out)
};

struct SgdBuffers {
  float* param;
  const void* grad;
  c10::ScalarType grad_dtype;  // Float, BFloat16 or Half
  float* momentum_buffer;      // nullptr without momentum
  void* weights_out;           // nullptr without weights_out
  c10::ScalarType weights_dtype;  // Float, BFloat16 or Half (Float without weights_out)
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

// The updated param in the weights' dtype. Inlined: a call per vector costs more than the cast.
template <typename weights_t>
C10_ALWAYS_INLINE void store_weights(weights_t* data, const Vec& value, int64_t count) {
  if constexpr (std::is_same_v<weights_t, float>) {
    store(data, value, count);
  } else {
    // value fills the first half of a reduced-precision vector. A constant count lets the
    // compiler store that half directly instead of through a buffer and memcpy.
    const at::vec::Vectorized<weights_t> cast = at::vec::convert<weights_t>(value);
    if (count == kVecSize) {
      cast.store(data, kVecSize);
    } else {
      cast.store(data, static_cast<int>(count));
    }
  }
}

template <typename grad_t, typename weights_t>
void adam_loop(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  const grad_t* grad = static_cast<const grad_t*>(b.grad);
  weights_t* weights_out = static_cast<weights_t*>(b.weights_out);
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
    if (weights_out != nullptr) store_weights(weights_out + i, p, count);
    store(b.exp_avg + i, m, count);
    store(b.exp_avg_sq + i, v, count);
  }
}

template <typename grad_t, typename weights_t>
void sgd_loop(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  const grad_t* grad = static_cast<const grad_t*>(b.grad);
  weights_t* weights_out = static_cast<weights_t*>(b.weights_out);
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
    if (weights_out != nullptr) store_weights(weights_out + i, p, count);
  }
}

// Calls f with a value of the element type of dtype, one of the three a step reads or writes
// besides its fp32 buffers (the op has checked that).
template <typename F>
void with_element_type(c10::ScalarType dtype, const F& f) {
  switch (dtype) {
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    case c10::ScalarType::Half:
      return f(c10::Half{});
    default:
      return f(float{});
  }
}

inline void adam_range(const AdamConstants& c, const AdamBuffers& b, int64_t begin, int64_t end) {
  with_element_type(b.grad_dtype, [&](auto grad) {
    with_element_type(b.weights_dtype, [&](auto weights) {
      adam_loop<decltype(grad), decltype(weights)>(c, b, begin, end);
    });
  });
}

inline void sgd_range(const SgdConstants& c, const SgdBuffers& b, int64_t begin, int64_t end) {
  with_element_type(b.grad_dtype, [&](auto grad) {
    with_element_type(b.weights_dtype, [&](auto weights) {
      sgd_loop<decltype(grad), decltype(weights)>(c, b, begin, end);
    });
  });
}

}  // namespace
}  // namespace megatron_fsdp
