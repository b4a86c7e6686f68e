// Per-feature registration functions; module.cpp holds the only PYBIND11_MODULE. Bindings convert
// arguments, release the GIL and call the core: nothing else.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace fsdp2_ext::bindings {

namespace py = pybind11;

void register_errors_logging(py::module_& m);
void register_wrap_targets(py::module_& m);
void register_no_placement(py::module_& m);
void register_sharded_load(py::module_& m);
void register_jagged_positions(py::module_& m);
void register_host_shared(py::module_& m);

}  // namespace fsdp2_ext::bindings
