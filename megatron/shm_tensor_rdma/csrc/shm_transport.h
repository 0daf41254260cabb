// Shared-memory transport between ranks on one host.
//
// Each rank owns one segment, its inbox: for every local peer it holds a control ring (small
// slots: Eager/Rts/Cts/Nack) and a bulk ring (large slots: Data chunks), written by that peer
// and drained by this rank's receive threads. A doorbell futex in the segment header wakes
// those threads. The segment is created exclusively under a job- and rank-scoped name and
// unlinked at once; peers receive its file descriptor over a Unix socket, so no name is
// left in /dev/shm whatever happens to any process afterwards.
//
// Large messages move with one copy where the kernel allows cross-memory attach
// (process_vm_readv): the sender offers its buffer's address in the Rts and the receiver reads
// it straight into the receive buffer. A claim word per offer, in the receiver's segment,
// settles the race between the receiver starting to read and the sender withdrawing (timeout):
// whoever moves it first from "offered" wins. Where cross-memory attach is refused (ptrace
// policy, seccomp), the receiver answers Cts and the bytes go through the bulk ring.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ring.h"
#include "transport.h"

namespace strdma {

struct ShmOptions {
  uint32_t ctrl_slots = 128;
  uint32_t ctrl_slot_payload = 4096;   // header + Eager payload
  uint32_t bulk_slots = 16;
  uint32_t bulk_slot_payload = 256 << 10;  // header + one Data chunk
  int spin_us = 5;  // receive threads busy-poll this long before sleeping on the doorbell
  bool single_copy = true;  // read large messages out of the sender's memory where permitted
};

// Claim words for single-copy offers: generation << 3 | state. The generation makes an Rts
// that outlived its offer (withdrawn, slot reused) fail to claim.
constexpr uint32_t kClaimSlots = 512;
enum ClaimState : uint32_t { kClaimFree = 0, kClaimOffered = 1, kClaimPulling = 2, kClaimAbandoned = 3, kClaimOver = 4 };

struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  int32_t owner_rank;
  int32_t world_size;
  uint32_t reserved;
  uint64_t total_bytes;
  int32_t owner_pid;    // for cross-memory attach by peers
  uint32_t reserved2;
  uint64_t owner_base;  // this segment's address in its owner, to probe cross-memory attach
  char pad0[16];
  std::atomic<uint32_t> doorbell;  // bumped by every producer after publishing
  std::atomic<uint32_t> sleepers;  // receive threads asleep on the doorbell
  std::atomic<uint32_t> pollers;   // callers busy-polling the inbox: no wake-up needed
  std::atomic<uint32_t> blocked;   // callers asleep in wait/wait_any: every message needs a wake-up
  std::atomic<int64_t> poll_ended_ns;  // CLOCK_MONOTONIC when a caller last stopped polling
  char pad1[40];
  // followed by world_size entries of {ctrl ring, bulk ring, claims} offsets; 0 = no ring
};

class ShmDomain;

class ShmChannel : public Channel {
 public:
  ShmChannel(EngineSink& sink, ShmDomain& domain, int my_rank, int peer, void* peer_base, size_t peer_bytes);
  ~ShmChannel() override;

  const char* kind() const override { return "shm"; }
  uint64_t eager_limit() const override;
  void post_ctrl(const CtrlHeader& h, const void* payload) override;
  void start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader& cts) override;
  std::string push_chunk(SendJob& job, uint64_t offset, uint64_t bytes) override;
  bool inbound_pending() override;
  bool bulk_pending() { return in_bulk_.has_published(); }
  bool flush() override;
  // flush() when something is queued; cheap otherwise (waiting callers call it as they spin).
  void flush_if_queued() {
    if (has_queued_.load(std::memory_order_relaxed)) flush();
  }
  // Wakes the peer's receive thread for a control message whose wake-up was deferred, once
  // the peer has stopped polling for a while. Cheap when nothing is owed.
  void nudge() override;
  bool owes_wake() const override { return owed_wake_.load(std::memory_order_relaxed); }
  void peer_gone() override;
  bool offer(Request& req, CtrlHeader& msg) override;
  int claim(const CtrlHeader& msg) override;
  void claim_over(const Request& req) override;
  bool withdraw(Request& req) override;
  void release_offer(Request& req) override;
  bool offer_in_use(const Request& req) override;
  bool can_copy_direct() const override { return can_pull_; }
  bool more_inbound() override { return in_ctrl_.has_published(); }
  std::string read(uint8_t* dst, uint64_t remote_addr, uint64_t bytes) override;
  std::string write(uint64_t remote_addr, const uint8_t* src, uint64_t bytes) override;
  std::string copy_path() const override;
  bool peer_vanished() const override { return gone_.load() || vanished_.load(); }

  // Receive-thread side: consume messages this peer published into our inbox.
  bool poll_ctrl();
  bool poll_bulk();

 private:
  bool try_push_ctrl(const CtrlHeader& h, const void* payload);
  void ring_peer_doorbell(bool wake_always, bool eager);
  bool peer_polled_recently() const;
  std::atomic<bool> owed_wake_{false};

  EngineSink& sink_;
  ShmDomain& domain_;
  int my_rank_;
  int peer_;
  void* peer_base_;
  size_t peer_bytes_;
  SegmentHeader* peer_header_;
  Ring out_ctrl_, out_bulk_;  // in the peer's segment: we produce
  Ring in_ctrl_, in_bulk_;    // in our segment: the peer produces
  std::atomic<uint32_t>* out_claims_ = nullptr;  // in the peer's segment: our offers to it
  std::atomic<uint32_t>* in_claims_ = nullptr;   // in our segment: its offers to us
  std::vector<uint32_t> free_claims_;            // engine mutex
  std::vector<uint32_t> claim_gen_;              // engine mutex
  int peer_pid_ = 0;
  bool can_pull_ = false;      // we may read and write the peer's memory (probed at attach)
  std::string pull_refused_;   // why not, when not
  std::atomic<bool> gone_{false};
  std::atomic<bool> vanished_{false};  // a copy found the peer's process gone
  std::mutex produce_mu_;  // keeps control messages in posting order
  bool flush_locked();  // flush() with produce_mu_ held
  std::deque<std::vector<uint8_t>> queued_;  // control messages that found the ring full
  std::vector<std::vector<uint8_t>> spare_queued_;  // their buffers, reused (no page faults)
  std::atomic<bool> has_queued_{false};      // !queued_.empty(), readable without produce_mu_
  std::mutex consume_mu_;  // one consumer at a time per control ring, to keep order
  // Consumers between "about to take a slot" and "done with it": a taken slot is no longer
  // published, but its message is not delivered yet either.
  std::atomic<int> consuming_{0};
};

class ShmDomain {
 public:
  // Creates and maps this rank's inbox with rings for `local_peers`; unlinks its name at once.
  ShmDomain(EngineSink& sink, const ShmOptions& options, const std::string& job_id, int my_rank, int world_size,
            const std::vector<int>& local_peers);
  ~ShmDomain();

  int inbox_fd() const { return fd_; }
  const ShmOptions& options() const { return options_; }
  // Maps a peer's inbox from the descriptor it handed over and returns the channel to it.
  ShmChannel* attach_peer(int peer, int fd);
  void start(int recv_threads);
  void stop();
  // One pass over all inbound rings; any thread may call it (waiting callers do, so a reply
  // is consumed without waking a receive thread first). True when something was consumed.
  bool progress_once();
  // Pushes control messages our channels queued on a full ring and delivers the wake-ups they
  // owe their peers (see ShmChannel::nudge).
  void nudge_peers();
  // Brackets a caller's busy-polling. While one polls, producers skip the doorbell wake-up
  // (a syscall, and on few cores a context switch that preempts the poller).
  void begin_polling() { header_->pollers.fetch_add(1, std::memory_order_seq_cst); }
  void end_polling();
  // Brackets a caller's sleep in wait/wait_any: until it ends, eager messages wake a receive
  // thread too (otherwise they wait in the ring for the receiver's next call).
  void begin_blocking();
  void end_blocking() { header_->blocked.fetch_sub(1, std::memory_order_seq_cst); }
  // Ring offsets inside a segment for messages produced by `source`.
  static bool ring_offsets(void* base, int source, uint64_t* ctrl, uint64_t* bulk, uint64_t* claims);
  // True when no caller busy-polls our inbox (receive threads then do the work).
  bool unpolled() const { return header_->pollers.load(std::memory_order_relaxed) == 0; }
  void* inbox_base() const { return base_; }
  void count_wakeup() { wakeups_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

 private:
  void recv_loop();
  void recv_body();

  EngineSink& sink_;
  ShmOptions options_;
  int my_rank_;
  int world_size_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  SegmentHeader* header_ = nullptr;
  std::vector<std::unique_ptr<ShmChannel>> channels_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> wakeups_{0};  // futex wake-ups of peers' receive threads we issued
};

// Name of the (immediately unlinked) segment, exposed for tests of name hygiene.
std::string shm_segment_name(const std::string& job_id, int rank);

}  // namespace strdma
