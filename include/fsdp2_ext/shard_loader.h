// Builds FSDP2 local shards from a full state without materialising any unsharded tensor on the
// destination device: rank 0 sends each rank only its rows, bucketed, over the caller's process
// group (rank0_transfer.cpp, [Note: rank-0 transfer]); or, when every rank can see the full state
// (a mapped file), each rank copies its own rows with no collective but the verdict
// (local_load.cpp). Both validate first (state_validation.h) and agree on one verdict on every
// rank (collectives.h).
#pragma once

#include "fsdp2_ext/collectives.h"
#include "fsdp2_ext/defaults.h"
#include "fsdp2_ext/sharding_plan.h"
#include "fsdp2_ext/state_validation.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace fsdp2_ext {

struct LoadOptions {
  int64_t bucket_bytes = kDefaultBucketBytes;   // bound of one bucket, summed over ranks
  c10::Device device = c10::Device(c10::kCPU);  // where the local shards (and buffers) live
  double progress_interval_s = kDefaultProgressIntervalSeconds;  // rank-0 progress lines
  double timeout_s = kDefaultTimeoutSeconds;  // floor of every wait; see [Note: bounded waits]
  // The work the other ranks may still have in front of them when they reach this load (bytes
  // read, written or built since the caller's last agreement): the plan agreement, the verdict and
  // the first collective allow for it ([Note: bounded waits]); `lead_work` says what it is.
  int64_t lead_bytes = 0;
  std::string lead_work;
  bool convert_dtype = false;  // load_from_local only: a source of another dtype is converted
  // load_from_local only: the caller's own verdict, agreed on every rank, already covers this
  // state (a checkpoint load in groups agrees once, not once per group); a mismatch found here
  // anyway raises on this rank alone.
  bool verdict_agreed = false;
};

struct LoadResult {
  // Per target: Shard0 -> the padded local buffer (ceil(d0/W), ...) of [Note: shard padding];
  // Replicate -> the full tensor.
  std::vector<at::Tensor> tensors;
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
  int64_t buckets = 0;
  double seconds = 0.0;
  // What load_from_rank0 allocated up front and held until it returns: the destinations (on the
  // load's device) and the two staging slots (on the transport device: the load's device on
  // VERL's group, [Note: transport device]), and pinned host staging (rank 0 of a device load).
  // Not counted: rank 0's padded copies of direct buckets' inputs during a host load. The
  // planner's peak figures per GPU are held against these.
  int64_t device_bytes_allocated = 0;
  int64_t host_staging_bytes_allocated = 0;
};

// Rank 0 of `pg` holds the full state (names/tensors, CPU); other ranks pass empty lists. Rank 0
// validates, all ranks agree on the verdict (ValueError everywhere on a mismatch, before any data
// moves), then each bucket moves as one scatter rooted at rank 0; see [Note: rank-0 transfer].
LoadResult load_from_rank0(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options);

// Every rank sees the full state (e.g. mapped safetensors); each copies only its rows. `pg` is
// used only to agree on the validation verdict (not at all with `verdict_agreed`).
LoadResult load_from_local(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options);

}  // namespace fsdp2_ext
