// Per-device state of the extension: loaded kernel sets and registered mailboxes.
//
// Python fills it at trace time, outside any CUDA graph capture; the FFI
// handler only reads it. XLA runs each device's program from its own thread,
// so reads take a shared lock and never block each other.

#ifndef JAX_MOE_PUBLISH_FFI_REGISTRY_H_
#define JAX_MOE_PUBLISH_FFI_REGISTRY_H_

#include <cuda.h>

#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "launch_values.h"

namespace jax_moe_publish {

// The rows rule of an operand's leading dimension, by the sidecar's word: "num_rows" (any count,
// passed to the kernels as num_rows), "m" (the first such operand fixes m, later ones equal it),
// "owned" (the ceil(m / tp) rows this rank owns), "pairs" (m * top_k), "zero" (a [0, ...]
// placeholder) or None, kFixed: no leading dimension beyond the shape. A kernel's grid has rows
// kM, kOwned, or kResident: exactly the CTAs the device holds at once, whatever m.
enum class Rows { kNumRows, kM, kOwned, kPairs, kZero, kFixed, kResident };

// One kernel record of a sidecar ("kernels"), as Python gives it: the role names it in
// messages; params and param_types are the values it takes, in .entry order.
struct KernelSpec {
  std::string role;
  std::string symbol;
  std::vector<std::string> params;
  std::vector<std::string> param_types;
  int64_t block = 0;
  int64_t smem = 0;
  int64_t ctas_per_row = 0;
  std::string rows;
  int64_t waves = 1;
  bool persistent = false;
  int64_t cluster = 1;
};

// One operand record of a sidecar's call, as Python gives it (_abi.call_operands); rows is
// nullopt for an array of fixed shape.
struct OperandSpec {
  std::string name;
  std::string io;
  std::string dtype;
  std::optional<std::string> rows;
  std::vector<int64_t> shape;  // The dimensions after the rows.
};

// The call of a kernel set (a sidecar's "call"), as Python gives it.
struct CallSpec {
  std::string target;
  int64_t tp = 0;
  int64_t hidden = 0;
  int64_t top_k = 0;
  int64_t max_m = 0;  // The most tokens the kernels take.
  bool pdl = false;
  std::vector<OperandSpec> operands;  // In FFI order: the args, then the rets.
};

// One checked operand of a call.
struct Operand {
  Value value;  // The value that carries its address, whose name it has.
  DtypeInfo dtype;
  Rows rows;
  std::vector<int64_t> shape;
};

struct Kernel {
  std::string role;
  CUfunction function;
  std::vector<Value> params;  // In .entry order.
  unsigned block;
  unsigned smem;
  unsigned ctas_per_row;
  // CTAs of one thread block cluster (consecutive CTAs); 1 for none.
  unsigned cluster;
  Rows rows;  // The rows of its grid: kM, kOwned or kResident.
  // Passes of a persistent kernel's grid over the rows: its grid is the CTAs of
  // ceil(rows / waves) rows. 1 for the other kernels.
  unsigned waves;
  bool persistent;
  // CTAs the device holds at once: the grid of a persistent kernel (whose CTAs wait on each
  // other's peers, or loop over work only the device knows) is capped at it. 0 for the others.
  int64_t max_resident_ctas;
};

// A 1-D launch of `kernel` over `ctas` CTAs: grid, block and dynamic shared memory; the
// caller adds the stream and the attributes.
CUlaunchConfig LaunchConfig(const Kernel& kernel, unsigned ctas);

// The launch attribute that groups `ctas` consecutive CTAs into one cluster.
CUlaunchAttribute ClusterDimension(unsigned ctas);

struct KernelSet {
  Target target;
  int64_t tp;
  int64_t hidden;
  int64_t top_k;
  int64_t max_m;
  bool pdl;
  bool uses_mailbox;  // Some kernel takes the mailbox or the peer table (tp > 1).
  size_t args;                    // The operands that are args; the rest are rets.
  std::vector<Operand> operands;  // In FFI order: the args, then the rets.
  std::vector<Kernel> kernels;    // In launch order.
};

// Checks a sidecar's records against the launch contract, with no CUDA call, and returns the set
// they describe (its kernels' functions unset). `where` starts each message. Throws
// std::invalid_argument for records that do not match.
KernelSet ValidateKernelSet(const std::string& where, const std::vector<KernelSpec>& kernels,
                            const CallSpec& call);

// One device's part of a mailbox. Addresses are device pointers.
struct MailboxDevice {
  int64_t rank = 0;
  int64_t tp = 0;
  int64_t hidden = 0;
  int64_t capacity_m = 0;
  uint64_t mailbox = 0;
  uint64_t peer_table = 0;
  uint64_t stage_state = 0;
  uint64_t status = 0;
  uint64_t timeout_ns = 0;
};

enum class MailboxState { kRegistered, kUnregistered, kClosed };

class Registry {
 public:
  static Registry& Get();

  // Loads `cubin` in the device's primary context, after ValidateKernelSet. A set already
  // loaded on that device is left as it is. Throws std::invalid_argument for records that
  // do not match the launch contract, std::runtime_error for CUDA failures.
  void LoadKernelSet(int64_t kernel_set_id, int device, std::string_view cubin,
                     const std::vector<KernelSpec>& kernels, const CallSpec& call);

  // Replaces any earlier registration of (mailbox_id, device). Throws
  // std::invalid_argument for bad values or a closed mailbox.
  void RegisterMailboxDevice(int64_t mailbox_id, int device, const MailboxDevice& mailbox);

  // Forgets every device's registration; later calls on the id fail.
  void CloseMailbox(int64_t mailbox_id);

  // Execute-time lookups. Kernel sets are never unloaded, so the pointer stays
  // valid; nullptr when the set is not loaded on the device.
  const KernelSet* FindKernelSet(int64_t kernel_set_id, int device) const;

  MailboxState FindMailbox(int64_t mailbox_id, int device, MailboxDevice* found) const;

 private:
  using Key = std::pair<int64_t, int>;  // (id, device ordinal)

  CUcontext RetainPrimaryContext(const std::string& where, int device);

  mutable std::shared_mutex mutex_;  // Guards the maps below.
  std::map<Key, std::unique_ptr<const KernelSet>> kernel_sets_;
  std::map<Key, MailboxDevice> mailboxes_;
  std::set<int64_t> closed_mailboxes_;

  // Serialises loads, so that a set is loaded once, without holding mutex_
  // (and blocking every device's calls) while a cubin loads.
  std::mutex load_mutex_;
  std::map<int, CUcontext> primary_contexts_;  // Guarded by load_mutex_; kept retained.
};

}  // namespace jax_moe_publish

#endif  // JAX_MOE_PUBLISH_FFI_REGISTRY_H_
