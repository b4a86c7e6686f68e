#include "fsdp2_ext/shard_loader.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "load_support.h"

#include <algorithm>
#include <future>

// [Note: rank-0 transfer]
// load_from_rank0 moves each bucket as one point-to-point message per receiving rank (tag = bucket
// index) rather than a scatter: the source rank fills its own rows straight into its destinations
// (the memcpy bound; no staging, no receive copy; on a helper thread) and stages only the W - 1
// parts it sends. Segments of at least kDirectBytes travel in `direct` buckets, straight from the
// source tensor's rows into the receiver's padded buffer (which zeroes its own padding): no
// packing, no unpacking, only the socket copies. Direct buckets need no slot, so every one is
// posted up front on both ends: Gloo sends a message only once its receive is posted (a
// ready notice from the receiver), and posting them one window at a time cost a round trip
// between busy threads per bucket (rank 0's load at 1.9x the transport bound on a 1 GiB model
// with ~200 direct buckets, 0.8-1.2x after; docs/BENCHMARKS.md). Staged buckets use two slots:
// bucket k+1 is packed / posted while bucket k is in flight. The parts, in order: ShardingPlan (the
// buckets), allocate_buffers (the destinations and staging slots, before the verdict so that a rank
// that cannot allocate is in it), agree_rank0_state (one verdict before any data moves),
// RankZeroTransfer (the messages).

namespace fsdp2_ext {

using detail::allocate_destination;
using detail::bounded_wait;
using detail::byte_view;
using detail::Clock;
using detail::contiguous_sources;
using detail::copy_bytes;
using detail::layouts_of;
using detail::ProgressReporter;
using detail::seconds_since;
using detail::zero_bytes;

namespace {

// Writes rank `rank`'s bytes of every piece of `bucket` from the full source tensors: into its
// flat transfer part (`into_part`, at the pieces' bucket offsets) or, for the source rank's own
// rows, straight into the destinations (at the pieces' segment offsets). Padding becomes zeros.
void fill_pieces(
    const ShardingPlan& plan,
    const Bucket& bucket,
    int64_t rank,
    const std::vector<at::Tensor>& sources,
    const at::Tensor& part,
    const std::vector<at::Tensor>* destinations) {
  for (const auto& piece : bucket.pieces) {
    const PlanEntry& entry = plan.entries()[piece.entry];
    const int64_t valid = entry.valid_bytes(plan.world_size(), rank);
    const int64_t data_end = std::min(piece.segment_end, valid);
    const int64_t length = std::max<int64_t>(0, data_end - piece.segment_begin);
    const at::Tensor& target = destinations ? (*destinations)[piece.entry] : part;
    const int64_t offset = destinations ? piece.segment_begin : piece.bucket_offset;
    copy_bytes(
        target,
        offset,
        sources[piece.entry],
        entry.source_offset(plan.world_size(), rank) + piece.segment_begin,
        length);
    zero_bytes(target, offset + length, piece.segment_end - piece.segment_begin - length);
  }
}

// Real (non-padding) bytes of `rank` inside a direct bucket's piece.
int64_t direct_length(
    const PlanEntry& entry, const BucketPiece& piece, int64_t world, int64_t rank) {
  const int64_t end = std::min(piece.segment_end, entry.valid_bytes(world, rank));
  return std::max<int64_t>(0, end - piece.segment_begin);
}

void unpack_part(
    const Bucket& bucket, const at::Tensor& part, const std::vector<at::Tensor>& destinations) {
  for (const auto& piece : bucket.pieces) {
    copy_bytes(
        destinations[piece.entry],
        piece.segment_begin,
        part,
        piece.bucket_offset,
        piece.segment_end - piece.segment_begin);
  }
}

}  // namespace

namespace {

// Rank 0 checks its full state against the targets, every other rank that it passed none, and
// every rank reports `allocation_problem` (its buffers could not be allocated); every rank raises
// the same ValueError before any data moves. Rank 0 gets, per target, the index of the tensor
// that feeds it.
std::vector<int64_t> agree_rank0_state(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options,
    const std::string& allocation_problem) {
  const int64_t rank = pg->getRank();
  std::vector<int64_t> source_index;
  std::string verdict = allocation_problem;
  if (!verdict.empty()) {
    // reported as is
  } else if (rank == 0) {
    verdict = describe_state_mismatch(targets, names, tensors, &source_index);
  } else if (!names.empty() || !tensors.empty()) {
    verdict = detail::concat(
        "load_from_rank0: rank ",
        rank,
        " passed a full state; only rank 0 holds the source (pass an empty state "
        "elsewhere, or use the local loader when every rank can see the full "
        "state)");
  }
  verdict = agree_on_verdict(pg, verdict, options.device, options.timeout_s);
  FSDP2_CHECK_VALUE(verdict.empty(), verdict);
  return source_index;
}

std::vector<at::Tensor> allocate_destinations(
    const std::vector<TargetSpec>& targets, const ShardingPlan& plan, c10::Device device) {
  std::vector<at::Tensor> destinations;
  destinations.reserve(targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    destinations.push_back(allocate_destination(targets[t], plan.entries()[t], device));
  }
  return destinations;
}

// The two slots of [Note: rank-0 transfer]: rank 0 one part per receiving rank (and pinned host
// staging for device loads), the others one; each as large as the largest staged bucket's part.
struct StagingSlots {
  std::vector<at::Tensor> parts[2];
  std::vector<at::Tensor> host_stage[2];
};

StagingSlots allocate_slots(
    const ShardingPlan& plan, int64_t rank, int64_t world, c10::Device device) {
  const int64_t capacity = plan.staging_part_bytes();
  StagingSlots slots;
  const auto byte_options = at::TensorOptions().dtype(at::kByte);
  for (int slot = 0; slot < 2 && capacity > 0 && world > 1; ++slot) {
    const int64_t count = rank == 0 ? world - 1 : 1;
    for (int64_t i = 0; i < count; ++i) {
      slots.parts[slot].push_back(at::empty({capacity}, byte_options.device(device)));
      if (rank == 0 && !device.is_cpu()) {
        slots.host_stage[slot].push_back(at::empty({capacity}, byte_options.pinned_memory(true)));
      }
    }
  }
  return slots;
}

// Allocates this rank's destinations and staging slots before the verdict. A rank that cannot
// returns why ("" otherwise), so that it reaches every rank in the shared verdict: its peers would
// otherwise wait for it in the transfer and could only name it as dead.
std::string allocate_buffers(
    const std::vector<TargetSpec>& targets,
    const ShardingPlan& plan,
    int64_t rank,
    int64_t world,
    c10::Device device,
    LoadResult& result,
    StagingSlots& slots) {
  std::string cause;
  try {
    result.tensors = allocate_destinations(targets, plan, device);
    slots = allocate_slots(plan, rank, world, device);
    return "";
  } catch (const c10::Error& error) {
    cause = error.what_without_backtrace();
  } catch (const std::exception& error) {
    cause = error.what();
  }
  result.tensors.clear();
  slots = StagingSlots{};
  return detail::concat(
      "rank ",
      rank,
      ": cannot allocate its ",
      plan.bytes_per_rank(),
      " bytes of shards and replicas (and staging) on ",
      device.str(),
      ": ",
      cause);
}

// One run of the rank-0 transfer of [Note: rank-0 transfer], on every rank of the group: rank 0
// posts sends, the others receives, bucket by bucket, two slots deep.
class RankZeroTransfer {
 public:
  RankZeroTransfer(
      const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
      const ShardingPlan& plan,
      const std::vector<at::Tensor>& sources,
      const LoadOptions& options,
      StagingSlots slots,
      LoadResult& result)
      : pg_(pg),
        plan_(plan),
        sources_(sources),
        options_(options),
        result_(result),
        rank_(pg->getRank()),
        world_(pg->getSize()),
        on_host_(options.device.is_cpu()),
        progress_(plan.bytes_per_rank() * world_, options.progress_interval_s, rank_ == 0),
        slots_(std::move(slots)) {}
  RankZeroTransfer(const RankZeroTransfer&) = delete;
  RankZeroTransfer& operator=(const RankZeroTransfer&) = delete;
  ~RankZeroTransfer();

  void run() {
    if (rank_ == 0) {
      start_own_rows();
    }
    const auto& buckets = plan_.buckets();
    direct_in_flight_.resize(buckets.size());
    for (int64_t index = 0; index < static_cast<int64_t>(buckets.size()); ++index) {
      if (buckets[index].direct) {
        post(index);  // no slot: all up front
      }
    }
    for (int64_t index = 0; index < static_cast<int64_t>(buckets.size()); ++index) {
      if (!buckets[index].direct) {
        post(index);
      }
      if (index > 0) {
        complete(index - 1);  // frees the other slot for bucket index + 1
      }
    }
    if (!buckets.empty()) {
      complete(static_cast<int64_t>(buckets.size()) - 1);
    }
    if (own_rows_.valid()) {
      own_rows_.get();
    }
  }

 private:
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t peer;
  };

  static int slot_of(int64_t index) {
    return static_cast<int>(index % 2);
  }

  void post(int64_t index) {
    if (rank_ == 0) {
      post_sends(index);
    } else {
      post_receive(index);
    }
  }

  // Where bucket `index`'s messages are tracked: its own list if direct, else its slot's.
  std::vector<InFlight>& flights_of(int64_t index) {
    return plan_.buckets()[index].direct ? direct_in_flight_[index] : in_flight_[slot_of(index)];
  }

  // Rank 0's own rows are copied on a second thread, all buckets in one go, while it packs and
  // sends the other ranks' parts: both are memory-bound, independent of each other, and the
  // receivers are mostly waiting. The copies are queued on the caller's current stream of the
  // destination device (the helper thread would otherwise use that device's default stream,
  // unordered with the caller's work); run() joins the thread before anything reads them, and an
  // exception unwinding past it waits for the thread in the future's destructor.
  void start_own_rows() {
    const c10::Stream stream =
        c10::impl::getDeviceGuardImpl(options_.device.type())->getStream(options_.device);
    own_rows_ = std::async(std::launch::async, [this, stream] {
      c10::StreamGuard on_caller_stream(stream);
      for (const auto& bucket : plan_.buckets()) {
        fill_pieces(plan_, bucket, 0, sources_, at::Tensor(), &result_.tensors);
      }
    });
  }

  void send(const at::Tensor& bytes, int64_t peer, int64_t index) {
    std::vector<at::Tensor> message{bytes};
    flights_of(index).push_back(
        {pg_->send(message, static_cast<int>(peer), static_cast<int>(index)), peer});
    result_.bytes_sent += bytes.numel();
  }

  // Rank 0: a direct bucket goes straight from the source rows; a staged one is packed per rank.
  void post_sends(int64_t index) {
    const Bucket& bucket = plan_.buckets()[index];
    const int slot = slot_of(index);
    for (int64_t r = 1; r < world_; ++r) {
      if (bucket.direct) {
        const BucketPiece& piece = bucket.pieces.front();
        const PlanEntry& entry = plan_.entries()[piece.entry];
        const int64_t length = direct_length(entry, piece, world_, r);
        if (length > 0) {
          send(
              byte_view(sources_[piece.entry])
                  .narrow(0, entry.source_offset(world_, r) + piece.segment_begin, length),
              r,
              index);
        }
        continue;
      }
      at::Tensor part = slots_.parts[slot][r - 1].narrow(0, 0, bucket.bytes_per_rank);
      if (on_host_) {
        fill_pieces(plan_, bucket, r, sources_, part, nullptr);
      } else {
        at::Tensor staged = slots_.host_stage[slot][r - 1].narrow(0, 0, bucket.bytes_per_rank);
        fill_pieces(plan_, bucket, r, sources_, staged, nullptr);
        // Blocking: the pinned slot is refilled two buckets later by the CPU.
        part.copy_(staged, /*non_blocking=*/false);
      }
      send(part, r, index);
    }
  }

  // Other ranks: a direct bucket lands in the destination (which zeroes its own padding); a
  // staged one in the slot's part, unpacked by complete().
  void post_receive(int64_t index) {
    const Bucket& bucket = plan_.buckets()[index];
    at::Tensor into;
    if (!bucket.direct) {
      into = slots_.parts[slot_of(index)][0].narrow(0, 0, bucket.bytes_per_rank);
    } else {
      const BucketPiece& piece = bucket.pieces.front();
      const int64_t length = direct_length(plan_.entries()[piece.entry], piece, world_, rank_);
      const at::Tensor& destination = result_.tensors[piece.entry];
      if (length > 0) {
        into = byte_view(destination).narrow(0, piece.segment_begin, length);
      }
      zero_bytes(
          destination,
          piece.segment_begin + length,
          piece.segment_end - piece.segment_begin - length);
    }
    if (into.defined()) {
      std::vector<at::Tensor> message{into};
      flights_of(index).push_back({pg_->recv(message, 0, static_cast<int>(index)), 0});
    }
  }

  // Waits for bucket `index` within its bound ([Note: bounded waits]) and unpacks it.
  void complete(int64_t index) {
    const int slot = slot_of(index);
    const auto& buckets = plan_.buckets();
    const Bucket& bucket = buckets[index];
    const auto bound = wait_bound(options_.timeout_s, bucket.bytes_per_rank * world_);
    const std::string what = detail::concat(
        "bucket ",
        index + 1,
        " of ",
        buckets.size(),
        " (",
        bucket.bytes_per_rank,
        " bytes per rank) of the rank-0 transfer");
    std::vector<InFlight>& flights = flights_of(index);
    for (auto& flight : flights) {
      bounded_wait(flight.work, rank_, flight.peer, what, bound);
    }
    flights.clear();
    if (rank_ != 0 && !bucket.direct) {
      unpack_part(
          bucket, slots_.parts[slot][0].narrow(0, 0, bucket.bytes_per_rank), result_.tensors);
    }
    result_.bytes_received += bucket.bytes_per_rank;
    progress_.advance(bucket.bytes_per_rank * world_);
  }

  const c10::intrusive_ptr<c10d::ProcessGroup>& pg_;
  const ShardingPlan& plan_;
  const std::vector<at::Tensor>& sources_;
  const LoadOptions& options_;
  LoadResult& result_;
  const int64_t rank_;
  const int64_t world_;
  const bool on_host_;
  ProgressReporter progress_;
  StagingSlots slots_;
  std::vector<InFlight> in_flight_[2];                   // staged buckets, per slot
  std::vector<std::vector<InFlight>> direct_in_flight_;  // direct buckets, per bucket
  std::future<void> own_rows_;
};

// On an exception, what is still in flight may write into (or read from) the staging parts,
// destinations and sources after the transfer has left: they are kept alive instead of freed under
// a transfer ([Note: bounded waits]). The process is failing; the leak is bounded.
RankZeroTransfer::~RankZeroTransfer() {
  if (own_rows_.valid()) {
    own_rows_.wait();  // the helper thread reads sources_ and writes result_: join it first
  }
  const bool direct_pending = std::any_of(
      direct_in_flight_.begin(), direct_in_flight_.end(), [](const auto& f) { return !f.empty(); });
  if (in_flight_[0].empty() && in_flight_[1].empty() && !direct_pending) {
    return;
  }
  auto* kept = new std::vector<at::Tensor>();  // intentionally leaked, see above
  for (int slot = 0; slot < 2; ++slot) {
    kept->insert(kept->end(), slots_.parts[slot].begin(), slots_.parts[slot].end());
    kept->insert(kept->end(), slots_.host_stage[slot].begin(), slots_.host_stage[slot].end());
  }
  kept->insert(kept->end(), result_.tensors.begin(), result_.tensors.end());
  kept->insert(kept->end(), sources_.begin(), sources_.end());  // direct sends read from these
}

}  // namespace

LoadResult load_from_rank0(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options) {
  FSDP2_CHECK_VALUE(
      !options.convert_dtype,
      "load_from_rank0 sends raw bytes: cast rank 0's state to the model's dtypes instead of "
      "passing convert_dtype (which is for load_from_local)");
  const auto start = Clock::now();
  const int64_t rank = pg->getRank();
  const int64_t world = pg->getSize();
  // Direct transfers need byte views of CPU tensors on both ends; device loads stage everything.
  const int64_t direct_bytes = options.device.is_cpu() ? kDirectBytes : 0;
  const ShardingPlan plan(layouts_of(targets), world, options.bucket_bytes, direct_bytes);
  LoadResult result;
  StagingSlots slots;
  const std::string allocation_problem =
      allocate_buffers(targets, plan, rank, world, options.device, result, slots);
  const std::vector<int64_t> source_index =
      agree_rank0_state(pg, targets, names, tensors, options, allocation_problem);
  std::vector<at::Tensor> sources;
  if (rank == 0) {
    sources = contiguous_sources(tensors, source_index);
  }
  RankZeroTransfer(pg, plan, sources, options, std::move(slots), result).run();
  result.buckets = static_cast<int64_t>(plan.buckets().size());
  result.seconds = seconds_since(start);
  std::ostringstream summary;
  summary << std::fixed << std::setprecision(3) << "full-state load from rank 0: " << targets.size()
          << " tensors, " << result.bytes_received << " bytes received in " << result.buckets
          << " buckets, " << result.bytes_sent << " bytes sent, " << result.seconds << " s";
  log::message(rank == 0 ? log::Level::kInfo : log::Level::kDebug, summary.str());
  return result;
}

}  // namespace fsdp2_ext
