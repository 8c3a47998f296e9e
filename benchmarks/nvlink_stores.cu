// NVLink write bandwidth of two store patterns, both GPUs writing into each other at once.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_stores.cu -o nvlink_stores
//   ./nvlink_stores results.json
//
// The publish kernels move their partials to the peer with one 16-byte `st.global.v4`
// per thread. This program times that pattern against a TMA bulk copy
// (`cp.async.bulk.global.shared::cta`, 8 KiB per CTA from shared memory), for the bytes
// one rank sends in a DeepSeek-V3 call (hidden 7168, bf16) at m = 64 and 512, and for
// 64 MiB. Each kernel reads its source from a 1 MiB buffer that stays in L2, so that HBM
// reads do not limit it. Every size replays a CUDA graph of `kLaunches` launches on both
// GPUs at once; a launch's time is the slower GPU's elapsed time over them, and an empty
// kernel's is reported beside it. Each pattern's result is checked once in
// the peer's memory, poisoned before, so that a copy that did not land cannot pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_bench.h"

namespace {

constexpr int kThreads = 128;
constexpr int kBulkVectorsPerThread = 4;  // 8 KiB of shared memory per CTA
constexpr size_t kBulkTileBytes = size_t{kThreads} * kBulkVectorsPerThread * 16;
constexpr size_t kSourceVectors = (size_t{1} << 20) / 16;  // 1 MiB, a power of two
constexpr int kLaunches = 200;
constexpr int kMaxCtasPerSm = 8;
constexpr uint8_t kPoison = 0xA5;

// The source word of 16-byte vector i: the pattern the check expects in the peer's memory.
__host__ __device__ uint4 SourceWord(size_t i, uint32_t salt) {
  uint32_t x = static_cast<uint32_t>(i % kSourceVectors) * 2654435761u ^ salt;
  return make_uint4(x, x + 1, x + 2, x + 3);
}

__global__ void FillSource(uint4* source, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < kSourceVectors;
       i += size_t{gridDim.x} * blockDim.x) {
    source[i] = SourceWord(i, salt);
  }
}

__global__ void Empty() {}

// One 16-byte store per thread and step, as the publish does.
__global__ void StoreVectors(const uint4* __restrict__ source, uint4* destination, size_t vectors) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < vectors;
       i += size_t{gridDim.x} * blockDim.x) {
    destination[i] = source[i & (kSourceVectors - 1)];
  }
}

// Each CTA stages 8 KiB in shared memory, then one thread hands it to the TMA unit.
__global__ void StoreBulk(const uint4* __restrict__ source, char* destination, size_t bytes) {
  __shared__ __align__(128) uint4 tile[kThreads * kBulkVectorsPerThread];
  for (size_t base = blockIdx.x * kBulkTileBytes; base < bytes; base += gridDim.x * kBulkTileBytes) {
    for (int k = 0; k < kBulkVectorsPerThread; ++k) {
      size_t vector = base / 16 + static_cast<size_t>(k) * kThreads + threadIdx.x;
      tile[k * kThreads + threadIdx.x] = source[vector & (kSourceVectors - 1)];
    }
    // The threads' shared stores must be visible to the async proxy before the copy reads them.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      auto shared = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
      auto count = static_cast<uint32_t>(bytes - base < kBulkTileBytes ? bytes - base : kBulkTileBytes);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(destination + base), "r"(shared), "r"(count) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // The tile is refilled next step: wait until the copy has read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  uint4* source = nullptr;
  char* inbox = nullptr;  // the peer writes here
  int sms = 0;
};

enum class StoreKind { kVectors, kBulk, kEmpty };

int Ctas(StoreKind kind, size_t bytes, int sms) {
  size_t per_cta = kind == StoreKind::kBulk ? kBulkTileBytes : size_t{kThreads} * 16;
  size_t wanted = (bytes + per_cta - 1) / per_cta;
  return static_cast<int>(std::min<size_t>(wanted, static_cast<size_t>(sms) * kMaxCtasPerSm));
}

void Launch(StoreKind kind, Gpu& gpu, Gpu& peer, size_t bytes) {
  CHECK(cudaSetDevice(gpu.device));
  int ctas = Ctas(kind, bytes, gpu.sms);
  switch (kind) {
    case StoreKind::kVectors:
      StoreVectors<<<ctas, kThreads, 0, gpu.stream>>>(gpu.source, reinterpret_cast<uint4*>(peer.inbox),
                                                      bytes / 16);
      break;
    case StoreKind::kBulk:
      StoreBulk<<<ctas, kThreads, 0, gpu.stream>>>(gpu.source, peer.inbox, bytes);
      break;
    case StoreKind::kEmpty:
      Empty<<<1, kThreads, 0, gpu.stream>>>();
      break;
  }
  CHECK(cudaGetLastError());
}

// Microseconds per launch: each GPU replays a CUDA graph of `kLaunches` launches into the
// other's inbox, both at once (a graph keeps the host's launch rate out of the figure).
double TimeLaunches(StoreKind kind, std::vector<Gpu>& gpus, size_t bytes) {
  std::vector<cudaGraphExec_t> graphs(gpus.size());
  for (size_t g = 0; g < gpus.size(); ++g) {
    CHECK(cudaSetDevice(gpus[g].device));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(gpus[g].stream, cudaStreamCaptureModeThreadLocal));
    for (int launch = 0; launch < kLaunches; ++launch) Launch(kind, gpus[g], gpus[1 - g], bytes);
    CHECK(cudaStreamEndCapture(gpus[g].stream, &graph));
    CHECK(cudaGraphInstantiate(&graphs[g], graph, 0));
    CHECK(cudaGraphDestroy(graph));
  }
  double slowest_ms = 0;
  for (int replay = 0; replay < 2; ++replay) {  // the first replay warms up
    for (size_t g = 0; g < gpus.size(); ++g) {
      CHECK(cudaSetDevice(gpus[g].device));
      CHECK(cudaStreamSynchronize(gpus[g].stream));
    }
    for (size_t g = 0; g < gpus.size(); ++g) {
      CHECK(cudaSetDevice(gpus[g].device));
      CHECK(cudaEventRecord(gpus[g].start, gpus[g].stream));
      CHECK(cudaGraphLaunch(graphs[g], gpus[g].stream));
      CHECK(cudaEventRecord(gpus[g].stop, gpus[g].stream));
    }
    slowest_ms = 0;
    for (auto& gpu : gpus) {
      CHECK(cudaSetDevice(gpu.device));
      CHECK(cudaEventSynchronize(gpu.stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, gpu.start, gpu.stop));
      slowest_ms = std::max(slowest_ms, double{ms});
    }
  }
  for (size_t g = 0; g < gpus.size(); ++g) {
    CHECK(cudaSetDevice(gpus[g].device));
    CHECK(cudaGraphExecDestroy(graphs[g]));
  }
  return slowest_ms * 1e3 / kLaunches;
}

// One launch into poisoned inboxes, then every 16-byte vector compared with the pattern.
// Returns the number of wrong vectors over both GPUs.
size_t CountWrong(StoreKind kind, std::vector<Gpu>& gpus, size_t bytes, const uint32_t* salts) {
  for (auto& gpu : gpus) {
    CHECK(cudaSetDevice(gpu.device));
    CHECK(cudaMemsetAsync(gpu.inbox, kPoison, bytes, gpu.stream));
    CHECK(cudaStreamSynchronize(gpu.stream));
  }
  for (size_t g = 0; g < gpus.size(); ++g) Launch(kind, gpus[g], gpus[1 - g], bytes);
  // Each inbox is written by the other GPU: both must have finished before either is read.
  for (auto& gpu : gpus) {
    CHECK(cudaSetDevice(gpu.device));
    CHECK(cudaStreamSynchronize(gpu.stream));
  }
  size_t wrong = 0;
  std::vector<uint4> host(bytes / 16);
  for (size_t g = 0; g < gpus.size(); ++g) {
    CHECK(cudaSetDevice(gpus[g].device));
    CHECK(cudaMemcpy(host.data(), gpus[g].inbox, bytes, cudaMemcpyDeviceToHost));
    uint32_t writer_salt = salts[1 - g];
    for (size_t i = 0; i < host.size(); ++i) {
      uint4 want = SourceWord(i, writer_salt);
      const uint4& got = host[i];
      wrong += got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w;
    }
  }
  return wrong;
}

const char* Name(StoreKind kind) {
  switch (kind) {
    case StoreKind::kVectors: return "st.global.v4";
    case StoreKind::kBulk: return "cp.async.bulk";
    case StoreKind::kEmpty: return "empty kernel";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s RESULTS.json\n", argv[0]);
    return 2;
  }
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "needs 2 GPUs, found %d\n", count);
    return 2;
  }
  const size_t row_bytes = 7168 * 2;
  const std::vector<std::pair<std::string, size_t>> sizes = {
      {"m=64 partial", 64 * row_bytes}, {"m=512 partial", 512 * row_bytes}, {"64 MiB", size_t{64} << 20}};
  size_t largest = 0;
  for (const auto& size : sizes) largest = std::max(largest, size.second);

  const std::string peers = EnablePeerPair(count);
  if (!peers.empty()) {
    std::fprintf(stderr, "%s\n", peers.c_str());
    return 1;
  }
  std::vector<Gpu> gpus(2);
  const uint32_t salts[2] = {0x9E3779B9u, 0x7F4A7C15u};
  for (int g = 0; g < 2; ++g) {
    Gpu& gpu = gpus[g];
    gpu.device = g;
    CHECK(cudaSetDevice(g));
    CHECK(cudaDeviceGetAttribute(&gpu.sms, cudaDevAttrMultiProcessorCount, g));
    CHECK(cudaStreamCreateWithFlags(&gpu.stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&gpu.start));
    CHECK(cudaEventCreate(&gpu.stop));
    CHECK(cudaMalloc(&gpu.source, kSourceVectors * 16));
    CHECK(cudaMalloc(&gpu.inbox, largest));
    FillSource<<<256, 256, 0, gpu.stream>>>(gpu.source, salts[g]);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(gpu.stream));
  }

  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::FILE* out = std::fopen(argv[1], "w");
  if (out == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  double empty_us = TimeLaunches(StoreKind::kEmpty, gpus, 0);
  std::fprintf(out, "{\n \"gpu\": \"%s\",\n \"launches\": %d,\n \"threads\": %d,\n", prop.name, kLaunches,
               kThreads);
  std::fprintf(out, " \"empty_kernel_us\": %.4f,\n \"what\": \"both GPUs write into each other at once; "
               "us per launch of the slower GPU; GB/s = bytes one way / that time\",\n \"results\": [\n",
               empty_us);
  std::printf("empty kernel: %.3f us per launch\n", empty_us);
  bool first = true;
  size_t total_wrong = 0;
  for (StoreKind kind : {StoreKind::kVectors, StoreKind::kBulk}) {
    size_t wrong = CountWrong(kind, gpus, largest, salts);
    total_wrong += wrong;
    for (const auto& [label, bytes] : sizes) {
      double us = TimeLaunches(kind, gpus, bytes);
      double gbps = bytes / us * 1e-3;
      std::printf("%-14s %-14s %10zu bytes  %9.3f us  %7.1f GB/s  (%d CTAs)  wrong vectors: %zu\n",
                  Name(kind), label.c_str(), bytes, us, gbps, Ctas(kind, bytes, gpus[0].sms), wrong);
      std::fprintf(out, "%s  {\"pattern\": \"%s\", \"size\": \"%s\", \"bytes\": %zu, \"us\": %.4f, "
                   "\"gb_per_s\": %.2f, \"ctas\": %d, \"wrong_vectors\": %zu}",
                   first ? "" : ",\n", Name(kind), label.c_str(), bytes, us, gbps,
                   Ctas(kind, bytes, gpus[0].sms), wrong);
      first = false;
    }
  }
  std::fprintf(out, "\n ]\n}\n");
  std::fclose(out);
  if (total_wrong != 0) {
    std::fprintf(stderr, "%zu vectors did not land as written\n", total_wrong);
    return 1;
  }
  return 0;
}
