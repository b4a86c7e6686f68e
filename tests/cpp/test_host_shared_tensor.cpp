#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/host_shared_tensor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>
#include <cstdlib>
#include <string>

namespace fsdp2_ext {
namespace {

std::string temporary_directory() {
  char pattern[] = "/tmp/fsdp2_ext_shared_XXXXXX";
  const char* made = mkdtemp(pattern);
  EXPECT_NE(made, nullptr);
  return made;
}

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

TEST(HostSharedTensor, CreateMapTwiceUnlinkAndUnmapOnRelease) {
  const std::string directory = temporary_directory();
  const at::Tensor table = at::arange(12, at::kFloat).view({3, 4});
  const at::Tensor bias = at::arange(5, at::kBFloat16);
  const SharedManifest manifest =
      plan_shared_file(directory + "/tables.bin", {"table", "bias"}, {table, bias});
  ASSERT_EQ(manifest.entries.size(), 2u);
  EXPECT_EQ(manifest.entries[1].offset % 65536, 0);
  EXPECT_EQ(SharedManifest::from_json(manifest.to_json()).entries[1].fqn, "bias");

  {
    SharedFile file = SharedFile::create(manifest);
    file.write(0, table);
    file.map_writable(1).copy_(bias.view(at::kByte));  // the other way in: a writable mapping
    EXPECT_THROW(file.write(2, table), ValueError);    // no entry 2
    EXPECT_THROW(file.write(1, table), ValueError);    // 48 bytes for a 10-byte entry
  }                                                    // closed here
  // Exclusive creation: the same name cannot be created twice.
  EXPECT_THROW(SharedFile::create(manifest), SystemError);

  std::vector<at::Tensor> first = map_shared_file(manifest);
  std::vector<at::Tensor> second = map_shared_file(manifest);
  unlink_shared_file(manifest.path);
  EXPECT_FALSE(exists(manifest.path));
  unlink_shared_file(manifest.path);  // idempotent
  // The mappings outlive the name.
  EXPECT_TRUE(at::equal(first[0], table));
  EXPECT_TRUE(at::equal(second[1], bias));
  first.clear();  // releasing one mapping leaves the other intact
  EXPECT_TRUE(at::equal(second[0], table));
  ::rmdir(directory.c_str());
}

TEST(HostSharedTensor, ErrorsCarryErrnoText) {
  const std::string directory = temporary_directory();
  const SharedManifest missing =
      plan_shared_file(directory + "/no/such/dir/t.bin", {"t"}, {at::zeros({2})});
  try {
    SharedFile::create(missing);
    FAIL() << "expected SystemError";
  } catch (const SystemError& error) {
    EXPECT_EQ(error.error_number(), ENOENT);
    EXPECT_NE(std::string(error.what()).find("No such file or directory"), std::string::npos);
  }
  EXPECT_THROW(map_shared_file(missing), SystemError);
  EXPECT_THROW(SharedManifest::from_json("{not json"), ValueError);
  ::rmdir(directory.c_str());
}

TEST(HostSharedTensor, DirectoryChecksNameTheProblem) {
  EXPECT_NE(
      check_shared_directory("/no/such/dir", 1).verdict.find("does not exist"), std::string::npos);
  EXPECT_NE(
      check_shared_directory("/etc/hostname", 1).verdict.find("is not a directory"),
      std::string::npos);
  EXPECT_NE(
      check_shared_directory("/tmp", int64_t{1} << 62).verdict.find("bytes free"),
      std::string::npos);
  EXPECT_EQ(check_shared_directory("/tmp", 1).verdict, "");
}

}  // namespace
}  // namespace fsdp2_ext
