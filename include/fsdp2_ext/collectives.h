// The collectives the loaders (and Python) use over the caller's process group, every wait
// bounded: one verdict for all ranks, a broadcast in chunks.
#pragma once

#include "fsdp2_ext/defaults.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>

namespace fsdp2_ext {

// [Note: bounded waits]
// No wait on a peer is left to the process group's own timeout (30 minutes by default): each one
// is bounded by `timeout_s` plus the time its bytes take at kMinBandwidthBytesPerSecond, so a rank
// that died or stopped makes every other rank raise within that bound. A point-to-point failure
// names the peer; a collective one says which collective and that one rank did not answer. After
// a failure the buffers that in-flight operations point into are kept alive (never freed under a
// transfer).

// The bound of a wait for `bytes`: timeout_s + bytes / kMinBandwidthBytesPerSecond.
std::chrono::milliseconds wait_bound(double timeout_s, int64_t bytes);

// [Note: transport device]
// A group may carry several backends (VERL's `cpu:gloo,cuda:nccl`: CPU tensors to Gloo, CUDA
// tensors to NCCL, one group), so the device of the tensors picks the backend, as in torch's own
// collectives. The data of a load travels on the load's device when the group has a backend for
// it (NCCL for a GPU load on VERL's group), else on the CPU (a `gloo`-only group with a GPU load:
// received on the host, copied to the device after). Verdicts, a few bytes, travel on the CPU
// whenever the group has a CPU backend, as torch's `_get_object_coll_device` picks "cpu" first: a
// rank that fails before the data moves never has to create a device communicator to say so, and
// every verdict wait is on Gloo's own connections, made when the group was.

// The device a load's data travels on over `pg` ([Note: transport device]); a ValueError naming
// the group's devices and the fix if it has a backend for neither `load_device` nor the CPU.
c10::Device transport_device(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device load_device);

// The device verdicts travel on: the CPU where `pg` has a CPU backend, else the transport device.
c10::Device verdict_device(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device load_device);

// The first collective of a load on `device`, bounded as a whole: on NCCL it is the one that
// creates the group's communicator (`ncclCommInitRank`, which blocks its calling thread until every
// rank has joined), so it runs on a helper thread and this rank raises if it has not finished
// within the bound (the helper is left behind: the process is failing). A one-element all-reduce;
// on Gloo, whose connections exist since the group was made, it costs one round trip.
void bounded_first_collective(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device, double timeout_s);

// Every rank passes its local verdict ("" = fine); every rank returns the same verdict: the one of
// the lowest rank that reported a problem. Uses one all-reduce and, on failure, two broadcasts on
// `pg` with tensors on `comm_device`.
std::string agree_on_verdict(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::string& local_verdict,
    c10::Device comm_device,
    double timeout_s = kDefaultTimeoutSeconds);

// Broadcasts `tensor` (contiguous; filled on `root`, allocated elsewhere) in chunks of at most
// `chunk_bytes`, so a 95 GiB frozen table never needs a second full staging copy. Returns the
// bytes moved.
int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s = kDefaultTimeoutSeconds);

}  // namespace fsdp2_ext
