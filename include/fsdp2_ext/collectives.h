// The collectives the loaders (and Python) use over the caller's process group, every wait
// bounded: one verdict for all ranks, a broadcast in chunks.
#pragma once

#include "fsdp2_ext/defaults.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace fsdp2_ext {

// [Note: bounded waits]
// No wait on a peer is left to the process group's own timeout (30 minutes by default): each one
// is bounded by the floor (`timeout_s`, [Note: wait knobs]) plus the time the work in front of the
// awaited ranks takes at the bandwidth floor: the bytes they must still read, write or send before
// they can arrive, computed from the plan every rank holds (never measured, never one rank's
// guess). A rank that died or stopped makes every other rank raise within that bound; a rank that
// is merely busy with the work its plan gives it never does. A failure names the stage, what the
// rank waited for, the peer where there is one, and the bound with what it allowed for. After a
// failure the buffers that in-flight operations point into are kept alive (never freed under a
// transfer).
//
// Every wait and what its bound allows for (B = bytes at the bandwidth floor):
// - fill_sharded's verdict: rank 0's converted and initialised tensors built before it
//   (CheckpointLoad.verdict_bytes); the rank-0 path: none (rank 0 holds its state already);
// - the rank-0 path's per-table view agreement: the table's bytes (rank 0 compares them);
// - the checkpoint load's "rows read" agreement: the most rows any rank copies from the files
//   (every rank's padded shard and replicated tensors, in the larger of the two dtypes);
// - load_from_rank0 / load_from_local: the plan agreement, the verdict and the first collective
//   allow for LoadOptions::lead_bytes (what the caller's peers do before the load, 0 when the
//   caller agreed just before); each bucket for its bytes summed over ranks;
// - the HSDP replicas' first broadcast: the leader's own load (its shard group's bytes), and the
//   replicate group's first collective (its communicator) the same;
// - host sharing: "create" the file's bytes (reserved), "fill" the slowest leader's writes and
//   sends, each table's first received chunk the source's writes and sends before it;
// - place_tables without a directory: the first chunk of a table allows for rank 0 assembling it;
// - broadcast_in_chunks: two chunks per wait, plus `lead_bytes` on the first.

// The bound of one wait: the floor plus `bytes` of work at the bandwidth floor; `allows_for` says
// what those bytes are (the error names it).
struct WaitBound {
  double floor_s = kDefaultTimeoutSeconds;
  int64_t bytes = 0;
  std::string allows_for;

  std::chrono::milliseconds duration() const;
  // "18.0 s (floor 2.0 s + 1.00 GiB at 64 MiB/s: rank 0 writing its host's file)"
  std::string describe() const;
};

// The bound of a wait for `bytes`: timeout_s + bytes / min_bandwidth_bytes_per_second().
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
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device, const WaitBound& bound);

// Every rank passes its local verdict ("" = fine); every rank returns the same verdict: the one of
// the lowest rank that reported a problem. Uses one all-reduce and, on failure, two broadcasts on
// `pg` with tensors on `comm_device`. The all-reduce is bounded by `bound` (the work the other
// ranks may still do before they arrive); `stage` names the agreement in an error.
std::string agree_on_verdict(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::string& local_verdict,
    c10::Device comm_device,
    const WaitBound& bound,
    const std::string& stage = "");

// Every rank passes the same number of int64 figures; every rank returns, per figure, the least
// and the greatest over the ranks (one all-reduce, bounded by `bound`).
std::pair<std::vector<int64_t>, std::vector<int64_t>> figure_range(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<int64_t>& figures,
    c10::Device comm_device,
    const WaitBound& bound,
    const std::string& stage);

// Broadcasts `tensor` (contiguous; filled on `root`, allocated elsewhere) in chunks of at most
// `chunk_bytes`, so a 95 GiB frozen table never needs a second full staging copy. The first wait
// also allows for `lead_bytes` (what the root does before it sends). Returns the bytes moved.
int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s,
    int64_t lead_bytes = 0);

}  // namespace fsdp2_ext
