#include "cuda_driver.h"

#include <dlfcn.h>

#include <string>

namespace jax_moe_publish {
namespace {

// The ABI version asked for every symbol; the PFN types in cuda_driver.h match it.
constexpr int kCudaAbiVersion = 12000;
constexpr char kLibcuda[] = "libcuda.so.1";

template <typename Fn>
bool Resolve(PFN_cuGetProcAddress_v12000 get_proc_address, const char* name, Fn* fn,
             std::string* error) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = get_proc_address(name, &address, kCudaAbiVersion,
                                     CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (result != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || address == nullptr) {
    *error = std::string(kLibcuda) + " could not be loaded: cuGetProcAddress(\"" + name +
             "\", cudaVersion " + std::to_string(kCudaAbiVersion) + ") failed with CUresult " +
             std::to_string(result) + ", query status " + std::to_string(status);
    return false;
  }
  *fn = reinterpret_cast<Fn>(address);
  return true;
}

CudaDriver Load() {
  CudaDriver cuda;
  // RTLD_LOCAL: the driver's symbols must not leak into the process's global namespace.
  void* library = dlopen(kLibcuda, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = dlerror();
    cuda.error = std::string(kLibcuda) + " could not be loaded: " + (reason ? reason : "unknown");
    return cuda;
  }
  // The exported name "cuGetProcAddress" is the CUDA 11.3 ABI without the
  // status out-parameter; the _v2 export has it (drivers of CUDA 12.0 on).
  auto get_proc_address =
      reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc_address == nullptr) {
    cuda.error = std::string(kLibcuda) +
                 " could not be loaded: it exports no cuGetProcAddress_v2 (driver older than "
                 "CUDA 12.0)";
    return cuda;
  }
  std::string error;
  bool resolved =
      Resolve(get_proc_address, "cuGetErrorName", &cuda.GetErrorName, &error) &&
      Resolve(get_proc_address, "cuGetErrorString", &cuda.GetErrorString, &error) &&
      Resolve(get_proc_address, "cuInit", &cuda.Init, &error) &&
      Resolve(get_proc_address, "cuDeviceGet", &cuda.DeviceGet, &error) &&
      Resolve(get_proc_address, "cuDeviceGetAttribute", &cuda.DeviceGetAttribute, &error) &&
      Resolve(get_proc_address, "cuDevicePrimaryCtxRetain", &cuda.DevicePrimaryCtxRetain,
              &error) &&
      Resolve(get_proc_address, "cuCtxPushCurrent", &cuda.CtxPushCurrent, &error) &&
      Resolve(get_proc_address, "cuCtxPopCurrent", &cuda.CtxPopCurrent, &error) &&
      Resolve(get_proc_address, "cuModuleLoadData", &cuda.ModuleLoadData, &error) &&
      Resolve(get_proc_address, "cuModuleUnload", &cuda.ModuleUnload, &error) &&
      Resolve(get_proc_address, "cuModuleGetFunction", &cuda.ModuleGetFunction, &error) &&
      Resolve(get_proc_address, "cuFuncSetAttribute", &cuda.FuncSetAttribute, &error) &&
      Resolve(get_proc_address, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
              &cuda.OccupancyMaxActiveBlocksPerMultiprocessor, &error) &&
      Resolve(get_proc_address, "cuOccupancyMaxActiveClusters", &cuda.OccupancyMaxActiveClusters,
              &error) &&
      Resolve(get_proc_address, "cuLaunchKernelEx", &cuda.LaunchKernelEx, &error) &&
      Resolve(get_proc_address, "cuStreamIsCapturing", &cuda.StreamIsCapturing, &error);
  if (!resolved) {
    cuda.error = error;
    return cuda;
  }
  if (CUresult result = cuda.Init(0); result != CUDA_SUCCESS) {
    cuda.error = std::string(kLibcuda) + " is unusable: " + CudaErrorMessage(cuda, "cuInit", result);
  }
  return cuda;
}

}  // namespace

const CudaDriver& GetCudaDriver() {
  static const CudaDriver cuda = Load();
  return cuda;
}

std::string CudaErrorMessage(const CudaDriver& cuda, const char* call, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuda.GetErrorName(result, &name);
  cuda.GetErrorString(result, &text);
  return std::string(call) + ": " + (name ? name : "CUresult " + std::to_string(result)) + ": " +
         (text ? text : "unknown error");
}

}  // namespace jax_moe_publish
