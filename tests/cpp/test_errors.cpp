#include "fsdp2_ext/errors.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

namespace fsdp2_ext {
namespace {

int check_positive(int value) {
  FSDP2_CHECK_VALUE(value > 0, "value must be positive, got ", value, " (pass a count)");
  return value;
}

TEST(CheckedErrors, AValueCheckNamesTheInputAndTheLineThatRaised) {
  EXPECT_EQ(check_positive(3), 3);
  try {
    check_positive(-2);
    FAIL() << "expected ValueError";
  } catch (const ValueError& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.rfind("value must be positive, got -2 (pass a count) [", 0), 0u) << message;
    EXPECT_NE(message.find("[tests/cpp/test_errors.cpp:"), std::string::npos) << message;
  }
}

TEST(CheckedErrors, KindsMapToTheirTypes) {
  EXPECT_THROW(FSDP2_CHECK(1 + 1 == 3, "arithmetic"), RuntimeError);
  EXPECT_THROW(FSDP2_THROW(ValueError, "bad ", 1), ValueError);
  try {
    FSDP2_THROW_ERRNO(ENOENT, "cannot open '", "/x", "'");
  } catch (const SystemError& error) {
    EXPECT_EQ(error.error_number(), ENOENT);
    const std::string message = error.what();
    EXPECT_EQ(message.rfind("cannot open '/x': No such file or directory (errno 2) [tests/", 0), 0u)
        << message;
  }
}

}  // namespace
}  // namespace fsdp2_ext
