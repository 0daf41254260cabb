// The engine: one per rank. It owns the request table, matches sends to receives by
// (peer, tag) in posting order, tracks completion per request, enforces timeouts, and runs the
// threads that serve the transports. It holds raw pointers to tensor memory; the Python
// wrapper keeps those tensors alive until a request is reported finished.
#pragma once

#include <condition_variable>
#include <deque>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "shm_transport.h"
#include "tcp_transport.h"
#include "transport.h"

namespace strdma {

class VerbsContext;

// A receiver with more messages waiting from the same sender lets the sender write every other
// message of at least this size into its buffer, and reads the others: both sides copy.
constexpr uint64_t kHandOverBytes = 64 << 10;

struct EngineConfig {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  std::string host_key;            // ranks with equal keys use shared memory
  std::string bind_host = "0.0.0.0";
  int bind_port = 0;               // 0: pick a free port (see listen_port())
  int send_threads = 2;
  int recv_threads = 2;
  uint64_t workload_bytes = 256 << 10;  // chunk size: large tensors are split across threads by it
  uint64_t eager_bytes = 4096;        // messages up to this size skip the Rts/Cts handshake
  uint32_t shm_ctrl_slots = 128;
  uint32_t shm_bulk_slots = 16;
  int spin_us = 50;
  bool single_copy = true;  // shm: large messages read straight from the sender (where permitted)
  bool allow_shm = true;
  bool allow_tcp = true;
  bool allow_verbs = true;
  std::string verbs_device;  // empty: first device with an active port
  std::map<uint32_t, std::string> dtype_names;  // for error messages only
  std::string device_key;  // GPUs this process can open IPC handles on (told to peers; empty: none)
};

class Engine : public EngineSink {
 public:
  explicit Engine(EngineConfig config);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int listen_port() const { return listen_port_; }
  bool verbs_ready() const { return verbs_ != nullptr; }
  // Forms the mesh with all ranks (addresses indexed by rank), then starts the threads.
  void connect(const std::vector<std::string>& addresses, double timeout_s);

  uint64_t isend(uintptr_t data, uint64_t nbytes, uint32_t dtype, const std::vector<int64_t>& shape, int dst,
                 int64_t tag, double timeout_s);
  uint64_t irecv(uintptr_t data, uint64_t nbytes, uint32_t dtype, const std::vector<int64_t>& shape, int src,
                 int64_t tag, double timeout_s);
  // isend or irecv.
  uint64_t post(bool is_send, uintptr_t data, uint64_t nbytes, uint32_t dtype, const std::vector<int64_t>& shape,
                int peer, int64_t tag, double timeout_s) {
    return is_send ? isend(data, nbytes, dtype, shape, peer, tag, timeout_s)
                   : irecv(data, nbytes, dtype, shape, peer, tag, timeout_s);
  }

  // A send whose bytes stay in this process's GPU memory: `descriptor` (an IPC handle the
  // caller made) travels in a DeviceRts; the receiver's caller copies out of that memory and
  // answers with device_done. Shared-memory peers only. The request finishes on that answer.
  uint64_t isend_device(const std::string& descriptor, uint64_t nbytes, uint32_t dtype,
                        const std::vector<int64_t>& shape, int dst, int64_t tag, double timeout_s);
  // The receiver's answer to a DeviceRts: the copy is done (ok), or failed with `reason`
  // (the sender's request fails with it).
  void device_done(int peer, uint64_t send_id, bool ok, const std::string& reason);
  // The device_key a peer announced when connecting ("" for none, or before connect).
  std::string peer_device_key(int peer);

  // -1 when `id` was already released (reported); else a ReqState value.
  int state(uint64_t id);
  // Blocks until the request finished or the timeout passed; true when finished.
  bool wait(uint64_t id, double timeout_s);
  // Returns a finished request's outcome and forgets it (poll() will not report it).
  Finished release(uint64_t id);
  // wait(id, no limit) then release(id), the blocking calls' path: a request that finished
  // when posted (an eager send, a receive whose message was there) costs one lock.
  Finished wait_release(uint64_t id);
  // Finished requests not yet released, releasing them.
  std::vector<Finished> poll();
  // As poll(), but blocks until at least one request finished or the timeout passed.
  std::vector<Finished> wait_any(double timeout_s);
  size_t in_flight();
  std::string describe(uint64_t id);
  std::string transport_of(int peer);
  std::string copy_path(int peer);
  // Transfers finished, by how their bytes moved, and wake-ups of peers' receive threads.
  std::map<std::string, uint64_t> stats();
  void close(double grace_s);

  // EngineSink
  void on_ctrl(int peer, const CtrlHeader& h, const uint8_t* payload) override;
  DataLease data_begin(int peer, const CtrlHeader& h) override;
  void data_end(DataLease& lease, uint64_t bytes) override;
  void recv_landed(int peer, uint64_t recv_id) override;
  bool send_chunk_begin(const std::shared_ptr<Request>& req) override;
  void send_chunk_end(const std::shared_ptr<Request>& req, uint64_t bytes, const std::string& error) override;
  void on_peer_gone(int peer, bool graceful, const std::string& reason) override;
  void enqueue_send_job(std::shared_ptr<SendJob> job) override;
  void on_internal_error(const std::string& where, const std::string& what) override;

 private:
  // A message consumed before its irecv: the compact header, then the eager payload, in one
  // buffer (taken from spare_payloads_), so that queues of arrivals stay small.
  struct Arrival {
    std::vector<uint8_t> bytes;
    void store(const CtrlHeader& h, const uint8_t* payload, std::vector<uint8_t>&& buffer) {
      bytes = std::move(buffer);
      const bool carries = h.type == static_cast<uint32_t>(MsgType::Eager) || h.type == static_cast<uint32_t>(MsgType::DeviceRts);
      const size_t tail = carries ? h.payload_bytes : 0;
      bytes.resize(compact_header_bytes(h.ndim) + tail);
      const size_t head = write_compact_header(bytes.data(), h);
      if (tail) std::memcpy(bytes.data() + head, payload, tail);
    }
    CtrlHeader header() const {
      CtrlHeader h;
      read_compact_header(bytes.data(), h);
      return h;
    }
    const uint8_t* payload() const {
      CtrlHeader h;
      return bytes.data() + read_compact_header(bytes.data(), h);
    }
  };
  // Payload buffers of consumed arrivals, reused: an eager message that arrives before its
  // irecv is copied out of the ring, and a fresh allocation each time costs page faults.
  std::vector<std::vector<uint8_t>> spare_payloads_;  // guarded by mu_
  struct PeerState {
    std::unordered_map<int64_t, std::deque<std::shared_ptr<Request>>> posted;
    std::unordered_map<int64_t, std::deque<Arrival>> arrived;  // no irecv matched yet
    bool gone = false;
    bool gone_final = false;  // drained; pending requests failed
    bool handed_last = false;  // the last single copy from this peer was handed to it (alternates)
    std::string gone_reason;
  };

  std::shared_ptr<Request> make_request(bool is_send, uintptr_t data, uint64_t nbytes, uint32_t dtype,
                                        const std::vector<int64_t>& shape, int peer, int64_t tag, double timeout_s);
  void check_ready(const char* op, int peer, const char* peer_arg) const;
  // mu_ held: gives a send its id and records it; false (and the send failed) when its peer is gone.
  bool admit_send(const std::shared_ptr<Request>& req);
  // The header announcing a send: its tag, id, dtype, size and shape.
  static CtrlHeader send_header(const Request& req);
  // ---- the following need mu_ held
  void on_ctrl_locked(int peer, const CtrlHeader& h, const uint8_t* payload);
  void accept_arrival(const std::shared_ptr<Request>& recv, const CtrlHeader& h, const uint8_t* payload);
  void fail(const std::shared_ptr<Request>& req, ErrorKind kind, const std::string& message);
  void finish(const std::shared_ptr<Request>& req, Path path = Path::Copied);
  void maybe_publish(const std::shared_ptr<Request>& req);
  void fail_peer_requests(int peer);
  void settle_if_peer_gone(const std::shared_ptr<Request>& req);
  std::shared_ptr<Request> find(uint64_t id);
  std::string describe(const Request& r) const;  // "isend(dst=1, tag=5, 64 bytes)"
  std::string stage(const Request& r) const;     // how far the transfer got
  std::string dtype_name(uint32_t code) const;
  Finished take(uint64_t id);
  // ----
  void monitor_loop();
  void monitor_body();
  void send_loop();
  bool take_chunk(bool block, std::shared_ptr<SendJob>* job, uint64_t* offset, uint64_t* bytes);
  void run_chunk(const std::shared_ptr<SendJob>& job, uint64_t offset, uint64_t bytes);
  void run_direct_chunk(const std::shared_ptr<SendJob>& job, uint64_t offset, uint64_t bytes);
  // mu_ held: queues a single copy (read of the sender's buffer, or write into the receiver's)
  // to be started by start_direct_jobs() once mu_ is released.
  void queue_direct(const std::shared_ptr<Request>& req, SendJob::Kind kind, uint64_t peer_id, uint64_t remote_addr);
  void start_direct_jobs();
  // mu_ held: the peer is done with `req`'s offered buffer; stop holding a failure back.
  void end_offer_hold(const std::shared_ptr<Request>& req);
  // mu_ held: tells the peer this side gave up the transfer (Nack).
  void tell_abandoned(const std::shared_ptr<Request>& req, ErrorKind kind, const std::string& message);
  // Spins up to spin_us, driving the shared-memory inbox from the calling thread, until
  // `ready()` (checked under mu_) holds. Saves two thread wake-ups per message when the
  // answer comes quickly, which is what small-message latency is made of.
  template <class Ready>
  bool spin_until(Ready ready, Clock::time_point deadline);

  // Consumes what peers published in our shared-memory inbox, from the calling thread. Every
  // call that reports completion does it first: eager messages do not wake a receive thread
  // when nobody waits (see ShmChannel::ring_peer_doorbell).
  void progress();
  struct Blocking {
    explicit Blocking(ShmDomain* d) : domain(d) {
      if (domain) domain->begin_blocking();
    }
    ~Blocking() {
      if (domain) domain->end_blocking();
    }
    ShmDomain* domain;
  };

  EngineConfig cfg_;
  std::vector<std::string> peer_device_keys_;  // by rank, from the hello (set in connect, then read-only)
  int listen_fd_ = -1;
  int listen_port_ = 0;
  int unix_fd_ = -1;
  std::string unix_name_;
  bool connected_ = false;
  std::unique_ptr<VerbsContext> verbs_;
  std::unique_ptr<ShmDomain> shm_;
  std::vector<std::unique_ptr<TcpLink>> links_;
  std::vector<std::unique_ptr<Channel>> owned_;  // verbs channels
  std::vector<Channel*> channels_;               // by rank; null for self

  std::mutex mu_;
  std::condition_variable done_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Request>> requests_;
  std::deque<uint64_t> completed_;
  uint64_t finished_by_path_[5] = {};
  std::vector<PeerState> peers_;
  uint64_t next_id_ = 1;
  std::atomic<uint64_t> publications_{0};  // bumped on every publish, read without mu_
  bool closing_ = false;
  std::string broken_;  // set by an internal error: the endpoint refuses new transfers

  std::mutex send_mu_;
  std::condition_variable send_cv_;
  std::deque<std::shared_ptr<SendJob>> send_jobs_;
  std::atomic<size_t> send_jobs_queued_{0};  // send_jobs_.size(), readable without send_mu_
  std::vector<std::shared_ptr<SendJob>> direct_jobs_;  // mu_: single copies to start
  bool send_stop_ = false;
  std::vector<std::thread> send_threads_;

  std::mutex monitor_mu_;
  std::condition_variable monitor_cv_;
  bool monitor_stop_ = false;
  std::thread monitor_;
};

}  // namespace strdma
