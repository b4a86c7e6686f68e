// The defaults every layer uses, stated once: C++ here, bound to Python as _fsdp2_ext.DEFAULTS
// (the bindings' argument defaults and the Python package's read them from there).
#pragma once

#include <cstdint>

namespace fsdp2_ext {

// The floor of every wait on another rank, in seconds; see [Note: bounded waits].
constexpr double kDefaultTimeoutSeconds = 60.0;

// A wait for N bytes is bounded by the timeout plus N at this rate; see [Note: bounded waits].
constexpr double kMinBandwidthBytesPerSecond = 64.0 * (1 << 20);

// The bound of one transfer bucket, summed over ranks.
constexpr int64_t kDefaultBucketBytes = int64_t{64} << 20;

// Segments at least this large (and at least a staged bucket's part) move unstaged, straight into
// the receiver's buffer, when the load targets host memory; see [Note: rank-0 transfer].
constexpr int64_t kDirectBytes = int64_t{1} << 20;

// Rank 0 prints a progress line at most this often during a load.
constexpr double kDefaultProgressIntervalSeconds = 2.0;

}  // namespace fsdp2_ext
