#include "fsdp2_ext/shard_loader.h"

#include "load_support.h"

namespace fsdp2_ext {

using detail::allocate_destination;
using detail::Clock;
using detail::layouts_of;
using detail::ProgressReporter;
using detail::seconds_since;

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
  if (!options.verdict_agreed) {
    verdict = agree_on_verdict(
        pg,
        verdict,
        verdict_device(pg, options.device),
        WaitBound{options.timeout_s, options.lead_bytes, options.lead_work},
        "load_from_local");
  }
  FSDP2_CHECK_VALUE(verdict.empty(), verdict);
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

}  // namespace fsdp2_ext
