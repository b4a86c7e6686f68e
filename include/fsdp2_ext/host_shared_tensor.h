// One node-local, file-backed copy of each frozen CPU table per host, mapped read-only by every
// local rank. The C++ side owns the file mechanics (directory checks, exclusive create, reserve,
// fill, map, unlink); the Python side (fsdp2_ext.tables.host_shared) runs the protocol over the
// caller's CPU (Gloo) group.
#pragma once

#include "fsdp2_ext/mapped_file.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fsdp2_ext {

// [Note: shm lifetime]
// Per initialisation, each host's leader creates a *fresh* file (O_CREAT | O_EXCL, a name unique to
// job, host, process and call), reserves its blocks (posix_fallocate: a full disk fails here, not
// later as SIGBUS on a mapped page), fills it and publishes a manifest (FQN, dtype, shape, offset).
// Every local rank maps it PROT_READ / MAP_SHARED (one page-cache copy per host; a stray in-place
// write faults instead of diverging silently). Once *all* local ranks have mapped it, the leader
// unlinks it: the mappings stay valid, the name is gone. The window in which the name exists is
// create -> last map; any failure inside it (a full disk, a rank that dies before mapping, detected
// by a monitored barrier with a timeout) makes the leader unlink before raising, so no file
// outlives the job unless the leader itself is killed inside the window (the name then carries job,
// host and pid, so a job-end cleanup can remove it). Mind that launchers such as torchrun send
// SIGTERM to every rank when one dies, and Python runs no `finally` on SIGTERM: a rank death inside
// the window under such a launcher can leave the file. The monitored barrier bounds the wait for a
// rank that dies before mapping by `timeout_s`; a peer dying in the middle of the fill's
// point-to-point transfer is bounded only by the process group's own timeout. Nothing is cached
// across initialisations: two models map two files.

struct SharedEntry {
  std::string fqn;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // page-aligned byte offset in the file
  int64_t bytes = 0;
};

struct SharedManifest {
  std::string path;
  int64_t file_bytes = 0;
  std::vector<SharedEntry> entries;

  std::string to_json() const;
  static SharedManifest from_json(const std::string& text);
};

// Lays out `tensors` (FQN, like-tensor for dtype/shape) at page-aligned offsets in `path`.
SharedManifest plan_shared_file(
    const std::string& path,
    const std::vector<std::string>& fqns,
    const std::vector<at::Tensor>& likes);

// Whether a directory can hold the shared file: `verdict` is "" or the reason it cannot; `note`
// a remark that is not an error (tmpfs: the copy lives in RAM).
struct DirectoryCheck {
  std::string verdict;
  std::string note;
};

// Checks that `directory` can hold `bytes`: it exists, is a directory, is writable, has the free
// space, and is not on a network filesystem.
DirectoryCheck check_shared_directory(const std::string& directory, int64_t bytes);

// The network or distributed filesystem `path` is on (statfs f_type: NFS, CIFS, SMB, 9p, Lustre,
// GPFS, CephFS, FUSE, IBRIX, BeeGFS), or "" on a local one: the one list, used for the shared
// directory and for whether a checkpoint file may be viewed in place. "" also when statfs fails.
std::string network_filesystem_of(const std::string& path);

// The leader's handle on a fresh shared file: created exclusively with its bytes reserved, closed
// when the handle goes (the name stays until unlink_shared_file; see [Note: shm lifetime]).
class SharedFile {
 public:
  // On failure nothing is left behind (the name is unlinked).
  static SharedFile create(SharedManifest manifest);

  const SharedManifest& manifest() const {
    return manifest_;
  }
  // Writes `tensor` (CPU, entry's bytes) at entry `index`'s offset.
  void write(int64_t index, const at::Tensor& tensor) const;
  // A read-write mapping of entry `index` as bytes (the leader receives or copies into it).
  at::Tensor map_writable(int64_t index) const;
  void close() {
    file_.close();
  }

 private:
  SharedFile(SharedManifest manifest, FileDescriptor file)
      : manifest_(std::move(manifest)), file_(std::move(file)) {}
  const SharedEntry& entry(int64_t index) const;
  SharedManifest manifest_;
  FileDescriptor file_;
};

// Maps the whole file read-only and shared; one CPU tensor per entry, each keeping the mapping
// alive (the last one to go unmaps it).
std::vector<at::Tensor> map_shared_file(const SharedManifest& manifest);

// Unlinks `path`; a missing file is fine (idempotent), other errors throw SystemError.
void unlink_shared_file(const std::string& path);

}  // namespace fsdp2_ext
