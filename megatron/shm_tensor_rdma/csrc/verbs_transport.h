// RDMA verbs transport (libibverbs). Compiled with the real implementation when the build
// finds <infiniband/verbs.h> (STRDMA_HAVE_VERBS); otherwise these entry points report that
// verbs are unavailable and the engine falls back to TCP.
//
// Control messages (Eager/Rts/Cts/Nack) still travel over the peer's TCP link; only Data moves
// by RDMA: the receiver registers its buffer and sends (address, rkey) in the Cts, and the
// sender writes the bytes directly with RDMA WRITE, ending with a WRITE_WITH_IMM whose
// immediate value tells the receiver which request landed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport.h"
#include "verbs_logic.h"

namespace strdma {

class TcpLink;

// True when this build contains the verbs implementation.
bool verbs_compiled();

// One line per device port: "mlx5_0 port 1 state=ACTIVE link=InfiniBand lid=3 mtu=4096".
std::vector<std::string> verbs_device_ports(std::string* error);

class VerbsContext {
 public:
  virtual ~VerbsContext() = default;
  virtual std::string describe() const = 0;
  // Builds the queue pair for `peer`, swaps connection info over `fd` (the handshake socket,
  // before any other traffic), and returns the channel. Control goes through `ctrl`.
  virtual std::unique_ptr<Channel> connect_peer(EngineSink& sink, int my_rank, int peer, int fd, TcpLink& ctrl,
                                                uint64_t chunk_bytes, Clock::time_point deadline) = 0;
  virtual void start() = 0;
  virtual void stop() = 0;
};

// Opens `device` (or the first device with an active port). Null with `why` set when verbs are
// not compiled in or no usable device exists.
std::unique_ptr<VerbsContext> open_verbs(const std::string& device, std::string* why);

}  // namespace strdma
