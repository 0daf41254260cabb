// Device-independent parts of the verbs transport, kept apart so they compile and are unit
// tested on machines without RDMA hardware or headers: the connection-info record swapped
// before a queue pair can be connected, the split of a transfer into RDMA writes, and the
// table that maps 32-bit immediate values back to receive requests.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"

namespace strdma {

// What each side of an RC queue pair must know about the other to move it to RTR/RTS.
struct VerbsConnInfo {
  static constexpr uint32_t kMagic = 0x56524253;  // "VRBS"
  uint32_t magic = kMagic;
  uint32_t qp_num = 0;
  uint32_t psn = 0;       // initial packet sequence number (24 bits)
  uint16_t lid = 0;       // InfiniBand local id (0 on RoCE)
  uint8_t port = 1;
  uint8_t gid_index = 0;
  uint32_t mtu = 0;       // ibv_mtu enum value
  uint8_t gid[16] = {};   // RoCE / global routing address

  std::string encode() const {
    std::string out(sizeof(*this), '\0');
    std::memcpy(out.data(), this, sizeof(*this));
    return out;
  }
  // Validates what a peer sent: wrong size or magic means the two sides run different
  // builds, and a zero queue-pair number or an out-of-range PSN would fail deep in the driver.
  static VerbsConnInfo decode(const std::string& bytes, int peer) {
    VerbsConnInfo info;
    if (bytes.size() != sizeof(info))
      throw PeerSetupError(peer, "rank " + std::to_string(peer) + " sent verbs connection info of " +
                                     std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof(info)));
    std::memcpy(&info, bytes.data(), sizeof(info));
    if (info.magic != kMagic)
      throw PeerSetupError(peer, "rank " + std::to_string(peer) + " sent malformed verbs connection info");
    if (info.qp_num == 0 || (info.psn >> 24) != 0)
      throw PeerSetupError(peer, "rank " + std::to_string(peer) + " sent an invalid queue pair number or PSN");
    if (info.mtu < 1 || info.mtu > 5)
      throw PeerSetupError(peer, "rank " + std::to_string(peer) + " sent an invalid path MTU code " +
                                     std::to_string(info.mtu));
    return info;
  }
  // RoCE ports have no LID; such a peer must be addressed by GID.
  bool needs_global_route() const {
    static const uint8_t zero[16] = {};
    return lid == 0 || std::memcmp(gid, zero, sizeof(gid)) != 0;
  }
};

// The smaller of the two sides' MTUs (ibv_mtu codes are ordered).
inline uint32_t common_mtu(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Splits `nbytes` into writes of at most `max_write` bytes; the last one carries the
// immediate value that completes the receive. An empty transfer is still one (empty) write.
inline std::vector<std::pair<uint64_t, uint64_t>> plan_rdma_writes(uint64_t nbytes, uint64_t max_write) {
  if (max_write == 0) throw ArgumentError("max_write must be > 0");
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t offset = 0;
  do {
    uint64_t len = nbytes - offset < max_write ? nbytes - offset : max_write;
    out.emplace_back(offset, len);
    offset += len;
  } while (offset < nbytes);
  return out;
}

// Immediate data is only 32 bits, but request ids are 64: the receiver hands out a small token
// per registered receive and resolves it when the final write lands. Token 0 is never used so a
// zeroed completion cannot match a live receive.
class ImmTokenTable {
 public:
  uint32_t add(uint64_t recv_id) {
    do {
      ++next_;
    } while (next_ == 0 || live_.count(next_));
    live_[next_] = recv_id;
    return next_;
  }
  // Returns the receive id and forgets the token; 0 when the token is unknown.
  uint64_t take(uint32_t token) {
    auto it = live_.find(token);
    if (it == live_.end()) return 0;
    uint64_t id = it->second;
    live_.erase(it);
    return id;
  }
  bool drop(uint32_t token) { return live_.erase(token) > 0; }
  size_t size() const { return live_.size(); }

 private:
  uint32_t next_ = 0;
  std::unordered_map<uint32_t, uint64_t> live_;
};

}  // namespace strdma
