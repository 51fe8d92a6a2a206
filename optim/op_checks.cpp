#include "op_checks.h"

namespace optstate::optim {
namespace {

// The backend's device rule for one tensor of list `what`, index i.
void check_device(OpBackend backend, const at::Tensor& t, const at::Tensor& first, const char* op, const char* what,
                  size_t i) {
  if (backend == OpBackend::kCpu) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", what, " ", i, " is on ", t.device(),
                "; all tensors must be on the CPU (or all on one GPU in a CUDA build)");
  } else {
    TORCH_CHECK(t.is_cuda() && t.device() == first.device(), op, ": ", what, " ", i, " is on ", t.device(),
                "; all tensors, step counters included, must be on ", first.device());
  }
}

// `any_dense_layout`: the param may lie in any dense, non-overlapping layout (channels_last, a
// transpose) that its grad and state share: an elementwise update over storage order is then the
// update in logical order (the dense AdamW step). Otherwise every tensor is C-contiguous (8-bit
// blocks follow logical order).
void check_param_grad_step(OpBackend backend, const at::Tensor& p, const at::Tensor& g, const at::Tensor& step,
                           const at::Tensor& first, const char* op, size_t i, bool any_dense_layout = false) {
  check_device(backend, p, first, op, "param", i);
  check_device(backend, g, first, op, "grad", i);
  check_device(backend, step, first, op, "step", i);
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16, op,
              ": params must be float32 or bfloat16, got ", p.scalar_type(), " (param ", i, ")");
  // The kernels take flat tensors in logical order (the optimizers step other layouts through a
  // contiguous working copy).
  if (any_dense_layout) {
    TORCH_CHECK(p.is_non_overlapping_and_dense(), op, ": param ", i, " is neither contiguous nor dense (strides ",
                p.strides(), ")");
    TORCH_CHECK(g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes() && g.strides() == p.strides(), op,
                ": grad ", i, " must be a ", p.scalar_type(), " tensor of its param's shape ", p.sizes(), " and strides ",
                p.strides());
  } else {
    TORCH_CHECK(p.is_contiguous(), op, ": param ", i, " is not contiguous (strides ", p.strides(), ")");
    TORCH_CHECK(g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes() && g.is_contiguous(), op, ": grad ", i,
                " must be a contiguous ", p.scalar_type(), " tensor of its param's shape ", p.sizes());
  }
  TORCH_CHECK(step.numel() == 1 && step.scalar_type() == at::kFloat, op, ": step ", i,
              " must be a float32 scalar tensor");
}

// `like`: the param whose strides a dense moment shares (check_param_grad_step's any_dense_layout).
void check_state(OpBackend backend, const at::Tensor& t, const at::Tensor& first, bool codes, int64_t numel,
                 const char* op, const char* what, size_t i, const at::Tensor* like = nullptr) {
  check_device(backend, t, first, op, what, i);
  if (like && !like->is_contiguous()) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == like->sizes() && t.strides() == like->strides(), op, ": ",
                what, " ", i, " must be float32 with its param's shape ", like->sizes(), " and strides ",
                like->strides());
    return;
  }
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel && t.scalar_type() == (codes ? at::kByte : at::kFloat), op,
              ": ", what, " ", i, " must be contiguous ", codes ? "uint8" : "float32", " with ", numel, " elements");
}

}  // namespace

void check_lr(OpBackend backend, const LrArg& lr, const at::Tensor& first_param, const char* op) {
  if (!lr.tensor.defined()) return;
  const at::Tensor& t = lr.tensor;
  TORCH_CHECK(t.numel() == 1, op, ": a tensor lr must have one element, got ", t.numel());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op,
              ": a tensor lr must be float32 or float64, got ", t.scalar_type());
  const bool on_cpu = t.device().is_cpu();
  if (backend == OpBackend::kCpu) {
    TORCH_CHECK(on_cpu, op, ": the tensor lr is on ", t.device(), "; CPU params need it on the CPU");
  } else {
    TORCH_CHECK(on_cpu || t.device() == first_param.device(), op, ": the tensor lr is on ", t.device(),
                "; it must be on the CPU or on the params' device ", first_param.device());
  }
}

double lr_value(const LrArg& lr) { return lr.tensor.defined() ? lr.tensor.item<double>() : lr.value; }

void check_fused_adamw_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                            bool amsgrad) {
  const char* op = "optstate.fused_adamw_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n, op,
              ": tensor lists differ in length");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, op, ": amsgrad needs max_exp_avg_sqs");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_param_grad_step(backend, p, grads[i], steps[i], params[0], op, i, /*any_dense_layout=*/true);
    check_state(backend, exp_avgs[i], params[0], false, p.numel(), op, "exp_avg", i, &p);
    check_state(backend, exp_avg_sqs[i], params[0], false, p.numel(), op, "exp_avg_sq", i, &p);
    if (amsgrad) check_state(backend, max_exp_avg_sqs[i], params[0], false, p.numel(), op, "max_exp_avg_sq", i, &p);
  }
}

void check_adamw8bit_args(OpBackend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax,
                          at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax, at::TensorList steps,
                          at::IntArrayRef block_sizes, bool amsgrad) {
  const char* op = "optstate.adamw8bit_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  block_sizes.size() == n && exp_avg_absmax.size() == n && exp_avg_sq_absmax.size() == n,
              op, ": lists differ in length");
  TORCH_CHECK(!amsgrad || (max_exp_avg_sqs.size() == n && max_exp_avg_sq_absmax.size() == n), op,
              ": amsgrad needs max_exp_avg_sq lists");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_param_grad_step(backend, p, grads[i], steps[i], params[0], op, i);
    const int64_t block = block_sizes[i], numel = p.numel();
    TORCH_CHECK(block >= 0 && block <= (1 << 20), op, ": bad block size ", block, " (param ", i, ")");
    const int64_t nblocks = block > 0 ? (numel + block - 1) / block : 0;
    check_state(backend, exp_avgs[i], params[0], block > 0, numel, op, "exp_avg", i);
    check_state(backend, exp_avg_sqs[i], params[0], block > 0, numel, op, "exp_avg_sq", i);
    if (amsgrad) check_state(backend, max_exp_avg_sqs[i], params[0], block > 0, numel, op, "max_exp_avg_sq", i);
    if (block > 0) {
      check_state(backend, exp_avg_absmax[i], params[0], false, nblocks, op, "exp_avg_absmax", i);
      check_state(backend, exp_avg_sq_absmax[i], params[0], false, nblocks, op, "exp_avg_sq_absmax", i);
      if (amsgrad)
        check_state(backend, max_exp_avg_sq_absmax[i], params[0], false, nblocks, op, "max_exp_avg_sq_absmax", i);
    }
  }
}

}  // namespace optstate::optim
