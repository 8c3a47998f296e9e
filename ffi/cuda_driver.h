// The CUDA driver API, resolved at run time.
//
// The extension never links libcuda: it must import on machines that have no
// driver at all (CI, development). The first use dlopens libcuda.so.1 and asks
// cuGetProcAddress for every entry point; where that fails, `error` says why
// and every caller reports it instead of crashing.

#ifndef JAX_MOE_PUBLISH_FFI_CUDA_DRIVER_H_
#define JAX_MOE_PUBLISH_FFI_CUDA_DRIVER_H_

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace jax_moe_publish {

// Entry points at their CUDA 12.0 ABI (the version asked of cuGetProcAddress).
struct CudaDriver {
  std::string error;  // Empty once every entry point is resolved and cuInit succeeded.
  PFN_cuGetErrorName_v6000 GetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 GetErrorString = nullptr;
  PFN_cuInit_v2000 Init = nullptr;
  PFN_cuDeviceGet_v2000 DeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 DeviceGetAttribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 DevicePrimaryCtxRetain = nullptr;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent = nullptr;
  PFN_cuModuleLoadData_v2000 ModuleLoadData = nullptr;
  PFN_cuModuleUnload_v2000 ModuleUnload = nullptr;
  PFN_cuModuleGetFunction_v2000 ModuleGetFunction = nullptr;
  PFN_cuFuncSetAttribute_v9000 FuncSetAttribute = nullptr;
  PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050 OccupancyMaxActiveBlocksPerMultiprocessor =
      nullptr;
  PFN_cuOccupancyMaxActiveClusters_v11070 OccupancyMaxActiveClusters = nullptr;
  PFN_cuLaunchKernelEx_v11060 LaunchKernelEx = nullptr;
  PFN_cuStreamIsCapturing_v10000 StreamIsCapturing = nullptr;
};

// The process-wide driver table, loaded on first call (thread-safe). Check
// `error` before using it.
const CudaDriver& GetCudaDriver();

// "<call>: CUDA_ERROR_NAME: description" for a failed driver call.
std::string CudaErrorMessage(const CudaDriver& cuda, const char* call, CUresult result);

}  // namespace jax_moe_publish

#endif  // JAX_MOE_PUBLISH_FFI_CUDA_DRIVER_H_
