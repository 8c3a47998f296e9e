// The XLA FFI handlers of the targets in kTargets (see moe_publish_handler.cc).

#ifndef JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
#define JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_

#include <cstdint>

#include "launch_values.h"
#include "xla/ffi/api/c_api.h"

namespace jax_moe_publish {

// The handler of `target`, for registration with JAX (the module's registrations()).
XLA_FFI_Handler* TargetHandler(Target target);

// Calls that launched their kernels since the process started: `captured`
// while XLA recorded a CUDA graph (command buffer), `direct` on a live stream.
struct ExecuteCounts {
  uint64_t captured;
  uint64_t direct;
};
ExecuteCounts GetExecuteCounts();

}  // namespace jax_moe_publish

#endif  // JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
