// Shared definitions of the shm_tensor_rdma core: error types, the wire header, futex and time
// helpers. Nothing here knows about Python; the bindings translate these types.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace strdma {

using Clock = std::chrono::steady_clock;

// Why a request failed; the Python wrapper maps each kind to an exception class.
enum class ErrorKind : uint32_t { None = 0, PeerGone = 1, Timeout = 2, Mismatch = 3, Closed = 4, Internal = 5,
                                  // Not a failure: a receive matched a device message, and its bytes are still in
                                  // the sender's GPU memory. The request is Done; its `error` holds the sender's
                                  // request id and the IPC descriptor, and the caller copies (see device_done).
                                  DeviceCopy = 6 };
enum class ReqState : int { Pending = 0, Done = 1, Failed = 2 };

// A bad argument at the API boundary (bindings raise ValueError).
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Setup or transport failure that is not tied to one request (bindings raise TransportError).
struct TransportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Setup failure caused by one peer (bindings raise PeerError carrying the rank).
struct PeerSetupError : TransportError {
  PeerSetupError(int peer_rank, const std::string& what) : TransportError(what), peer(peer_rank) {}
  int peer;
};

inline std::string errno_text(const std::string& what, int err = errno) {
  return what + ": " + std::strerror(err);
}

// A deadline `seconds` from now; negative means never.
inline Clock::time_point deadline_after(double seconds) {
  if (seconds < 0) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

inline double seconds_until(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1e9;
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Messages between endpoints. The same header travels in shared-memory slots and TCP frames;
// both ends are little-endian (checked in the handshake), so it is sent as raw bytes.
enum class MsgType : uint32_t {
  Eager = 1,  // header + whole payload (small messages): no handshake needed
  Rts = 2,    // request to send: the receiver answers Cts once an irecv matches
  Cts = 3,    // clear to send: the sender may now stream Data for `recv_id`
  Nack = 4,   // a transfer was refused or abandoned; payload is the reason text
  Data = 5,   // one chunk of a matched transfer: `nbytes` bytes at `offset`
  Bye = 6,    // the sender closes its endpoint; nothing follows
  Pulled = 7, // shm single copy: the receiver read the whole message out of the sender's memory
  Pushed = 8, // shm single copy: the sender wrote the whole message into the receiver's memory
  DeviceRts = 9,   // shm, GPU memory: header as Rts, payload an IPC descriptor the receiver's caller opens
  DeviceDone = 10, // the receiver's caller copied a DeviceRts message out of the sender's GPU memory
};

constexpr int kMaxDims = 32;
// Buffers of messages copied aside (an eager message before its irecv, a control message
// that found the ring full) kept for reuse, each at most a slot's size.
constexpr size_t kSparePayloads = 256;

struct CtrlHeader {
  uint32_t type = 0;
  uint32_t dtype = 0;
  int64_t tag = 0;
  uint64_t send_id = 0;        // request id on the sending rank
  uint64_t recv_id = 0;        // request id on the receiving rank (Cts, Data, Nack)
  uint64_t nbytes = 0;         // message size (Eager, Rts) or chunk size (Data)
  uint64_t offset = 0;         // chunk offset (Data)
  uint64_t remote_addr = 0;    // verbs Cts: receive buffer address; shm Rts/Cts: the offered buffer (single copy)
  uint32_t rkey = 0;           // verbs Cts: remote key of that buffer; shm Rts/Cts: generation of the claim
  uint32_t ndim = 0;
  uint32_t payload_bytes = 0;  // bytes that follow the header in the same slot/frame
  uint32_t error_kind = 0;     // Nack: ErrorKind
  uint32_t from_sender = 0;    // Nack: 1 when the sender abandons, 0 when the receiver refuses;
                               // shm Rts: 1 when the sender can also write into the receiver's memory
  uint32_t token = 0;          // verbs Cts: immediate value of the final write; shm Rts/Cts: claim slot + 1
  int64_t shape[kMaxDims] = {};
};
static_assert(sizeof(CtrlHeader) % 8 == 0, "header must keep payloads 8-byte aligned");

// Bytes of a header in a shared-memory slot: the fixed fields and only the `ndim` dimensions in
// use, so a small message moves two cache lines instead of six (the payload follows at once).
constexpr size_t kHeaderFixedBytes = offsetof(CtrlHeader, shape);
static_assert(kHeaderFixedBytes % 8 == 0, "the compact header must keep payloads 8-byte aligned");
inline size_t compact_header_bytes(uint32_t ndim) {
  return kHeaderFixedBytes + sizeof(int64_t) * (ndim < static_cast<uint32_t>(kMaxDims) ? ndim : kMaxDims);
}
// Writes `h` compactly at `dst`; returns the bytes written (the payload goes right after).
inline size_t write_compact_header(void* dst, const CtrlHeader& h) {
  const size_t n = compact_header_bytes(h.ndim);
  std::memcpy(dst, &h, n);
  return n;
}
// Reads a compact header at `src` into `h`; returns its size (where the payload starts).
inline size_t read_compact_header(const void* src, CtrlHeader& h) {
  std::memcpy(static_cast<void*>(&h), src, kHeaderFixedBytes);
  const size_t n = compact_header_bytes(h.ndim);
  std::memcpy(h.shape, static_cast<const char*>(src) + kHeaderFixedBytes, n - kHeaderFixedBytes);
  return n;
}

// Failure record handed to Python when a request finishes.
struct Finished {
  uint64_t id = 0;
  int state = 0;
  uint32_t error_kind = 0;
  std::string message;
};

// Futex words live in shared memory, so the process-private flag must not be used.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000LL;
  ts.tv_nsec = timeout_ns % 1000000000LL;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

// CLOCK_MONOTONIC in nanoseconds: comparable between processes on one host.
inline int64_t monotonic_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline std::string shape_text(const int64_t* shape, uint32_t ndim) {
  std::string s = "[";
  for (uint32_t i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace strdma
