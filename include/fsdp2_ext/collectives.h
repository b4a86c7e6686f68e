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
