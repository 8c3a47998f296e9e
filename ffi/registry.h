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
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace jax_moe_publish {

enum class Mode { kOneshot, kTwoshot, kReduceScatter, kDirect };
// kPublishReduce(Norm): the whole call in one kernel (fuse_reduce, oneshot; with the epilogue).
enum class Role { kPublish, kReduce, kReduceNorm, kGather, kPublishReduce, kPublishReduceNorm };
// What the reduce does after the sum: nothing, or residual add + RMSNorm (reduce_norm).
enum class Epilogue { kNone, kRmsNorm };
// Grid rows of a kernel: m, or the ceil(m / tp) rows this rank owns.
enum class Rows { kM, kOwned };

const char* RoleName(Role role);

// One kernel record of a cubin's metadata, as Python gives it.
struct KernelSpec {
  std::string role;
  std::string symbol;
  int64_t block = 0;
  int64_t smem = 0;
  int64_t ctas_per_row = 0;
  std::string rows;
  int64_t waves = 1;
  std::vector<std::string> params;
};

// The problem a kernel set was specialized for, as Python gives it.
struct KernelSetSpec {
  std::string mode;
  int64_t tp = 0;
  int64_t hidden = 0;
  int64_t top_k = 0;
  bool fp32_weights = false;
  bool include_shared_expert = false;
  bool pdl = false;
  std::string epilogue = "none";
  bool fuse_reduce = false;
};

struct Kernel {
  Role role;
  CUfunction function;
  unsigned block;
  unsigned smem;
  unsigned ctas_per_row;
  // CTAs of one thread block cluster: the row's ctas_per_row for the fused epilogue,
  // whose CTAs of a row sum its squares through distributed shared memory; else 1.
  unsigned cluster;
  Rows rows;
  // Passes of a persistent kernel's grid over the rows: its grid is the CTAs of
  // ceil(rows / waves) rows. 1 for the other roles.
  unsigned waves;
  // CTAs the device holds at once: the grid of a persistent (fused) kernel, whose
  // CTAs wait on each other's peers, is capped at it. 0 for the other roles.
  int64_t max_resident_ctas;
};

// A 1-D launch of `kernel` over `ctas` CTAs: grid, block and dynamic shared memory; the
// caller adds the stream and the attributes.
CUlaunchConfig LaunchConfig(const Kernel& kernel, unsigned ctas);

// The launch attribute that groups `ctas` consecutive CTAs into one cluster.
CUlaunchAttribute ClusterDimension(unsigned ctas);

struct KernelSet {
  Mode mode;
  int64_t tp;
  int64_t hidden;
  int64_t top_k;
  bool fp32_weights;
  bool include_shared_expert;
  bool pdl;
  Epilogue epilogue;
  bool fuse_reduce;
  std::vector<Kernel> kernels;  // In launch order.
};

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

  // Loads `cubin` in the device's primary context. A set already loaded on
  // that device is left as it is. Throws std::invalid_argument for records
  // that do not match the kernel ABI, std::runtime_error for CUDA failures.
  void LoadKernelSet(int64_t kernel_set_id, int device, std::string_view cubin,
                     const std::vector<KernelSpec>& kernels, const KernelSetSpec& spec);

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
