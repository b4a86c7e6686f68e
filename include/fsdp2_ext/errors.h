// Exception types of the core. The bindings translate them to Python's ValueError, OSError and
// RuntimeError; messages name the offending FQN / field and say what to do instead.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp2_ext {

// Bad input from the caller (Python: ValueError).
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A failed system call; the message carries strerror(errno) (Python: OSError with that errno).
class SystemError : public std::runtime_error {
 public:
  SystemError(const std::string& what, int error_number);
  int error_number() const noexcept {
    return error_number_;
  }

 private:
  int error_number_;
};

// A broken collective or an invariant that does not hold (Python: RuntimeError).
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fsdp2_ext
