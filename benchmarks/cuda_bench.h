// What the benchmark programs share: the CUDA error check, the median time of a captured graph,
// and peer access between GPU 0 and 1.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t error_ = (call);                                                         \
    if (error_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(error_));                                          \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// Why GPU 0 and 1 cannot reach each other's memory ("" once peer access is on both ways), with
// `count` GPUs present.
inline std::string EnablePeerPair(int count) {
  if (count < 2) return "needs 2 GPUs, found " + std::to_string(count);
  for (int g = 0; g < 2; ++g) {
    int can_access = 0;
    CHECK(cudaDeviceCanAccessPeer(&can_access, g, 1 - g));
    if (!can_access) {
      return "GPU " + std::to_string(g) + " cannot access GPU " + std::to_string(1 - g) + " as a peer";
    }
  }
  for (int g = 0; g < 2; ++g) {
    CHECK(cudaSetDevice(g));
    cudaError_t error = cudaDeviceEnablePeerAccess(1 - g, 0);
    if (error != cudaSuccess && error != cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return std::string("cudaDeviceEnablePeerAccess(") + std::to_string(1 - g) + ") on GPU " +
             std::to_string(g) + ": " + cudaGetErrorString(error);
    }
    (void)cudaGetLastError();
  }
  return "";
}

// Median µs per unit of what `enqueue(stream)` launches: its launches captured once into a CUDA
// graph, replayed `reps` times after a warm-up replay, each replay's time divided by `units`.
template <typename Enqueue>
double MedianGraphMicroseconds(cudaStream_t stream, int reps, int units, Enqueue enqueue) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1e3 / units);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}
