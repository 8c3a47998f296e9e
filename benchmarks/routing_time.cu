// The time the experts kernels spend on their routing tables, per launch, against m.
//
//   python benchmarks/routing_probe.py --out DIR                  # where CuTe DSL is
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iffi benchmarks/routing_time.cu ffi/cuda_driver.cc -ldl -o routing_time
//   JMP_COMMIT=$(git rev-parse HEAD) ./routing_time DIR results.json
//
// Every CTA of both experts kernels builds the call's routing tables from the ids before it
// reads a weight (`ExpertRouting`). `routing_probe.py` compiles a kernel that does only that;
// this program launches it at the experts kernels' grids (1 and 2 CTAs of its threads per SM),
// for ids drawn as top-k distinct experts per token, and checks every CTA's totals (active
// groups, valid pairs) against the host's count of the same ids. A CUDA graph of `kLaunches`
// launches is replayed `kReps` times; a launch's time is the median over the replays, and
// an empty kernel of the same grid, threads and shared memory is timed the same way: the
// difference is what the routing adds to a launch.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_bench.h"
#include "cuda_driver.h"

namespace {

using jax_moe_publish::CudaDriver;

// The driver's functions come from the extension's loader (no link against libcuda, which a
// machine without a GPU lacks).
const CudaDriver& Driver() {
  const CudaDriver& cuda = jax_moe_publish::GetCudaDriver();
  if (!cuda.error.empty()) {
    std::fprintf(stderr, "%s\n", cuda.error.c_str());
    std::exit(1);
  }
  return cuda;
}

#define CHECK_CU(call)                                                                        \
  do {                                                                                        \
    CUresult result_ = (call);                                                                \
    if (result_ != CUDA_SUCCESS) {                                                            \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__,                                 \
                   jax_moe_publish::CudaErrorMessage(Driver(), #call, result_).c_str());      \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kLaunches = 100;
constexpr int kReps = 21;
constexpr int kMs[] = {1, 4, 16, 64, 256};

struct Probe {
  std::string file, symbol;
  int threads = 0, smem = 0, experts = 0, top_k = 0, shared = 0;
};

__global__ void Empty() {}

void Launch(CUfunction function, void** params, int grid, const Probe& probe, cudaStream_t stream) {
  CUlaunchConfig config = {};
  config.gridDimX = grid;
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = probe.threads;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = probe.smem;
  config.hStream = stream;
  CHECK_CU(Driver().LaunchKernelEx(&config, function, params, nullptr));
}

// Median µs per launch of the probe's `function` at `grid` CTAs, and of the empty kernel there.
double TimeProbe(CUfunction function, void** params, int grid, const Probe& probe, cudaStream_t stream) {
  return MedianGraphMicroseconds(stream, kReps, kLaunches, [&](cudaStream_t s) {
    for (int i = 0; i < kLaunches; ++i) Launch(function, params, grid, probe, s);
  });
}

double TimeEmpty(int grid, const Probe& probe, cudaStream_t stream) {
  return MedianGraphMicroseconds(stream, kReps, kLaunches, [&](cudaStream_t s) {
    for (int i = 0; i < kLaunches; ++i) Empty<<<grid, probe.threads, probe.smem, s>>>();
  });
}

std::vector<Probe> ReadProbes(const std::string& dir) {
  std::ifstream list(dir + "/routing.txt");
  if (!list) {
    std::fprintf(stderr, "no %s/routing.txt: build it with python benchmarks/routing_probe.py --out %s\n",
                 dir.c_str(), dir.c_str());
    std::exit(2);
  }
  std::vector<Probe> probes;
  std::string line;
  while (std::getline(list, line)) {
    std::istringstream fields(line);
    Probe p;
    if (fields >> p.file >> p.symbol >> p.threads >> p.smem >> p.experts >> p.top_k >> p.shared) probes.push_back(p);
  }
  return probes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  return std::string(std::istreambuf_iterator<char>(file), {});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DIR results.json\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));  // the primary context, which the driver calls below use
  const CudaDriver& cuda = Driver();
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int max_m = kMs[std::size(kMs) - 1];
  FILE* out = std::fopen(argv[2], "w");
  if (out == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", argv[2]);
    return 1;
  }
  const char* commit = std::getenv("JMP_COMMIT");
  std::fprintf(out, "{\n \"commit\": \"%s\",\n \"gpu\": \"%s\",\n \"multiprocessors\": %d,\n \"launches_per_graph\": %d,\n"
               " \"reps\": %d,\n \"cases\": [\n", commit != nullptr ? commit : "unknown", prop.name,
               prop.multiProcessorCount, kLaunches, kReps);
  std::mt19937 random(0);
  bool first_case = true;
  for (const Probe& probe : ReadProbes(dir)) {
    CUmodule module;
    CUfunction function;
    CHECK_CU(cuda.ModuleLoadData(&module, ReadFile(dir + "/" + probe.file).data()));
    CHECK_CU(cuda.ModuleGetFunction(&function, module, probe.symbol.c_str()));
    CHECK_CU(cuda.FuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, probe.smem));
    const int max_grid = prop.multiProcessorCount * 2;
    int32_t* ids;
    uint32_t* totals;
    CHECK(cudaMalloc(&ids, sizeof(int32_t) * max_m * probe.top_k));
    CHECK(cudaMalloc(&totals, sizeof(uint32_t) * 2 * max_grid));
    for (int m : kMs) {
      // Top-k distinct experts per token, uniformly: as a router's choice, not its distribution.
      std::vector<int32_t> host(size_t(m) * probe.top_k);
      std::set<int32_t> active;
      for (int t = 0; t < m; ++t) {
        std::set<int32_t> chosen;
        while (int(chosen.size()) < probe.top_k) chosen.insert(int32_t(random() % probe.experts));
        int k = 0;
        for (int32_t e : chosen) host[size_t(t) * probe.top_k + k++] = e;
        active.insert(chosen.begin(), chosen.end());
      }
      const uint32_t want_active = uint32_t(active.size()) + probe.shared;
      const uint32_t want_valid = uint32_t(m) * (probe.top_k + probe.shared);
      CHECK(cudaMemcpy(ids, host.data(), sizeof(int32_t) * host.size(), cudaMemcpyHostToDevice));
      CUdeviceptr ids_address = reinterpret_cast<CUdeviceptr>(ids), totals_address = reinterpret_cast<CUdeviceptr>(totals);
      int32_t m_value = m;
      void* params[] = {&ids_address, &totals_address, &m_value};
      for (int per_sm = 1; per_sm <= 2; ++per_sm) {
        const int grid = prop.multiProcessorCount * per_sm;
        CHECK(cudaMemset(totals, 0xFF, sizeof(uint32_t) * 2 * max_grid));
        Launch(function, params, grid, probe, stream);
        CHECK(cudaStreamSynchronize(stream));
        std::vector<uint32_t> got(2 * grid);
        CHECK(cudaMemcpy(got.data(), totals, sizeof(uint32_t) * got.size(), cudaMemcpyDeviceToHost));
        for (int b = 0; b < grid; ++b) {
          if (got[2 * b] != want_active || got[2 * b + 1] != want_valid) {
            std::fprintf(stderr, "%s m=%d CTA %d: totals %u active, %u valid; the host counts %u and %u\n",
                         probe.file.c_str(), m, b, got[2 * b], got[2 * b + 1], want_active, want_valid);
            return 1;
          }
        }
        const double routing_us = TimeProbe(function, params, grid, probe, stream);
        const double empty_us = TimeEmpty(grid, probe, stream);
        std::printf("%-36s m=%4d  %d CTA/SM: %6.2f us per launch, empty %5.2f, routing adds %5.2f\n",
                    probe.file.c_str(), m, per_sm, routing_us, empty_us, routing_us - empty_us);
        std::fprintf(out, "%s  {\"probe\": \"%s\", \"experts\": %d, \"top_k\": %d, \"shared_expert\": %s, \"m\": %d, "
                     "\"active_groups\": %u, \"threads\": %d, \"ctas_per_sm\": %d, \"us_per_launch\": %.3f, "
                     "\"empty_us_per_launch\": %.3f, \"routing_us\": %.3f}",
                     first_case ? "" : ",\n", probe.file.c_str(), probe.experts, probe.top_k,
                     probe.shared ? "true" : "false", m, want_active, probe.threads, per_sm, routing_us, empty_us,
                     routing_us - empty_us);
        first_case = false;
      }
    }
    CHECK(cudaFree(ids));
    CHECK(cudaFree(totals));
    CHECK_CU(cuda.ModuleUnload(module));
  }
  std::fprintf(out, "\n ]\n}\n");
  std::fclose(out);
  return 0;
}
