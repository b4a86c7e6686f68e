#include "bindings/registrations.h"

#include "fsdp2_ext/safetensors_file.h"
#include "fsdp2_ext/shard_loader.h"
#include "fsdp2_ext/sharding_plan.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {
namespace {

// (fqn, aliases, like, placement): `like` is any tensor (usually the meta parameter) that carries
// the global shape and dtype; placement is "shard0" or "replicate".
using TargetTuple = std::tuple<std::string, std::vector<std::string>, at::Tensor, std::string>;

Placement parse_placement(const std::string& name, const std::string& fqn) {
  if (name == "shard0") {
    return Placement::kShard0;
  }
  if (name == "replicate") {
    return Placement::kReplicate;
  }
  throw ValueError(
      "target '" + fqn + "': placement must be 'shard0' or 'replicate', got '" + name + "'");
}

std::vector<TargetSpec> to_targets(const std::vector<TargetTuple>& targets) {
  std::vector<TargetSpec> specs;
  specs.reserve(targets.size());
  for (const auto& [fqn, aliases, like, placement] : targets) {
    specs.push_back(TargetSpec{
        fqn, aliases, like.sizes().vec(), like.scalar_type(), parse_placement(placement, fqn)});
  }
  return specs;
}

py::dict to_dict(LoadResult&& result) {
  py::dict out;
  out["tensors"] = py::cast(std::move(result.tensors));
  out["bytes_received"] = result.bytes_received;
  out["bytes_sent"] = result.bytes_sent;
  out["buckets"] = result.buckets;
  out["seconds"] = result.seconds;
  return out;
}

LoadOptions to_options(
    int64_t bucket_bytes,
    const c10::Device& device,
    double progress_interval_s,
    double timeout_s,
    bool convert_dtype) {
  LoadOptions options;
  options.convert_dtype = convert_dtype;
  options.bucket_bytes = bucket_bytes;
  options.device = device;
  options.progress_interval_s = progress_interval_s;
  options.timeout_s = timeout_s;
  return options;
}

using LoadFunction = LoadResult (*)(
    const c10::intrusive_ptr<c10d::ProcessGroup>&,
    const std::vector<TargetSpec>&,
    const std::vector<std::string>&,
    const std::vector<at::Tensor>&,
    const LoadOptions&);

// load_from_rank0 and load_from_local share one Python signature.
void def_loader(py::module_& m, const char* name, LoadFunction load) {
  m.def(
      name,
      [load](
          const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
          const std::vector<TargetTuple>& targets,
          const std::vector<std::string>& names,
          const std::vector<at::Tensor>& tensors,
          int64_t bucket_bytes,
          const c10::Device& device,
          double progress_interval_s,
          double timeout_s,
          bool convert_dtype) {
        const auto specs = to_targets(targets);
        LoadResult result;
        {
          py::gil_scoped_release no_gil;
          result = load(
              pg,
              specs,
              names,
              tensors,
              to_options(bucket_bytes, device, progress_interval_s, timeout_s, convert_dtype));
        }
        return to_dict(std::move(result));
      },
      py::arg("group"),
      py::arg("targets"),
      py::arg("names"),
      py::arg("tensors"),
      py::kw_only(),
      py::arg("bucket_bytes"),
      py::arg("device"),
      py::arg("progress_interval_s") = 2.0,
      py::arg("timeout_s") = 60.0,
      py::arg("convert_dtype") = false);
}

}  // namespace

void register_sharded_load(py::module_& m) {
  m.def(
      "shard_rows",
      [](int64_t dim0, int64_t world_size, int64_t rank) {
        const ShardRows rows = shard_rows(dim0, world_size, rank);
        return py::make_tuple(rows.row_begin, rows.rows, rows.padded_rows);
      },
      py::arg("dim0"),
      py::arg("world_size"),
      py::arg("rank"),
      "FSDP2's Shard(0) chunking: (row_begin, rows, padded_rows) of `rank`.");
  m.def(
      "plan_json",
      [](const std::vector<TargetTuple>& targets, int64_t world_size, int64_t bucket_bytes) {
        std::vector<TensorLayout> layouts;
        for (const auto& spec : to_targets(targets)) {
          layouts.push_back(TensorLayout{
              spec.fqn,
              spec.shape,
              static_cast<int64_t>(c10::elementSize(spec.dtype)),
              spec.placement});
        }
        return ShardingPlan(std::move(layouts), world_size, bucket_bytes).to_json();
      },
      py::arg("targets"),
      py::arg("world_size"),
      py::arg("bucket_bytes"));
  m.def(
      "describe_state_mismatch",
      [](const std::vector<TargetTuple>& targets,
         const std::vector<std::string>& names,
         const std::vector<at::Tensor>& tensors,
         bool convert_dtype) {
        return describe_state_mismatch(to_targets(targets), names, tensors, nullptr, convert_dtype);
      },
      py::arg("targets"),
      py::arg("names"),
      py::arg("tensors"),
      py::kw_only(),
      py::arg("convert_dtype") = false);
  m.def(
      "agree_on_verdict",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         const std::string& verdict,
         const c10::Device& device,
         double timeout_s) { return agree_on_verdict(pg, verdict, device, timeout_s); },
      py::arg("group"),
      py::arg("verdict"),
      py::arg("device"),
      py::arg("timeout_s") = 60.0,
      py::call_guard<py::gil_scoped_release>(),
      "All ranks return the verdict of the lowest rank that reported one ('' if none did).");
  def_loader(m, "load_from_rank0", &load_from_rank0);
  def_loader(m, "load_from_local", &load_from_local);
  m.def(
      "map_safetensors",
      [](const std::string& path) {
        SafetensorsFile file(path);
        std::vector<std::pair<std::string, at::Tensor>> tensors;
        for (const auto& entry : file.entries()) {
          tensors.emplace_back(entry.name, file.tensor(entry));
        }
        return tensors;
      },
      py::arg("path"),
      "[(name, tensor)] viewing a read-only shared mapping of the file (never write to them).");
  m.def(
      "broadcast_in_chunks",
      &broadcast_in_chunks,
      py::arg("group"),
      py::arg("tensor"),
      py::kw_only(),
      py::arg("chunk_bytes"),
      py::arg("root") = 0,
      py::arg("timeout_s") = 60.0,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace fsdp2_ext::bindings
