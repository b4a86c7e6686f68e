#include "fsdp2_ext/collectives.h"

#include "load_support.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>
#include <cstdlib>
#include <future>
#include <limits>
#include <memory>
#include <thread>

namespace fsdp2_ext {

using detail::bounded_wait;
using detail::byte_view;
using detail::ProgressReporter;

namespace {

// A knob of [Note: wait knobs]: the variable's positive number, else `fallback`.
double positive_from_env(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  FSDP2_CHECK_VALUE(
      end != text && *end == '\0' && std::isfinite(value) && value > 0,
      name,
      "='",
      text,
      "' is not a positive number; unset it for the default or give a number like ",
      fallback);
  return value;
}

std::string gib(double bytes) {
  std::ostringstream text;
  text << std::fixed << std::setprecision(bytes < (1 << 30) ? 1 : 2);
  if (bytes < (1 << 30)) {
    text << bytes / (1 << 20) << " MiB";
  } else {
    text << bytes / (1 << 30) << " GiB";
  }
  return text.str();
}

}  // namespace

double wait_floor_seconds() {
  return positive_from_env(kWaitFloorEnv, kDefaultTimeoutSeconds);
}

double min_bandwidth_bytes_per_second() {
  return positive_from_env(kMinBandwidthEnv, kMinBandwidthBytesPerSecond / (1 << 20)) * (1 << 20);
}

std::chrono::milliseconds WaitBound::duration() const {
  const double seconds = floor_s + static_cast<double>(bytes) / min_bandwidth_bytes_per_second();
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

std::string WaitBound::describe() const {
  std::ostringstream text;
  text << std::fixed << std::setprecision(floor_s < 1.0 ? 2 : 1) << duration().count() / 1000.0
       << " s (floor " << floor_s << " s";
  if (bytes > 0) {
    text << " + " << gib(static_cast<double>(bytes)) << " at " << std::setprecision(0)
         << min_bandwidth_bytes_per_second() / (1 << 20) << " MiB/s";
    if (!allows_for.empty()) {
      text << " for " << allows_for;
    }
  }
  text << ")";
  return text.str();
}

std::chrono::milliseconds wait_bound(double timeout_s, int64_t bytes) {
  return WaitBound{timeout_s, bytes, ""}.duration();
}

namespace {

bool has_backend_for(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::DeviceType type) {
  const auto devices = pg->getDeviceTypes();
  return std::any_of(
      devices.begin(), devices.end(), [type](const c10::Device& d) { return d.type() == type; });
}

}  // namespace

c10::Device transport_device(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device load_device) {
  if (has_backend_for(pg, load_device.type())) {
    return load_device;
  }
  if (has_backend_for(pg, c10::kCPU)) {
    return c10::Device(c10::kCPU);
  }
  std::string devices;
  for (const auto& device : pg->getDeviceTypes()) {
    devices += (devices.empty() ? "" : ", ") + device.str();
  }
  FSDP2_THROW(
      ValueError,
      "the process group has a backend for [",
      devices,
      "] but neither for ",
      load_device.str(),
      " (where the shards load) nor for cpu; initialise it with a backend for both, e.g. "
      "backend=\"cpu:gloo,cuda:nccl\" as VERL does");
}

c10::Device verdict_device(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device load_device) {
  return has_backend_for(pg, c10::kCPU) ? c10::Device(c10::kCPU)
                                        : transport_device(pg, load_device);
}

void bounded_first_collective(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device, const WaitBound& wait) {
  const auto bound = wait.duration();
  auto outcome = std::make_shared<std::promise<std::string>>();
  std::future<std::string> finished = outcome->get_future();
  // Detached: a communicator that never forms keeps its thread; the copies of `pg` and `outcome`
  // keep what it touches alive.
  std::thread([pg, device, outcome, bound] {
    try {
      c10::OptionalDeviceGuard on_device;
      if (!device.is_cpu()) {
        on_device.reset_device(device);
      }
      std::vector<at::Tensor> one{
          at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device))};
      pg->allreduce(one)->wait(bound);
      outcome->set_value("");
    } catch (const c10::Error& error) {
      outcome->set_value(error.what_without_backtrace());
    } catch (const std::exception& error) {
      outcome->set_value(error.what());
    }
  }).detach();
  const std::string what = detail::concat(
      "rank ",
      pg->getRank(),
      ": the load's first collective on ",
      device.str(),
      " (it creates the group's communicator there)");
  if (finished.wait_for(bound) != std::future_status::ready) {
    FSDP2_THROW(
        RuntimeError,
        what,
        " did not finish within ",
        wait.describe(),
        " -- one of the ranks has most likely died or stopped; its own log holds the cause");
  }
  const std::string failure = finished.get();
  if (!failure.empty()) {
    FSDP2_THROW(
        RuntimeError,
        what,
        " failed: ",
        failure,
        " -- one of the ranks has most likely died or stopped; its own log holds the cause");
  }
}

std::string agree_on_verdict(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::string& local_verdict,
    c10::Device comm_device,
    const WaitBound& bound,
    const std::string& stage) {
  const int64_t rank = pg->getRank();
  const int64_t world = pg->getSize();
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(comm_device);
  std::vector<at::Tensor> reporter{
      at::full({1}, local_verdict.empty() ? world : rank, long_options)};
  c10d::AllreduceOptions min_options;
  min_options.reduceOp = c10d::ReduceOp::MIN;
  const std::string what = stage.empty() ? std::string("agreeing on the verdict")
                                         : detail::concat(stage, ": agreeing on the verdict");
  // With two ranks the all-reduce has one peer to name; beyond that any of them may be the one.
  bounded_wait(
      pg->allreduce(reporter, min_options),
      rank,
      world == 2 ? 1 - rank : -1,
      what + " (all-reduce)",
      bound);
  const int64_t source = reporter[0].item<int64_t>();
  if (source == world) {
    return "";
  }
  // Every rank has arrived: the verdict itself is a few bytes.
  const WaitBound floor{bound.floor_s, 0, ""};
  c10d::BroadcastOptions broadcast_options;
  broadcast_options.rootRank = source;
  std::vector<at::Tensor> length{
      at::full({1}, rank == source ? static_cast<int64_t>(local_verdict.size()) : 0, long_options)};
  bounded_wait(
      pg->broadcast(length, broadcast_options), rank, source, what + " (receiving it)", floor);
  const int64_t size = length[0].item<int64_t>();
  at::Tensor host = at::empty({std::max<int64_t>(size, 1)}, at::kByte);
  if (rank == source) {
    std::memcpy(host.data_ptr(), local_verdict.data(), size);
  }
  std::vector<at::Tensor> text{host.to(comm_device)};
  bounded_wait(
      pg->broadcast(text, broadcast_options), rank, source, what + " (receiving it)", floor);
  host = text[0].cpu();
  std::string verdict(static_cast<const char*>(host.data_ptr()), size);
  if (rank != source) {
    verdict = detail::concat("(reported by rank ", source, ") ", verdict);
  }
  return verdict;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> figure_range(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const std::vector<int64_t>& figures,
    c10::Device comm_device,
    const WaitBound& bound,
    const std::string& stage) {
  const int64_t count = static_cast<int64_t>(figures.size());
  // MIN of each figure and of its negation gives the least and the greatest in one all-reduce.
  at::Tensor both = at::empty({2 * count}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    FSDP2_CHECK_VALUE(
        figures[i] > std::numeric_limits<int64_t>::min(),
        "figure_range: INT64_MIN has no negation");
    both[i] = figures[i];
    both[count + i] = -figures[i];
  }
  std::vector<at::Tensor> reduced{both.to(comm_device)};
  c10d::AllreduceOptions min_options;
  min_options.reduceOp = c10d::ReduceOp::MIN;
  bounded_wait(
      pg->allreduce(reduced, min_options),
      pg->getRank(),
      pg->getSize() == 2 ? 1 - pg->getRank() : -1,
      stage + " (all-reduce)",
      bound);
  const at::Tensor result = reduced[0].cpu();
  std::vector<int64_t> least(count), greatest(count);
  for (int64_t i = 0; i < count; ++i) {
    least[i] = result[i].item<int64_t>();
    greatest[i] = -result[count + i].item<int64_t>();
  }
  return {least, greatest};
}

int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s,
    int64_t lead_bytes) {
  FSDP2_CHECK_VALUE(tensor.is_contiguous(), "broadcast_in_chunks: the tensor must be contiguous");
  FSDP2_CHECK_VALUE(chunk_bytes > 0, "broadcast_in_chunks: chunk_bytes must be positive");
  const at::Tensor bytes = byte_view(tensor);
  const int64_t total = bytes.numel();
  c10d::BroadcastOptions options;
  options.rootRank = root;
  ProgressReporter progress(total, 2.0, pg->getRank() == root && total > (int64_t{1} << 30));
  const int64_t rank = pg->getRank();
  const WaitBound bound{timeout_s, 2 * chunk_bytes, "two chunks"};
  const WaitBound first{
      timeout_s, 2 * chunk_bytes + lead_bytes, "two chunks and the root's work before"};
  const std::string what = detail::concat("broadcasting a ", total, "-byte tensor from its root");
  bool waited = false;
  c10::intrusive_ptr<c10d::Work> previous;
  for (int64_t offset = 0; offset < total; offset += chunk_bytes) {
    std::vector<at::Tensor> chunk{bytes.narrow(0, offset, std::min(chunk_bytes, total - offset))};
    auto work = pg->broadcast(chunk, options);
    if (previous) {
      bounded_wait(previous, rank, rank == root ? -1 : root, what, waited ? bound : first);
      waited = true;
    }
    previous = work;
    progress.advance(chunk[0].numel());
  }
  if (previous) {
    bounded_wait(previous, rank, rank == root ? -1 : root, what, waited ? bound : first);
  }
  return total;
}

}  // namespace fsdp2_ext
