#include "bindings/registrations.h"
#include "load_support.h"

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/safetensors_file.h"
#include "fsdp2_ext/shard_loader.h"
#include "fsdp2_ext/sharding_plan.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {
namespace {

void register_types(py::module_& m) {
  py::enum_<Placement>(
      m, "Placement", "Where a target lives: FSDP2's Shard(0), or whole on every rank.")
      .value("SHARD0", Placement::kShard0)
      .value("REPLICATE", Placement::kReplicate);
  py::class_<TargetSpec>(m, "TargetSpec", "One tensor to build on every rank.")
      .def(
          py::init([](std::string fqn,
                      const at::Tensor& like,
                      Placement placement,
                      std::vector<std::string> aliases) {
            return TargetSpec{
                std::move(fqn),
                std::move(aliases),
                like.sizes().vec(),
                like.scalar_type(),
                placement};
          }),
          py::arg("fqn"),
          py::arg("like"),
          py::arg("placement"),
          py::arg("aliases") = std::vector<std::string>{},
          "`like`: any tensor (usually the meta parameter) with the global shape and dtype; "
          "`aliases`: other FQNs of the same tensor, accepted as source keys.")
      .def_readonly("fqn", &TargetSpec::fqn)
      .def_readonly("aliases", &TargetSpec::aliases)
      .def_readonly("shape", &TargetSpec::shape)
      .def_readonly("dtype", &TargetSpec::dtype)
      .def_readonly("placement", &TargetSpec::placement)
      .def("__repr__", [](const TargetSpec& spec) {
        return detail::concat(
            "TargetSpec('",
            spec.fqn,
            "', shape=",
            c10::IntArrayRef(spec.shape),
            ", dtype=",
            spec.dtype,
            spec.placement == Placement::kShard0 ? ", SHARD0)" : ", REPLICATE)");
      });
  py::class_<LoadResult>(m, "LoadResult", "What a load built on this rank, and what it moved.")
      .def_readonly(
          "tensors",
          &LoadResult::tensors,
          "per target: the padded local shard (SHARD0) or the full tensor (REPLICATE)")
      .def_readonly("bytes_received", &LoadResult::bytes_received)
      .def_readonly("bytes_sent", &LoadResult::bytes_sent)
      .def_readonly("buckets", &LoadResult::buckets)
      .def_readonly("device_bytes_allocated", &LoadResult::device_bytes_allocated)
      .def_readonly("host_staging_bytes_allocated", &LoadResult::host_staging_bytes_allocated)
      .def_readonly("seconds", &LoadResult::seconds);
  py::class_<ShardRows>(m, "ShardRows", "FSDP2's Shard(0) chunking of dim 0 for one rank.")
      .def_readonly("row_begin", &ShardRows::row_begin)
      .def_readonly("rows", &ShardRows::rows)
      .def_readonly("padded_rows", &ShardRows::padded_rows)
      .def("__repr__", [](const ShardRows& rows) {
        return "ShardRows(row_begin=" + std::to_string(rows.row_begin) +
               ", rows=" + std::to_string(rows.rows) +
               ", padded_rows=" + std::to_string(rows.padded_rows) + ")";
      });
}

// A group given as None crosses as a null pointer: refused here, never dereferenced.
const c10::intrusive_ptr<c10d::ProcessGroup>& checked(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  FSDP2_CHECK_VALUE(
      pg,
      "group is None: initialise torch.distributed (init_process_group) before a collective of "
      "fsdp2_ext, or pass the group");
  return pg;
}

// None: the floor of [Note: wait knobs], read when the call is made.
double floor_or(std::optional<double> timeout_s) {
  return timeout_s ? *timeout_s : wait_floor_seconds();
}

LoadOptions to_options(
    int64_t bucket_bytes,
    const c10::Device& device,
    double progress_interval_s,
    std::optional<double> timeout_s,
    bool convert_dtype,
    bool verdict_agreed,
    int64_t lead_bytes,
    const std::string& lead_work) {
  LoadOptions options;
  options.lead_bytes = lead_bytes;
  options.lead_work = lead_work;
  options.convert_dtype = convert_dtype;
  options.verdict_agreed = verdict_agreed;
  options.bucket_bytes = bucket_bytes;
  options.device = device;
  options.progress_interval_s = progress_interval_s;
  options.timeout_s = floor_or(timeout_s);
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
          const std::vector<TargetSpec>& targets,
          const std::vector<std::string>& names,
          const std::vector<at::Tensor>& tensors,
          int64_t bucket_bytes,
          const c10::Device& device,
          double progress_interval_s,
          std::optional<double> timeout_s,
          bool convert_dtype,
          bool verdict_agreed,
          int64_t lead_bytes,
          const std::string& lead_work) {
        LoadResult result;
        {
          py::gil_scoped_release no_gil;
          result = load(
              checked(pg),
              targets,
              names,
              tensors,
              to_options(
                  bucket_bytes,
                  device,
                  progress_interval_s,
                  timeout_s,
                  convert_dtype,
                  verdict_agreed,
                  lead_bytes,
                  lead_work));
        }
        return result;
      },
      py::arg("group"),
      py::arg("targets"),
      py::arg("names"),
      py::arg("tensors"),
      py::kw_only(),
      py::arg("bucket_bytes"),
      py::arg("device"),
      py::arg("progress_interval_s") = kDefaultProgressIntervalSeconds,
      py::arg("timeout_s") = py::none(),
      py::arg("convert_dtype") = false,
      py::arg("verdict_agreed") = false,
      py::arg("lead_bytes") = 0,
      py::arg("lead_work") = "");
}

}  // namespace

void register_sharded_load(py::module_& m) {
  register_types(m);
  py::dict defaults;
  defaults["timeout_s"] = kDefaultTimeoutSeconds;  // without FSDP2_EXT_WAIT_FLOOR_S
  defaults["min_bandwidth_bytes_per_second"] = kMinBandwidthBytesPerSecond;
  defaults["wait_floor_env"] = kWaitFloorEnv;
  defaults["min_bandwidth_env"] = kMinBandwidthEnv;
  defaults["bucket_bytes"] = kDefaultBucketBytes;
  defaults["direct_bytes"] = kDirectBytes;
  defaults["progress_interval_s"] = kDefaultProgressIntervalSeconds;
  m.attr("DEFAULTS") = defaults;
  py::class_<ShardingPlan>(
      m,
      "ShardingPlan",
      "The layout math of a load: every target's padded Shard(0) segment and the buckets that "
      "move them (what the loaders execute; the planner reads its figures from here).")
      .def(
          py::init([](const std::vector<TargetSpec>& targets,
                      int64_t world_size,
                      int64_t bucket_bytes,
                      int64_t direct_bytes) {
            return ShardingPlan(
                detail::layouts_of(targets), world_size, bucket_bytes, direct_bytes);
          }),
          py::arg("targets"),
          py::arg("world_size"),
          py::kw_only(),
          py::arg("bucket_bytes") = kDefaultBucketBytes,
          py::arg("direct_bytes") = 0)
      .def_property_readonly("world_size", &ShardingPlan::world_size)
      .def_property_readonly("bytes_per_rank", &ShardingPlan::bytes_per_rank)
      .def_property_readonly("source_bytes", &ShardingPlan::source_bytes)
      .def_property_readonly("staging_part_bytes", &ShardingPlan::staging_part_bytes)
      .def_property_readonly(
          "bucket_count", [](const ShardingPlan& plan) { return plan.buckets().size(); });
  m.def(
      "shard_rows",
      &shard_rows,
      py::arg("dim0"),
      py::arg("world_size"),
      py::arg("rank"),
      "FSDP2's Shard(0) chunking of a dimension of size dim0 for `rank`.");
  m.def(
      "describe_state_mismatch",
      [](const std::vector<TargetSpec>& targets,
         const std::vector<std::string>& names,
         const std::vector<at::Tensor>& tensors,
         bool convert_dtype) {
        return describe_state_mismatch(targets, names, tensors, nullptr, convert_dtype);
      },
      py::arg("targets"),
      py::arg("names"),
      py::arg("tensors"),
      py::kw_only(),
      py::arg("convert_dtype") = false);
  m.def(
      "wait_floor_s",
      &wait_floor_seconds,
      "The floor of every wait: $FSDP2_EXT_WAIT_FLOOR_S, else DEFAULTS['timeout_s'] "
      "([Note: wait knobs]).");
  m.def(
      "min_bandwidth_bytes_per_second",
      &min_bandwidth_bytes_per_second,
      "The bandwidth floor: $FSDP2_EXT_MIN_BANDWIDTH_MIB_S MiB/s, else "
      "DEFAULTS['min_bandwidth_bytes_per_second'] ([Note: wait knobs]).");
  m.def(
      "wait_bound",
      [](std::optional<double> timeout_s, int64_t bytes, const std::string& allows_for) {
        const WaitBound bound{floor_or(timeout_s), bytes, allows_for};
        return py::make_tuple(bound.duration().count() / 1000.0, bound.describe());
      },
      py::arg("timeout_s"),
      py::arg("bytes") = 0,
      py::arg("allows_for") = "",
      "(seconds, description) of the bound of a wait for `bytes` of work ([Note: bounded "
      "waits]).");
  m.def(
      "agree_on_verdict",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         const std::string& verdict,
         const c10::Device& device,
         std::optional<double> timeout_s,
         int64_t allow_bytes,
         const std::string& allows_for,
         const std::string& stage) {
        return agree_on_verdict(
            checked(pg),
            verdict,
            device,
            WaitBound{floor_or(timeout_s), allow_bytes, allows_for},
            stage);
      },
      py::arg("group"),
      py::arg("verdict"),
      py::arg("device"),
      py::arg("timeout_s") = py::none(),
      py::kw_only(),
      py::arg("allow_bytes") = 0,
      py::arg("allows_for") = "",
      py::arg("stage") = "",
      py::call_guard<py::gil_scoped_release>(),
      "All ranks return the verdict of the lowest rank that reported one ('' if none did); the "
      "wait allows for `allow_bytes` of work the other ranks may still do ([Note: bounded "
      "waits]), `stage` names the agreement in an error.");
  m.def(
      "bounded_first_collective",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         const c10::Device& device,
         std::optional<double> timeout_s,
         int64_t allow_bytes,
         const std::string& allows_for) {
        bounded_first_collective(
            checked(pg), device, WaitBound{floor_or(timeout_s), allow_bytes, allows_for});
      },
      py::arg("group"),
      py::arg("device"),
      py::arg("timeout_s") = py::none(),
      py::kw_only(),
      py::arg("allow_bytes") = 0,
      py::arg("allows_for") = "",
      py::call_guard<py::gil_scoped_release>(),
      "The group's first collective on `device`, bounded as a whole (on NCCL it creates the "
      "communicator; [Note: bounded waits]).");
  m.def(
      "figure_range",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         const std::vector<int64_t>& figures,
         std::optional<double> timeout_s,
         int64_t allow_bytes,
         const std::string& allows_for,
         const std::string& stage) {
        return figure_range(
            checked(pg),
            figures,
            c10::Device(c10::kCPU),
            WaitBound{floor_or(timeout_s), allow_bytes, allows_for},
            stage);
      },
      py::arg("group"),
      py::arg("figures"),
      py::arg("timeout_s") = py::none(),
      py::kw_only(),
      py::arg("allow_bytes") = 0,
      py::arg("allows_for") = "",
      py::arg("stage"),
      py::call_guard<py::gil_scoped_release>(),
      "(least, greatest) over the ranks of each int64 figure, on the CPU backend (one bounded "
      "all-reduce).");
  def_loader(m, "load_from_rank0", &load_from_rank0);
  def_loader(m, "load_from_local", &load_from_local);
  m.def(
      "transport_device",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const c10::Device& load_device) {
        return transport_device(checked(pg), load_device);
      },
      py::arg("group"),
      py::arg("load_device"),
      "The device a load's data travels on over `group` ([Note: transport device]).");
  py::class_<SafetensorsEntry>(m, "SafetensorsEntry", "One tensor of a safetensors header.")
      .def_readonly("name", &SafetensorsEntry::name)
      .def_readonly("dtype", &SafetensorsEntry::dtype)
      .def_readonly("shape", &SafetensorsEntry::shape)
      .def_readonly("begin", &SafetensorsEntry::begin, "byte offset in the data section")
      .def_readonly("end", &SafetensorsEntry::end)
      .def_readonly(
          "in_place",
          &SafetensorsEntry::in_place,
          "aligned to its element size: viewed in the mapping (else a private copy)");
  py::class_<SafetensorsFile>(
      m, "SafetensorsFile", "A safetensors file mapped read-only; its tensors view the mapping.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def_property_readonly("path", &SafetensorsFile::path)
      .def_property_readonly("entries", &SafetensorsFile::entries)
      .def(
          "tensor",
          &SafetensorsFile::tensor,
          py::arg("entry"),
          "A read-only view of the mapping (never write to it); it keeps the mapping alive. A "
          "tensor not aligned to its element size is a private copy.")
      .def(
          "tensors",
          [](const SafetensorsFile& file) {
            py::dict tensors;
            for (const auto& entry : file.entries()) {
              tensors[py::str(entry.name)] = file.tensor(entry);
            }
            return tensors;
          },
          "{name: tensor} in the header's order, viewing the mapping (never write to them).");
  m.def(
      "broadcast_in_chunks",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         const at::Tensor& tensor,
         int64_t chunk_bytes,
         int64_t root,
         std::optional<double> timeout_s,
         int64_t lead_bytes) {
        return broadcast_in_chunks(
            checked(pg), tensor, chunk_bytes, root, floor_or(timeout_s), lead_bytes);
      },
      py::arg("group"),
      py::arg("tensor"),
      py::kw_only(),
      py::arg("chunk_bytes"),
      py::arg("root") = 0,
      py::arg("timeout_s") = py::none(),
      py::arg("lead_bytes") = 0,
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace fsdp2_ext::bindings
