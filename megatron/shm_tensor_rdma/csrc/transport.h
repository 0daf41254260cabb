// The contract between the engine (matching, completion, timeouts) and the transports that
// move bytes (shared memory, TCP, verbs). Transports call back into the engine through
// EngineSink and never see Python or the request tables.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common.h"

namespace strdma {

// How a finished transfer's bytes moved: whole with its header; copied by the transport
// (shared-memory ring, TCP, RDMA); single copy, read by the receiver or written by the sender.
enum class Path : uint8_t { Eager = 0, Copied = 1, Read = 2, Write = 3, Device = 4 };

// One posted isend or irecv. Fields above the line are fixed at creation; the rest are
// guarded by the engine mutex.
struct Request {
  uint64_t id = 0;
  bool is_send = false;
  int peer = -1;
  int64_t tag = 0;
  uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  uint32_t dtype = 0;
  uint32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  double timeout_s = -1;
  Clock::time_point deadline = Clock::time_point::max();
  // Set when the request fails, so a send thread blocked on ring space gives up.
  std::atomic<bool> aborted{false};
  // ---- guarded by the engine mutex
  ReqState state = ReqState::Pending;
  ErrorKind error_kind = ErrorKind::None;
  std::string error;
  int busy = 0;             // transport threads currently touching `data`
  bool published = false;   // finished and queued for poll()
  bool matched = false;     // send: Cts received; recv: matched to an Rts
  uint64_t remote_id = 0;   // the peer's request id, once known
  uint64_t bytes_done = 0;
  void* transport_state = nullptr;  // verbs: memory registration of `data`
  // Shared-memory single copy: one side offers its buffer (owner), the other copies straight
  // out of it (the receiver reads) or into it (the sender writes). Owner: the offer's claim
  // (-1: none), and whether a failed request waits for the peer to finish copying before it
  // is reported. Copier: the claim it holds on the peer's offer (-1: none).
  int32_t offer_slot = -1;
  uint32_t offer_gen = 0;
  bool offer_hold = false;
  int32_t claim_slot = -1;
  uint32_t claim_gen = 0;
  std::string deferred_nack;  // copier: told to the owner once no copy runs (busy == 0)
  ErrorKind deferred_kind = ErrorKind::None;
};

// A matched send being streamed in chunks; shared by the threads that move its chunks.
struct SendJob {
  std::shared_ptr<Request> req;
  class Channel* channel = nullptr;
  uint64_t recv_id = 0;
  uint64_t next_offset = 0;
  uint64_t chunk = 0;
  // Single copy: a receive that reads the sender's buffer, or a send that writes into the
  // receiver's (`remote_addr`), instead of a send that copies into the peer's ring.
  enum Kind { Ring = 0, Read = 1, Write = 2 } kind = Ring;
  uint64_t remote_addr = 0;
};

// Where an incoming Data chunk goes: null `dst` means drop it (the receive failed meanwhile).
struct DataLease {
  std::shared_ptr<Request> req;
  uint8_t* dst = nullptr;
};

class EngineSink {
 public:
  virtual ~EngineSink() = default;
  // Eager, Rts, Cts and Nack messages, delivered in the peer's sending order.
  virtual void on_ctrl(int peer, const CtrlHeader& h, const uint8_t* payload) = 0;
  virtual DataLease data_begin(int peer, const CtrlHeader& h) = 0;
  virtual void data_end(DataLease& lease, uint64_t bytes) = 0;
  // A whole receive landed at once (verbs writes straight into the buffer).
  virtual void recv_landed(int peer, uint64_t recv_id) = 0;
  // Send threads bracket every chunk so a failing request waits for its in-flight copies.
  virtual bool send_chunk_begin(const std::shared_ptr<Request>& req) = 0;
  virtual void send_chunk_end(const std::shared_ptr<Request>& req, uint64_t bytes, const std::string& error) = 0;
  virtual void on_peer_gone(int peer, bool graceful, const std::string& reason) = 0;
  // Hands a matched send to the engine's send threads (shared-memory transport).
  virtual void enqueue_send_job(std::shared_ptr<SendJob> job) = 0;
  // A transport thread caught an exception: fail what is in flight rather than abort.
  virtual void on_internal_error(const std::string& where, const std::string& what) = 0;
};

// The per-peer transport.
class Channel {
 public:
  virtual ~Channel() = default;
  virtual const char* kind() const = 0;
  // Largest payload sent with its header in one Eager message.
  virtual uint64_t eager_limit() const = 0;
  // Queues a control message. Never blocks on the peer: receive threads call it, and a
  // blocking send there could deadlock two ranks that both wait for ring space.
  virtual void post_ctrl(const CtrlHeader& h, const void* payload) = 0;
  // Starts streaming a send that the peer cleared (Cts).
  virtual void start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader& cts) = 0;
  // Moves one chunk (send threads; shared memory only). Returns an error text or "".
  virtual std::string push_chunk(SendJob&, uint64_t, uint64_t) { return "transport has no chunk path"; }
  // Receiver side, when an Rts is matched: fills transport fields of the Cts (verbs: rkey).
  virtual std::string prepare_recv(Request&, CtrlHeader&) { return ""; }
  // A request with this peer finished: release per-request transport state.
  virtual void request_finished(Request&) {}
  // True while the peer's already-published messages still wait to be consumed.
  virtual bool inbound_pending() { return false; }
  // Retries control messages that found no room (called by the monitor thread).
  virtual bool flush() { return false; }
  // The peer went away: wake our threads that wait on it.
  virtual void peer_gone() {}
  // Delivers a deferred wake-up, if one is owed and due (shared memory).
  virtual void nudge() {}
  virtual bool owes_wake() const { return false; }

  // ---- single copy (shared memory): one side copies straight out of or into the other's
  // buffer. All of these are called with the engine mutex held, except read() and write().
  // Owner: offers `req`'s buffer in `msg` (Rts for reads, Cts for writes). False when it cannot.
  virtual bool offer(Request&, CtrlHeader&) { return false; }
  // Copier, for a message with an offer: 1 when it may copy now (the claim is taken), 0 when
  // the message offers nothing usable, -1 when the owner withdrew the offer.
  virtual int claim(const CtrlHeader&) { return 0; }
  // Copier: the copy is over (finished or failed); the owner's buffer is no longer touched.
  virtual void claim_over(const Request&) {}
  // Owner: withdraws an offer before the peer claims it. False while the peer copies.
  virtual bool withdraw(Request&) { return true; }
  // Owner: the peer answered; the offer's claim is free again.
  virtual void release_offer(Request&) {}
  // Owner: true while the peer copies (or has copied) through the offer.
  virtual bool offer_in_use(const Request&) { return false; }
  // True when more control messages from the peer wait to be consumed.
  virtual bool more_inbound() { return false; }
  // True when this side can read and write the peer's memory.
  virtual bool can_copy_direct() const { return false; }
  // Copier, any thread, without the mutex: `bytes` from / to the peer's `remote_addr`.
  virtual std::string read(uint8_t*, uint64_t, uint64_t) { return "transport cannot read the peer's memory"; }
  virtual std::string write(uint64_t, const uint8_t*, uint64_t) { return "transport cannot write the peer's memory"; }
  // How large messages move on this channel, for diagnostics.
  virtual std::string copy_path() const { return "copy"; }
  // True once this side knows the peer is gone (a failed copy is then the peer's death, not ours).
  virtual bool peer_vanished() const { return false; }
};

}  // namespace strdma
