// One-way store-to-visible latency between two GPUs over NVLink: a flag ping-pong.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_pingpong.cu -o nvlink_pingpong
//   ./nvlink_pingpong results.json
//
// The publish kernels hand data over through a Lamport mailbox: a rank stores into the
// peer's memory and the peer polls its own. This program times that hand-over for one
// 32-bit word. Two sides, A and B, one thread each, own one flag each (a 128-byte slot of
// their own GPU's memory). A round trip: A stores sequence number i into B's flag
// (`st.release.sys`), B spins on its own flag (`ld.acquire.sys`) until it reads i, then
// stores i into A's flag, on which A spins. Both sides run `kWarmup` + `kIterations` round
// trips in one launch each, launched on two streams before either is waited on. The
// one-way latency is half a round trip: the launch's event time on A's stream over all its
// round trips (launch cost amortized; an empty kernel's time is reported beside it), and
// A's `%globaltimer` over the timed round trips alone. Modes: "two-gpus" (A on GPU 0, B
// on GPU 1, push: remote stores, local polls), "two-gpus-pull" (each side stores into its
// own flag and polls the peer's: remote loads), and "one-gpu" (A and B as two CTAs of one
// launch on GPU 0: the on-chip baseline). The flags are poisoned before each mode; every
// spin is bounded, and each side must have read every sequence number in order, so a
// ping-pong that did not complete cannot pass.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_bench.h"

namespace {

constexpr int kIterations = 100000;  // timed round trips
constexpr int kWarmup = 1000;        // round trips before them, in the same launch
constexpr int kEmptyLaunches = 100;
constexpr uint32_t kPoison = 0xFFFFFFFFu;
constexpr uint32_t kFirstSequence = 1;
constexpr uint32_t kMaxPolls = 1u << 26;  // per spin: tens of seconds, far beyond any round trip
constexpr size_t kSlotBytes = 128;        // one flag per cache line
constexpr size_t kFlagBytes = 2 * kSlotBytes;

static_assert(kFirstSequence + uint64_t{kWarmup} + kIterations < kPoison,
              "a sequence number must never equal the poison");

struct SideResult {
  unsigned long long start_ns;  // %globaltimer before the first timed round trip
  unsigned long long end_ns;    // and after the last
  uint32_t completed;           // round trips finished, warm-up included
  uint32_t last_seen;           // the last sequence number read from the partner
  uint32_t timed_out;           // a spin ran past kMaxPolls ...
  uint32_t waiting_for;         // ... waiting for this sequence number
  uint32_t out_of_order;        // a spin read neither the previous nor the awaited number ...
  uint32_t bad_value;           // ... but this
};

struct Side {
  const uint32_t* poll = nullptr;  // where the partner's sequence numbers appear
  uint32_t* store = nullptr;       // where this side's go
  SideResult* result = nullptr;
  int initiator = 0;               // A starts each round trip, B answers it
};

struct Sides {
  Side side[2];  // indexed by blockIdx.x: one block per side in each launch
};

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void StoreRelease(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__global__ void Empty() {}

// One thread per block; block b plays sides.side[b].
__global__ void PingPong(Sides sides, int warmup, int iterations) {
  const Side me = sides.side[blockIdx.x];
  SideResult r{};
  uint32_t previous = kPoison;
  const int total = warmup + iterations;
  bool failed = false;
  for (int k = 0; k < total && !failed; ++k) {
    if (k == warmup) r.start_ns = GlobalTimer();
    const uint32_t sequence = kFirstSequence + static_cast<uint32_t>(k);
    if (me.initiator) StoreRelease(me.store, sequence);
    uint32_t polls = 0;
    uint32_t seen;
#pragma unroll 1
    while ((seen = LoadAcquire(me.poll)) != sequence) {
      if (seen != previous) {
        r.out_of_order = 1;
        r.bad_value = seen;
        failed = true;
        break;
      }
      if (++polls == kMaxPolls) {
        r.timed_out = 1;
        r.waiting_for = sequence;
        failed = true;
        break;
      }
    }
    if (failed) break;
    if (!me.initiator) StoreRelease(me.store, sequence);
    previous = sequence;
    r.last_seen = seen;
    r.completed = static_cast<uint32_t>(k + 1);
  }
  r.end_ns = GlobalTimer();
  *me.result = r;
}

enum class Mode { kTwoGpus, kTwoGpusPull, kOneGpu };

const char* Name(Mode mode) {
  switch (mode) {
    case Mode::kTwoGpus: return "two-gpus";
    case Mode::kTwoGpusPull: return "two-gpus-pull";
    case Mode::kOneGpu: return "one-gpu";
  }
  return "?";
}

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  uint32_t* flags = nullptr;  // kFlagBytes: slot 0, and slot 1 for B in the one-GPU mode
  SideResult* results = nullptr;  // two of them
};

uint32_t* Slot(uint32_t* flags, int slot) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(flags) + slot * kSlotBytes);
}

struct Outcome {
  double round_trip_ns = 0;
  double one_way_ns = 0;
  double one_way_ns_globaltimer = 0;
  double empty_launch_us = 0;
  std::string error;  // empty where every check passed
};

// Mean event time of one empty launch on `gpu`'s stream, each waited for before the next.
double EmptyLaunchUs(const Gpu& gpu, cudaEvent_t start, cudaEvent_t stop) {
  CHECK(cudaSetDevice(gpu.device));
  double total_ms = 0;
  for (int launch = 0; launch <= kEmptyLaunches; ++launch) {  // launch 0 warms up
    CHECK(cudaEventRecord(start, gpu.stream));
    Empty<<<1, 1, 0, gpu.stream>>>();
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop, gpu.stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (launch > 0) total_ms += ms;
  }
  return total_ms * 1e3 / kEmptyLaunches;
}

std::string CheckSide(const char* who, const SideResult& r, uint32_t flag) {
  const uint32_t total = kWarmup + kIterations;
  const uint32_t last = kFirstSequence + total - 1;
  char text[256];
  if (r.timed_out) {
    std::snprintf(text, sizeof text, "side %s timed out after %u polls waiting for sequence %u "
                  "(%u of %u round trips done)", who, kMaxPolls, r.waiting_for, r.completed, total);
  } else if (r.out_of_order) {
    std::snprintf(text, sizeof text, "side %s read %#x out of order after sequence %u", who,
                  r.bad_value, r.last_seen);
  } else if (r.completed != total || r.last_seen != last) {
    std::snprintf(text, sizeof text, "side %s finished %u of %u round trips, last read %u (want %u)",
                  who, r.completed, total, r.last_seen, last);
  } else if (flag != last) {
    std::snprintf(text, sizeof text, "side %s's flag holds %#x at the end, want %u", who, flag, last);
  } else {
    return "";
  }
  return text;
}

// Poisons the flags, runs both sides' launches, checks them and derives the latencies.
Outcome Run(Mode mode, std::vector<Gpu>& gpus, cudaEvent_t start, cudaEvent_t stop) {
  Outcome outcome;
  Gpu& a = gpus[0];
  Gpu& b = mode == Mode::kOneGpu ? gpus[0] : gpus[1];
  outcome.empty_launch_us = EmptyLaunchUs(a, start, stop);

  uint32_t* flag_a = Slot(a.flags, 0);
  uint32_t* flag_b = mode == Mode::kOneGpu ? Slot(a.flags, 1) : Slot(b.flags, 0);
  SideResult* result_a = &a.results[0];
  SideResult* result_b = mode == Mode::kOneGpu ? &a.results[1] : &b.results[0];
  for (Gpu* gpu : {&a, &b}) {
    CHECK(cudaSetDevice(gpu->device));
    CHECK(cudaMemsetAsync(gpu->flags, 0xFF, kFlagBytes, gpu->stream));
    CHECK(cudaMemsetAsync(gpu->results, 0, 2 * sizeof(SideResult), gpu->stream));
    CHECK(cudaStreamSynchronize(gpu->stream));
  }

  Side side_a{flag_a, flag_b, result_a, 1};  // push: store into the partner's flag, poll one's own
  Side side_b{flag_b, flag_a, result_b, 0};
  if (mode == Mode::kTwoGpusPull) {  // pull: store into one's own flag, poll the partner's
    side_a = Side{flag_b, flag_a, result_a, 1};
    side_b = Side{flag_a, flag_b, result_b, 0};
  }

  CHECK(cudaSetDevice(a.device));
  CHECK(cudaEventRecord(start, a.stream));
  if (mode == Mode::kOneGpu) {
    PingPong<<<2, 1, 0, a.stream>>>(Sides{{side_a, side_b}}, kWarmup, kIterations);
    CHECK(cudaGetLastError());
  } else {
    PingPong<<<1, 1, 0, a.stream>>>(Sides{{side_a, Side{}}}, kWarmup, kIterations);
    CHECK(cudaGetLastError());
  }
  CHECK(cudaEventRecord(stop, a.stream));
  if (mode != Mode::kOneGpu) {
    CHECK(cudaSetDevice(b.device));
    PingPong<<<1, 1, 0, b.stream>>>(Sides{{side_b, Side{}}}, kWarmup, kIterations);
    CHECK(cudaGetLastError());
  }
  for (Gpu* gpu : {&a, &b}) {
    CHECK(cudaSetDevice(gpu->device));
    CHECK(cudaStreamSynchronize(gpu->stream));
  }

  SideResult host_a{}, host_b{};
  uint32_t final_a = 0, final_b = 0;
  CHECK(cudaMemcpy(&host_a, result_a, sizeof host_a, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&host_b, result_b, sizeof host_b, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&final_a, flag_a, sizeof final_a, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&final_b, flag_b, sizeof final_b, cudaMemcpyDeviceToHost));
  outcome.error = CheckSide("A", host_a, final_a);
  if (outcome.error.empty()) outcome.error = CheckSide("B", host_b, final_b);
  if (!outcome.error.empty()) return outcome;

  float ms = 0;
  CHECK(cudaSetDevice(a.device));
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  outcome.round_trip_ns = ms * 1e6 / (kWarmup + kIterations);
  outcome.one_way_ns = outcome.round_trip_ns / 2;
  outcome.one_way_ns_globaltimer =
      static_cast<double>(host_a.end_ns - host_a.start_ns) / (2.0 * kIterations);
  return outcome;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s RESULTS.json\n", argv[0]);
    return 2;
  }
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  if (count < 1) {
    std::fprintf(stderr, "needs a GPU, found none\n");
    return 2;
  }
  const std::string peer_skip = EnablePeerPair(count);
  const int used = peer_skip.empty() ? 2 : 1;

  std::vector<Gpu> gpus(used);
  std::vector<std::string> names(used);
  for (int g = 0; g < used; ++g) {
    Gpu& gpu = gpus[g];
    gpu.device = g;
    CHECK(cudaSetDevice(g));
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, g));
    names[g] = prop.name;
    CHECK(cudaStreamCreateWithFlags(&gpu.stream, cudaStreamNonBlocking));
    CHECK(cudaMalloc(&gpu.flags, kFlagBytes));
    CHECK(cudaMalloc(&gpu.results, 2 * sizeof(SideResult)));
  }
  CHECK(cudaSetDevice(0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  std::FILE* out = std::fopen(argv[1], "w");
  if (out == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  std::fprintf(out, "{\n \"gpus\": [");
  for (int g = 0; g < used; ++g) std::fprintf(out, "%s\"%s\"", g ? ", " : "", names[g].c_str());
  std::fprintf(out, "],\n \"iterations\": %d,\n \"warmup_round_trips\": %d,\n", kIterations, kWarmup);
  std::fprintf(out, " \"what\": \"one thread per side; round trips of a 32-bit flag in one launch "
               "per side; one_way_ns = event time on A's stream / (2 * all round trips, warm-up "
               "included); one_way_ns_globaltimer = A's %%globaltimer over the timed round trips / "
               "(2 * iterations); empty_launch_us = event time of one empty launch\",\n"
               " \"results\": [\n");
  std::printf("%-14s %14s %12s %24s %16s\n", "mode", "round trip ns", "one-way ns",
              "one-way ns (globaltimer)", "empty launch us");

  bool first = true;
  int failures = 0;
  for (Mode mode : {Mode::kTwoGpus, Mode::kTwoGpusPull, Mode::kOneGpu}) {
    std::fprintf(out, "%s  {\"mode\": \"%s\", ", first ? "" : ",\n", Name(mode));
    first = false;
    if (mode != Mode::kOneGpu && !peer_skip.empty()) {
      std::printf("%-14s skipped: %s\n", Name(mode), peer_skip.c_str());
      std::fprintf(out, "\"skipped\": \"%s\"}", peer_skip.c_str());
      continue;
    }
    Outcome o = Run(mode, gpus, start, stop);
    if (!o.error.empty()) {
      ++failures;
      std::printf("%-14s FAILED: %s\n", Name(mode), o.error.c_str());
      std::fprintf(stderr, "%s: %s\n", Name(mode), o.error.c_str());
      std::fprintf(out, "\"error\": \"%s\"}", o.error.c_str());
      continue;
    }
    std::printf("%-14s %14.1f %12.1f %24.1f %16.3f\n", Name(mode), o.round_trip_ns, o.one_way_ns,
                o.one_way_ns_globaltimer, o.empty_launch_us);
    std::fprintf(out, "\"round_trip_ns\": %.2f, \"one_way_ns\": %.2f, \"one_way_ns_globaltimer\": %.2f, "
                 "\"empty_launch_us\": %.4f}",
                 o.round_trip_ns, o.one_way_ns, o.one_way_ns_globaltimer, o.empty_launch_us);
  }
  std::fprintf(out, "\n ]\n}\n");
  std::fclose(out);
  if (failures != 0) {
    std::fprintf(stderr, "%d mode(s) did not complete their round trips\n", failures);
    return 1;
  }
  return 0;
}
