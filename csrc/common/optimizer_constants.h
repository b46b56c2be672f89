// The fp32 constants of one optimizer step (adam_step_, sgd_step_), as the kernels read them.
// Plain data with no ATen includes, so that every kernel (CPU capabilities, CUDA) can include it.
#pragma once

namespace megatron_fsdp {

struct AdamConstants {
  bool maximize;
  bool l2;                    // Adam's weight decay: grad += weight_decay * param
  bool decoupled;             // AdamW's weight decay: param *= 1 - lr * weight_decay
  float weight_decay;
  float decay;                // 1 - lr * weight_decay
  // exp_avg.lerp_(grad, 1 - beta1). ATen's lerp is exp_avg + w * (grad - exp_avg) for |w| < 0.5,
  // grad - (1 - w) * (grad - exp_avg) otherwise; both forms are kept to round like it.
  float lerp_weight;          // w = 1 - beta1
  float lerp_weight_minus_one;  // w - 1 (exact for w >= 0.5, the only case it is used in)
  bool lerp_from_exp_avg;     // |w| < 0.5
  float beta2;
  float square_weight;        // 1 - beta2
  float neg_step_size;        // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // (1 - beta2^step)^0.5
  float eps;
};

struct SgdConstants {
  bool maximize;
  bool l2;                    // grad += weight_decay * param
  float weight_decay;
  bool momentum;              // a momentum buffer is updated (momentum != 0)
  bool first_step;            // the buffer starts as the gradient
  bool nesterov;
  float momentum_factor;      // momentum
  float grad_weight;          // 1 - dampening
  float neg_lr;               // -lr
};

}  // namespace megatron_fsdp
