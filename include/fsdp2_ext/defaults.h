// The defaults every layer uses, stated once: C++ here, bound to Python as _fsdp2_ext.DEFAULTS
// (the bindings' argument defaults and the Python package's read them from there).
#pragma once

#include <cstdint>

namespace fsdp2_ext {

// The floor of every wait on another rank, in seconds; see [Note: bounded waits].
constexpr double kDefaultTimeoutSeconds = 60.0;

// A wait for N bytes is bounded by the timeout plus N at this rate; see [Note: bounded waits].
constexpr double kMinBandwidthBytesPerSecond = 64.0 * (1 << 20);

// [Note: wait knobs]
// The two constants above are a user's knobs, read from the environment of every process that
// waits (the trainer's ranks under VERL, the CPU support, the planner) each time a bound is made:
//   FSDP2_EXT_WAIT_FLOOR_S          the floor of every wait, in seconds (default 60)
//   FSDP2_EXT_MIN_BANDWIDTH_MIB_S   the bandwidth floor, in MiB/s (default 64): the slowest rate
//                                   at which a peer reads, writes or sends the bytes in front of it
// A value that is not a positive number is refused, naming the variable. An explicit `timeout_s`
// argument replaces the floor for that call; the bandwidth floor has no argument.
constexpr const char* kWaitFloorEnv = "FSDP2_EXT_WAIT_FLOOR_S";
constexpr const char* kMinBandwidthEnv = "FSDP2_EXT_MIN_BANDWIDTH_MIB_S";

// The floor of every wait: $FSDP2_EXT_WAIT_FLOOR_S, else kDefaultTimeoutSeconds.
double wait_floor_seconds();

// The bandwidth floor: $FSDP2_EXT_MIN_BANDWIDTH_MIB_S MiB/s, else kMinBandwidthBytesPerSecond.
double min_bandwidth_bytes_per_second();

// The bound of one transfer bucket, summed over ranks.
constexpr int64_t kDefaultBucketBytes = int64_t{64} << 20;

// Segments at least this large (and at least a staged bucket's part) move unstaged, straight into
// the receiver's buffer, when the load targets host memory; see [Note: rank-0 transfer].
constexpr int64_t kDirectBytes = int64_t{1} << 20;

// Rank 0 prints a progress line at most this often during a load.
constexpr double kDefaultProgressIntervalSeconds = 2.0;

}  // namespace fsdp2_ext
