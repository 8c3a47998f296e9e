// The C++ side of the launch contracts in jax_moe_publish/_abi.py: the values a kernel of either op
// can receive (with their PTX parameter types, where the handler takes each from, and the ops that
// have it), the FFI targets, the operand dtypes and the launch limits. The sidecar names each
// kernel's parameters and each operand of a call from these lists, and the handler fills them by
// name. CPU tests keep them equal to _abi's (the module's launch_values(), launch_limits(),
// operand_dtypes() and registrations()).

#ifndef JAX_MOE_PUBLISH_FFI_LAUNCH_VALUES_H_
#define JAX_MOE_PUBLISH_FFI_LAUNCH_VALUES_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_moe_publish {

enum class Value {
  kRouted,
  kWeights,
  kIndices,
  kShared,
  kMailbox,
  kPeerTable,
  kStageState,
  kStatus,
  kOut,
  kResidual,
  kNormWeight,
  kResidualOut,
  kTimeoutNs,
  kNumRows,
  kM,
  kCapacityM,
  kRank,
  kEps,
  kOutScales,
  kOutScale,
  kX,
  kExpertIds,
  kGateUp,
  kGate,
  kUp,
  kDown,
  kGateUpScales,
  kGateScales,
  kUpScales,
  kDownScales,
  kXScales,
  kActivations,
};

// The ops of the package (_abi.CONTRACTS); a value belongs to one or both.
enum class Op { kPublish, kExperts };
inline constexpr Op kOps[] = {Op::kPublish, Op::kExperts};
constexpr unsigned OpBit(Op op) { return 1u << static_cast<unsigned>(op); }

// Each Op's name, as _abi.CONTRACTS has it; -Wswitch-enum makes an Op without one a build error.
constexpr std::string_view OpName(Op op) {
  switch (op) {
    case Op::kPublish: return "publish";
    case Op::kExperts: return "experts";
  }
  return {};
}
inline constexpr unsigned kPublishOp = OpBit(Op::kPublish);
inline constexpr unsigned kExpertsOp = OpBit(Op::kExperts);

// Where the handler takes a value from (FillValues in moe_publish_handler.cc).
enum class Source {
  kOperand,    // the address of the call's operand of the same name
  kRows,       // num_rows or m, from the rows rules of the operands
  kMailbox,    // this device's mailbox registration; 0 without a mailbox (tp = 1)
  kAttribute,  // the call's norm_eps; 0 for a target without it
};

struct ValueInfo {
  std::string_view name;
  std::string_view ptx_type;  // "u64", "u32" or "f32"
  Source source;
  unsigned ops;  // OpBit of each op whose kernels can take it
};

// In the order of Value: the publish op's values (_abi.VALUES), then the experts op's that it
// does not share (_abi.ALL_VALUES).
inline constexpr ValueInfo kValues[] = {
    {"routed", "u64", Source::kOperand, kPublishOp},
    {"weights", "u64", Source::kOperand, kPublishOp},
    {"indices", "u64", Source::kOperand, kPublishOp},
    {"shared", "u64", Source::kOperand, kPublishOp | kExpertsOp},
    {"mailbox", "u64", Source::kMailbox, kPublishOp},
    {"peer_table", "u64", Source::kMailbox, kPublishOp},
    {"stage_state", "u64", Source::kMailbox, kPublishOp},
    {"status", "u64", Source::kMailbox, kPublishOp},
    {"out", "u64", Source::kOperand, kPublishOp | kExpertsOp},
    {"residual", "u64", Source::kOperand, kPublishOp},
    {"norm_weight", "u64", Source::kOperand, kPublishOp},
    {"residual_out", "u64", Source::kOperand, kPublishOp},
    {"timeout_ns", "u64", Source::kMailbox, kPublishOp},
    {"num_rows", "u32", Source::kRows, kPublishOp},
    {"m", "u32", Source::kRows, kPublishOp | kExpertsOp},
    {"capacity_m", "u32", Source::kMailbox, kPublishOp},
    {"rank", "u32", Source::kMailbox, kPublishOp},
    {"eps", "f32", Source::kAttribute, kPublishOp},
    {"out_scales", "u64", Source::kOperand, kPublishOp},
    {"out_scale", "u64", Source::kOperand, kPublishOp},
    {"x", "u64", Source::kOperand, kExpertsOp},
    {"expert_ids", "u64", Source::kOperand, kExpertsOp},
    {"gate_up", "u64", Source::kOperand, kExpertsOp},
    {"gate", "u64", Source::kOperand, kExpertsOp},
    {"up", "u64", Source::kOperand, kExpertsOp},
    {"down", "u64", Source::kOperand, kExpertsOp},
    {"gate_up_scales", "u64", Source::kOperand, kExpertsOp},
    {"gate_scales", "u64", Source::kOperand, kExpertsOp},
    {"up_scales", "u64", Source::kOperand, kExpertsOp},
    {"down_scales", "u64", Source::kOperand, kExpertsOp},
    {"x_scales", "u64", Source::kOperand, kExpertsOp},
    {"activations", "u64", Source::kOperand, kExpertsOp},
};
inline constexpr size_t kValueCount = sizeof(kValues) / sizeof(kValues[0]);

constexpr const ValueInfo& Info(Value value) { return kValues[static_cast<size_t>(value)]; }

// Each Value's name, written apart from kValues so that the compiler checks the table's order;
// -Wswitch-enum makes a Value without a case a build error. Empty past the last Value.
constexpr std::string_view ValueName(Value value) {
  switch (value) {
    case Value::kRouted: return "routed";
    case Value::kWeights: return "weights";
    case Value::kIndices: return "indices";
    case Value::kShared: return "shared";
    case Value::kMailbox: return "mailbox";
    case Value::kPeerTable: return "peer_table";
    case Value::kStageState: return "stage_state";
    case Value::kStatus: return "status";
    case Value::kOut: return "out";
    case Value::kResidual: return "residual";
    case Value::kNormWeight: return "norm_weight";
    case Value::kResidualOut: return "residual_out";
    case Value::kTimeoutNs: return "timeout_ns";
    case Value::kNumRows: return "num_rows";
    case Value::kM: return "m";
    case Value::kCapacityM: return "capacity_m";
    case Value::kRank: return "rank";
    case Value::kEps: return "eps";
    case Value::kOutScales: return "out_scales";
    case Value::kOutScale: return "out_scale";
    case Value::kX: return "x";
    case Value::kExpertIds: return "expert_ids";
    case Value::kGateUp: return "gate_up";
    case Value::kGate: return "gate";
    case Value::kUp: return "up";
    case Value::kDown: return "down";
    case Value::kGateUpScales: return "gate_up_scales";
    case Value::kGateScales: return "gate_scales";
    case Value::kUpScales: return "up_scales";
    case Value::kDownScales: return "down_scales";
    case Value::kXScales: return "x_scales";
    case Value::kActivations: return "activations";
  }
  return {};
}

// The index of the first kValues row that is not its Value's; kValueCount when every row is.
constexpr size_t FirstValueOutOfOrder() {
  for (size_t i = 0; i < kValueCount; ++i) {
    if (kValues[i].name != ValueName(static_cast<Value>(i))) return i;
  }
  return kValueCount;
}
static_assert(FirstValueOutOfOrder() == kValueCount, "kValues must list the Values in enum order");
static_assert(ValueName(static_cast<Value>(kValueCount)).empty(), "kValues must list every Value");

// The FFI targets (_abi.ALL_TARGETS). Each handler takes its operands as RemainingArgs and
// RemainingRets: a call's operands are its kernel set's (the sidecar's call record), checked
// at load to be values of the target's op.
enum class Target { kPublish, kPublishRmsNorm, kExperts };

struct TargetInfo {
  Target target;
  std::string_view name;
  Op op;
  bool mailbox;   // Takes the int64 attribute mailbox_id.
  bool norm_eps;  // Takes the float attribute norm_eps, which gives the value eps.
};

inline constexpr TargetInfo kTargets[] = {
    {Target::kPublish, "jax_moe_publish", Op::kPublish, true, false},
    {Target::kPublishRmsNorm, "jax_moe_publish_rmsnorm", Op::kPublish, true, true},
    {Target::kExperts, "jax_moe_publish_experts", Op::kExperts, false, false},
};

constexpr const TargetInfo& Info(Target target) { return kTargets[static_cast<size_t>(target)]; }

constexpr bool TargetsInEnumOrder() {
  for (size_t i = 0; i < sizeof(kTargets) / sizeof(kTargets[0]); ++i) {
    if (kTargets[i].target != static_cast<Target>(i)) return false;
  }
  return true;
}
static_assert(TargetsInEnumOrder(), "kTargets must list the Targets in enum order");

// The dtypes an operand may have, by the sidecar's name (_abi.DTYPES).
struct DtypeInfo {
  std::string_view name;
  xla::ffi::DataType type;
};

inline constexpr DtypeInfo kDtypes[] = {
    {"bf16", xla::ffi::DataType::BF16},
    {"f32", xla::ffi::DataType::F32},
    {"s32", xla::ffi::DataType::S32},
    {"e4m3", xla::ffi::DataType::F8E4M3FN},
};

// The launch limits (_abi.py's).
inline constexpr int64_t kMaxThreads = 1024;
inline constexpr int64_t kPortableClusterCtas = 8;  // beyond it, opt in per function
inline constexpr int64_t kMaxClusterCtas = 16;      // Hopper's largest
inline constexpr int64_t kDefaultSmemBytes = 48 * 1024;  // beyond it, opt in per function

// One value as a kernel parameter: the launch passes a pointer to it, and the kernel reads
// the parameter's size from its start (little-endian).
union ValueSlot {
  uint64_t u64;
  uint32_t u32;
  float f32;
};

}  // namespace jax_moe_publish

#endif  // JAX_MOE_PUBLISH_FFI_LAUNCH_VALUES_H_
