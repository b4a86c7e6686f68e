#include "fsdp2_ext/collectives.h"

#include "load_support.h"

#include <c10/core/DeviceGuard.h>

#include <future>
#include <memory>
#include <thread>

namespace fsdp2_ext {

using detail::bounded_wait;
using detail::byte_view;
using detail::ProgressReporter;

std::chrono::milliseconds wait_bound(double timeout_s, int64_t bytes) {
  const double seconds = timeout_s + static_cast<double>(bytes) / kMinBandwidthBytesPerSecond;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
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
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device, double timeout_s) {
  const auto bound = wait_bound(timeout_s, 0);
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
  std::ostringstream seconds;
  seconds << std::fixed << std::setprecision(1) << bound.count() / 1000.0;
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
        seconds.str(),
        " s -- one of the ranks has most likely died or stopped; its own log holds the cause");
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
    verdict = detail::concat("(reported by rank ", source, ") ", verdict);
  }
  return verdict;
}

int64_t broadcast_in_chunks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const at::Tensor& tensor,
    int64_t chunk_bytes,
    int64_t root,
    double timeout_s) {
  FSDP2_CHECK_VALUE(tensor.is_contiguous(), "broadcast_in_chunks: the tensor must be contiguous");
  FSDP2_CHECK_VALUE(chunk_bytes > 0, "broadcast_in_chunks: chunk_bytes must be positive");
  const at::Tensor bytes = byte_view(tensor);
  const int64_t total = bytes.numel();
  c10d::BroadcastOptions options;
  options.rootRank = root;
  ProgressReporter progress(total, 2.0, pg->getRank() == root && total > (int64_t{1} << 30));
  const int64_t rank = pg->getRank();
  const auto bound = wait_bound(timeout_s, 2 * chunk_bytes);
  const std::string what = detail::concat("broadcasting a ", total, "-byte tensor from its root");
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
