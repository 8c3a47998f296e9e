// Python module jax_moe_publish._ffi: the FFI handlers as capsules (registrations()), the
// setup calls that fill the registry before the first call, and the contract's tables for the
// tests that keep them equal to _abi's. jax_moe_publish/_extension.py wraps it; see there for
// the documentation of each function.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "launch_values.h"
#include "moe_publish_handler.h"
#include "registry.h"

namespace nb = nanobind;

namespace jax_moe_publish {
namespace {

template <typename T>
T Field(const nb::dict& record, const std::string& name, const char* key, const char* expected) {
  if (!record.contains(key)) {
    throw std::invalid_argument(name + ": missing key '" + key + "'");
  }
  T value;
  // A bool is not a count: nanobind would cast True to 1.
  const bool bool_for_int = std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                            nb::isinstance<nb::bool_>(record[key]);
  if (bool_for_int || !nb::try_cast(record[key], value)) {
    throw nb::type_error((name + "['" + key + "']=" + nb::repr(record[key]).c_str() +
                          ": expected " + expected)
                             .c_str());
  }
  return value;
}

// The records of `list`, which must be dicts; `name` names the list in messages.
std::vector<nb::dict> Records(const nb::list& list, const std::string& name) {
  std::vector<nb::dict> records;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!nb::isinstance<nb::dict>(list[i])) {
      throw nb::type_error((name + "[" + std::to_string(i) + "]: expected a dict").c_str());
    }
    records.push_back(nb::borrow<nb::dict>(list[i]));
  }
  return records;
}

std::vector<KernelSpec> ParseKernels(const nb::list& kernels) {
  std::vector<KernelSpec> specs;
  const std::vector<nb::dict> records = Records(kernels, "kernels");
  for (size_t i = 0; i < records.size(); ++i) {
    const std::string name = "kernels[" + std::to_string(i) + "]";
    const nb::dict& record = records[i];
    specs.push_back(KernelSpec{
        Field<std::string>(record, name, "role", "a str"),
        Field<std::string>(record, name, "symbol", "a str"),
        Field<std::vector<std::string>>(record, name, "params", "a list of str"),
        Field<std::vector<std::string>>(record, name, "param_types", "a list of str"),
        Field<int64_t>(record, name, "block", "an int"),
        Field<int64_t>(record, name, "smem", "an int"),
        Field<int64_t>(record, name, "ctas_per_row", "an int"),
        Field<std::string>(record, name, "rows", "a str"),
        Field<int64_t>(record, name, "waves", "an int"),
        Field<bool>(record, name, "persistent", "a bool"),
        Field<int64_t>(record, name, "cluster", "an int"),
    });
  }
  return specs;
}

CallSpec ParseCall(const nb::dict& call) {
  const std::string name = "call";
  CallSpec spec{
      Field<std::string>(call, name, "target", "a str"),
      Field<int64_t>(call, name, "tp", "an int"),
      Field<int64_t>(call, name, "hidden", "an int"),
      Field<int64_t>(call, name, "top_k", "an int"),
      Field<int64_t>(call, name, "max_m", "an int"),
      Field<bool>(call, name, "pdl", "a bool"),
      {},
  };
  const std::vector<nb::dict> operands =
      Records(Field<nb::list>(call, name, "operands", "a list of dicts"), "call['operands']");
  for (size_t i = 0; i < operands.size(); ++i) {
    const std::string operand = "call['operands'][" + std::to_string(i) + "]";
    const nb::dict& record = operands[i];
    spec.operands.push_back(OperandSpec{
        Field<std::string>(record, operand, "name", "a str"),
        Field<std::string>(record, operand, "io", "a str"),
        Field<std::string>(record, operand, "dtype", "a str"),
        Field<std::optional<std::string>>(record, operand, "rows", "a str or None"),
        Field<std::vector<int64_t>>(record, operand, "shape", "a list of ints"),
    });
  }
  return spec;
}

// The word of each Source, as launch_values() reports it.
const char* SourceWord(Source source) {
  switch (source) {
    case Source::kOperand:
      return "operand";
    case Source::kRows:
      return "rows";
    case Source::kMailbox:
      return "mailbox";
    case Source::kAttribute:
      return "attribute";
  }
  return "";
}

nb::str Str(std::string_view text) { return nb::str(text.data(), text.size()); }

}  // namespace
}  // namespace jax_moe_publish

NB_MODULE(_ffi, m) {
  using jax_moe_publish::Registry;

  m.def("registrations", []() {
    nb::dict registrations;
    for (const jax_moe_publish::TargetInfo& target : jax_moe_publish::kTargets) {
      registrations[jax_moe_publish::Str(target.name)] =
          nb::capsule(reinterpret_cast<void*>(jax_moe_publish::TargetHandler(target.target)));
    }
    return registrations;
  });

  m.def(
      "load_kernel_set",
      [](int64_t kernel_set_id, int device_ordinal, nb::bytes cubin, nb::list kernels, nb::dict call) {
        std::vector<jax_moe_publish::KernelSpec> specs = jax_moe_publish::ParseKernels(kernels);
        jax_moe_publish::CallSpec spec = jax_moe_publish::ParseCall(call);
        std::string_view image(cubin.c_str(), cubin.size());
        nb::gil_scoped_release release;  // A cubin load can take milliseconds.
        Registry::Get().LoadKernelSet(kernel_set_id, device_ordinal, image, specs, spec);
      },
      nb::arg("kernel_set_id"), nb::arg("device_ordinal"), nb::arg("cubin"), nb::arg("kernels"),
      nb::arg("call"));

  m.def(
      "validate_kernel_set",
      [](nb::list kernels, nb::dict call) {
        jax_moe_publish::ValidateKernelSet("validate_kernel_set",
                                           jax_moe_publish::ParseKernels(kernels),
                                           jax_moe_publish::ParseCall(call));
      },
      nb::arg("kernels"), nb::arg("call"));

  // The C++ tables of the launch contract, for the tests that keep them equal to Python's.
  m.def("launch_values", []() {
    nb::list values;
    for (const jax_moe_publish::ValueInfo& value : jax_moe_publish::kValues) {
      nb::list ops;
      for (const jax_moe_publish::Op op : jax_moe_publish::kOps) {
        if ((value.ops & jax_moe_publish::OpBit(op)) != 0) ops.append(jax_moe_publish::Str(jax_moe_publish::OpName(op)));
      }
      values.append(nb::make_tuple(jax_moe_publish::Str(value.name),
                                   jax_moe_publish::Str(value.ptx_type),
                                   jax_moe_publish::SourceWord(value.source), ops));
    }
    return values;
  });
  m.def("operand_dtypes", []() {
    nb::dict dtypes;
    for (const jax_moe_publish::DtypeInfo& dtype : jax_moe_publish::kDtypes) {
      dtypes[jax_moe_publish::Str(dtype.name)] = xla::ffi::ByteWidth(dtype.type);
    }
    return dtypes;
  });
  m.def("launch_limits", []() {
    nb::dict limits;
    limits["MAX_THREADS"] = jax_moe_publish::kMaxThreads;
    limits["PORTABLE_CLUSTER_CTAS"] = jax_moe_publish::kPortableClusterCtas;
    limits["MAX_CLUSTER_CTAS"] = jax_moe_publish::kMaxClusterCtas;
    limits["DEFAULT_SMEM_BYTES"] = jax_moe_publish::kDefaultSmemBytes;
    return limits;
  });

  m.def(
      "register_mailbox_device",
      [](int64_t mailbox_id, int device_ordinal, int64_t rank, int64_t tp, int64_t hidden,
         int64_t capacity_m, uint64_t mailbox, uint64_t peer_table, uint64_t stage_state,
         uint64_t status, uint64_t timeout_ns) {
        Registry::Get().RegisterMailboxDevice(
            mailbox_id, device_ordinal,
            jax_moe_publish::MailboxDevice{rank, tp, hidden, capacity_m, mailbox, peer_table,
                                           stage_state, status, timeout_ns});
      },
      nb::arg("mailbox_id"), nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("tp"),
      nb::arg("hidden"), nb::arg("capacity_m"), nb::arg("mailbox"), nb::arg("peer_table"),
      nb::arg("stage_state"), nb::arg("status"), nb::arg("timeout_ns"));

  m.def(
      "close_mailbox",
      [](int64_t mailbox_id) { Registry::Get().CloseMailbox(mailbox_id); },
      nb::arg("mailbox_id"));

  m.def("execute_counts", []() {
    jax_moe_publish::ExecuteCounts counts = jax_moe_publish::GetExecuteCounts();
    return nb::make_tuple(counts.captured, counts.direct);
  });
}
