// The XLA FFI handlers of targets "jax_moe_publish" and "jax_moe_publish_rmsnorm"
// (see moe_publish_handler.cc).

#ifndef JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
#define JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_

#include <cstdint>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePublish);
// Target "jax_moe_publish_rmsnorm": the same call with the residual add + RMSNorm epilogue.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePublishRmsNorm);

namespace jax_moe_publish {

// Calls that launched their kernels since the process started: `captured`
// while XLA recorded a CUDA graph (command buffer), `direct` on a live stream.
struct ExecuteCounts {
  uint64_t captured;
  uint64_t direct;
};
ExecuteCounts GetExecuteCounts();

}  // namespace jax_moe_publish

#endif  // JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
