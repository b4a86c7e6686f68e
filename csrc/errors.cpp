#include "fsdp2_ext/errors.h"

#include <cstring>

namespace fsdp2_ext {

SystemError::SystemError(const std::string& what, int error_number)
    : std::runtime_error(
          what + ": " + std::strerror(error_number) + " (errno " + std::to_string(error_number) +
          ")"),
      error_number_(error_number) {}

}  // namespace fsdp2_ext
