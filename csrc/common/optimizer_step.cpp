#include "optimizer_step.h"

#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <vector>

namespace megatron_fsdp {
namespace {

// Every buffer of a step: a flat buffer with param's elements on param's device.
void check_buffer(const char* op, const char* name, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.device() == param.device(), op, ": ", name, " is on ", t.device(),
              " but param is on ", param.device(),
              "; every buffer of a step must be on one device");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D tensor (a flat buffer), got shape ", t.sizes(),
              " and strides ", t.strides(), "; pass a contiguous tensor's .view(-1)");
  TORCH_CHECK(t.numel() == param.numel(), op, ": ", name, " has ", t.numel(),
              " elements but param has ", param.numel(),
              "; every buffer must cover the same elements");
}

void check_state(const char* op, const char* name, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32 like param, got ",
              t.scalar_type());
  check_buffer(op, name, t, param);
}

void check_param_and_grad(const char* op, const at::Tensor& param, const at::Tensor& grad) {
  TORCH_CHECK(param.scalar_type() == at::kFloat, op,
              ": param must be float32 (the fp32 main weights), got ", param.scalar_type());
  check_buffer(op, "param", param, param);
  const at::ScalarType g = grad.scalar_type();
  TORCH_CHECK(g == at::kFloat || g == at::kBFloat16 || g == at::kHalf, op,
              ": grad must be float32, bfloat16 or float16, got ", g);
  check_buffer(op, "grad", grad, param);
}

// The kernels read and write each element once, in place: no two buffers may share memory.
void check_no_overlap(const std::vector<at::Tensor>& buffers) {
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (size_t j = i + 1; j < buffers.size(); ++j) at::assert_no_overlap(buffers[i], buffers[j]);
  }
}

// The updated param written again, cast: in a dtype the compute weights come in.
void check_weights_out(const char* op, const at::Tensor& weights_out, const at::Tensor& param) {
  const at::ScalarType w = weights_out.scalar_type();
  TORCH_CHECK(w == at::kFloat || w == at::kBFloat16 || w == at::kHalf, op,
              ": weights_out must be float32, bfloat16 or float16 (the dtype the updated param is "
              "written in), got ",
              w);
  check_buffer(op, "weights_out", weights_out, param);
}

// `!(x >= 0)` also refuses NaN.
void check_non_negative(const char* op, const char* name, double value) {
  TORCH_CHECK(value >= 0, op, ": ", name, " must be >= 0, got ", value);
}

}  // namespace

AdamConstants check_adam_args(const at::Tensor& param, const at::Tensor& grad,
                              const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                              const std::optional<at::Tensor>& max_exp_avg_sq, double lr,
                              double beta1, double beta2, double eps, double weight_decay,
                              int64_t step, bool decoupled_weight_decay, bool amsgrad,
                              bool maximize, const std::optional<at::Tensor>& weights_out) {
  constexpr const char* op = "adam_step_";
  check_param_and_grad(op, param, grad);
  check_state(op, "exp_avg", exp_avg, param);
  check_state(op, "exp_avg_sq", exp_avg_sq, param);
  if (amsgrad) {
    TORCH_CHECK(max_exp_avg_sq.has_value(), op,
                ": amsgrad=True needs max_exp_avg_sq, a float32 buffer like exp_avg_sq that "
                "starts at zero");
    check_state(op, "max_exp_avg_sq", *max_exp_avg_sq, param);
  } else {
    TORCH_CHECK(!max_exp_avg_sq.has_value(), op,
                ": max_exp_avg_sq is only read with amsgrad=True; pass None or set amsgrad=True");
  }
  if (weights_out.has_value()) check_weights_out(op, *weights_out, param);
  std::vector<at::Tensor> buffers{param, grad, exp_avg, exp_avg_sq};
  if (amsgrad) buffers.push_back(*max_exp_avg_sq);
  if (weights_out.has_value()) buffers.push_back(*weights_out);
  check_no_overlap(buffers);
  // torch.optim.Adam's own rules for its hyperparameters.
  check_non_negative(op, "lr", lr);
  check_non_negative(op, "eps", eps);
  check_non_negative(op, "weight_decay", weight_decay);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(step >= 1, op,
              ": step must be >= 1 (the step count including this step, as torch.optim.Adam's "
              "state['step'] after its increment), got ",
              step);

  AdamConstants c{};
  c.maximize = maximize;
  c.l2 = weight_decay != 0 && !decoupled_weight_decay;
  c.decoupled = weight_decay != 0 && decoupled_weight_decay;
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.lerp_weight_minus_one = c.lerp_weight - 1.0f;
  c.lerp_from_exp_avg = std::abs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(beta2);
  c.square_weight = static_cast<float>(1.0 - beta2);
  // torch.optim passes state['step'] as a float to Python's `**`, i.e. pow(double, double); and
  // takes the square root as `** 0.5`, so pow here too.
  const double steps = static_cast<double>(step);
  c.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, steps))));
  c.bias_correction2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, steps), 0.5));
  c.eps = static_cast<float>(eps);
  return c;
}

SgdConstants check_sgd_args(const at::Tensor& param, const at::Tensor& grad,
                            const std::optional<at::Tensor>& momentum_buffer, double lr,
                            double momentum, double dampening, double weight_decay, bool nesterov,
                            bool maximize, bool first_step,
                            const std::optional<at::Tensor>& weights_out) {
  constexpr const char* op = "sgd_step_";
  check_param_and_grad(op, param, grad);
  // torch.optim.SGD's own rules for its hyperparameters.
  check_non_negative(op, "lr", lr);
  check_non_negative(op, "momentum", momentum);
  check_non_negative(op, "weight_decay", weight_decay);
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), op,
              ": nesterov=True needs momentum > 0 and dampening == 0, got momentum ", momentum,
              " and dampening ", dampening);
  std::vector<at::Tensor> buffers{param, grad};
  if (momentum != 0) {
    TORCH_CHECK(momentum_buffer.has_value(), op, ": momentum=", momentum,
                " needs momentum_buffer, a float32 buffer like param (any contents when "
                "first_step=True)");
    check_state(op, "momentum_buffer", *momentum_buffer, param);
    buffers.push_back(*momentum_buffer);
  } else {
    TORCH_CHECK(!momentum_buffer.has_value(), op,
                ": momentum_buffer is only used with momentum != 0; pass None or set momentum");
  }
  if (weights_out.has_value()) {
    check_weights_out(op, *weights_out, param);
    buffers.push_back(*weights_out);
  }
  check_no_overlap(buffers);

  SgdConstants c{};
  c.maximize = maximize;
  c.l2 = weight_decay != 0;
  c.weight_decay = static_cast<float>(weight_decay);
  c.momentum = momentum != 0;
  c.first_step = first_step;
  c.nesterov = nesterov;
  c.momentum_factor = static_cast<float>(momentum);
  c.grad_weight = static_cast<float>(1.0 - dampening);
  c.neg_lr = static_cast<float>(-lr);
  return c;
}

}  // namespace megatron_fsdp
