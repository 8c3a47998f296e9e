#include "registry.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda_driver.h"

namespace jax_moe_publish {
namespace {

std::string Quote(std::string_view text) { return "'" + std::string(text) + "'"; }

std::string ListRepr(const std::vector<std::string>& items) {
  std::string text = "[";
  for (size_t i = 0; i < items.size(); ++i) text += (i ? ", " : "") + Quote(items[i]);
  return text + "]";
}

void Require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

// The entry of a contract table (kValues, kDtypes, kTargets) named `name`, or nullptr.
template <typename Entry, size_t N>
const Entry* FindNamed(const Entry (&table)[N], std::string_view name) {
  for (const Entry& entry : table) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

// Every name of a contract table, for a message.
template <typename Entry, size_t N>
std::vector<std::string> NamesOf(const Entry (&table)[N]) {
  std::vector<std::string> names;
  for (const Entry& entry : table) names.emplace_back(entry.name);
  return names;
}

std::optional<Value> FindValue(std::string_view name) {
  const ValueInfo* value = FindNamed(kValues, name);
  if (value == nullptr) return std::nullopt;
  return static_cast<Value>(value - kValues);
}

// The names of the contract's values that `keep` selects.
template <typename Keep>
std::vector<std::string> ValueNames(Keep keep) {
  std::vector<std::string> names;
  for (const ValueInfo& value : kValues) {
    if (keep(value)) names.emplace_back(value.name);
  }
  return names;
}

// The value named `name` of the launch contract (launch_values.h).
Value ParseValue(const std::string& where, const std::string& name) {
  std::optional<Value> value = FindValue(name);
  Require(value.has_value(),
          where + ": parameter " + Quote(name) + " is not a value of the launch contract " +
              ListRepr(NamesOf(kValues)));
  return *value;
}

// The sidecar's word of each rows rule but Rows::kFixed, which it writes as None.
constexpr std::pair<std::string_view, Rows> kRowsWords[] = {
    {"num_rows", Rows::kNumRows}, {"m", Rows::kM},           {"owned", Rows::kOwned},
    {"pairs", Rows::kPairs},      {"zero", Rows::kZero},     {"resident", Rows::kResident}};

std::optional<Rows> FindRows(std::string_view word) {
  for (const auto& [name, rows] : kRowsWords) {
    if (name == word) return rows;
  }
  return std::nullopt;
}

bool Takes(const std::vector<Value>& params, Value value) {
  return std::find(params.begin(), params.end(), value) != params.end();
}

// Checks one kernel record against the launch contract.
Kernel ValidateKernel(const std::string& name, const KernelSpec& spec) {
  Require(!spec.symbol.empty(), name + ": symbol is empty");
  Require(spec.params.size() == spec.param_types.size(),
          name + ": " + std::to_string(spec.params.size()) + " params but " +
              std::to_string(spec.param_types.size()) + " param_types");
  Kernel kernel{spec.role, nullptr, {}, 0, 0, 0, 1, Rows::kM, 1, spec.persistent, 0};
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const Value value = ParseValue(name, spec.params[i]);
    Require(!Takes(kernel.params, value), name + ": parameter " + Quote(spec.params[i]) + " twice");
    const std::string expected(Info(value).ptx_type);
    Require(spec.param_types[i] == expected,
            name + ": parameter " + std::to_string(i) + " (" + spec.params[i] + ") of " +
                Quote(spec.symbol) + " has type " + Quote(spec.param_types[i]) +
                ", but the launch contract's " + spec.params[i] + " is " + Quote(expected));
    kernel.params.push_back(value);
  }
  Require(spec.block >= 1 && spec.block <= kMaxThreads,
          name + ": block=" + std::to_string(spec.block) + ": expected 1 to 1024 threads");
  Require(spec.smem >= 0 && spec.smem <= std::numeric_limits<int>::max(),
          name + ": smem=" + std::to_string(spec.smem) + ": expected a byte count >= 0");
  Require(spec.ctas_per_row >= 1 && spec.ctas_per_row <= std::numeric_limits<int>::max(),
          name + ": ctas_per_row=" + std::to_string(spec.ctas_per_row) + ": expected >= 1");
  const std::optional<Rows> rows = FindRows(spec.rows);
  Require(rows == Rows::kM || rows == Rows::kOwned || rows == Rows::kResident,
          name + ": rows=" + Quote(spec.rows) + ": expected 'm', 'owned' or 'resident'");
  Require(rows != Rows::kResident || spec.persistent,
          name + ": rows='resident' for a kernel that is not persistent: expected a persistent "
                 "one (its grid is the CTAs the device holds at once)");
  Require(spec.waves >= 1 && spec.waves <= std::numeric_limits<int>::max(),
          name + ": waves=" + std::to_string(spec.waves) + ": expected >= 1");
  Require(spec.persistent || spec.waves == 1,
          name + ": waves=" + std::to_string(spec.waves) +
              ": expected 1 for a kernel that is not persistent (only a persistent grid makes "
              "several passes)");
  Require(spec.cluster >= 1 && spec.cluster <= kMaxClusterCtas,
          name + ": cluster=" + std::to_string(spec.cluster) + ": expected 1 to " +
              std::to_string(kMaxClusterCtas) + " CTAs");
  Require(spec.ctas_per_row % spec.cluster == 0,
          name + ": cluster=" + std::to_string(spec.cluster) + " does not divide ctas_per_row=" +
              std::to_string(spec.ctas_per_row));
  kernel.block = static_cast<unsigned>(spec.block);
  kernel.smem = static_cast<unsigned>(spec.smem);
  kernel.ctas_per_row = static_cast<unsigned>(spec.ctas_per_row);
  kernel.cluster = static_cast<unsigned>(spec.cluster);
  kernel.rows = *rows;
  kernel.waves = static_cast<unsigned>(spec.waves);
  return kernel;
}

std::string Count(size_t count, const char* noun) {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : "s");
}

// Checks one operand record, the `index`th of a call of `op`; `seen` are the operands before it.
Operand ValidateOperand(const std::string& where, size_t index, const OperandSpec& spec, Op op,
                        const std::vector<Operand>& seen, bool after_ret) {
  const std::string at = where + "operands[" + std::to_string(index) + "]";
  const std::optional<Value> value = FindValue(spec.name);
  auto is_operand = [op](const ValueInfo& info) {
    return info.source == Source::kOperand && (info.ops & OpBit(op)) != 0;
  };
  Require(value.has_value() && is_operand(Info(*value)),
          at + ": name=" + Quote(spec.name) + ": expected one of the op's operands " +
              ListRepr(ValueNames(is_operand)));
  const std::string name = at + " (" + spec.name + ")";
  for (const Operand& operand : seen) {
    Require(operand.value != *value, name + ": a second operand " + Quote(spec.name));
  }
  Require(spec.io == "arg" || spec.io == "ret",
          name + ": io=" + Quote(spec.io) + ": expected 'arg' or 'ret'");
  Require(spec.io == "ret" || !after_ret,
          name + ": io='arg' after a 'ret': expected every arg before every ret (the FFI order)");
  const DtypeInfo* dtype = FindNamed(kDtypes, spec.dtype);
  Require(dtype != nullptr,
          name + ": dtype=" + Quote(spec.dtype) + ": expected one of " + ListRepr(NamesOf(kDtypes)));
  const std::optional<Rows> rows = spec.rows ? FindRows(*spec.rows) : Rows::kFixed;
  Require(rows.has_value() && rows != Rows::kResident,
          name + ": rows=" + Quote(spec.rows.value_or("")) +
              ": expected 'num_rows', 'm', 'owned', 'pairs', 'zero' or None (a fixed shape)");
  const bool m_fixed = std::any_of(seen.begin(), seen.end(),
                                   [](const Operand& operand) { return operand.rows == Rows::kM; });
  Require((*rows != Rows::kOwned && *rows != Rows::kPairs) || m_fixed,
          name + ": rows=" + Quote(spec.rows.value_or("")) +
              " before any operand with rows 'm': expected the operand that fixes m first, since "
              "its rows need m");
  Require(!spec.shape.empty() || *rows != Rows::kFixed,
          name + ": no rows and an empty shape: expected an array of at least one dimension");
  for (size_t i = 0; i < spec.shape.size(); ++i) {
    Require(spec.shape[i] >= 1, name + ": shape[" + std::to_string(i) + "]=" +
                                    std::to_string(spec.shape[i]) + ": expected >= 1");
  }
  return Operand{*value, *dtype, *rows, spec.shape};
}

// Checks the call record: its target, shape and operands (in FFI order).
void ValidateCall(const std::string& where, const CallSpec& call, KernelSet* set) {
  const std::string at = where + ": call: ";
  const TargetInfo* target = FindNamed(kTargets, call.target);
  Require(target != nullptr,
          at + "target=" + Quote(call.target) + ": expected one of " + ListRepr(NamesOf(kTargets)));
  Require(call.tp >= 1, at + "tp=" + std::to_string(call.tp) + ": expected >= 1");
  Require(call.hidden >= 1, at + "hidden=" + std::to_string(call.hidden) + ": expected >= 1");
  Require(call.top_k >= 1, at + "top_k=" + std::to_string(call.top_k) + ": expected >= 1");
  Require(call.max_m >= 1 && call.max_m <= std::numeric_limits<int32_t>::max(),
          at + "max_m=" + std::to_string(call.max_m) +
              ": expected 1 to 2**31 - 1 (the kernels count tokens in 32-bit ints)");
  set->target = target->target;
  set->tp = call.tp;
  set->hidden = call.hidden;
  set->top_k = call.top_k;
  set->max_m = call.max_m;
  set->pdl = call.pdl;
  size_t args = 0;
  size_t num_rows = 0;
  size_t m = 0;
  for (size_t i = 0; i < call.operands.size(); ++i) {
    Operand operand =
        ValidateOperand(at, i, call.operands[i], target->op, set->operands, args < i);
    args += call.operands[i].io == "arg";
    num_rows += operand.rows == Rows::kNumRows;
    m += operand.rows == Rows::kM;
    set->operands.push_back(operand);
  }
  Require(num_rows <= 1, at + Count(num_rows, "operand") +
                             " with rows 'num_rows': expected at most one (it gives num_rows)");
  Require(m >= 1, at + "no operand with rows 'm': expected at least one (the first fixes m)");
  set->args = args;
  Require(args >= 1 && args < call.operands.size(),
          at + "operands lists " + Count(args, "arg") + " and " +
              Count(call.operands.size() - args, "ret") + ": expected at least one of each");
}

// Checks that every value `kernel` takes is its op's, and that the call gives it from an operand,
// the operands' rows or an attribute.
void CheckKernelValues(const std::string& name, const Kernel& kernel, const KernelSet& set) {
  const TargetInfo& target = Info(set.target);
  for (Value value : kernel.params) {
    const std::string param = name + ": parameter " + Quote(Info(value).name);
    Require((Info(value).ops & OpBit(target.op)) != 0,
            param + " is not a value of the op of target " + Quote(target.name));
    if (Info(value).source == Source::kOperand) {
      const bool given =
          std::any_of(set.operands.begin(), set.operands.end(),
                      [value](const Operand& operand) { return operand.value == value; });
      Require(given, param + " is the address of an operand, but the call has no operand " +
                         Quote(Info(value).name));
    } else if (Info(value).source == Source::kAttribute) {
      Require(target.norm_eps, param + " comes from the attribute norm_eps, which target " +
                                   Quote(target.name) + " does not take");
    } else if (value == Value::kNumRows) {
      Require(std::any_of(set.operands.begin(), set.operands.end(),
                          [](const Operand& operand) { return operand.rows == Rows::kNumRows; }),
              param + " is the rows of the operand with rows 'num_rows', but the call has none");
    } else if (Info(value).source == Source::kMailbox) {
      Require(target.mailbox, param + " comes from the mailbox, which target " +
                                  Quote(target.name) + " does not take");
    }
  }
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

KernelSet ValidateKernelSet(const std::string& where, const std::vector<KernelSpec>& specs,
                            const CallSpec& call) {
  KernelSet set{Target::kPublish, 0, 0, 0, 0, false, false, 0, {}, {}};
  ValidateCall(where, call, &set);
  Require(!specs.empty(), where + ": kernels is empty");
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string name = where + ": kernels[" + std::to_string(i) + "] (" + specs[i].role + ")";
    Kernel kernel = ValidateKernel(name, specs[i]);
    CheckKernelValues(name, kernel, set);
    set.uses_mailbox = set.uses_mailbox || Takes(kernel.params, Value::kMailbox) ||
                       Takes(kernel.params, Value::kPeerTable);
    set.kernels.push_back(std::move(kernel));
  }
  for (const Operand& operand : set.operands) {
    const bool taken = std::any_of(set.kernels.begin(), set.kernels.end(), [&](const Kernel& kernel) {
      return Takes(kernel.params, operand.value);
    });
    Require(taken, where + ": call: operand " + Quote(Info(operand.value).name) +
                       " is taken by no kernel of the set: expected the operands of its kernels");
  }
  Require(set.uses_mailbox == (call.tp > 1),
          where + ": tp=" + std::to_string(call.tp) + (set.uses_mailbox ? " with" : " without") +
              " a kernel that takes the mailbox: expected one exactly when tp > 1");
  return set;
}

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
                             const std::vector<KernelSpec>& kernels, const CallSpec& call) {
  const std::string where = "load_kernel_set(kernel_set_id=" + std::to_string(kernel_set_id) +
                            ", device_ordinal=" + std::to_string(device) + ")";
  Require(device >= 0, where + ": device_ordinal must be >= 0");
  Require(!cubin.empty(), where + ": cubin is empty");
  KernelSet set = ValidateKernelSet(where, kernels, call);

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
      if (kernel.smem > kDefaultSmemBytes) {
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
      if (kernel.persistent) {
        kernel.max_resident_ctas = ResidentCtas(cuda, where, device, kernel);
        Require(kernel.max_resident_ctas > 0,
                where + ": the " + kernel.role + " kernel (block=" +
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
  // A u32 parameter, but the kernels count tokens in signed 32-bit ints.
  Require(mailbox.capacity_m >= 1 && mailbox.capacity_m <= std::numeric_limits<int32_t>::max(),
          where + ": capacity_m=" + std::to_string(mailbox.capacity_m) +
              ": expected 1 to 2**31 - 1 (the kernels count tokens in 32-bit ints)");
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
