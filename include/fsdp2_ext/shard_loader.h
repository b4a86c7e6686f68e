// Builds FSDP2 local shards from a full state without materialising any unsharded tensor on the
// destination device: rank 0 scatters each rank only its rows, bucketed into flat buffers, over
// the caller's process group; or, when every rank can see the full state (a mapped file), each
// rank copies its own rows with no collective at all.
#pragma once

#include "fsdp2_ext/sharding_plan.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace fsdp2_ext {

// One tensor to build on every rank.
struct TargetSpec {
  std::string fqn;
  std::vector<std::string> aliases;  // other FQNs of the same tensor, accepted as source keys
  std::vector<int64_t> shape;        // the global (unsharded) shape
  at::ScalarType dtype = at::kFloat;
  Placement placement = Placement::kShard0;
};

// [Note: bounded waits]
// No wait on a peer is left to the process group's own timeout (30 minutes by default): each one
// is bounded by `timeout_s` plus the time its bytes take at kMinBandwidth, so a rank that died or
// stopped makes every other rank raise within that bound. A point-to-point failure names the
// peer; a collective one says which collective and that one rank did not answer. After a failure
// the buffers that in-flight operations point into are kept alive (never freed under a transfer).
constexpr double kMinBandwidthBytesPerSecond = 64.0 * (1 << 20);

struct LoadOptions {
  int64_t bucket_bytes = int64_t{64} << 20;     // bound of one bucket, summed over ranks
  c10::Device device = c10::Device(c10::kCPU);  // where the local shards (and buffers) live
  double progress_interval_s = 2.0;             // rank-0 progress lines at most this often
  double timeout_s = 60.0;                      // floor of every wait; see [Note: bounded waits]
  bool convert_dtype = false;  // load_from_local only: a source of another dtype is converted
};

// The bound of a wait for `bytes`: timeout_s + bytes / kMinBandwidthBytesPerSecond.
std::chrono::milliseconds wait_bound(double timeout_s, int64_t bytes);

struct LoadResult {
  // Per target: Shard0 -> the padded local buffer (ceil(d0/W), ...) of [Note: shard padding];
  // Replicate -> the full tensor.
  std::vector<at::Tensor> tensors;
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
  int64_t buckets = 0;
  double seconds = 0.0;
};

// Compares the targets with a provided state (key names, shapes, dtypes). Returns "" when they
// match, else one message naming the missing / unexpected keys and the shape and dtype
// mismatches (the first few of each, with counts). `source_index` receives, per target, the
// index of the provided tensor that feeds it. With `convert_dtype`, a floating-point source of
// another floating-point dtype is accepted (the copy converts it).
std::string describe_state_mismatch(
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    std::vector<int64_t>* source_index = nullptr,
    bool convert_dtype = false);

// Every rank passes its local verdict ("" = fine); every rank returns the same verdict: the one of
// the lowest rank that reported a problem. Uses one all-reduce and, on failure, two broadcasts on
// `pg` with tensors on `comm_device`.
std::string agree_on_verdict(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::string& local_verdict,
    c10::Device comm_device,
    double timeout_s = 60.0);

// Rank 0 of `pg` holds the full state (names/tensors, CPU); other ranks pass empty lists. Rank 0
// validates, all ranks agree on the verdict (ValueError everywhere on a mismatch, before any data
// moves), then each bucket moves as one point-to-point message per receiving rank; see
// [Note: rank-0 transfer].
LoadResult load_from_rank0(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options);

// Every rank sees the full state (e.g. mapped safetensors); each copies only its rows. `pg` is
// used only to agree on the validation verdict.
LoadResult load_from_local(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options);

// Broadcasts `tensor` (contiguous; filled on `root`, allocated elsewhere) in chunks of at most
// `chunk_bytes`, so a 95 GiB frozen table never needs a second full staging copy. Returns the
// bytes moved.
int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s = 60.0);

}  // namespace fsdp2_ext
