// The values a kernel of the op can receive, with their PTX parameter types, and the launch
// limits: the C++ side of the launch contract in jax_moe_publish/_abi.py. The sidecar names each
// kernel's parameters from this list, and the handler fills them by name. A CPU test
// keeps the two lists equal (the module's launch_values()).

#ifndef JAX_MOE_PUBLISH_FFI_LAUNCH_VALUES_H_
#define JAX_MOE_PUBLISH_FFI_LAUNCH_VALUES_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

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
};

struct ValueInfo {
  std::string_view name;
  std::string_view ptx_type;  // "u64", "u32" or "f32"
};

// In the order of Value.
inline constexpr ValueInfo kValues[] = {
    {"routed", "u64"},       {"weights", "u64"},     {"indices", "u64"},     {"shared", "u64"},
    {"mailbox", "u64"},      {"peer_table", "u64"},  {"stage_state", "u64"}, {"status", "u64"},
    {"out", "u64"},          {"residual", "u64"},    {"norm_weight", "u64"}, {"residual_out", "u64"},
    {"timeout_ns", "u64"},   {"num_rows", "u32"},    {"m", "u32"},           {"capacity_m", "u32"},
    {"rank", "u32"},         {"eps", "f32"},
};
inline constexpr size_t kValueCount = sizeof(kValues) / sizeof(kValues[0]);
static_assert(kValueCount == static_cast<size_t>(Value::kEps) + 1, "kValues must list every Value");

// The launch limits (_abi.py's); the module's launch_limits() lets a CPU test compare them.
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
