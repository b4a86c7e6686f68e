#include "fsdp2_ext/shard_loader.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <future>
#include <iomanip>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

// [Note: rank-0 transfer]
// load_from_rank0 moves each bucket as one point-to-point message per receiving rank (tag = bucket
// index) rather than a scatter: the source rank fills its own rows straight into its destinations
// (the memcpy bound; no staging, no receive copy; on a helper thread) and stages only the W - 1
// parts it sends. Segments of at least kDirectBytes travel in `direct` buckets, straight from the
// source tensor's rows into the receiver's padded buffer (which zeroes its own padding): no
// packing, no unpacking, only the socket copies. Two slots: bucket k+1 is packed / posted while
// bucket k is in flight. The parts, in order: ShardingPlan (the buckets), allocate_buffers (the
// destinations and staging slots, before the verdict so that a rank that cannot allocate is in
// it), agree_rank0_state (one verdict before any data moves), RankZeroTransfer (the messages).

namespace fsdp2_ext {
namespace {

using Clock = std::chrono::steady_clock;

std::string shape_to_string(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

void append_examples(
    std::ostringstream& out,
    const char* title,
    const std::vector<std::string>& items,
    const char* fix) {
  if (items.empty()) {
    return;
  }
  constexpr size_t kShown = 5;
  out << "\n  " << items.size() << " " << title << ": ";
  for (size_t i = 0; i < std::min(items.size(), kShown); ++i) {
    out << (i ? ", " : "") << items[i];
  }
  if (items.size() > kShown) {
    out << ", ... (" << items.size() - kShown << " more)";
  }
  out << "\n    -> " << fix;
}

std::vector<TensorLayout> layouts_of(const std::vector<TargetSpec>& targets) {
  std::vector<TensorLayout> layouts;
  layouts.reserve(targets.size());
  for (const auto& target : targets) {
    layouts.push_back(TensorLayout{
        target.fqn,
        target.shape,
        static_cast<int64_t>(c10::elementSize(target.dtype)),
        target.placement});
  }
  return layouts;
}

// The tensor each rank keeps for `entry`: the padded local buffer or the full replicated tensor.
at::Tensor allocate_destination(
    const TargetSpec& target, const PlanEntry& entry, c10::Device device) {
  std::vector<int64_t> shape = target.shape;
  if (target.placement == Placement::kShard0) {
    shape.at(0) = entry.padded_rows;
  }
  return at::empty(shape, at::TensorOptions().dtype(target.dtype).device(device));
}

// Raw bytes of a contiguous tensor, as a flat uint8 view that shares (and keeps alive) its storage.
at::Tensor byte_view(const at::Tensor& tensor) {
  return tensor.reshape({-1}).view(at::kByte);
}

void copy_bytes(
    const at::Tensor& dst,
    int64_t dst_offset,
    const at::Tensor& src,
    int64_t src_offset,
    int64_t bytes) {
  if (bytes <= 0) {
    return;
  }
  if (dst.is_cpu() && src.is_cpu()) {
    std::memcpy(
        static_cast<char*>(dst.data_ptr()) + dst_offset,
        static_cast<const char*>(src.data_ptr()) + src_offset,
        static_cast<size_t>(bytes));
    return;
  }
  byte_view(dst)
      .narrow(0, dst_offset, bytes)
      .copy_(byte_view(src).narrow(0, src_offset, bytes), true);
}

void zero_bytes(const at::Tensor& dst, int64_t offset, int64_t bytes) {
  if (bytes <= 0) {
    return;
  }
  if (dst.is_cpu()) {
    std::memset(static_cast<char*>(dst.data_ptr()) + offset, 0, static_cast<size_t>(bytes));
  } else {
    byte_view(dst).narrow(0, offset, bytes).zero_();
  }
}

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

// Segments at least this large move in direct buckets; see [Note: rank-0 transfer].
constexpr int64_t kDirectBytes = int64_t{1} << 20;

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

class ProgressReporter {
 public:
  ProgressReporter(int64_t total_bytes, double interval_s, bool active)
      : total_(total_bytes),
        interval_(interval_s),
        active_(active),
        start_(Clock::now()),
        last_(start_) {}

  void advance(int64_t bytes) {
    done_ += bytes;
    if (!active_) {
      return;
    }
    const auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_).count() < interval_ || done_ >= total_) {
      return;
    }
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? done_ / elapsed : 0.0;
    std::ostringstream line;
    line << std::fixed << std::setprecision(2) << "full-state load: " << done_ / 1073741824.0
         << " / " << total_ / 1073741824.0 << " GiB, " << rate / 1e9 << " GB/s, ETA "
         << std::setprecision(1) << (rate > 0 ? (total_ - done_) / rate : 0.0) << " s";
    log::info(line.str());
  }

 private:
  int64_t total_;
  int64_t done_ = 0;
  double interval_;
  bool active_;
  Clock::time_point start_;
  Clock::time_point last_;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Waits for `work` within `bound`; a failure becomes a RuntimeError naming this rank, the peer
// (-1: a collective) and what was waited for. See [Note: bounded waits].
void bounded_wait(
    const c10::intrusive_ptr<c10d::Work>& work,
    int64_t rank,
    int64_t peer,
    const std::string& what,
    std::chrono::milliseconds bound) {
  auto fail = [&](const std::string& cause) {
    const std::string who = peer >= 0 ? "rank " + std::to_string(peer) : "one of the ranks";
    std::ostringstream seconds;
    seconds << std::fixed << std::setprecision(1) << bound.count() / 1000.0;
    FSDP2_THROW(
        RuntimeError,
        "rank " + std::to_string(rank) + ": " + what +
            (peer >= 0 ? " with rank " + std::to_string(peer) : "") + " failed within " +
            seconds.str() + " s: " + cause + " -- " + who +
            " has most likely died or stopped; its own log holds the cause");
  };
  try {
    work->wait(bound);
  } catch (const c10::Error& error) {
    fail(error.what_without_backtrace());
  } catch (const std::exception& error) {
    fail(error.what());
  }
}

std::vector<at::Tensor> contiguous_sources(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& source_index) {
  std::vector<at::Tensor> sources;
  sources.reserve(source_index.size());
  for (int64_t index : source_index) {
    sources.push_back(tensors[index].contiguous());
  }
  return sources;
}

}  // namespace

std::string describe_state_mismatch(
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    std::vector<int64_t>* source_index,
    bool convert_dtype) {
  if (names.size() != tensors.size()) {
    return "full state: " + std::to_string(names.size()) + " names for " +
           std::to_string(tensors.size()) + " tensors";
  }
  std::unordered_map<std::string, int64_t> provided;
  for (size_t i = 0; i < names.size(); ++i) {
    provided.emplace(names[i], static_cast<int64_t>(i));
  }
  std::vector<std::string> missing, shape_mismatch, dtype_mismatch, unexpected, not_on_cpu;
  std::unordered_set<std::string> claimed;
  if (source_index) {
    source_index->assign(targets.size(), -1);
  }
  for (size_t t = 0; t < targets.size(); ++t) {
    const TargetSpec& target = targets[t];
    int64_t found = -1;
    auto it = provided.find(target.fqn);
    for (size_t a = 0; it == provided.end() && a < target.aliases.size(); ++a) {
      it = provided.find(target.aliases[a]);  // a tied checkpoint may store only one alias
    }
    if (it != provided.end()) {
      found = it->second;
    }
    claimed.insert(target.fqn);
    claimed.insert(target.aliases.begin(), target.aliases.end());
    if (found < 0) {
      missing.push_back(target.fqn);
      continue;
    }
    const at::Tensor& tensor = tensors[found];
    if (!tensor.defined()) {
      missing.push_back(target.fqn + " (None)");
      continue;
    }
    if (!tensor.is_cpu()) {
      not_on_cpu.push_back(names[found] + " (" + tensor.device().str() + ")");
      continue;
    }
    if (tensor.sizes() != c10::IntArrayRef(target.shape)) {
      shape_mismatch.push_back(
          names[found] + " " + shape_to_string(tensor.sizes()) + " vs model " +
          shape_to_string(target.shape));
    } else if (
        tensor.scalar_type() != target.dtype &&
        !(convert_dtype && at::isFloatingType(tensor.scalar_type()) &&
          at::isFloatingType(target.dtype))) {
      dtype_mismatch.push_back(
          names[found] + " " + std::string(c10::toString(tensor.scalar_type())) + " vs model " +
          c10::toString(target.dtype));
    }
    if (source_index) {
      (*source_index)[t] = found;
    }
  }
  for (const auto& name : names) {
    if (claimed.count(name) == 0) {
      unexpected.push_back(name);
    }
  }
  if (missing.empty() && unexpected.empty() && shape_mismatch.empty() && dtype_mismatch.empty() &&
      not_on_cpu.empty()) {
    return "";
  }
  std::ostringstream out;
  out << "full state does not match the model (" << targets.size() << " model tensors, "
      << names.size() << " provided):";
  append_examples(
      out, "missing keys", missing, "add them to the full state, or build the model that wrote it");
  append_examples(
      out, "unexpected keys", unexpected, "drop them, or rename them to the model's FQNs");
  append_examples(
      out, "shape mismatches", shape_mismatch, "load a checkpoint of the same architecture/config");
  append_examples(
      out,
      "dtype mismatches",
      dtype_mismatch,
      "cast the full state to the model's dtype before loading");
  append_examples(
      out,
      "tensors not on the CPU",
      not_on_cpu,
      "the full state must hold real CPU tensors (a meta model's state_dict() has no values)");
  return out.str();
}

std::chrono::milliseconds wait_bound(double timeout_s, int64_t bytes) {
  const double seconds = timeout_s + static_cast<double>(bytes) / kMinBandwidthBytesPerSecond;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::string agree_on_verdict(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::string& local_verdict,
    c10::Device comm_device,
    double timeout_s) {
  const int64_t rank = pg->getRank();
  const int64_t world = pg->getSize();
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(comm_device);
  std::vector<at::Tensor> reporter{
      at::full({1}, local_verdict.empty() ? world : rank, long_options)};
  c10d::AllreduceOptions min_options;
  min_options.reduceOp = c10d::ReduceOp::MIN;
  const auto bound = wait_bound(timeout_s, 0);
  // With two ranks the all-reduce has one peer to name; beyond that any of them may be the one.
  bounded_wait(
      pg->allreduce(reporter, min_options),
      rank,
      world == 2 ? 1 - rank : -1,
      "agreeing on the verdict (all-reduce)",
      bound);
  const int64_t source = reporter[0].item<int64_t>();
  if (source == world) {
    return "";
  }
  c10d::BroadcastOptions broadcast_options;
  broadcast_options.rootRank = source;
  std::vector<at::Tensor> length{
      at::full({1}, rank == source ? static_cast<int64_t>(local_verdict.size()) : 0, long_options)};
  bounded_wait(
      pg->broadcast(length, broadcast_options), rank, source, "receiving the verdict", bound);
  const int64_t size = length[0].item<int64_t>();
  at::Tensor host = at::empty({std::max<int64_t>(size, 1)}, at::kByte);
  if (rank == source) {
    std::memcpy(host.data_ptr(), local_verdict.data(), size);
  }
  std::vector<at::Tensor> text{host.to(comm_device)};
  bounded_wait(
      pg->broadcast(text, broadcast_options), rank, source, "receiving the verdict", bound);
  host = text[0].cpu();
  std::string verdict(static_cast<const char*>(host.data_ptr()), size);
  if (rank != source) {
    verdict = "(reported by rank " + std::to_string(source) + ") " + verdict;
  }
  return verdict;
}

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
    verdict =
        "load_from_rank0: rank " + std::to_string(rank) +
        " passed a full state; only rank 0 holds the source (pass an empty state elsewhere, or "
        "use the local loader when every rank can see the full state)";
  }
  verdict = agree_on_verdict(pg, verdict, options.device, options.timeout_s);
  if (!verdict.empty()) {
    FSDP2_THROW(ValueError, verdict);
  }
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
  int64_t capacity = 0;
  for (const auto& bucket : plan.buckets()) {
    capacity = bucket.direct ? capacity : std::max(capacity, bucket.bytes_per_rank);
  }
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
  return "rank " + std::to_string(rank) + ": cannot allocate its " +
         std::to_string(plan.bytes_per_rank()) + " bytes of shards and replicas (and staging) on " +
         device.str() + ": " + cause;
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
    for (int64_t index = 0; index < static_cast<int64_t>(buckets.size()); ++index) {
      if (rank_ == 0) {
        post_sends(index);
      } else {
        post_receive(index);
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
    in_flight_[slot_of(index)].push_back(
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
      in_flight_[slot_of(index)].push_back({pg_->recv(message, 0, static_cast<int>(index)), 0});
    }
  }

  // Waits for bucket `index` within its bound ([Note: bounded waits]) and unpacks it.
  void complete(int64_t index) {
    const int slot = slot_of(index);
    const auto& buckets = plan_.buckets();
    const Bucket& bucket = buckets[index];
    const auto bound = wait_bound(options_.timeout_s, bucket.bytes_per_rank * world_);
    const std::string what =
        "bucket " + std::to_string(index + 1) + " of " + std::to_string(buckets.size()) + " (" +
        std::to_string(bucket.bytes_per_rank) + " bytes per rank) of the rank-0 transfer";
    for (auto& flight : in_flight_[slot]) {
      bounded_wait(flight.work, rank_, flight.peer, what, bound);
    }
    in_flight_[slot].clear();
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
  std::vector<InFlight> in_flight_[2];
  std::future<void> own_rows_;
};

// On an exception, what is still in flight may write into (or read from) the staging parts,
// destinations and sources after the transfer has left: they are kept alive instead of freed under
// a transfer ([Note: bounded waits]). The process is failing; the leak is bounded.
RankZeroTransfer::~RankZeroTransfer() {
  if (own_rows_.valid()) {
    own_rows_.wait();  // the helper thread reads sources_ and writes result_: join it first
  }
  if (in_flight_[0].empty() && in_flight_[1].empty()) {
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

LoadResult load_from_local(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    const LoadOptions& options) {
  const auto start = Clock::now();
  const int64_t rank = pg->getRank();
  const int64_t world = pg->getSize();
  std::vector<int64_t> source_index;
  std::string verdict =
      describe_state_mismatch(targets, names, tensors, &source_index, options.convert_dtype);
  verdict = agree_on_verdict(pg, verdict, options.device, options.timeout_s);
  if (!verdict.empty()) {
    FSDP2_THROW(ValueError, verdict);
  }
  ShardingPlan plan(layouts_of(targets), world, options.bucket_bytes);
  LoadResult result;
  result.tensors.reserve(targets.size());
  ProgressReporter progress(plan.bytes_per_rank(), options.progress_interval_s, rank == 0);
  for (size_t t = 0; t < targets.size(); ++t) {
    const PlanEntry& entry = plan.entries()[t];
    at::Tensor destination = allocate_destination(targets[t], entry, options.device);
    const at::Tensor& source = tensors[source_index[t]];
    if (targets[t].placement == Placement::kReplicate) {
      destination.copy_(source);
    } else {
      const ShardRows rows = shard_rows(targets[t].shape.at(0), world, rank);
      if (rows.rows > 0) {
        destination.narrow(0, 0, rows.rows).copy_(source.narrow(0, rows.row_begin, rows.rows));
      }
      if (rows.padded_rows > rows.rows) {
        destination.narrow(0, rows.rows, rows.padded_rows - rows.rows).zero_();
      }
    }
    result.bytes_received += entry.segment_bytes;
    progress.advance(entry.segment_bytes);
    result.tensors.push_back(std::move(destination));
  }
  result.seconds = seconds_since(start);
  std::ostringstream summary;
  summary << std::fixed << std::setprecision(3)
          << "full-state load from local source: " << targets.size() << " tensors, "
          << result.bytes_received << " bytes, " << result.seconds << " s";
  log::message(rank == 0 ? log::Level::kInfo : log::Level::kDebug, summary.str());
  return result;
}

int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s) {
  if (!tensor.is_contiguous()) {
    FSDP2_THROW(ValueError, "broadcast_in_chunks: the tensor must be contiguous");
  }
  if (chunk_bytes <= 0) {
    FSDP2_THROW(ValueError, "broadcast_in_chunks: chunk_bytes must be positive");
  }
  const at::Tensor bytes = byte_view(tensor);
  const int64_t total = bytes.numel();
  c10d::BroadcastOptions options;
  options.rootRank = root;
  ProgressReporter progress(total, 2.0, pg->getRank() == root && total > (int64_t{1} << 30));
  const int64_t rank = pg->getRank();
  const auto bound = wait_bound(timeout_s, 2 * chunk_bytes);
  const std::string what = "broadcasting a " + std::to_string(total) + "-byte tensor from its root";
  c10::intrusive_ptr<c10d::Work> previous;
  for (int64_t offset = 0; offset < total; offset += chunk_bytes) {
    std::vector<at::Tensor> chunk{bytes.narrow(0, offset, std::min(chunk_bytes, total - offset))};
    auto work = pg->broadcast(chunk, options);
    if (previous) {
      bounded_wait(previous, rank, rank == root ? -1 : root, what, bound);
    }
    previous = work;
    progress.advance(chunk[0].numel());
  }
  if (previous) {
    bounded_wait(previous, rank, rank == root ? -1 : root, what, bound);
  }
  return total;
}

}  // namespace fsdp2_ext
