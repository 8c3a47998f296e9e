// XLA FFI handlers of the targets in kTargets (launch_values.h): "jax_moe_publish" (one call of
// the MoE finalize and its TP reduction), "jax_moe_publish_rmsnorm" (the same, with the residual
// add + RMSNorm epilogue fused into the reduce) and "jax_moe_publish_experts" (the routed experts'
// decode GEMM). One body serves all: it checks the call's operands against its kernel set's
// operand records (the sidecar's call record) and, for the publish op, this device's mailbox,
// fills every value of the launch contract, and launches the set's kernels in order on XLA's
// stream, each with the values its sidecar names.
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
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include "cuda_driver.h"
#include "launch_values.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Returns the ffi::Error of `expr` from the enclosing function if it is a failure, as jaxlib's
// FFI_RETURN_IF_ERROR does, so that a handler reads as a list of checks.
#define JMP_RETURN_IF_ERROR(expr)                                    \
  do {                                                               \
    if (::xla::ffi::Error jmp_error = (expr); jmp_error.failure()) { \
      return jmp_error;                                              \
    }                                                                \
  } while (false)

namespace jax_moe_publish {
namespace {

std::atomic<uint64_t> captured_executes{0};
std::atomic<uint64_t> direct_executes{0};

ffi::Error FailedPrecondition(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
}

std::string OfSet(int64_t kernel_set_id) { return "kernel set " + std::to_string(kernel_set_id); }

// What the operands of one call give the kernels.
struct CallOperands {
  uint64_t addresses[kValueCount] = {};  // By Value: each operand's; 0 where no operand has it.
  int64_t num_rows = 0;
  int64_t m = 0;
  int64_t owned = 0;        // ceil(m / tp): the rows this rank owns.
  int64_t pairs = 0;        // m * top_k: the token-expert pairs.
  std::string_view m_from;  // The operand that fixed m; empty before it.
};

uint64_t Address(const ffi::AnyBuffer& buffer) {
  return reinterpret_cast<uintptr_t>(buffer.untyped_data());
}

// The sidecar's name of `type`, or XLA's in lower case for a dtype that no operand has.
std::string DtypeName(ffi::DataType type) {
  for (const DtypeInfo& dtype : kDtypes) {
    if (dtype.type == type) return std::string(dtype.name);
  }
  std::ostringstream name;
  name << type;
  std::string text = name.str();
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Why `operand` must have the rows it must, for messages.
std::string RowsRule(const Operand& operand, const CallOperands& call, const KernelSet& set) {
  switch (operand.rows) {
    case Rows::kNumRows:
      return "any rows: their count is num_rows";
    case Rows::kM:
      return call.m_from.empty() ? "m >= 1 rows: this operand fixes m"
                                 : "m from " + std::string(call.m_from);
    case Rows::kOwned:
      return "ceil(m / tp) rows this rank owns, m=" + std::to_string(call.m) + " from " +
             std::string(call.m_from) + ", tp=" + std::to_string(set.tp);
    case Rows::kPairs:
      return "m * top_k rows, one per token-expert pair, m=" + std::to_string(call.m) + " from " +
             std::string(call.m_from) + ", top_k=" + std::to_string(set.top_k);
    case Rows::kZero:
      return "a placeholder of 0 rows";
    case Rows::kFixed:
    case Rows::kResident:
      return "a fixed shape";
  }
  return {};
}

// A count of rows that the kernels take as a u32 and read as an int32.
ffi::Error CheckRowCount(std::string_view operand, const char* value, int64_t count, int64_t low,
                         int64_t kernel_set_id) {
  const std::string got =
      std::string(operand) + ": " + value + "=" + std::to_string(count) + " rows";
  if (count < low) {
    return ffi::Error::InvalidArgument(got + ", expected " + value + " >= " + std::to_string(low) +
                                       " (" + OfSet(kernel_set_id) + ")");
  }
  if (count > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(got + ", expected at most 2**31 - 1 (the kernels count rows "
                                       "in 32-bit ints; " + OfSet(kernel_set_id) + ")");
  }
  return ffi::Error::Success();
}

// Checks one operand against its record. The operand with rows num_rows, and the first with
// rows m, set those counts.
ffi::Error CheckOperand(const Operand& operand, const ffi::AnyBuffer& buffer, const KernelSet& set,
                        int64_t kernel_set_id, CallOperands* call) {
  const std::string_view name = Info(operand.value).name;
  const ffi::AnyBuffer::Dimensions dims = buffer.dimensions();
  const bool leading = operand.rows != Rows::kFixed;
  int64_t rows = -1;  // Any count.
  switch (operand.rows) {
    case Rows::kNumRows:
    case Rows::kFixed:
    case Rows::kResident:
      break;
    case Rows::kM:
      if (!call->m_from.empty()) rows = call->m;
      break;
    case Rows::kOwned:
      rows = call->owned;
      break;
    case Rows::kPairs:
      rows = call->pairs;
      break;
    case Rows::kZero:
      rows = 0;
      break;
  }
  const size_t first = leading ? 1 : 0;
  bool fits = buffer.element_type() == operand.dtype.type &&
              dims.size() == first + operand.shape.size() &&
              (!leading || rows < 0 || dims[0] == rows);
  for (size_t i = 0; fits && i < operand.shape.size(); ++i) fits = dims[first + i] == operand.shape[i];
  if (!fits) {
    std::ostringstream message;
    message << name << ": got " << DtypeName(buffer.element_type()) << "[";
    for (size_t i = 0; i < dims.size(); ++i) message << (i ? ", " : "") << dims[i];
    message << "], expected " << operand.dtype.name << "[";
    if (leading) {
      if (rows >= 0) {
        message << rows;
      } else {
        message << (operand.rows == Rows::kNumRows ? "num_rows" : "m");
      }
    }
    for (size_t i = 0; i < operand.shape.size(); ++i) {
      message << (leading || i ? ", " : "") << operand.shape[i];
    }
    message << "] (" << RowsRule(operand, *call, set) << "; " << OfSet(kernel_set_id) << ")";
    return ffi::Error::InvalidArgument(message.str());
  }
  call->addresses[static_cast<size_t>(operand.value)] = Address(buffer);
  if (operand.rows == Rows::kNumRows) {
    JMP_RETURN_IF_ERROR(CheckRowCount(name, "num_rows", dims[0], 0, kernel_set_id));
    call->num_rows = dims[0];
  } else if (operand.rows == Rows::kM && call->m_from.empty()) {
    JMP_RETURN_IF_ERROR(CheckRowCount(name, "m", dims[0], 1, kernel_set_id));
    if (dims[0] > set.max_m) {
      return ffi::Error::InvalidArgument(
          std::string(name) + ": m=" + std::to_string(dims[0]) + " rows, expected at most " +
          std::to_string(set.max_m) + ", the most tokens the kernels take (" +
          OfSet(kernel_set_id) + ")");
    }
    call->m = dims[0];
    call->owned = (call->m + set.tp - 1) / set.tp;
    call->pairs = call->m * set.top_k;
    call->m_from = name;
  }
  return ffi::Error::Success();
}

// The operand at FFI position `index`: the args, then the rets.
ffi::ErrorOr<ffi::AnyBuffer> OperandBuffer(const ffi::RemainingArgs& args,
                                           const ffi::RemainingRets& rets, size_t index) {
  if (index < args.size()) return args.get<ffi::AnyBuffer>(index);
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(index - args.size());
  if (ret.has_error()) return ffi::Unexpected<ffi::Error>(std::move(ret.error()));
  return **ret;
}

// Checks the call's operands against the set's operand records, and gathers what they give the
// kernels.
ffi::Error CheckOperands(const KernelSet& set, int64_t kernel_set_id,
                         const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                         CallOperands* call) {
  const TargetInfo& target = Info(set.target);
  const size_t set_rets = set.operands.size() - set.args;
  if (args.size() != set.args || rets.size() != set_rets) {
    std::string names[2];  // The set's args, then its rets.
    for (size_t i = 0; i < set.operands.size(); ++i) {
      std::string& list = names[i < set.args ? 0 : 1];
      list += (list.empty() ? "" : ", ") + std::string(Info(set.operands[i].value).name);
    }
    return ffi::Error::InvalidArgument(
        OfSet(kernel_set_id) + " (target " + std::string(target.name) + ") takes " +
        std::to_string(set.args) + " args (" + names[0] + ") and " + std::to_string(set_rets) +
        " rets (" + names[1] + "), but the call gives " + std::to_string(args.size()) +
        " args and " + std::to_string(rets.size()) + " rets");
  }
  for (size_t i = 0; i < set.operands.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = OperandBuffer(args, rets, i);
    if (buffer.has_error()) return std::move(buffer.error());
    JMP_RETURN_IF_ERROR(CheckOperand(set.operands[i], *buffer, set, kernel_set_id, call));
  }
  return ffi::Error::Success();
}

// This device's part of the set's mailbox, checked against the set and m; left zero for a set
// without a mailbox (tp = 1).
ffi::Error CheckMailbox(const Registry& registry, const KernelSet& set, int64_t kernel_set_id,
                        int32_t device, int64_t mailbox_id, int64_t m, MailboxDevice* mailbox) {
  if (!set.uses_mailbox) {
    if (mailbox_id == 0) return ffi::Error::Success();
    return ffi::Error::InvalidArgument("mailbox_id=" + std::to_string(mailbox_id) +
                                       ": expected 0, " + OfSet(kernel_set_id) +
                                       " uses no mailbox");
  }
  const std::string name = "mailbox " + std::to_string(mailbox_id);
  switch (registry.FindMailbox(mailbox_id, device, mailbox)) {
    case MailboxState::kClosed:
      return FailedPrecondition(name +
                                " is closed: its memory may be freed, so calls on it are "
                                "refused; use a new Mailbox");
    case MailboxState::kUnregistered:
      return FailedPrecondition(name + " is not registered on device " + std::to_string(device) +
                                ": register_mailbox_device must be called for this device "
                                "before the first call");
    case MailboxState::kRegistered:
      break;
  }
  const std::string of_set = " of " + OfSet(kernel_set_id);
  if (m > mailbox->capacity_m) {
    return ffi::Error::InvalidArgument("m=" + std::to_string(m) + " exceeds capacity_m=" +
                                       std::to_string(mailbox->capacity_m) + " of " + name);
  }
  if (mailbox->hidden != set.hidden) {
    return ffi::Error::InvalidArgument(name + " has hidden=" + std::to_string(mailbox->hidden) +
                                       ", expected the hidden=" + std::to_string(set.hidden) +
                                       of_set);
  }
  if (mailbox->tp != set.tp) {
    return ffi::Error::InvalidArgument(name + " has tp=" + std::to_string(mailbox->tp) +
                                       ", expected the tp=" + std::to_string(set.tp) + of_set);
  }
  return ffi::Error::Success();
}

// Every value of the launch contract for one call; each kernel takes the ones its sidecar names.
// No default: -Wswitch-enum makes a Value without a fill a build error.
void FillValues(const CallOperands& call, const MailboxDevice& mailbox, float eps,
                ValueSlot* values) {
  for (size_t i = 0; i < kValueCount; ++i) {
    ValueSlot& slot = values[i];
    switch (static_cast<Value>(i)) {
      case Value::kRouted:
      case Value::kWeights:
      case Value::kIndices:
      case Value::kShared:
      case Value::kOut:
      case Value::kResidual:
      case Value::kNormWeight:
      case Value::kResidualOut:
      case Value::kOutScales:
      case Value::kOutScale:
      case Value::kX:
      case Value::kExpertIds:
      case Value::kGateUp:
      case Value::kGate:
      case Value::kUp:
      case Value::kDown:
      case Value::kGateUpScales:
      case Value::kGateScales:
      case Value::kUpScales:
      case Value::kDownScales:
      case Value::kXScales:
      case Value::kActivations:
        slot.u64 = call.addresses[i];
        break;
      case Value::kMailbox:
        slot.u64 = mailbox.mailbox;
        break;
      case Value::kPeerTable:
        slot.u64 = mailbox.peer_table;
        break;
      case Value::kStageState:
        slot.u64 = mailbox.stage_state;
        break;
      case Value::kStatus:
        slot.u64 = mailbox.status;
        break;
      case Value::kTimeoutNs:
        slot.u64 = mailbox.timeout_ns;
        break;
      case Value::kNumRows:
        slot.u32 = static_cast<uint32_t>(call.num_rows);
        break;
      case Value::kM:
        slot.u32 = static_cast<uint32_t>(call.m);
        break;
      case Value::kCapacityM:
        slot.u32 = static_cast<uint32_t>(mailbox.capacity_m);
        break;
      case Value::kRank:
        slot.u32 = static_cast<uint32_t>(mailbox.rank);
        break;
      case Value::kEps:
        slot.f32 = eps;
        break;
    }
  }
}

ffi::Error LaunchKernel(const CudaDriver& cuda, CUstream stream, const Kernel& kernel, bool pdl,
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
  // peers, so all must run at once; a resident one loops over work only the device knows.
  // (Both limits are whole numbers of clusters.)
  int64_t ctas = (rows + kernel.waves - 1) / kernel.waves * kernel.ctas_per_row;
  if (kernel.rows == Rows::kResident) ctas = kernel.max_resident_ctas;
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

// Launches the set's kernels in order on `stream`, each over the rows of its grid.
ffi::Error LaunchKernels(CUstream stream, const KernelSet& set, const CallOperands& call,
                         ValueSlot* values) {
  // A kernel set exists on this device, so the driver is loaded.
  const CudaDriver& cuda = GetCudaDriver();
  // Counted so that tests can tell whether XLA captured the call in a graph.
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (CUresult result = cuda.StreamIsCapturing(stream, &capture); result != CUDA_SUCCESS) {
    return ffi::Error::Internal(CudaErrorMessage(cuda, "cuStreamIsCapturing", result));
  }
  (capture == CU_STREAM_CAPTURE_STATUS_ACTIVE ? captured_executes : direct_executes)
      .fetch_add(1, std::memory_order_relaxed);
  for (const Kernel& kernel : set.kernels) {
    // kM, kOwned or kResident (which ignores it).
    const int64_t rows = kernel.rows == Rows::kOwned ? call.owned : call.m;
    JMP_RETURN_IF_ERROR(LaunchKernel(cuda, stream, kernel, set.pdl, rows, values));
  }
  return ffi::Error::Success();
}

// One call of `target`; `mailbox_id` and `eps` are its attributes, 0 for a target without them.
ffi::Error Call(Target target, CUstream stream, int32_t device, const ffi::RemainingArgs& args,
                const ffi::RemainingRets& rets, int64_t kernel_set_id, int64_t mailbox_id,
                float eps) {
  const Registry& registry = Registry::Get();
  const KernelSet* set = registry.FindKernelSet(kernel_set_id, device);
  if (set == nullptr) {
    return FailedPrecondition(OfSet(kernel_set_id) + " is not loaded on device " +
                              std::to_string(device) +
                              ": load_kernel_set must be called for this device before the "
                              "first call");
  }
  if (set->target != target) {
    return ffi::Error::InvalidArgument(
        OfSet(kernel_set_id) + " is called through target " + std::string(Info(target).name) +
        ", but its sidecar's call is for target " + std::string(Info(set->target).name));
  }
  CallOperands call;
  JMP_RETURN_IF_ERROR(CheckOperands(*set, kernel_set_id, args, rets, &call));
  MailboxDevice mailbox;  // Stays zero for a set without a mailbox (tp = 1, the experts op).
  if (Info(target).mailbox) {
    JMP_RETURN_IF_ERROR(
        CheckMailbox(registry, *set, kernel_set_id, device, mailbox_id, call.m, &mailbox));
  }
  if (Info(target).norm_eps && !(std::isfinite(eps) && eps > 0.0f)) {
    return ffi::Error::InvalidArgument("norm_eps=" + std::to_string(eps) +
                                       ": expected a finite float32 > 0");
  }
  ValueSlot values[kValueCount] = {};
  FillValues(call, mailbox, eps, values);
  return LaunchKernels(stream, *set, call, values);
}

ffi::Error MoePublishImpl(CUstream stream, int32_t device, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, int64_t kernel_set_id, int64_t mailbox_id) {
  return Call(Target::kPublish, stream, device, args, rets, kernel_set_id, mailbox_id, 0.0f);
}

ffi::Error MoePublishRmsNormImpl(CUstream stream, int32_t device, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, int64_t kernel_set_id,
                                 int64_t mailbox_id, float norm_eps) {
  return Call(Target::kPublishRmsNorm, stream, device, args, rets, kernel_set_id, mailbox_id,
              norm_eps);
}

ffi::Error ExpertsImpl(CUstream stream, int32_t device, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, int64_t kernel_set_id) {
  return Call(Target::kExperts, stream, device, args, rets, kernel_set_id, 0, 0.0f);
}

}  // namespace

ExecuteCounts GetExecuteCounts() {
  return {captured_executes.load(std::memory_order_relaxed),
          direct_executes.load(std::memory_order_relaxed)};
}

}  // namespace jax_moe_publish

// The operands are the kernel set's (its sidecar's call record, in FFI order), so every target
// takes them as they come and CheckOperands checks them.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePublish, jax_moe_publish::MoePublishImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()             // device
                                  .RemainingArgs()                            // the set's args
                                  .RemainingRets()                            // the set's rets
                                  .Attr<int64_t>("kernel_set_id")
                                  .Attr<int64_t>("mailbox_id"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePublishRmsNorm, jax_moe_publish::MoePublishRmsNormImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()             // device
                                  .RemainingArgs()                            // the set's args
                                  .RemainingRets()                            // the set's rets
                                  .Attr<int64_t>("kernel_set_id")
                                  .Attr<int64_t>("mailbox_id")
                                  .Attr<float>("norm_eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The experts' operands are their kernel set's too; no mailbox.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeExperts, jax_moe_publish::ExpertsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()             // device
                                  .RemainingArgs()                            // the set's args
                                  .RemainingRets()                            // the set's rets
                                  .Attr<int64_t>("kernel_set_id"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_moe_publish {

XLA_FFI_Handler* TargetHandler(Target target) {
  switch (target) {
    case Target::kPublish:
      return MoePublish;
    case Target::kPublishRmsNorm:
      return MoePublishRmsNorm;
    case Target::kExperts:
      return MoeExperts;
  }
  return nullptr;
}

}  // namespace jax_moe_publish
