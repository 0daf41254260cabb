// Engine lifecycle: listeners, mesh setup and transport choice, threads, completion queries,
// shutdown. Matching and the data path are in matching.cpp.
#include "engine.h"

#include <sys/socket.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <exception>
#include <random>

#include "bootstrap.h"
#include "verbs_transport.h"

namespace strdma {

Engine::Engine(EngineConfig config) : cfg_(std::move(config)) {
  if (cfg_.world_size < 1) throw ArgumentError("world_size must be >= 1, got " + std::to_string(cfg_.world_size));
  if (cfg_.rank < 0 || cfg_.rank >= cfg_.world_size)
    throw ArgumentError("rank must be in [0, world_size=" + std::to_string(cfg_.world_size) + "), got " +
                        std::to_string(cfg_.rank));
  if (cfg_.job_id.empty() || cfg_.job_id.find('\n') != std::string::npos)
    throw ArgumentError("job_id must be a non-empty single-line string");
  if (cfg_.send_threads < 1 || cfg_.send_threads > 64 || cfg_.recv_threads < 1 || cfg_.recv_threads > 64)
    throw ArgumentError("send_threads and recv_threads must be in [1, 64]");
  if (cfg_.workload_bytes < 4096 || cfg_.workload_bytes > (64u << 20))
    throw ArgumentError("workload_bytes must be in [4 KiB, 64 MiB], got " + std::to_string(cfg_.workload_bytes));
  if (cfg_.eager_bytes > (1u << 20)) throw ArgumentError("eager_bytes must be <= 1 MiB");
  auto pow2 = [](uint32_t v) { return v >= 2 && (v & (v - 1)) == 0; };
  if (!pow2(cfg_.shm_ctrl_slots) || !pow2(cfg_.shm_bulk_slots))
    throw ArgumentError("shm_ctrl_slots and shm_bulk_slots must be powers of two >= 2");
  if (!cfg_.allow_shm && !cfg_.allow_tcp && !cfg_.allow_verbs)
    throw ArgumentError("at least one transport (shm, tcp, verbs) must be allowed");

  peers_.resize(cfg_.world_size);
  channels_.assign(cfg_.world_size, nullptr);
  links_.resize(cfg_.world_size);
  listen_fd_ = tcp_listen(cfg_.bind_host, cfg_.bind_port, cfg_.world_size + 16, &listen_port_);
  // The hand-over socket needs a name no other endpoint on the host uses; pid plus a random
  // nonce makes a collision practically impossible even for repeated jobs.
  std::random_device rd;
  char name[96];
  std::snprintf(name, sizeof(name), "strdma.%d.%d.%08x%08x", static_cast<int>(getpid()), cfg_.rank, rd(), rd());
  unix_name_ = name;
  try {
    unix_fd_ = unix_listen(unix_name_);
  } catch (...) {
    ::close(listen_fd_);
    throw;
  }
  if (cfg_.allow_verbs) {
    std::string why;
    verbs_ = open_verbs(cfg_.verbs_device, &why);
  }
}

Engine::~Engine() {
  try {
    close(1.0);
  } catch (...) {
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (unix_fd_ >= 0) ::close(unix_fd_);
}

void Engine::connect(const std::vector<std::string>& addresses, double timeout_s) {
  if (connected_) throw TransportError("endpoint is already connected");
  if (closing_) throw TransportError("endpoint is closed");
  if (static_cast<int>(addresses.size()) != cfg_.world_size)
    throw ArgumentError("expected " + std::to_string(cfg_.world_size) + " peer addresses (one per rank), got " +
                        std::to_string(addresses.size()));
  for (size_t r = 0; r < addresses.size(); ++r) {
    std::string host;
    int port = 0;
    split_address(addresses[r], "peer address of rank " + std::to_string(r), &host, &port);
  }
  const auto deadline = deadline_after(timeout_s);
  Hello me;
  me.job_id = cfg_.job_id;
  me.rank = cfg_.rank;
  me.world_size = cfg_.world_size;
  me.host_key = cfg_.host_key;
  me.unix_name = unix_name_;
  me.allow_shm = cfg_.allow_shm;
  me.allow_tcp = cfg_.allow_tcp;
  me.verbs = verbs_ != nullptr;
  me.verbs_info = verbs_ ? verbs_->describe() : "";
  me.device_key = cfg_.device_key;

  std::vector<PeerConn> conns = connect_mesh(listen_fd_, me, addresses, deadline);
  auto close_all = [&] {
    for (auto& c : conns)
      if (c.fd >= 0) ::close(c.fd);
  };
  try {
    std::vector<int> local;
    std::vector<char> use_verbs(cfg_.world_size, 0);
    peer_device_keys_.assign(cfg_.world_size, "");
    for (int p = 0; p < cfg_.world_size; ++p)
      if (p != cfg_.rank) peer_device_keys_[p] = conns[p].hello.device_key;
    for (int p = 0; p < cfg_.world_size; ++p) {
      if (p == cfg_.rank) continue;
      const Hello& h = conns[p].hello;
      bool same_host = !cfg_.host_key.empty() && h.host_key == cfg_.host_key;
      if (same_host && cfg_.allow_shm && h.allow_shm) {
        local.push_back(p);
      } else if (verbs_ && h.verbs) {
        use_verbs[p] = 1;
      } else if (!(cfg_.allow_tcp && h.allow_tcp)) {
        throw PeerSetupError(p, "no transport usable with rank " + std::to_string(p) + ": " +
                                    (same_host ? "same host but shared memory is disabled on one side"
                                               : "different host, no RDMA device on both sides") +
                                    ", and TCP is disabled on one side");
      }
    }
    if (!local.empty()) {
      ShmOptions opt;
      opt.ctrl_slots = cfg_.shm_ctrl_slots;
      opt.ctrl_slot_payload = static_cast<uint32_t>(sizeof(CtrlHeader) + cfg_.eager_bytes);
      opt.bulk_slots = cfg_.shm_bulk_slots;
      opt.bulk_slot_payload = static_cast<uint32_t>(sizeof(CtrlHeader) + cfg_.workload_bytes);
      opt.single_copy = cfg_.single_copy;
      shm_ = std::make_unique<ShmDomain>(*this, opt, cfg_.job_id, cfg_.rank, cfg_.world_size, local);
      // Serve our segment while fetching the peers' ones, so no pair waits on the other.
      std::exception_ptr server_error;
      std::thread server([&] {
        try {
          serve_fd(unix_fd_, shm_->inbox_fd(), local, deadline);
        } catch (...) {
          server_error = std::current_exception();
        }
      });
      try {
        for (int p : local) {
          int fd = fetch_fd(conns[p].hello.unix_name, cfg_.rank, p, deadline);
          channels_[p] = shm_->attach_peer(p, fd);
        }
      } catch (...) {
        ::shutdown(unix_fd_, SHUT_RDWR);
        server.join();
        throw;
      }
      server.join();
      if (server_error) std::rethrow_exception(server_error);
    }
    ::close(unix_fd_);
    unix_fd_ = -1;
    for (int p = 0; p < cfg_.world_size; ++p) {
      if (p == cfg_.rank) continue;
      bool is_local = channels_[p] != nullptr;
      const int fd = conns[p].fd;
      links_[p] = std::make_unique<TcpLink>(*this, cfg_.rank, p, fd, cfg_.workload_bytes, cfg_.eager_bytes, !is_local);
      conns[p].fd = -1;  // owned by the link now
      if (use_verbs[p]) {
        // The link's threads have not started, so the socket is still free for the QP swap.
        owned_.push_back(verbs_->connect_peer(*this, cfg_.rank, p, fd, *links_[p], cfg_.workload_bytes, deadline));
        channels_[p] = owned_.back().get();
      } else if (!is_local) {
        channels_[p] = links_[p].get();
      }
    }
  } catch (...) {
    close_all();
    throw;
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  connected_ = true;
  monitor_ = std::thread([this] { monitor_loop(); });
  for (int i = 0; i < cfg_.send_threads && shm_; ++i) send_threads_.emplace_back([this] { send_loop(); });
  if (shm_) shm_->start(cfg_.recv_threads);
  if (verbs_) verbs_->start();
  for (auto& link : links_)
    if (link) link->start();
}

std::string Engine::transport_of(int peer) {
  if (peer < 0 || peer >= cfg_.world_size)
    throw ArgumentError("peer must be in [0, " + std::to_string(cfg_.world_size) + "), got " + std::to_string(peer));
  if (peer == cfg_.rank) return "self";
  if (!connected_ || !channels_[peer]) return "none";
  return channels_[peer]->kind();
}

std::string Engine::copy_path(int peer) {
  std::string kind = transport_of(peer);
  return kind == "shm" ? channels_[peer]->copy_path() : kind;
}

std::string Engine::peer_device_key(int peer) {
  if (peer < 0 || peer >= cfg_.world_size)
    throw ArgumentError("peer must be in [0, " + std::to_string(cfg_.world_size) + "), got " + std::to_string(peer));
  return peer < static_cast<int>(peer_device_keys_.size()) ? peer_device_keys_[peer] : "";
}

std::map<std::string, uint64_t> Engine::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  return {{"eager", finished_by_path_[0]}, {"copied", finished_by_path_[1]}, {"read", finished_by_path_[2]},
          {"written", finished_by_path_[3]}, {"device", finished_by_path_[4]}, {"wakeups", shm_ ? shm_->wakeups() : 0}};
}

int Engine::state(uint64_t id) {
  progress();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return -1;
  return it->second->published ? static_cast<int>(it->second->state) : static_cast<int>(ReqState::Pending);
}

template <class Ready>
bool Engine::spin_until(Ready ready, Clock::time_point deadline) {
  if (!shm_ || cfg_.spin_us <= 0 || !connected_) return false;
  const auto spin = std::chrono::microseconds(cfg_.spin_us);
  auto until = std::min(deadline, Clock::now() + spin);
  uint64_t seen = publications_.load(std::memory_order_acquire) - 1;  // check once up front
  bool result = false;
  uint32_t idle_rounds = 0;
  shm_->begin_polling();
  for (;;) {
    uint64_t now_seen = publications_.load(std::memory_order_acquire);
    if (now_seen != seen) {
      seen = now_seen;
      std::lock_guard<std::mutex> lk(mu_);
      if (ready()) {
        result = true;
        break;
      }
      until = std::min(deadline, Clock::now() + spin);  // requests finish: traffic is flowing
    }
    // While waiting, the caller works: it drains the inbox and copies outgoing chunks, so on
    // few cores it adds to the copy threads instead of competing with them.
    std::shared_ptr<SendJob> job;
    uint64_t offset = 0, bytes = 0;
    bool worked = shm_->progress_once();
    if (!worked && send_jobs_queued_.load(std::memory_order_relaxed) > 0 && take_chunk(false, &job, &offset, &bytes)) {
      run_chunk(job, offset, bytes);
      worked = true;
    }
    if (worked) {
      until = std::min(deadline, Clock::now() + spin);  // traffic is flowing: keep going
      continue;
    }
    if (Clock::now() >= until) break;
    shm_->nudge_peers();
    // Idle for a while: let another runnable thread have this core (a peer's thread we just
    // woke, on a host with fewer cores than busy threads); free when nothing else is runnable.
    if (++idle_rounds % 32 == 0) sched_yield(); else cpu_relax();
  }
  shm_->end_polling();
  if (!result) {
    std::lock_guard<std::mutex> lk(mu_);
    result = ready();
  }
  return result;
}

bool Engine::wait(uint64_t id, double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  auto done = [&] {
    auto it = requests_.find(id);
    return it == requests_.end() || it->second->published;
  };
  if (spin_until(done, deadline)) return true;
  Blocking blocking(connected_ ? shm_.get() : nullptr);
  std::unique_lock<std::mutex> lk(mu_);
  if (deadline == Clock::time_point::max()) {
    done_cv_.wait(lk, done);
    return true;
  }
  return done_cv_.wait_until(lk, deadline, done);
}

void Engine::progress() {
  if (shm_ && connected_) shm_->progress_once();
}

Finished Engine::take(uint64_t id) {
  Finished f;
  f.id = id;
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    f.state = -1;
    return f;
  }
  auto& r = *it->second;
  if (!r.published) {
    f.state = static_cast<int>(ReqState::Pending);
    return f;
  }
  f.state = static_cast<int>(r.state);
  f.error_kind = static_cast<uint32_t>(r.error_kind);
  f.message = r.error;
  requests_.erase(it);
  // Callers that only wait on handles never drain completed_; drop the ids already taken
  // once they dominate, so the queue stays proportional to what is still unreported.
  if (completed_.size() > 4096 && completed_.size() > 2 * requests_.size()) {
    std::deque<uint64_t> live;
    for (uint64_t c : completed_)
      if (requests_.count(c)) live.push_back(c);
    completed_.swap(live);
  }
  return f;
}

Finished Engine::release(uint64_t id) {
  progress();
  std::lock_guard<std::mutex> lk(mu_);
  return take(id);
}

Finished Engine::wait_release(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second->published) return take(id);
  }
  wait(id, -1);
  std::lock_guard<std::mutex> lk(mu_);
  return take(id);
}

std::vector<Finished> Engine::poll() {
  progress();
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<Finished> out;
  while (!completed_.empty()) {
    uint64_t id = completed_.front();
    completed_.pop_front();
    Finished f = take(id);
    if (f.state > 0) out.push_back(std::move(f));
  }
  return out;
}

std::vector<Finished> Engine::wait_any(double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  spin_until([&] { return !completed_.empty() || requests_.empty(); }, deadline);
  Blocking blocking(connected_ ? shm_.get() : nullptr);
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<Finished> out;
  for (;;) {
    while (!completed_.empty()) {
      uint64_t id = completed_.front();
      completed_.pop_front();
      Finished f = take(id);
      if (f.state > 0) out.push_back(std::move(f));
    }
    if (!out.empty() || requests_.empty()) return out;
    if (deadline == Clock::time_point::max()) {
      done_cv_.wait(lk);
    } else if (done_cv_.wait_until(lk, deadline) == std::cv_status::timeout && completed_.empty()) {
      return out;
    }
  }
}

size_t Engine::in_flight() {
  progress();
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& kv : requests_) n += kv.second->published ? 0 : 1;
  return n;
}

std::string Engine::describe(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto r = find(id);
  return r ? describe(*r) + ": " + stage(*r) : "request " + std::to_string(id) + " (already reported)";
}

void Engine::enqueue_send_job(std::shared_ptr<SendJob> job) {
  std::lock_guard<std::mutex> lk(send_mu_);
  send_jobs_.push_back(std::move(job));
  send_jobs_queued_.store(send_jobs_.size(), std::memory_order_relaxed);
  send_cv_.notify_one();
}

bool Engine::take_chunk(bool block, std::shared_ptr<SendJob>* job, uint64_t* offset, uint64_t* bytes) {
  std::unique_lock<std::mutex> lk(send_mu_);
  if (block) send_cv_.wait(lk, [&] { return send_stop_ || !send_jobs_.empty(); });
  if (send_stop_ || send_jobs_.empty()) return false;
  *job = send_jobs_.front();
  send_jobs_.pop_front();
  // Round-robin over transfers, one chunk per turn: a later, smaller transfer finishes
  // without waiting for an earlier large one, and idle threads pick up the next chunk.
  auto& j = **job;
  *offset = j.next_offset;
  *bytes = std::min(j.chunk, j.req->nbytes - j.next_offset);
  j.next_offset += *bytes;
  if (j.next_offset < j.req->nbytes) {
    send_jobs_.push_back(*job);
    send_cv_.notify_one();
  }
  send_jobs_queued_.store(send_jobs_.size(), std::memory_order_relaxed);
  return true;
}

void Engine::run_chunk(const std::shared_ptr<SendJob>& job, uint64_t offset, uint64_t bytes) {
  if (job->kind != SendJob::Ring) return run_direct_chunk(job, offset, bytes);
  if (!send_chunk_begin(job->req)) return;
  std::string error = job->channel->push_chunk(*job, offset, bytes);
  send_chunk_end(job->req, error.empty() && !job->req->aborted.load() ? bytes : 0, error);
}

void Engine::send_loop() {
  try {
    std::shared_ptr<SendJob> job;
    uint64_t offset = 0, bytes = 0;
    while (take_chunk(true, &job, &offset, &bytes)) run_chunk(job, offset, bytes);
  } catch (const std::exception& e) {
    on_internal_error("send thread", e.what());
  }
}

void Engine::on_internal_error(const std::string& where, const std::string& what) {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_.empty()) broken_ = "internal error in the " + where + " of rank " + std::to_string(cfg_.rank) + ": " + what;
  std::vector<std::shared_ptr<Request>> pending;
  for (auto& kv : requests_)
    if (kv.second->state == ReqState::Pending) pending.push_back(kv.second);
  for (auto& r : pending) fail(r, ErrorKind::Internal, describe(*r) + " failed: " + broken_);
}

void Engine::monitor_loop() {
  try {
    monitor_body();
  } catch (const std::exception& e) {
    on_internal_error("monitor thread", e.what());
  }
}

void Engine::monitor_body() {
  auto next_deadline_scan = Clock::now();
  std::unique_lock<std::mutex> mlk(monitor_mu_);
  while (!monitor_stop_) {
    mlk.unlock();
    bool queued = false;
    bool owed = false;
    for (Channel* ch : channels_)
      if (ch) {
        queued |= ch->flush();
        ch->nudge();
        owed |= ch->owes_wake();
      }
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (int p = 0; p < cfg_.world_size; ++p) {
        auto& ps = peers_[p];
        // A departed peer's last messages may still sit in our inbox; fail its requests only
        // once they are drained, so a send that completed before the peer exited still lands.
        if (ps.gone && !ps.gone_final && !(channels_[p] && channels_[p]->inbound_pending())) fail_peer_requests(p);
      }
      if (now >= next_deadline_scan) {
        next_deadline_scan = now + std::chrono::milliseconds(5);
        std::vector<std::shared_ptr<Request>> expired;
        for (auto& kv : requests_)
          if (kv.second->state == ReqState::Pending && kv.second->deadline <= now &&
              // the peer is copying out of or into this buffer right now: it is about to finish
              !(kv.second->offer_slot >= 0 && channels_[kv.second->peer]->offer_in_use(*kv.second)))
            expired.push_back(kv.second);
        for (auto& r : expired) {
          char secs[32];
          std::snprintf(secs, sizeof(secs), "%g", r->timeout_s);
          fail(r, ErrorKind::Timeout, describe(*r) + " timed out after " + secs + " s: " + stage(*r));
        }
      }
    }
    mlk.lock();
    // Queued control messages are retried soon; otherwise only deadlines need attention.
    // Queued control messages are retried soon. An owed wake-up is delivered by the waiting
    // sender itself (spin_until) in the common case; this is the safety net when it does not wait.
    monitor_cv_.wait_for(mlk, queued ? std::chrono::microseconds(200)
                              : owed ? std::chrono::milliseconds(1) : std::chrono::milliseconds(5));
  }
}

void Engine::on_peer_gone(int peer, bool graceful, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& ps = peers_[peer];
    if (ps.gone) return;
    ps.gone = true;
    ps.gone_reason = reason;
    (void)graceful;
  }
  if (channels_[peer]) channels_[peer]->peer_gone();
  if (links_[peer] && channels_[peer] != links_[peer].get()) links_[peer]->peer_gone();
  std::lock_guard<std::mutex> mlk(monitor_mu_);
  monitor_cv_.notify_all();
}

void Engine::close(double grace_s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closing_) return;
    closing_ = true;
    std::vector<std::shared_ptr<Request>> pending;
    for (auto& kv : requests_)
      if (kv.second->state == ReqState::Pending) pending.push_back(kv.second);
    for (auto& r : pending) fail(r, ErrorKind::Closed, describe(*r) + " was still in flight when the endpoint closed");
    done_cv_.notify_all();
  }
  {
    // A request whose buffer a peer is copying out of or into (single copy) is reported only
    // once the peer is done, because Python frees the tensor then; give those the grace period.
    // Blocking: the peers' answers (Pulled, Pushed) then wake a receive thread to consume them.
    Blocking blocking(connected_ ? shm_.get() : nullptr);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait_until(lk, deadline_after(grace_s < 0 ? 0 : grace_s), [&] {
      for (auto& kv : requests_)
        if (kv.second->offer_hold) return false;
      return true;
    });
  }
  {
    std::lock_guard<std::mutex> lk(send_mu_);
    send_stop_ = true;
    send_cv_.notify_all();
  }
  for (auto& t : send_threads_) t.join();
  send_threads_.clear();
  // All links share one deadline, so closing never takes much longer than `grace_s`.
  const auto deadline = deadline_after(grace_s < 0 ? 0 : grace_s);
  for (auto& link : links_)
    if (link) link->close(std::max(0.0, seconds_until(deadline)));
  if (verbs_) verbs_->stop();
  if (shm_) shm_->stop();
  {
    std::lock_guard<std::mutex> mlk(monitor_mu_);
    monitor_stop_ = true;
    monitor_cv_.notify_all();
  }
  if (monitor_.joinable()) monitor_.join();
  std::lock_guard<std::mutex> lk(mu_);
  done_cv_.notify_all();
}

}  // namespace strdma
