// XLA FFI handlers "jax_moe_publish" (one call of the MoE finalize and its TP
// reduction) and "jax_moe_publish_rmsnorm" (the same, with the residual add +
// RMSNorm epilogue fused into the reduce). They check the call against its
// kernel set and this device's mailbox, then launch the set's kernels in order
// on XLA's stream, each with the values its sidecar names (launch_values.h).
//
// It is command-buffer compatible: execute reads only host state registered
// before the first call and launches, with no allocation, synchronisation or
// host read of device memory, so a CUDA graph capture records just the
// kernels. Per-call progress lives in device memory (the stage words), never in
// a host value that a captured graph would freeze.

#include "moe_publish_handler.h"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "cuda_driver.h"
#include "launch_values.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe_publish {
namespace {

std::atomic<uint64_t> captured_executes{0};
std::atomic<uint64_t> direct_executes{0};

ffi::Error FailedPrecondition(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
}

// Checks that `buffer` is dtype[rows, cols]; rows < 0 accepts any row count.
// `rule` says where the expected shape comes from.
ffi::Error CheckMatrix(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                       int64_t rows, int64_t cols, const char* rule, int64_t kernel_set_id) {
  ffi::AnyBuffer::Dimensions dims = buffer.dimensions();
  if (buffer.element_type() == dtype && dims.size() == 2 && (rows < 0 || dims[0] == rows) &&
      dims[1] == cols) {
    return ffi::Error::Success();
  }
  std::ostringstream message;
  message << name << ": got " << buffer.element_type() << "[";
  for (size_t i = 0; i < dims.size(); ++i) message << (i ? ", " : "") << dims[i];
  message << "], expected " << dtype << "[";
  if (rows < 0) {
    message << "num_rows";
  } else {
    message << rows;
  }
  message << ", " << cols << "] (" << rule << " of kernel set " << kernel_set_id << ")";
  return ffi::Error::InvalidArgument(message.str());
}

// Checks that `buffer` is bf16[cols] (norm_weight).
ffi::Error CheckVector(const char* name, const ffi::AnyBuffer& buffer, int64_t cols,
                       int64_t kernel_set_id) {
  ffi::AnyBuffer::Dimensions dims = buffer.dimensions();
  if (buffer.element_type() == ffi::DataType::BF16 && dims.size() == 1 && dims[0] == cols) {
    return ffi::Error::Success();
  }
  std::ostringstream message;
  message << name << ": got " << buffer.element_type() << "[";
  for (size_t i = 0; i < dims.size(); ++i) message << (i ? ", " : "") << dims[i];
  message << "], expected " << ffi::DataType::BF16 << "[" << cols << "] (hidden of kernel set "
          << kernel_set_id << ")";
  return ffi::Error::InvalidArgument(message.str());
}

// The operands of the epilogue: given exactly when the target is jax_moe_publish_rmsnorm.
struct NormOperands {
  ffi::AnyBuffer residual;
  ffi::AnyBuffer norm_weight;
  ffi::AnyBuffer residual_out;
  float eps;
};

ffi::Error Launch(const CudaDriver& cuda, CUstream stream, const Kernel& kernel, bool pdl,
                  int64_t rows, ValueSlot* values) {
  void* params[kValueCount];
  for (size_t i = 0; i < kernel.params.size(); ++i) {
    params[i] = &values[static_cast<size_t>(kernel.params[i])];
  }
  CUlaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (pdl) {
    // Lets the kernel start while its predecessor (XLA's, or ours) finishes; the
    // kernels order their reads with griddepcontrol.wait.
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[count].value.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (kernel.cluster > 1) attributes[count++] = ClusterDimension(kernel.cluster);
  // A persistent grid covers its rows in `waves` passes, and its CTAs wait on each other's
  // peers, so all must run at once. (Both limits are whole numbers of clusters.)
  int64_t ctas = (rows + kernel.waves - 1) / kernel.waves * kernel.ctas_per_row;
  if (kernel.persistent) ctas = std::min(ctas, kernel.max_resident_ctas);
  CUlaunchConfig config = LaunchConfig(kernel, static_cast<unsigned>(ctas));
  config.hStream = stream;  // The launch runs in the stream's context.
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = count;
  CUresult result = cuda.LaunchKernelEx(&config, kernel.function, params, nullptr);
  if (result != CUDA_SUCCESS) {
    const std::string call = "cuLaunchKernelEx(" + kernel.role + ")";
    return ffi::Error::Internal(CudaErrorMessage(cuda, call.c_str(), result));
  }
  return ffi::Error::Success();
}

uint64_t Address(const ffi::AnyBuffer& buffer) {
  return reinterpret_cast<uintptr_t>(buffer.untyped_data());
}

// One call of either target; `norm` is null for jax_moe_publish.
ffi::Error MoePublishCall(CUstream stream, int32_t device, const ffi::AnyBuffer& routed,
                          const ffi::AnyBuffer& weights, const ffi::AnyBuffer& indices,
                          const ffi::AnyBuffer& shared, const ffi::AnyBuffer& out,
                          int64_t kernel_set_id, int64_t mailbox_id, const NormOperands* norm) {
  const Registry& registry = Registry::Get();
  const KernelSet* set = registry.FindKernelSet(kernel_set_id, device);
  if (set == nullptr) {
    return FailedPrecondition("kernel set " + std::to_string(kernel_set_id) +
                              " is not loaded on device " + std::to_string(device) +
                              ": load_kernel_set must be called for this device before the "
                              "first call");
  }
  if (set->epilogue != (norm != nullptr)) {
    return ffi::Error::InvalidArgument(
        "kernel set " + std::to_string(kernel_set_id) +
        (set->epilogue ? " has the epilogue" : " has no epilogue") + ": call it through target " +
        (set->epilogue ? "jax_moe_publish_rmsnorm" : "jax_moe_publish"));
  }

  MailboxDevice mailbox;  // Stays zero for a set without a mailbox (tp = 1).
  if (!set->uses_mailbox) {
    if (mailbox_id != 0) {
      return ffi::Error::InvalidArgument("mailbox_id=" + std::to_string(mailbox_id) +
                                         ": expected 0, kernel set " +
                                         std::to_string(kernel_set_id) + " uses no mailbox");
    }
  } else {
    switch (registry.FindMailbox(mailbox_id, device, &mailbox)) {
      case MailboxState::kClosed:
        return FailedPrecondition("mailbox " + std::to_string(mailbox_id) +
                                  " is closed: its memory may be freed, so calls on it are "
                                  "refused; use a new Mailbox");
      case MailboxState::kUnregistered:
        return FailedPrecondition("mailbox " + std::to_string(mailbox_id) +
                                  " is not registered on device " + std::to_string(device) +
                                  ": register_mailbox_device must be called for this device "
                                  "before the first call");
      case MailboxState::kRegistered:
        break;
    }
  }

  // weights fixes m; every other argument is checked against it.
  const ffi::DataType weights_dtype = set->fp32_weights ? ffi::DataType::F32 : ffi::DataType::BF16;
  if (ffi::Error error = CheckMatrix("weights", weights, weights_dtype, -1, set->top_k,
                                     "dtype from the set's weights, top_k", kernel_set_id);
      error.failure()) {
    return error;
  }
  const int64_t m = weights.dimensions()[0];
  if (m < 1) {
    return ffi::Error::InvalidArgument("weights: m=" + std::to_string(m) +
                                       " rows, expected m >= 1");
  }
  const int64_t owned = (m + set->tp - 1) / set->tp;
  const bool scatter = set->out_owned;
  const ffi::Error errors[] = {
      CheckMatrix("routed", routed, ffi::DataType::BF16, -1, set->hidden, "hidden",
                  kernel_set_id),
      CheckMatrix("indices", indices, ffi::DataType::S32, m, set->top_k,
                  "m from weights, top_k", kernel_set_id),
      CheckMatrix("shared", shared, ffi::DataType::BF16, set->shared_expert ? m : 0,
                  set->hidden,
                  set->shared_expert
                      ? "m from weights, hidden"
                      : "a [0, hidden] placeholder, since the set has no shared expert,",
                  kernel_set_id),
      CheckMatrix("out", out, ffi::DataType::BF16, scatter ? owned : m, set->hidden,
                  scatter ? "ceil(m / tp) rows of a reduce-scatter, hidden" : "m from weights, hidden",
                  kernel_set_id),
  };
  for (const ffi::Error& error : errors) {
    if (error.failure()) return error;
  }
  if (norm != nullptr) {
    const char* rows_rule =
        scatter ? "ceil(m / tp) rows of a reduce-scatter, hidden" : "m from weights, hidden";
    const ffi::Error norm_errors[] = {
        CheckMatrix("residual", norm->residual, ffi::DataType::BF16, scatter ? owned : m,
                    set->hidden, rows_rule, kernel_set_id),
        CheckVector("norm_weight", norm->norm_weight, set->hidden, kernel_set_id),
        CheckMatrix("residual_out", norm->residual_out, ffi::DataType::BF16, scatter ? owned : m,
                    set->hidden, rows_rule, kernel_set_id),
    };
    for (const ffi::Error& error : norm_errors) {
      if (error.failure()) return error;
    }
    if (!(std::isfinite(norm->eps) && norm->eps > 0.0f)) {
      return ffi::Error::InvalidArgument("norm_eps=" + std::to_string(norm->eps) +
                                         ": expected a finite float32 > 0");
    }
  }
  if (set->uses_mailbox) {
    const std::string name = "mailbox " + std::to_string(mailbox_id);
    const std::string of_set = " of kernel set " + std::to_string(kernel_set_id);
    if (m > mailbox.capacity_m) {
      return ffi::Error::InvalidArgument("m=" + std::to_string(m) + " exceeds capacity_m=" +
                                         std::to_string(mailbox.capacity_m) + " of " + name);
    }
    if (mailbox.hidden != set->hidden) {
      return ffi::Error::InvalidArgument(name + " has hidden=" + std::to_string(mailbox.hidden) +
                                         ", expected the hidden=" + std::to_string(set->hidden) +
                                         of_set);
    }
    if (mailbox.tp != set->tp) {
      return ffi::Error::InvalidArgument(name + " has tp=" + std::to_string(mailbox.tp) +
                                         ", expected the tp=" + std::to_string(set->tp) + of_set);
    }
  }

  // Every value of the launch contract; each kernel takes the ones its sidecar names. Without
  // a mailbox its values are 0.
  ValueSlot values[kValueCount] = {};
  auto set_u64 = [&values](Value value, uint64_t x) { values[static_cast<size_t>(value)].u64 = x; };
  auto set_u32 = [&values](Value value, uint32_t x) { values[static_cast<size_t>(value)].u32 = x; };
  set_u64(Value::kRouted, Address(routed));
  set_u64(Value::kWeights, Address(weights));
  set_u64(Value::kIndices, Address(indices));
  set_u64(Value::kShared, Address(shared));
  set_u64(Value::kMailbox, mailbox.mailbox);
  set_u64(Value::kPeerTable, mailbox.peer_table);
  set_u64(Value::kStageState, mailbox.stage_state);
  set_u64(Value::kStatus, mailbox.status);
  set_u64(Value::kOut, Address(out));
  set_u64(Value::kTimeoutNs, mailbox.timeout_ns);
  set_u32(Value::kNumRows, static_cast<uint32_t>(routed.dimensions()[0]));
  set_u32(Value::kM, static_cast<uint32_t>(m));
  set_u32(Value::kCapacityM, static_cast<uint32_t>(mailbox.capacity_m));
  set_u32(Value::kRank, static_cast<uint32_t>(mailbox.rank));
  if (norm != nullptr) {
    set_u64(Value::kResidual, Address(norm->residual));
    set_u64(Value::kNormWeight, Address(norm->norm_weight));
    set_u64(Value::kResidualOut, Address(norm->residual_out));
    values[static_cast<size_t>(Value::kEps)].f32 = norm->eps;
  }

  // A kernel set exists on this device, so the driver is loaded.
  const CudaDriver& cuda = GetCudaDriver();
  // Counted so that tests can tell whether XLA captured the call in a graph.
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (CUresult result = cuda.StreamIsCapturing(stream, &capture); result != CUDA_SUCCESS) {
    return ffi::Error::Internal(CudaErrorMessage(cuda, "cuStreamIsCapturing", result));
  }
  (capture == CU_STREAM_CAPTURE_STATUS_ACTIVE ? captured_executes : direct_executes)
      .fetch_add(1, std::memory_order_relaxed);
  for (const Kernel& kernel : set->kernels) {
    const int64_t rows = kernel.rows == Rows::kM ? m : owned;
    if (ffi::Error error = Launch(cuda, stream, kernel, set->pdl, rows, values); error.failure()) {
      return error;
    }
  }
  return ffi::Error::Success();
}

ffi::Error MoePublishImpl(CUstream stream, int32_t device, ffi::AnyBuffer routed,
                          ffi::AnyBuffer weights, ffi::AnyBuffer indices, ffi::AnyBuffer shared,
                          ffi::Result<ffi::AnyBuffer> out, int64_t kernel_set_id,
                          int64_t mailbox_id) {
  return MoePublishCall(stream, device, routed, weights, indices, shared, *out, kernel_set_id,
                        mailbox_id, nullptr);
}

ffi::Error MoePublishRmsNormImpl(CUstream stream, int32_t device, ffi::AnyBuffer routed,
                                 ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                                 ffi::AnyBuffer shared, ffi::AnyBuffer residual,
                                 ffi::AnyBuffer norm_weight, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> residual_out, int64_t kernel_set_id,
                                 int64_t mailbox_id, float norm_eps) {
  const NormOperands norm{residual, norm_weight, *residual_out, norm_eps};
  return MoePublishCall(stream, device, routed, weights, indices, shared, *out, kernel_set_id,
                        mailbox_id, &norm);
}

}  // namespace

ExecuteCounts GetExecuteCounts() {
  return {captured_executes.load(std::memory_order_relaxed),
          direct_executes.load(std::memory_order_relaxed)};
}

}  // namespace jax_moe_publish

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePublish, jax_moe_publish::MoePublishImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()             // device
                                  .Arg<xla::ffi::AnyBuffer>()                 // routed
                                  .Arg<xla::ffi::AnyBuffer>()                 // weights
                                  .Arg<xla::ffi::AnyBuffer>()                 // indices
                                  .Arg<xla::ffi::AnyBuffer>()                 // shared
                                  .Ret<xla::ffi::AnyBuffer>()                 // out
                                  .Attr<int64_t>("kernel_set_id")
                                  .Attr<int64_t>("mailbox_id"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePublishRmsNorm, jax_moe_publish::MoePublishRmsNormImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()             // device
                                  .Arg<xla::ffi::AnyBuffer>()                 // routed
                                  .Arg<xla::ffi::AnyBuffer>()                 // weights
                                  .Arg<xla::ffi::AnyBuffer>()                 // indices
                                  .Arg<xla::ffi::AnyBuffer>()                 // shared
                                  .Arg<xla::ffi::AnyBuffer>()                 // residual
                                  .Arg<xla::ffi::AnyBuffer>()                 // norm_weight
                                  .Ret<xla::ffi::AnyBuffer>()                 // out
                                  .Ret<xla::ffi::AnyBuffer>()                 // residual_out
                                  .Attr<int64_t>("kernel_set_id")
                                  .Attr<int64_t>("mailbox_id")
                                  .Attr<float>("norm_eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
