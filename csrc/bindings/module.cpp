#include "bindings/registrations.h"

PYBIND11_MODULE(_fsdp2_ext, m) {
  m.doc() = "fsdp2_ext core: FSDP2 sharded init, aliases, wrap targets, no-placement parameters";
  m.attr("__version__") = FSDP2_EXT_VERSION;
  // The torch this module was compiled against; see [Note: one torch].
  m.attr("__torch_version__") = FSDP2_EXT_TORCH_VERSION;
  fsdp2_ext::bindings::register_errors_logging(m);
  fsdp2_ext::bindings::register_wrap_targets(m);
  fsdp2_ext::bindings::register_no_placement(m);
  fsdp2_ext::bindings::register_sharded_load(m);
  fsdp2_ext::bindings::register_jagged_positions(m);
  fsdp2_ext::bindings::register_host_shared(m);
}
