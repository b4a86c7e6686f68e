#include "fsdp2_ext/errors.h"

#include <cstring>

namespace fsdp2_ext {

SystemError::SystemError(const std::string& what, int error_number, const std::string& where)
    : std::runtime_error(
          what + ": " + std::strerror(error_number) + " (errno " + std::to_string(error_number) +
          ")" + where),
      error_number_(error_number) {}

namespace detail {

std::string where(const char* file, int line) {
  std::string path(file);
  for (const char* top : {"/csrc/", "/include/", "/tests/"}) {
    const auto found = path.rfind(top);
    if (found != std::string::npos) {
      path = path.substr(found + 1);
      break;
    }
  }
  return " [" + path + ":" + std::to_string(line) + "]";
}

}  // namespace detail
}  // namespace fsdp2_ext
