#include "fsdp2_ext/host_shared_tensor.h"

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <cerrno>

namespace fsdp2_ext {
namespace {

// Entry offsets are multiples of 64 KiB: page-aligned for mmap on 4 KiB and 64 KiB page kernels.
constexpr int64_t kAlignment = int64_t{1} << 16;

int64_t align_up(int64_t value) {
  return (value + kAlignment - 1) / kAlignment * kAlignment;
}

// Network and distributed filesystems (statfs f_type): mapping a file there is neither node-local
// nor coherent across hosts.
const char* network_filesystem(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0x6969:
      return "NFS";
    case 0xFF534D42:
      return "CIFS";
    case 0xFE534D42:
      return "SMB2";
    case 0x517B:
      return "SMB";
    case 0x01021997:
      return "9p";
    case 0x0BD00BD0:
      return "Lustre";
    case 0x47504653:
      return "GPFS";
    case 0x00C36400:
      return "CephFS";
    case 0x65735546:
      return "FUSE";
    case 0x013111A8:
      return "IBRIX";
    case 0x19830326:
      return "FhGFS/BeeGFS";
    default:
      return nullptr;
  }
}

std::string dtype_name(at::ScalarType dtype) {
  return c10::toString(dtype);
}

at::ScalarType dtype_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(at::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<at::ScalarType>(i);
    if (name == c10::toString(type)) {
      return type;
    }
  }
  FSDP2_THROW(ValueError, "shared manifest: unknown dtype '", name, "'");
}

}  // namespace

std::string SharedManifest::to_json() const {
  nlohmann::json manifest;
  manifest["path"] = path;
  manifest["file_bytes"] = file_bytes;
  manifest["entries"] = nlohmann::json::array();
  for (const auto& entry : entries) {
    manifest["entries"].push_back(
        {{"fqn", entry.fqn},
         {"dtype", dtype_name(entry.dtype)},
         {"shape", entry.shape},
         {"offset", entry.offset},
         {"bytes", entry.bytes}});
  }
  return manifest.dump();
}

SharedManifest SharedManifest::from_json(const std::string& text) {
  try {
    const auto json = nlohmann::json::parse(text);
    SharedManifest manifest;
    manifest.path = json.at("path").get<std::string>();
    manifest.file_bytes = json.at("file_bytes").get<int64_t>();
    for (const auto& item : json.at("entries")) {
      manifest.entries.push_back(SharedEntry{
          item.at("fqn").get<std::string>(),
          dtype_from_name(item.at("dtype").get<std::string>()),
          item.at("shape").get<std::vector<int64_t>>(),
          item.at("offset").get<int64_t>(),
          item.at("bytes").get<int64_t>()});
    }
    return manifest;
  } catch (const nlohmann::json::exception& error) {
    FSDP2_THROW(ValueError, "shared manifest is malformed: ", error.what());
  }
}

SharedManifest plan_shared_file(
    const std::string& path,
    const std::vector<std::string>& fqns,
    const std::vector<at::Tensor>& likes) {
  FSDP2_CHECK_VALUE(
      fqns.size() == likes.size(),
      "plan_shared_file: ",
      fqns.size(),
      " FQNs for ",
      likes.size(),
      " tensors");
  SharedManifest manifest;
  manifest.path = path;
  int64_t offset = 0;
  for (size_t i = 0; i < fqns.size(); ++i) {
    const int64_t bytes = likes[i].numel() * static_cast<int64_t>(likes[i].element_size());
    manifest.entries.push_back(
        SharedEntry{fqns[i], likes[i].scalar_type(), likes[i].sizes().vec(), offset, bytes});
    offset = align_up(offset + bytes);
  }
  manifest.file_bytes = std::max<int64_t>(offset, kAlignment);
  return manifest;
}

std::string network_filesystem_of(const std::string& path) {
  struct statfs filesystem {};
  if (::statfs(path.c_str(), &filesystem) != 0) {
    return "";
  }
  const char* name = network_filesystem(filesystem.f_type);
  return name != nullptr ? name : "";
}

DirectoryCheck check_shared_directory(const std::string& directory, int64_t bytes) {
  DirectoryCheck check;
  const std::string what = "VERL_NO_PLACEMENT_MMAP_DIR='" + directory + "'";
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    check.verdict = what + " does not exist (" + std::strerror(errno) +
                    "); create it on node-local disk, same path on every rank of the host";
    return check;
  }
  if (!S_ISDIR(info.st_mode)) {
    check.verdict = what + " is not a directory; point it at a directory on node-local disk";
    return check;
  }
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    check.verdict = what + " is not writable by this process (" + std::strerror(errno) +
                    "); fix its permissions or choose another directory";
    return check;
  }
  struct statfs filesystem {};
  if (::statfs(directory.c_str(), &filesystem) == 0) {
    if (const char* name = network_filesystem(filesystem.f_type)) {
      check.verdict = what + " is on a network filesystem (" + name +
                      "); host-shared tables need node-local disk";
      return check;
    }
    if (static_cast<unsigned long>(filesystem.f_type) == 0x01021994UL) {
      check.note =
          what + " is tmpfs: the shared copy lives in RAM (still one per host, not one per rank)";
    }
  }
  struct statvfs space {};
  if (::statvfs(directory.c_str(), &space) == 0) {
    const long double available = static_cast<long double>(space.f_bavail) * space.f_frsize;
    if (available < static_cast<long double>(bytes)) {
      check.verdict = what + " has " + std::to_string(static_cast<int64_t>(available)) +
                      " bytes free but the tables need " + std::to_string(bytes) +
                      "; free space or choose a larger node-local disk";
      return check;
    }
  }
  return check;
}

SharedFile SharedFile::create(SharedManifest manifest) {
  FileDescriptor file = FileDescriptor::open(
      manifest.path,
      O_RDWR | O_CREAT | O_EXCL,
      0600,
      "shared table file '" + manifest.path + "' for writing");
  const int error = ::posix_fallocate(file.get(), 0, manifest.file_bytes);
  if (error != 0) {
    file.close();
    ::unlink(manifest.path.c_str());
    FSDP2_THROW_ERRNO(
        error, "cannot reserve ", manifest.file_bytes, " bytes for '", manifest.path, "'");
  }
  return SharedFile(std::move(manifest), std::move(file));
}

const SharedEntry& SharedFile::entry(int64_t index) const {
  FSDP2_CHECK_VALUE(
      index >= 0 && index < static_cast<int64_t>(manifest_.entries.size()),
      "shared file '",
      manifest_.path,
      "' has ",
      manifest_.entries.size(),
      " entries, not an entry ",
      index);
  FSDP2_CHECK_VALUE(file_.valid(), "shared file '", manifest_.path, "' is closed");
  return manifest_.entries[index];
}

void SharedFile::write(int64_t index, const at::Tensor& tensor) const {
  const SharedEntry& target = entry(index);
  FSDP2_CHECK_VALUE(
      tensor.is_cpu() &&
          tensor.numel() * static_cast<int64_t>(tensor.element_size()) == target.bytes,
      "SharedFile.write: '",
      target.fqn,
      "' must be a CPU tensor of ",
      target.bytes,
      " bytes");
  const at::Tensor source = tensor.contiguous();
  const char* data = static_cast<const char*>(source.data_ptr());
  int64_t done = 0;
  while (done < target.bytes) {
    const ssize_t written = ::pwrite(
        file_.get(), data + done, static_cast<size_t>(target.bytes - done), target.offset + done);
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      FSDP2_THROW_ERRNO(errno, "cannot write '", target.fqn, "' to the shared table file");
    }
    done += written;
  }
}

at::Tensor SharedFile::map_writable(int64_t index) const {
  const SharedEntry& target = entry(index);
  const auto region = MappedRegion::map(
      file_,
      target.offset,
      target.bytes,
      MappedRegion::Access::kReadWrite,
      "'" + target.fqn + "' of '" + manifest_.path + "' for writing");
  return region->view(0, at::kByte, {target.bytes}, "'" + target.fqn + "'");
}

std::vector<at::Tensor> map_shared_file(const SharedManifest& manifest) {
  const std::string what = "shared table file '" + manifest.path + "'";
  const FileDescriptor file = FileDescriptor::open(
      manifest.path,
      O_RDONLY,
      0,
      what + " (is the directory node-local and at the same path for every rank of this host?)");
  const auto region =
      MappedRegion::map(file, 0, manifest.file_bytes, MappedRegion::Access::kReadOnly, what);
  std::vector<at::Tensor> tensors;
  for (const auto& entry : manifest.entries) {
    tensors.push_back(
        region->view(entry.offset, entry.dtype, entry.shape, what + " entry '" + entry.fqn + "'"));
  }
  return tensors;
}

void unlink_shared_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    FSDP2_THROW_ERRNO(errno, "cannot unlink shared table file '", path, "'");
  }
}

}  // namespace fsdp2_ext
