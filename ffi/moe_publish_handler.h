// The XLA FFI handler of target "jax_moe_publish" (see moe_publish_handler.cc).

#ifndef JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
#define JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePublish);

#endif  // JAX_MOE_PUBLISH_FFI_MOE_PUBLISH_HANDLER_H_
