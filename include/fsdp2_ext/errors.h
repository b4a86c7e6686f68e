// Exception types of the core and the one way to raise them. The bindings translate them to
// Python's ValueError, OSError and RuntimeError; messages name the offending FQN / file / field,
// say what to do instead, and end with the place that raised them ("[csrc/file.cpp:123]").
#pragma once

#include <sstream>
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
  SystemError(const std::string& what, int error_number, const std::string& where = "");
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

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// " [csrc/file.cpp:123]": the path from the project's top-level folder on, whatever the build dir.
std::string where(const char* file, int line);

}  // namespace detail

// [Note: checked errors]
// Every error the core raises goes through these macros (after TORCH_CHECK_VALUE /
// C10_THROW_ERROR): the message is the concatenation of the arguments (strings, numbers, anything
// streamable) and ends with the file and line that raised it, so a user's report points at the
// check.
//   FSDP2_CHECK_VALUE(cond, ...)   bad input from the caller          -> ValueError
//   FSDP2_CHECK(cond, ...)         an invariant or a peer that failed -> RuntimeError
//   FSDP2_THROW(Type, ...)         the same, unconditionally (Type: ValueError or RuntimeError)
//   FSDP2_THROW_ERRNO(errno, ...)  a failed system call               -> OSError(errno)
#define FSDP2_THROW(Type, ...) \
  throw ::fsdp2_ext::Type(     \
      ::fsdp2_ext::detail::concat(__VA_ARGS__) + ::fsdp2_ext::detail::where(__FILE__, __LINE__))

// The error number is read once, before the message is built (which may change errno).
#define FSDP2_THROW_ERRNO(error_number, ...)             \
  do {                                                   \
    const int fsdp2_saved_errno = (error_number);        \
    throw ::fsdp2_ext::SystemError(                      \
        ::fsdp2_ext::detail::concat(__VA_ARGS__),        \
        fsdp2_saved_errno,                               \
        ::fsdp2_ext::detail::where(__FILE__, __LINE__)); \
  } while (false)

#define FSDP2_CHECK_AS(Type, condition, ...) \
  do {                                       \
    if (!(condition)) {                      \
      FSDP2_THROW(Type, __VA_ARGS__);        \
    }                                        \
  } while (false)

#define FSDP2_CHECK_VALUE(condition, ...) FSDP2_CHECK_AS(ValueError, condition, __VA_ARGS__)
#define FSDP2_CHECK(condition, ...) FSDP2_CHECK_AS(RuntimeError, condition, __VA_ARGS__)

}  // namespace fsdp2_ext
