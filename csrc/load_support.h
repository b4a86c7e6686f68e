// What the loaders and collectives share, internal to the core: target layouts and
// destinations, byte copies, progress lines, bounded waits. Not a public header.
#pragma once

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"
#include "fsdp2_ext/shard_loader.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp2_ext::detail {

using Clock = std::chrono::steady_clock;

inline std::vector<TensorLayout> layouts_of(const std::vector<TargetSpec>& targets) {
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
inline at::Tensor allocate_destination(
    const TargetSpec& target, const PlanEntry& entry, c10::Device device) {
  std::vector<int64_t> shape = target.shape;
  if (target.placement == Placement::kShard0) {
    shape.at(0) = entry.padded_rows;
  }
  return at::empty(shape, at::TensorOptions().dtype(target.dtype).device(device));
}

// Raw bytes of a contiguous tensor, as a flat uint8 view that shares (and keeps alive) its storage.
inline at::Tensor byte_view(const at::Tensor& tensor) {
  return tensor.reshape({-1}).view(at::kByte);
}

inline void copy_bytes(
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

inline void zero_bytes(const at::Tensor& dst, int64_t offset, int64_t bytes) {
  if (bytes <= 0) {
    return;
  }
  if (dst.is_cpu()) {
    std::memset(static_cast<char*>(dst.data_ptr()) + offset, 0, static_cast<size_t>(bytes));
  } else {
    byte_view(dst).narrow(0, offset, bytes).zero_();
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

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Waits for `work` within `bound`; a failure becomes a RuntimeError naming this rank, the peer
// (-1: a collective), what was waited for and the bound with what it allowed for. See
// [Note: bounded waits].
inline void bounded_wait(
    const c10::intrusive_ptr<c10d::Work>& work,
    int64_t rank,
    int64_t peer,
    const std::string& what,
    const WaitBound& bound) {
  auto fail = [&](const std::string& cause) {
    const std::string peer_name = peer >= 0 ? detail::concat("rank ", peer) : "";
    FSDP2_THROW(
        RuntimeError,
        "rank ",
        rank,
        ": ",
        what,
        peer >= 0 ? " with " + peer_name : "",
        " failed within ",
        bound.describe(),
        ": ",
        cause,
        " -- ",
        peer >= 0 ? peer_name : "one of the ranks",
        " has most likely died or stopped; its own log holds the cause");
  };
  try {
    work->wait(bound.duration());
  } catch (const c10::Error& error) {
    fail(error.what_without_backtrace());
  } catch (const std::exception& error) {
    fail(error.what());
  }
}

inline std::vector<at::Tensor> contiguous_sources(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& source_index) {
  std::vector<at::Tensor> sources;
  sources.reserve(source_index.size());
  for (int64_t index : source_index) {
    sources.push_back(tensors[index].contiguous());
  }
  return sources;
}

}  // namespace fsdp2_ext::detail
