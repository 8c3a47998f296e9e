// The least time in which dependent kernel launches can read a decode step's expert weights.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/hbm_reads.cu -o hbm_reads
//   ./hbm_reads results.json
//
// The experts op reads its weights in two dependent launches (gate/up, then down), a few to a
// hundred MB each at decode. The floor of bench_moe_experts.py is those bytes at the rate of a
// 4 GiB copy, a rate that one launch of tens of MB does not reach: it pays its launch, the
// ramp of its first loads and the tail of its last. This program measures what the plainest
// reader gets for the same launches. Each case is a list of per-launch sizes (one layer); a CUDA
// graph chains `kLayers` layers, every launch reading its own bytes from a pool of
// `kPoolBytes`, so that no launch finds its bytes in L2. Each launch is a grid-stride read of
// 16-byte words, `kUnroll` of them in flight per thread, at several CTAs per SM; the best grid
// per case is kept, with every grid's time in the JSON. A launch's sum of its words is checked
// against the host's sum of the same words, so that a read the compiler dropped cannot pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "cuda_bench.h"

namespace {

constexpr size_t kPoolBytes = size_t{16} << 30;
constexpr int kLayers = 24;
constexpr int kReps = 15;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kCtasPerSm[] = {1, 2, 4, 8};

struct Case {
  const char* name;
  std::vector<double> launch_mb;  // one layer: the bytes of each dependent launch, in 1e6 bytes
};

// Word i of the pool (32-bit words): what the check sums again on the host.
__host__ __device__ uint32_t PoolWord(size_t i) { return static_cast<uint32_t>(i) * 2654435761u + 12345u; }

__global__ void FillPool(uint32_t* pool, size_t words) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x) {
    pool[i] = PoolWord(i);
  }
}

// Sums the `vectors` 16-byte words at `source` into sums[blockIdx.x] (wrapping), `kUnroll`
// loads in flight per thread before any is added.
__global__ void __launch_bounds__(kThreads) Read(const uint4* __restrict__ source, size_t vectors,
                                                  unsigned long long* sums) {
  const size_t stride = size_t{gridDim.x} * kThreads;
  size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x;
  uint32_t sum = 0;
  for (; i + (kUnroll - 1) * stride < vectors; i += kUnroll * stride) {
    uint4 words[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) words[u] = __ldcs(source + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) sum += words[u].x + words[u].y + words[u].z + words[u].w;
  }
  for (; i < vectors; i += stride) {
    uint4 w = __ldcs(source + i);
    sum += w.x + w.y + w.z + w.w;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(sums + blockIdx.x, static_cast<unsigned long long>(sum));
}

size_t VectorsOf(double mb) { return static_cast<size_t>(mb * 1e6) / 16; }

// Time per layer (µs, the median of kReps graph replays) of `layer` at `ctas` CTAs per launch.
double TimeLayer(const std::vector<double>& layer, int ctas, const uint4* pool, unsigned long long* sums,
                 cudaStream_t stream) {
  return MedianGraphMicroseconds(stream, kReps, kLayers, [&](cudaStream_t s) {
    size_t pool_vectors = kPoolBytes / 16, offset = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (double mb : layer) {
        size_t vectors = VectorsOf(mb);
        if (offset + vectors > pool_vectors) offset = 0;
        Read<<<ctas, kThreads, 0, s>>>(pool + offset, vectors, sums);
        offset += (vectors + 255) / 256 * 256;  // 4 KiB aligned
      }
    }
  });
}

// Whether one launch of `mb` at `ctas` CTAs sums the pool's first words as the host does.
bool SumIsRight(double mb, int ctas, const uint4* pool, unsigned long long* sums, cudaStream_t stream) {
  CHECK(cudaMemsetAsync(sums, 0, sizeof(unsigned long long) * ctas, stream));
  size_t vectors = VectorsOf(mb);
  Read<<<ctas, kThreads, 0, stream>>>(pool, vectors, sums);
  std::vector<unsigned long long> device(ctas);
  CHECK(cudaMemcpyAsync(device.data(), sums, sizeof(unsigned long long) * ctas, cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  uint32_t got = 0, want = 0;
  for (unsigned long long s : device) got += static_cast<uint32_t>(s);
  for (size_t i = 0; i < vectors * 4; ++i) want += PoolWord(i);
  return got == want;
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = argc > 1 ? argv[1] : "hbm_reads.json";
  // Per-launch sizes (1e6 bytes) of one layer: the routed experts' weights of one call at m = 1
  // (8 active experts; gate/up then down), and one large read for the asymptotic rate.
  const std::vector<Case> cases = {
      {"deepseek-v3 tp8 m1 bf16 (gate/up, down)", {58.72, 29.36}},
      {"deepseek-v3 tp8 m1 e4m3 (gate/up, down)", {29.36, 14.68}},
      {"deepseek-v3 tp8 m1 bf16 as one launch", {88.08}},
      {"deepseek-v3 tp4 m1 bf16 (gate/up, down)", {117.44, 58.72}},
      {"qwen3-30b-a3b tp8 m1 bf16 (gate/up, down)", {6.29, 3.15}},
      {"qwen3-30b-a3b tp1 m1 bf16 (gate/up, down)", {50.33, 25.17}},
      {"1 GB", {1000.0}},
  };
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint4* pool;
  unsigned long long* sums;
  const int max_ctas = prop.multiProcessorCount * kCtasPerSm[std::size(kCtasPerSm) - 1];
  CHECK(cudaMalloc(&pool, kPoolBytes));
  CHECK(cudaMalloc(&sums, sizeof(unsigned long long) * max_ctas));
  FillPool<<<prop.multiProcessorCount * 8, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(pool), kPoolBytes / 4);
  CHECK(cudaStreamSynchronize(stream));
  for (int per_sm : kCtasPerSm) {
    if (!SumIsRight(6.29, prop.multiProcessorCount * per_sm, pool, sums, stream)) {
      std::fprintf(stderr, "the read kernel's sum at %d CTAs per SM differs from the host's\n", per_sm);
      return 1;
    }
  }
  FILE* out = std::fopen(out_path, "w");
  if (out == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", out_path);
    return 1;
  }
  const char* commit = std::getenv("JMP_COMMIT");  // the benchmarks' convention: the tree's commit
  std::fprintf(out, "{\n \"commit\": \"%s\",\n \"gpu\": \"%s\",\n \"multiprocessors\": %d,\n \"l2_bytes\": %d,\n \"layers_per_graph\": %d,\n"
               " \"reps\": %d,\n \"threads\": %d,\n \"loads_in_flight_per_thread\": %d,\n \"cases\": [\n",
               commit != nullptr ? commit : "unknown", prop.name, prop.multiProcessorCount, prop.l2CacheSize, kLayers, kReps, kThreads, kUnroll);
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& item = cases[c];
    double bytes = 0;
    for (double mb : item.launch_mb) bytes += mb * 1e6;
    double best = 1e30;
    std::string grids;
    for (int per_sm : kCtasPerSm) {
      double us = TimeLayer(item.launch_mb, prop.multiProcessorCount * per_sm, pool, sums, stream);
      best = std::min(best, us);
      grids += (grids.empty() ? "" : ", ") + std::string("\"") + std::to_string(per_sm) + "\": " + std::to_string(us);
    }
    std::printf("%-45s %8.2f us per layer, %6.0f GB/s (best grid)\n", item.name, best, bytes / best / 1e3);
    std::fprintf(out, "  {\"case\": \"%s\", \"bytes_per_layer\": %.0f, \"launches_per_layer\": %zu, \"us_per_layer\": %.3f, "
                 "\"read_bytes_per_s\": %.4g, \"us_by_ctas_per_sm\": {%s}}%s\n",
                 item.name, bytes, item.launch_mb.size(), best, bytes / best * 1e6, grids.c_str(),
                 c + 1 < cases.size() ? "," : "");
  }
  std::fprintf(out, " ]\n}\n");
  std::fclose(out);
  CHECK(cudaFree(pool));
  CHECK(cudaFree(sums));
  return 0;
}
