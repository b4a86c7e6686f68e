#include "bindings/registrations.h"

#include "fsdp2_ext/host_shared_tensor.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {

void register_host_shared(py::module_& m) {
  py::class_<SharedEntry>(m, "SharedEntry", "One tensor of a host-shared file.")
      .def_readonly("fqn", &SharedEntry::fqn)
      .def_readonly("dtype", &SharedEntry::dtype)
      .def_readonly("shape", &SharedEntry::shape)
      .def_readonly("offset", &SharedEntry::offset, "page-aligned byte offset in the file")
      .def_readonly("bytes", &SharedEntry::bytes);
  py::class_<SharedManifest>(
      m, "SharedManifest", "Where each tensor lies in a host-shared file; JSON on the wire.")
      .def_static(
          "plan",
          &plan_shared_file,
          py::arg("path"),
          py::arg("fqns"),
          py::arg("likes"),
          "Lays the tensors (dtype and shape of `likes`) out at page-aligned offsets of `path`.")
      .def_readonly("path", &SharedManifest::path)
      .def_readonly("file_bytes", &SharedManifest::file_bytes)
      .def_readonly("entries", &SharedManifest::entries)
      .def("to_json", &SharedManifest::to_json)
      .def_static("from_json", &SharedManifest::from_json, py::arg("text"));
  py::class_<DirectoryCheck>(m, "DirectoryCheck")
      .def_readonly("verdict", &DirectoryCheck::verdict, "'' or why the directory cannot serve")
      .def_readonly("note", &DirectoryCheck::note, "'' or a remark (tmpfs: the copy is in RAM)");
  m.def(
      "check_shared_directory",
      &check_shared_directory,
      py::arg("directory"),
      py::arg("bytes"),
      "Whether `directory` can hold a shared file of `bytes` (0: skip the free-space check).");
  m.def(
      "network_filesystem_of",
      &network_filesystem_of,
      py::arg("path"),
      "The network filesystem `path` is on (NFS, FUSE, BeeGFS, ...), or '' on a local one.");
  py::class_<SharedFile>(
      m, "SharedFile", "The leader's handle on a fresh shared file (created, reserved, open).")
      .def_static(
          "create",
          &SharedFile::create,
          py::arg("manifest"),
          py::call_guard<py::gil_scoped_release>(),
          "Creates the file exclusively and reserves its bytes; nothing is left on failure.")
      .def_property_readonly("manifest", &SharedFile::manifest)
      .def(
          "write",
          &SharedFile::write,
          py::arg("index"),
          py::arg("tensor"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "map_writable",
          &SharedFile::map_writable,
          py::arg("index"),
          "Entry `index` as a writable uint8 tensor over the file (unmapped when it goes).")
      .def("close", &SharedFile::close);
  m.def(
      "map_shared_file",
      &map_shared_file,
      py::arg("manifest"),
      "Read-only shared mapping: one CPU tensor per entry.");
  m.def("unlink_shared_file", &unlink_shared_file, py::arg("path"));
}

}  // namespace fsdp2_ext::bindings
