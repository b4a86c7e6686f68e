#include "bindings/registrations.h"

#include "fsdp2_ext/host_shared_tensor.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {

void register_host_shared(py::module_& m) {
  m.def(
      "plan_shared_file",
      [](const std::string& path,
         const std::vector<std::string>& fqns,
         const std::vector<at::Tensor>& likes) {
        return plan_shared_file(path, fqns, likes).to_json();
      },
      py::arg("path"),
      py::arg("fqns"),
      py::arg("likes"),
      "Manifest JSON laying the tensors out at page-aligned offsets of `path`.");
  m.def(
      "check_shared_directory",
      [](const std::string& directory, int64_t bytes) {
        std::string note;
        std::string verdict = check_shared_directory(directory, bytes, &note);
        return std::make_tuple(verdict, note);
      },
      py::arg("directory"),
      py::arg("bytes"),
      "(verdict or '', note or '')");
  m.def(
      "create_shared_file",
      [](const std::string& manifest) {
        return create_shared_file(SharedManifest::from_json(manifest));
      },
      py::arg("manifest"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "write_shared_entry",
      [](int fd, const std::string& manifest, int64_t index, const at::Tensor& tensor) {
        write_shared_entry(fd, SharedManifest::from_json(manifest).entries.at(index), tensor);
      },
      py::arg("fd"),
      py::arg("manifest"),
      py::arg("index"),
      py::arg("tensor"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "map_entry_writable",
      [](int fd, const std::string& manifest, int64_t index) {
        return map_entry_writable(fd, SharedManifest::from_json(manifest).entries.at(index));
      },
      py::arg("fd"),
      py::arg("manifest"),
      py::arg("index"));
  m.def(
      "map_shared_file",
      [](const std::string& manifest) {
        return map_shared_file(SharedManifest::from_json(manifest));
      },
      py::arg("manifest"),
      "Read-only shared mapping: one CPU tensor per entry.");
  m.def("close_descriptor", &close_descriptor, py::arg("fd"));
  m.def("unlink_shared_file", &unlink_shared_file, py::arg("path"));
}

}  // namespace fsdp2_ext::bindings
