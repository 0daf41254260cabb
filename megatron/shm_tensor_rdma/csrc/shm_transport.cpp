// Shared-memory transport: inbox segment, per-peer rings, receive threads.
#include "shm_transport.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <fstream>

namespace strdma {
namespace {

constexpr uint64_t kSegmentMagic = 0x31414d4453525453ULL;  // "STRSDMA1"
constexpr uint32_t kSegmentVersion = 2;

uint64_t* ring_table(void* base) {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(base) + sizeof(SegmentHeader));
}

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Copies `bytes` between `local` here and `remote` in process `pid` (reading it, or writing
// it when `write`); "" or why not (`failed_errno`, when given, gets the call's errno). The kernel
// may move less than asked: the rest follows.
std::string copy_remote(int pid, bool write, uint8_t* local, uint64_t remote, uint64_t bytes,
                        int* failed_errno = nullptr) {
  const char* call = write ? "process_vm_writev" : "process_vm_readv";
  uint64_t done = 0;
  while (done < bytes) {
    struct iovec here{local + done, static_cast<size_t>(bytes - done)};
    struct iovec far{reinterpret_cast<void*>(remote + done), static_cast<size_t>(bytes - done)};
    ssize_t n = write ? process_vm_writev(pid, &here, 1, &far, 1, 0) : process_vm_readv(pid, &here, 1, &far, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      if (failed_errno != nullptr) *failed_errno = err;
      return errno_text(call, err);
    }
    if (n == 0) return std::string(call) + " moved nothing";
    done += static_cast<uint64_t>(n);
  }
  return "";
}

// Under the Yama "restricted ptrace" policy (ptrace_scope 1) only a process's ancestors may
// attach to it, which includes cross-memory attach; peers are siblings. Allowing any process
// of the same user is what makes single copy possible there; scopes 2 and 3 are left alone
// and the probe at attach time falls back to the ring.
void allow_peer_reads() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  if (f >> scope && scope == 1) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
}

uint32_t claim_word(uint32_t gen, ClaimState state) { return gen << 3 | state; }

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

}  // namespace

std::string shm_segment_name(const std::string& job_id, int rank) {
  // The job id may hold any characters; a hash keeps the name short and valid.
  char buf[96];
  std::snprintf(buf, sizeof(buf), "/strdma.%016llx.r%d.p%d", static_cast<unsigned long long>(fnv1a(job_id)), rank,
                static_cast<int>(getpid()));
  return buf;
}

// ---------------------------------------------------------------------------------------- channel

ShmChannel::ShmChannel(EngineSink& sink, ShmDomain& domain, int my_rank, int peer, void* peer_base,
                       size_t peer_bytes)
    : sink_(sink), domain_(domain), my_rank_(my_rank), peer_(peer), peer_base_(peer_base), peer_bytes_(peer_bytes) {
  peer_header_ = static_cast<SegmentHeader*>(peer_base);
  uint64_t ctrl = 0, bulk = 0, claims = 0;
  if (!ShmDomain::ring_offsets(peer_base, my_rank, &ctrl, &bulk, &claims))
    throw PeerSetupError(peer, "rank " + std::to_string(peer) + "'s segment has no ring for rank " +
                                   std::to_string(my_rank));
  out_ctrl_ = Ring(static_cast<char*>(peer_base) + ctrl);
  out_bulk_ = Ring(static_cast<char*>(peer_base) + bulk);
  out_claims_ = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(peer_base) + claims);
  if (!ShmDomain::ring_offsets(domain.inbox_base(), peer, &ctrl, &bulk, &claims))
    throw TransportError("internal: no inbox ring for rank " + std::to_string(peer));
  in_ctrl_ = Ring(static_cast<char*>(domain.inbox_base()) + ctrl);
  in_bulk_ = Ring(static_cast<char*>(domain.inbox_base()) + bulk);
  in_claims_ = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(domain.inbox_base()) + claims);
  claim_gen_.assign(kClaimSlots, 0);
  for (uint32_t i = kClaimSlots; i > 0; --i) free_claims_.push_back(i - 1);
  // Probe: read the magic number at the start of the peer's segment through its own address
  // space. Success proves the kernel lets us read the peer's memory and that the pid names
  // the right process (same pid namespace).
  peer_pid_ = peer_header_->owner_pid;
  if (!domain.options().single_copy) {
    pull_refused_ = "single copy disabled by configuration";
  } else {
    uint64_t magic = 0;
    std::string error = copy_remote(peer_pid_, false, reinterpret_cast<uint8_t*>(&magic), peer_header_->owner_base, 8);
    if (!error.empty())
      pull_refused_ = "cross-memory attach to rank " + std::to_string(peer) + " (pid " + std::to_string(peer_pid_) +
                      ") refused: " + error + " (ptrace policy, seccomp or a separate pid namespace)";
    else if (magic != peer_header_->magic)
      pull_refused_ = "pid " + std::to_string(peer_pid_) + " of rank " + std::to_string(peer) +
                      " is a different process here (separate pid namespaces)";
    else
      can_pull_ = true;
  }
}

ShmChannel::~ShmChannel() { munmap(peer_base_, peer_bytes_); }

uint64_t ShmChannel::eager_limit() const { return out_ctrl_.slot_payload() - sizeof(CtrlHeader); }

// A caller that stopped polling this recently is most likely about to poll again (it is
// between two calls of a loop); waking a thread for it would mostly cost a context switch.
constexpr int64_t kRecentPollNs = 50 * 1000;

bool ShmChannel::peer_polled_recently() const {
  return monotonic_ns() - peer_header_->poll_ended_ns.load(std::memory_order_relaxed) < kRecentPollNs;
}

void ShmChannel::ring_peer_doorbell(bool wake_always, bool eager) {
  peer_header_->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (peer_header_->sleepers.load(std::memory_order_seq_cst) == 0) return;
  // Waking a receive thread costs a system call here and, on few cores, a context switch
  // that preempts someone. So it happens at once only for bulk chunks (more threads copy in
  // parallel). Never while a caller polls the peer's inbox (it consumes the message itself).
  // Messages that need no answer (`eager`) wake only a peer caller asleep in wait/wait_any:
  // otherwise the peer's next call into the library consumes them. Handshake messages (Rts,
  // Cts) wake at once unless the peer polled a moment ago; then the wake is owed, and
  // nudge() delivers it if the message is still unconsumed once that moment has passed.
  // A caller asleep in wait/wait_any will not poll again by itself, however recently it polled.
  bool wake = wake_always;
  if (!wake && peer_header_->pollers.load(std::memory_order_seq_cst) == 0) {
    const bool peer_blocked = peer_header_->blocked.load(std::memory_order_seq_cst) > 0;
    if (eager || peer_blocked) {
      wake = peer_blocked;
    } else if (peer_polled_recently()) {
      owed_wake_.store(true, std::memory_order_relaxed);
    } else {
      wake = true;
    }
  }
  if (wake) {
    domain_.count_wakeup();
    futex_wake(&peer_header_->doorbell, 1);
  }
}

void ShmChannel::nudge() {
  if (!owed_wake_.load(std::memory_order_relaxed)) return;
  if (!out_ctrl_.has_published() || gone_.load()) {
    owed_wake_.store(false, std::memory_order_relaxed);  // consumed meanwhile
    return;
  }
  if (peer_header_->pollers.load(std::memory_order_seq_cst) > 0 ||
      (peer_polled_recently() && peer_header_->blocked.load(std::memory_order_seq_cst) == 0))
    return;
  owed_wake_.store(false, std::memory_order_relaxed);
  peer_header_->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (peer_header_->sleepers.load(std::memory_order_seq_cst) > 0) {
    domain_.count_wakeup();
    futex_wake(&peer_header_->doorbell, 1);
  }
}

bool ShmChannel::try_push_ctrl(const CtrlHeader& h, const void* payload) {
  uint32_t pos = 0;
  if (!out_ctrl_.try_claim(&pos)) return false;
  char* slot = out_ctrl_.payload(pos);
  const size_t header_bytes = write_compact_header(slot, h);
  if (h.payload_bytes) std::memcpy(slot + header_bytes, payload, h.payload_bytes);
  out_ctrl_.publish(pos, static_cast<uint32_t>(header_bytes + h.payload_bytes));
  // Pulled, Nack and DeviceDone only settle a request the peer already posted, and a DeviceRts
  // carries all a receive needs: like an eager message, the peer's next call consumes them.
  const auto type = static_cast<MsgType>(h.type);
  ring_peer_doorbell(false, type == MsgType::Eager || type == MsgType::Pulled || type == MsgType::Nack ||
                                type == MsgType::DeviceRts || type == MsgType::DeviceDone);
  return true;
}

void ShmChannel::post_ctrl(const CtrlHeader& h, const void* payload) {
  if (sizeof(h) + h.payload_bytes > out_ctrl_.slot_payload())
    throw TransportError("internal: control message larger than a slot");
  if (gone_.load()) return;
  std::lock_guard<std::mutex> lk(produce_mu_);
  // Anything already queued must go first, or messages with one tag could overtake.
  if (!queued_.empty()) flush_locked();
  if (queued_.empty() && try_push_ctrl(h, payload)) return;
  has_queued_.store(true, std::memory_order_relaxed);
  std::vector<uint8_t> copy;
  if (!spare_queued_.empty()) {
    copy = std::move(spare_queued_.back());
    spare_queued_.pop_back();
  }
  copy.resize(sizeof(h) + h.payload_bytes);
  std::memcpy(copy.data(), &h, sizeof(h));
  if (h.payload_bytes) std::memcpy(copy.data() + sizeof(h), payload, h.payload_bytes);
  queued_.push_back(std::move(copy));
}

bool ShmChannel::flush() {
  std::lock_guard<std::mutex> lk(produce_mu_);
  return flush_locked();
}

bool ShmChannel::flush_locked() {
  if (gone_.load()) queued_.clear();
  while (!queued_.empty()) {
    auto& m = queued_.front();
    CtrlHeader h;
    std::memcpy(&h, m.data(), sizeof(h));
    if (!try_push_ctrl(h, m.data() + sizeof(h))) return true;
    if (spare_queued_.size() < kSparePayloads) spare_queued_.push_back(std::move(m));
    queued_.pop_front();
  }
  has_queued_.store(false, std::memory_order_relaxed);
  return false;
}

void ShmChannel::start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader&) {
  auto job = std::make_shared<SendJob>();
  job->req = send;
  job->channel = this;
  job->recv_id = recv_id;
  job->chunk = out_bulk_.slot_payload() - sizeof(CtrlHeader);
  sink_.enqueue_send_job(std::move(job));
}

std::string ShmChannel::push_chunk(SendJob& job, uint64_t offset, uint64_t bytes) {
  uint32_t pos = 0;
  auto& req = *job.req;
  if (!out_bulk_.claim_blocking(&pos, [&] { return !gone_.load() && !req.aborted.load(); }))
    return gone_.load() ? "rank " + std::to_string(peer_) + " went away during the transfer" : "";
  // Once claimed the slot must be published, even for an aborted request, or the ring stalls;
  // the receiver drops chunks whose request no longer exists.
  char* slot = out_bulk_.payload(pos);
  CtrlHeader h;
  h.type = static_cast<uint32_t>(MsgType::Data);
  h.send_id = req.id;
  h.recv_id = job.recv_id;
  h.offset = offset;
  h.nbytes = bytes;
  h.payload_bytes = static_cast<uint32_t>(bytes);
  std::memcpy(slot, &h, sizeof(h));
  std::memcpy(slot + sizeof(h), req.data + offset, bytes);
  out_bulk_.publish(pos, static_cast<uint32_t>(sizeof(h) + bytes));
  ring_peer_doorbell(true, false);
  return "";
}

bool ShmChannel::offer(Request& req, CtrlHeader& msg) {
  // Offered whenever single copy is configured: the peer knows whether it may copy, and
  // answers otherwise (Cts: two copies through the ring) when it may not.
  if (!domain_.options().single_copy || free_claims_.empty() || req.nbytes == 0 || gone_.load()) return false;
  const uint32_t slot = free_claims_.back();
  free_claims_.pop_back();
  const uint32_t gen = claim_gen_[slot] = (claim_gen_[slot] + 1) & 0x1fffffffu;
  out_claims_[slot].store(claim_word(gen, kClaimOffered), std::memory_order_release);
  req.offer_slot = static_cast<int32_t>(slot);
  req.offer_gen = gen;
  msg.remote_addr = reinterpret_cast<uintptr_t>(req.data);
  msg.token = slot + 1;
  msg.rkey = gen;
  return true;
}

int ShmChannel::claim(const CtrlHeader& msg) {
  if (msg.token == 0 || msg.token > kClaimSlots || !can_pull_) return 0;
  uint32_t expected = claim_word(msg.rkey, kClaimOffered);
  return in_claims_[msg.token - 1].compare_exchange_strong(expected, claim_word(msg.rkey, kClaimPulling)) ? 1 : -1;
}

void ShmChannel::claim_over(const Request& req) {
  if (req.claim_slot < 0) return;
  in_claims_[req.claim_slot].store(claim_word(req.claim_gen, kClaimOver), std::memory_order_release);
}

bool ShmChannel::withdraw(Request& req) {
  if (req.offer_slot < 0) return true;
  uint32_t expected = claim_word(req.offer_gen, kClaimOffered);
  if (!out_claims_[req.offer_slot].compare_exchange_strong(expected, claim_word(req.offer_gen, kClaimAbandoned)))
    return false;
  release_offer(req);
  return true;
}

void ShmChannel::release_offer(Request& req) {
  if (req.offer_slot < 0) return;
  free_claims_.push_back(static_cast<uint32_t>(req.offer_slot));
  req.offer_slot = -1;
}

bool ShmChannel::offer_in_use(const Request& req) {
  if (req.offer_slot < 0) return false;
  uint32_t w = out_claims_[req.offer_slot].load(std::memory_order_acquire);
  return w == claim_word(req.offer_gen, kClaimPulling) || w == claim_word(req.offer_gen, kClaimOver);
}

std::string ShmChannel::read(uint8_t* dst, uint64_t remote_addr, uint64_t bytes) {
  if (gone_.load()) return "rank " + std::to_string(peer_) + " went away during the transfer";
  int err = 0;
  std::string error = copy_remote(peer_pid_, false, dst, remote_addr, bytes, &err);
  if (err == ESRCH) vanished_.store(true);  // the process is gone: the monitor may not have seen it yet
  return error.empty() ? "" : "reading rank " + std::to_string(peer_) + "'s buffer failed: " + error;
}

std::string ShmChannel::write(uint64_t remote_addr, const uint8_t* src, uint64_t bytes) {
  if (gone_.load()) return "rank " + std::to_string(peer_) + " went away during the transfer";
  int err = 0;
  std::string error = copy_remote(peer_pid_, true, const_cast<uint8_t*>(src), remote_addr, bytes, &err);
  if (err == ESRCH) vanished_.store(true);
  return error.empty() ? "" : "writing rank " + std::to_string(peer_) + "'s buffer failed: " + error;
}

std::string ShmChannel::copy_path() const {
  return can_pull_ ? "single copy (cross-memory attach)" : "two copies through the ring (" + pull_refused_ + ")";
}

bool ShmChannel::inbound_pending() {
  return consuming_.load(std::memory_order_seq_cst) > 0 || in_ctrl_.has_published() || in_bulk_.has_published();
}

void ShmChannel::peer_gone() {
  gone_.store(true);
  out_bulk_.wake_producers();
  out_ctrl_.wake_producers();
}

bool ShmChannel::poll_ctrl() {
  if (!in_ctrl_.has_published()) return false;  // two plain loads: an idle spin stays cheap
  std::unique_lock<std::mutex> lk(consume_mu_, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  consuming_.fetch_add(1, std::memory_order_seq_cst);
  bool any = false;
  // A small batch per turn keeps the lock hand-over cost low without starving bulk data.
  for (int i = 0; i < 16; ++i) {
    uint32_t pos = 0;
    if (!in_ctrl_.try_take(&pos)) break;
    const char* slot = in_ctrl_.payload(pos);
    CtrlHeader h;
    const size_t header_bytes = read_compact_header(slot, h);
    sink_.on_ctrl(peer_, h, reinterpret_cast<const uint8_t*>(slot + header_bytes));
    in_ctrl_.release(pos);
    any = true;
  }
  consuming_.fetch_sub(1, std::memory_order_seq_cst);
  return any;
}

bool ShmChannel::poll_bulk() {
  if (!in_bulk_.has_published()) return false;
  uint32_t pos = 0;
  consuming_.fetch_add(1, std::memory_order_seq_cst);
  if (!in_bulk_.try_take(&pos)) {
    consuming_.fetch_sub(1, std::memory_order_seq_cst);
    return false;
  }
  const char* slot = in_bulk_.payload(pos);
  CtrlHeader h;
  std::memcpy(&h, slot, sizeof(h));
  DataLease lease = sink_.data_begin(peer_, h);
  if (lease.dst) std::memcpy(lease.dst, slot + sizeof(h), h.nbytes);
  sink_.data_end(lease, h.nbytes);
  in_bulk_.release(pos);
  consuming_.fetch_sub(1, std::memory_order_seq_cst);
  return true;
}

// ---------------------------------------------------------------------------------------- domain

ShmDomain::ShmDomain(EngineSink& sink, const ShmOptions& options, const std::string& job_id, int my_rank,
                     int world_size, const std::vector<int>& local_peers)
    : sink_(sink), options_(options), my_rank_(my_rank), world_size_(world_size) {
  const size_t table = align_up(sizeof(uint64_t) * 3 * world_size, 64);
  const size_t claim_bytes = align_up(sizeof(uint32_t) * kClaimSlots, 4096);
  const size_t ctrl_bytes = align_up(Ring::bytes_needed(options.ctrl_slots, options.ctrl_slot_payload), 4096);
  const size_t bulk_bytes = align_up(Ring::bytes_needed(options.bulk_slots, options.bulk_slot_payload), 4096);
  const size_t rings_start = align_up(sizeof(SegmentHeader) + table, 4096);
  bytes_ = rings_start + local_peers.size() * (ctrl_bytes + bulk_bytes + claim_bytes);
  if (options.single_copy) allow_peer_reads();

  const std::string name = shm_segment_name(job_id, my_rank);
  fd_ = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd_ < 0)
    throw TransportError(errno_text("cannot create shared-memory segment " + name +
                                    (errno == EEXIST ? " (another endpoint with this job id and rank exists)" : "")));
  // Unlink before anyone else can learn the name: peers get the descriptor instead, so a
  // crash at any later point cannot leave the name behind in /dev/shm.
  shm_unlink(name.c_str());
  if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
    int err = errno;
    ::close(fd_);
    throw TransportError(errno_text("cannot size shared-memory segment (is /dev/shm full?)", err));
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base_ == MAP_FAILED) {
    int err = errno;
    ::close(fd_);
    throw TransportError(errno_text("cannot map shared-memory segment", err));
  }
  header_ = new (base_) SegmentHeader();
  header_->magic = kSegmentMagic;
  header_->version = kSegmentVersion;
  header_->owner_rank = my_rank;
  header_->world_size = world_size;
  header_->total_bytes = bytes_;
  header_->owner_pid = static_cast<int32_t>(getpid());
  header_->owner_base = reinterpret_cast<uintptr_t>(base_);
  header_->doorbell.store(0);
  header_->sleepers.store(0);
  header_->pollers.store(0);
  header_->blocked.store(0);
  header_->poll_ended_ns.store(0);
  uint64_t* offsets = ring_table(base_);
  size_t at = rings_start;
  for (int peer : local_peers) {
    Ring::initialize(static_cast<char*>(base_) + at, options.ctrl_slots, options.ctrl_slot_payload);
    offsets[3 * peer] = at;
    at += ctrl_bytes;
    Ring::initialize(static_cast<char*>(base_) + at, options.bulk_slots, options.bulk_slot_payload);
    offsets[3 * peer + 1] = at;
    at += bulk_bytes;
    auto* claims = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base_) + at);
    for (uint32_t i = 0; i < kClaimSlots; ++i) new (claims + i) std::atomic<uint32_t>(kClaimFree);
    offsets[3 * peer + 2] = at;
    at += claim_bytes;
  }
}

ShmDomain::~ShmDomain() {
  stop();
  channels_.clear();
  if (base_ && base_ != MAP_FAILED) munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

bool ShmDomain::ring_offsets(void* base, int source, uint64_t* ctrl, uint64_t* bulk, uint64_t* claims) {
  auto* h = static_cast<SegmentHeader*>(base);
  if (source < 0 || source >= h->world_size) return false;
  *ctrl = ring_table(base)[3 * source];
  *bulk = ring_table(base)[3 * source + 1];
  *claims = ring_table(base)[3 * source + 2];
  return *ctrl != 0 && *bulk != 0 && *claims != 0;
}

ShmChannel* ShmDomain::attach_peer(int peer, int fd) {
  struct stat st{};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(SegmentHeader)) {
    ::close(fd);
    throw PeerSetupError(peer, "rank " + std::to_string(peer) + " handed over an invalid shared-memory segment");
  }
  size_t bytes = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the memory alive
  if (base == MAP_FAILED) throw PeerSetupError(peer, errno_text("cannot map rank " + std::to_string(peer) + "'s segment"));
  auto* h = static_cast<SegmentHeader*>(base);
  if (h->magic != kSegmentMagic || h->version != kSegmentVersion || h->owner_rank != peer ||
      h->world_size != world_size_) {
    munmap(base, bytes);
    throw PeerSetupError(peer, "rank " + std::to_string(peer) +
                                   "'s shared-memory segment has an unexpected layout (different library version?)");
  }
  try {
    channels_.push_back(std::make_unique<ShmChannel>(sink_, *this, my_rank_, peer, base, bytes));
  } catch (...) {
    munmap(base, bytes);
    throw;
  }
  return channels_.back().get();
}

void ShmDomain::start(int recv_threads) {
  if (channels_.empty()) return;
  for (int i = 0; i < recv_threads; ++i) threads_.emplace_back([this] { recv_loop(); });
}

void ShmDomain::stop() {
  stop_.store(true);
  if (header_) {
    header_->doorbell.fetch_add(1);
    futex_wake(&header_->doorbell, INT_MAX);
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void ShmDomain::nudge_peers() {
  for (auto& ch : channels_) {
    ch->flush_if_queued();
    ch->nudge();
  }
}

bool ShmDomain::progress_once() {
  bool did = false;
  for (auto& ch : channels_) {
    did |= ch->poll_ctrl();
    did |= ch->poll_bulk();
  }
  return did;
}

void ShmDomain::end_polling() {
  header_->poll_ended_ns.store(monotonic_ns(), std::memory_order_relaxed);
  header_->pollers.fetch_sub(1, std::memory_order_seq_cst);
  // A producer that saw us polling did not ring; its message was published before that, so
  // one more pass after leaving catches it.
  while (progress_once()) {
  }
}

void ShmDomain::begin_blocking() {
  header_->blocked.fetch_add(1, std::memory_order_seq_cst);
  // A producer that published before seeing us blocked did not wake anyone: consume it now.
  while (progress_once()) {
  }
}

void ShmDomain::recv_loop() {
  try {
    recv_body();
  } catch (const std::exception& e) {
    sink_.on_internal_error("shared-memory receive thread", e.what());
  }
}

void ShmDomain::recv_body() {
  const auto spin = std::chrono::microseconds(options_.spin_us);
  size_t start = 0;
  auto idle_since = Clock::now();
  uint32_t idle_rounds = 0;
  const size_t n = channels_.size();
  while (!stop_.load(std::memory_order_relaxed)) {
    // While a caller busy-polls the inbox it consumes the control messages itself (and does
    // the single copies they start): this thread then only helps with bulk chunks, which
    // producers always ring for. Taking control messages too would leave the caller spinning
    // on the consumer lock beside a thread doing its work, three busy threads where two do.
    const bool caller_polls = header_->pollers.load(std::memory_order_relaxed) > 0;
    bool did = false;
    for (size_t i = 0; i < n; ++i) {
      ShmChannel* ch = channels_[(start + i) % n].get();
      if (!caller_polls) did |= ch->poll_ctrl();
      did |= ch->poll_bulk();
    }
    ++start;
    if (did) {
      idle_since = Clock::now();
      continue;
    }
    if (!caller_polls && Clock::now() - idle_since < spin) {
      if (++idle_rounds % 32 == 0) sched_yield(); else cpu_relax();  // as Engine::spin_until
      continue;
    }
    // Event-count sleep: read the doorbell, announce ourselves, re-check, then wait on the
    // value read, so a publish between the check and the wait is never missed. Beside a
    // polling caller the sleep is short: the caller may stop polling without a new message.
    uint32_t bell = header_->doorbell.load(std::memory_order_seq_cst);
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    bool pending = false;
    for (auto& ch : channels_) pending = pending || (caller_polls ? ch->bulk_pending() : ch->inbound_pending());
    if (!pending && !stop_.load())
      futex_wait(&header_->doorbell, bell, caller_polls ? 1000 * 1000 : 50 * 1000 * 1000);
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    idle_since = Clock::now();
  }
}

}  // namespace strdma
