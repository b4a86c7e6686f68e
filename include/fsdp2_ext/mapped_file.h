// The one owner of file descriptors and memory mappings in the core: the safetensors reader and
// the host-shared table files both map through these types (after fairseq2n's file_desc /
// memory_block).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace fsdp2_ext {

// An open file descriptor, closed when its owner goes (move-only).
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    close();
  }

  // open(2) with O_CLOEXEC added; OSError naming `what` (e.g. "safetensors file '/x'") on failure.
  static FileDescriptor open(
      const std::string& path, int flags, mode_t mode, const std::string& what);

  int get() const {
    return fd_;
  }
  bool valid() const {
    return fd_ >= 0;
  }
  struct stat status(const std::string& what) const;  // fstat(2)
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void close() noexcept;

 private:
  int fd_ = -1;
};

// [Note: mapped memory]
// A MappedRegion is one mmap of a byte range of a file, unmapped when the last owner lets go. Every
// tensor made by `view` holds a share of it, so the mapping lives exactly as long as something
// still points into it, whoever made it (a SafetensorsFile, a host-shared file) and wherever the
// tensor went (a parameter, a Python object). `view` checks its range against the region with
// checked arithmetic: no shape or offset read from a file can make a tensor reach past it.
class MappedRegion : public std::enable_shared_from_this<MappedRegion> {
 public:
  enum class Access { kReadOnly, kReadWrite };

  // Maps [offset, offset + bytes) of `file` (offset page-aligned) shared; OSError naming `what`.
  static std::shared_ptr<MappedRegion> map(
      const FileDescriptor& file,
      int64_t offset,
      int64_t bytes,
      Access access,
      const std::string& what);
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  const unsigned char* bytes() const {
    return static_cast<const unsigned char*>(address_);
  }
  int64_t size() const {
    return size_;
  }
  // A CPU tensor of `dtype` and `shape` starting `offset` bytes into the region, sharing it;
  // ValueError naming `what` if it would not fit inside the region.
  at::Tensor view(
      int64_t offset, at::ScalarType dtype, c10::IntArrayRef shape, const std::string& what) const;

 private:
  MappedRegion(void* address, int64_t size, size_t mapped)
      : address_(address), size_(size), mapped_(mapped) {}
  void* address_;
  int64_t size_;   // the bytes asked for
  size_t mapped_;  // the bytes mapped (at least one page's worth is asked of mmap)
};

// Bytes of `shape` x element size of `dtype`; ValueError naming `what` on a negative dimension
// or an overflow of 64 bits.
int64_t checked_nbytes(c10::IntArrayRef shape, at::ScalarType dtype, const std::string& what);

}  // namespace fsdp2_ext
