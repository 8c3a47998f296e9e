#include "registry.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace jax_moe_publish {
namespace {

// Dynamic shared memory above this needs an explicit opt-in per function.
constexpr int64_t kDefaultSmemLimit = 48 * 1024;
constexpr int64_t kPortableClusterCtas = 8;
constexpr int64_t kMaxClusterCtas = 16;  // Hopper's largest, beyond the portable size by opt-in

// The kernel parameter ABI of each role, in PTX .param types.
const std::vector<std::string>& ExpectedParams(Role role) {
  // routed, weights, indices, shared, stage_state, destination, num_rows, m, capacity_m, rank
  static const std::vector<std::string> publish = {"u64", "u64", "u64", "u64", "u64",
                                                   "u64", "u32", "u32", "u32", "u32"};
  // mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank
  static const std::vector<std::string> wait = {"u64", "u64", "u64", "u64", "u64",
                                                "u64", "u32", "u32", "u32"};
  // The wait parameters, then residual, norm_weight, residual_out, eps
  static const std::vector<std::string> wait_norm = {"u64", "u64", "u64", "u64", "u64",
                                                     "u64", "u32", "u32", "u32", "u64",
                                                     "u64", "u64", "f32"};
  // routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out,
  // timeout_ns, num_rows, m, capacity_m, rank
  static const std::vector<std::string> publish_reduce = {"u64", "u64", "u64", "u64", "u64",
                                                          "u64", "u64", "u64", "u64", "u64",
                                                          "u32", "u32", "u32", "u32"};
  // The publish_reduce parameters, then residual, norm_weight, residual_out, eps
  static const std::vector<std::string> publish_reduce_norm = {
      "u64", "u64", "u64", "u64", "u64", "u64", "u64", "u64", "u64",
      "u64", "u32", "u32", "u32", "u32", "u64", "u64", "u64", "f32"};
  switch (role) {
    case Role::kPublish:
      return publish;
    case Role::kPublishReduce:
      return publish_reduce;
    case Role::kPublishReduceNorm:
      return publish_reduce_norm;
    case Role::kReduceNorm:
      return wait_norm;
    case Role::kReduce:
    case Role::kGather:
      break;
  }
  return wait;
}

// The kernels each mode launches, in order; the epilogue replaces reduce by reduce_norm,
// and fuse_reduce makes the call one publish_reduce (publish_reduce_norm).
std::vector<Role> ExpectedRoles(Mode mode, Epilogue epilogue, bool fuse_reduce) {
  if (fuse_reduce) {
    return {epilogue == Epilogue::kNone ? Role::kPublishReduce : Role::kPublishReduceNorm};
  }
  const Role reduce = epilogue == Epilogue::kNone ? Role::kReduce : Role::kReduceNorm;
  switch (mode) {
    case Mode::kDirect:
      return {Role::kPublish};
    case Mode::kOneshot:
    case Mode::kReduceScatter:
      return {Role::kPublish, reduce};
    case Mode::kTwoshot:
      return {Role::kPublish, reduce, Role::kGather};
  }
  return {};
}

std::string Quote(const std::string& text) { return "'" + text + "'"; }

std::string ListRepr(const std::vector<std::string>& items) {
  std::string text = "[";
  for (size_t i = 0; i < items.size(); ++i) text += (i ? ", " : "") + Quote(items[i]);
  return text + "]";
}

std::string RolesRepr(const std::vector<Role>& roles) {
  std::vector<std::string> names;
  for (Role role : roles) names.push_back(RoleName(role));
  return ListRepr(names);
}

void Require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

Mode ParseMode(const std::string& where, const std::string& mode) {
  if (mode == "oneshot") return Mode::kOneshot;
  if (mode == "twoshot") return Mode::kTwoshot;
  if (mode == "reduce_scatter") return Mode::kReduceScatter;
  if (mode == "direct") return Mode::kDirect;
  throw std::invalid_argument(where + ": mode=" + Quote(mode) +
                              ": expected one of 'oneshot', 'twoshot', 'reduce_scatter', 'direct'");
}

Epilogue ParseEpilogue(const std::string& where, const std::string& epilogue) {
  if (epilogue == "none") return Epilogue::kNone;
  if (epilogue == "rmsnorm") return Epilogue::kRmsNorm;
  throw std::invalid_argument(where + ": epilogue=" + Quote(epilogue) +
                              ": expected one of 'none', 'rmsnorm'");
}

// Checks the set against the contract before any CUDA call, so that a bad
// record is refused the same way on machines without a GPU.
KernelSet ValidateKernelSet(const std::string& where, const std::vector<KernelSpec>& specs,
                            const KernelSetSpec& spec) {
  KernelSet set{ParseMode(where, spec.mode),
                spec.tp,
                spec.hidden,
                spec.top_k,
                spec.fp32_weights,
                spec.include_shared_expert,
                spec.pdl,
                ParseEpilogue(where, spec.epilogue),
                spec.fuse_reduce,
                {}};
  Require(set.epilogue == Epilogue::kNone || set.mode == Mode::kOneshot ||
              set.mode == Mode::kReduceScatter,
          where + ": epilogue=" + Quote(spec.epilogue) + " with mode=" + Quote(spec.mode) +
              ": expected mode 'oneshot' or 'reduce_scatter'");
  Require(!set.fuse_reduce || set.mode == Mode::kOneshot,
          where + ": fuse_reduce=true with mode=" + Quote(spec.mode) + ": expected mode 'oneshot'");
  Require(spec.tp >= 1, where + ": tp=" + std::to_string(spec.tp) + ": expected >= 1");
  Require((set.mode == Mode::kDirect) == (spec.tp == 1),
          where + ": tp=" + std::to_string(spec.tp) + " with mode=" + Quote(spec.mode) +
              ": expected mode 'direct' exactly when tp == 1");
  Require(spec.hidden >= 1, where + ": hidden=" + std::to_string(spec.hidden) + ": expected >= 1");
  Require(spec.top_k >= 1, where + ": top_k=" + std::to_string(spec.top_k) + ": expected >= 1");

  std::vector<Role> roles = ExpectedRoles(set.mode, set.epilogue, set.fuse_reduce);
  const std::string kind = "mode " + Quote(spec.mode) +
                           (set.epilogue == Epilogue::kNone
                                ? std::string()
                                : " with epilogue " + Quote(spec.epilogue)) +
                           (set.fuse_reduce ? " with fuse_reduce" : "");
  std::vector<std::string> given_roles;
  for (const KernelSpec& kernel : specs) given_roles.push_back(kernel.role);
  Require(given_roles.size() == roles.size(),
          where + ": kernels have roles " + ListRepr(given_roles) + ": " + kind + " expects " +
              RolesRepr(roles));
  for (size_t i = 0; i < specs.size(); ++i) {
    const KernelSpec& kernel = specs[i];
    const Role role = roles[i];
    const std::string name = where + ": kernels[" + std::to_string(i) + "]";
    Require(kernel.role == RoleName(role), name + ": role=" + Quote(kernel.role) + ": " + kind +
                                               " expects roles " + RolesRepr(roles) +
                                               " in this order");
    Require(!kernel.symbol.empty(), name + ": symbol is empty");
    Require(kernel.block >= 1 && kernel.block <= 1024,
            name + ": block=" + std::to_string(kernel.block) + ": expected 1 to 1024 threads");
    Require(kernel.smem >= 0 && kernel.smem <= std::numeric_limits<int>::max(),
            name + ": smem=" + std::to_string(kernel.smem) + ": expected a byte count >= 0");
    Require(kernel.ctas_per_row >= 1 && kernel.ctas_per_row <= std::numeric_limits<int>::max(),
            name + ": ctas_per_row=" + std::to_string(kernel.ctas_per_row) + ": expected >= 1");
    Require(kernel.rows == "m" || kernel.rows == "owned",
            name + ": rows=" + Quote(kernel.rows) + ": expected 'm' or 'owned'");
    const std::vector<std::string>& expected = ExpectedParams(role);
    Require(kernel.params == expected, name + ": the " + kernel.role + " kernel " +
                                           Quote(kernel.symbol) + " has params " +
                                           ListRepr(kernel.params) + ", but the " + kernel.role +
                                           " ABI is " + ListRepr(expected));
    const bool persistent = role == Role::kPublishReduce || role == Role::kPublishReduceNorm;
    Require(kernel.waves >= 1 && kernel.waves <= std::numeric_limits<int>::max(),
            name + ": waves=" + std::to_string(kernel.waves) + ": expected >= 1");
    Require(persistent || kernel.waves == 1,
            name + ": waves=" + std::to_string(kernel.waves) + ": expected 1 for the " + kernel.role +
                " kernel (only a persistent kernel makes several passes)");
    const int64_t cluster = role == Role::kPublishReduceNorm ? kernel.ctas_per_row : 1;
    Require(cluster <= kMaxClusterCtas,
            name + ": ctas_per_row=" + std::to_string(kernel.ctas_per_row) + ": the " + kernel.role +
                " kernel's CTAs of a row form one cluster, expected at most " +
                std::to_string(kMaxClusterCtas));
    set.kernels.push_back(Kernel{role, nullptr, static_cast<unsigned>(kernel.block),
                                 static_cast<unsigned>(kernel.smem),
                                 static_cast<unsigned>(kernel.ctas_per_row),
                                 static_cast<unsigned>(cluster),
                                 kernel.rows == "m" ? Rows::kM : Rows::kOwned,
                                 static_cast<unsigned>(kernel.waves), 0});
  }
  return set;
}

void CheckCuda(const CudaDriver& cuda, const std::string& where, const char* call,
               CUresult result) {
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error(where + ": " + CudaErrorMessage(cuda, call, result));
  }
}

// Makes a context current for the scope of a load.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& cuda, const std::string& where, CUcontext context)
      : cuda_(cuda) {
    CheckCuda(cuda, where, "cuCtxPushCurrent", cuda.CtxPushCurrent(context));
  }
  ~ScopedContext() {
    CUcontext popped;
    cuda_.CtxPopCurrent(&popped);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaDriver& cuda_;
};

// CTAs of `kernel` that the device runs at once: its occupancy per SM times the SMs, or
// for a cluster kernel its resident clusters times the cluster size.
int64_t ResidentCtas(const CudaDriver& cuda, const std::string& where, int device,
                     const Kernel& kernel) {
  if (kernel.cluster > 1) {
    CUlaunchAttribute attribute = ClusterDimension(kernel.cluster);
    CUlaunchConfig config = LaunchConfig(kernel, kernel.cluster);
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    CheckCuda(cuda, where, "cuOccupancyMaxActiveClusters",
              cuda.OccupancyMaxActiveClusters(&clusters, kernel.function, &config));
    return static_cast<int64_t>(clusters) * kernel.cluster;
  }
  int per_sm = 0;
  CheckCuda(cuda, where, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            cuda.OccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel.function,
                                                           static_cast<int>(kernel.block),
                                                           kernel.smem));
  CUdevice handle;
  CheckCuda(cuda, where, "cuDeviceGet", cuda.DeviceGet(&handle, device));
  int sms = 0;
  CheckCuda(cuda, where, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            cuda.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, handle));
  return static_cast<int64_t>(per_sm) * sms;
}

}  // namespace

CUlaunchConfig LaunchConfig(const Kernel& kernel, unsigned ctas) {
  CUlaunchConfig config = {};
  config.gridDimX = ctas;
  config.gridDimY = 1;
  config.gridDimZ = 1;
  config.blockDimX = kernel.block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = kernel.smem;
  return config;
}

CUlaunchAttribute ClusterDimension(unsigned ctas) {
  CUlaunchAttribute attribute = {};
  attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attribute.value.clusterDim.x = ctas;
  attribute.value.clusterDim.y = 1;
  attribute.value.clusterDim.z = 1;
  return attribute;
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kPublish:
      return "publish";
    case Role::kReduce:
      return "reduce";
    case Role::kReduceNorm:
      return "reduce_norm";
    case Role::kGather:
      return "gather";
    case Role::kPublishReduce:
      return "publish_reduce";
    case Role::kPublishReduceNorm:
      return "publish_reduce_norm";
  }
  return "unknown";
}

Registry& Registry::Get() {
  static Registry* registry = new Registry();  // Never destroyed: XLA may call in at exit.
  return *registry;
}

CUcontext Registry::RetainPrimaryContext(const std::string& where, int device) {
  auto it = primary_contexts_.find(device);
  if (it != primary_contexts_.end()) return it->second;
  const CudaDriver& cuda = GetCudaDriver();
  CUdevice handle;
  CheckCuda(cuda, where, "cuDeviceGet", cuda.DeviceGet(&handle, device));
  CUcontext context;
  CheckCuda(cuda, where, "cuDevicePrimaryCtxRetain", cuda.DevicePrimaryCtxRetain(&context, handle));
  primary_contexts_.emplace(device, context);
  return context;
}

void Registry::LoadKernelSet(int64_t kernel_set_id, int device, std::string_view cubin,
                             const std::vector<KernelSpec>& kernels, const KernelSetSpec& spec) {
  const std::string where = "load_kernel_set(kernel_set_id=" + std::to_string(kernel_set_id) +
                            ", device_ordinal=" + std::to_string(device) + ")";
  Require(device >= 0, where + ": device_ordinal must be >= 0");
  Require(!cubin.empty(), where + ": cubin is empty");
  KernelSet set = ValidateKernelSet(where, kernels, spec);

  std::lock_guard<std::mutex> load_lock(load_mutex_);
  if (FindKernelSet(kernel_set_id, device) != nullptr) return;
  const CudaDriver& cuda = GetCudaDriver();
  if (!cuda.error.empty()) throw std::runtime_error(where + ": " + cuda.error);

  ScopedContext scope(cuda, where, RetainPrimaryContext(where, device));
  CUmodule module;
  CheckCuda(cuda, where, "cuModuleLoadData", cuda.ModuleLoadData(&module, cubin.data()));
  try {
    for (size_t i = 0; i < kernels.size(); ++i) {
      Kernel& kernel = set.kernels[i];
      const std::string call = "cuModuleGetFunction(" + Quote(kernels[i].symbol) + ")";
      CheckCuda(cuda, where, call.c_str(),
                cuda.ModuleGetFunction(&kernel.function, module, kernels[i].symbol.c_str()));
      if (kernel.smem > kDefaultSmemLimit) {
        CheckCuda(cuda, where, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                  cuda.FuncSetAttribute(kernel.function,
                                        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        static_cast<int>(kernel.smem)));
      }
      if (kernel.cluster > kPortableClusterCtas) {
        CheckCuda(cuda, where, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                  cuda.FuncSetAttribute(kernel.function,
                                        CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1));
      }
      if (kernel.role == Role::kPublishReduce || kernel.role == Role::kPublishReduceNorm) {
        kernel.max_resident_ctas = ResidentCtas(cuda, where, device, kernel);
        Require(kernel.max_resident_ctas > 0,
                where + ": the " + RoleName(kernel.role) + " kernel (block=" +
                    std::to_string(kernel.block) + ", cluster=" + std::to_string(kernel.cluster) +
                    ", smem=" + std::to_string(kernel.smem) + ") cannot be resident on this device");
      }
    }
  } catch (...) {
    cuda.ModuleUnload(module);
    throw;
  }
  // The module stays loaded for the life of the process: captured graphs may launch it.
  std::unique_lock<std::shared_mutex> lock(mutex_);
  kernel_sets_.emplace(Key{kernel_set_id, device}, std::make_unique<const KernelSet>(std::move(set)));
}

void Registry::RegisterMailboxDevice(int64_t mailbox_id, int device, const MailboxDevice& mailbox) {
  const std::string where = "register_mailbox_device(mailbox_id=" + std::to_string(mailbox_id) +
                            ", device_ordinal=" + std::to_string(device) + ")";
  Require(mailbox_id != 0, where + ": mailbox_id 0 is reserved for mode 'direct', which has none");
  Require(device >= 0, where + ": device_ordinal must be >= 0");
  Require(mailbox.tp >= 1, where + ": tp=" + std::to_string(mailbox.tp) + ": expected >= 1");
  Require(mailbox.rank >= 0 && mailbox.rank < mailbox.tp,
          where + ": rank=" + std::to_string(mailbox.rank) + ": expected 0 <= rank < tp=" +
              std::to_string(mailbox.tp));
  Require(mailbox.hidden >= 1,
          where + ": hidden=" + std::to_string(mailbox.hidden) + ": expected >= 1");
  Require(mailbox.capacity_m >= 1 && mailbox.capacity_m <= std::numeric_limits<uint32_t>::max(),
          where + ": capacity_m=" + std::to_string(mailbox.capacity_m) +
              ": expected 1 to 2**32 - 1 (a u32 kernel parameter)");
  const std::pair<const char*, uint64_t> addresses[] = {{"mailbox", mailbox.mailbox},
                                                       {"peer_table", mailbox.peer_table},
                                                       {"stage_state", mailbox.stage_state},
                                                       {"status", mailbox.status}};
  for (const auto& [name, address] : addresses) {
    Require(address != 0, where + ": " + name + " is a null device pointer");
  }

  std::unique_lock<std::shared_mutex> lock(mutex_);
  Require(closed_mailboxes_.count(mailbox_id) == 0,
          where + ": mailbox " + std::to_string(mailbox_id) + " is closed; ids are not reused");
  mailboxes_[Key{mailbox_id, device}] = mailbox;
}

void Registry::CloseMailbox(int64_t mailbox_id) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  closed_mailboxes_.insert(mailbox_id);
  auto it = mailboxes_.lower_bound(Key{mailbox_id, std::numeric_limits<int>::min()});
  while (it != mailboxes_.end() && it->first.first == mailbox_id) it = mailboxes_.erase(it);
}

const KernelSet* Registry::FindKernelSet(int64_t kernel_set_id, int device) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = kernel_sets_.find(Key{kernel_set_id, device});
  return it == kernel_sets_.end() ? nullptr : it->second.get();
}

MailboxState Registry::FindMailbox(int64_t mailbox_id, int device, MailboxDevice* found) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  if (closed_mailboxes_.count(mailbox_id) != 0) return MailboxState::kClosed;
  auto it = mailboxes_.find(Key{mailbox_id, device});
  if (it == mailboxes_.end()) return MailboxState::kUnregistered;
  *found = it->second;
  return MailboxState::kRegistered;
}

}  // namespace jax_moe_publish
