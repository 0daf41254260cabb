// Shared-memory transport: inbox segment, per-peer rings, receive threads.
#include "shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

namespace strdma {
namespace {

constexpr uint64_t kSegmentMagic = 0x31414d4453525453ULL;  // "STRSDMA1"
constexpr uint32_t kSegmentVersion = 1;

uint64_t* ring_table(void* base) {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(base) + sizeof(SegmentHeader));
}

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

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
  uint64_t ctrl = 0, bulk = 0;
  if (!ShmDomain::ring_offsets(peer_base, my_rank, &ctrl, &bulk))
    throw PeerSetupError(peer, "rank " + std::to_string(peer) + "'s segment has no ring for rank " +
                                   std::to_string(my_rank));
  out_ctrl_ = Ring(static_cast<char*>(peer_base) + ctrl);
  out_bulk_ = Ring(static_cast<char*>(peer_base) + bulk);
  if (!ShmDomain::ring_offsets(domain.inbox_base(), peer, &ctrl, &bulk))
    throw TransportError("internal: no inbox ring for rank " + std::to_string(peer));
  in_ctrl_ = Ring(static_cast<char*>(domain.inbox_base()) + ctrl);
  in_bulk_ = Ring(static_cast<char*>(domain.inbox_base()) + bulk);
}

ShmChannel::~ShmChannel() { munmap(peer_base_, peer_bytes_); }

uint64_t ShmChannel::eager_limit() const { return out_ctrl_.slot_payload() - sizeof(CtrlHeader); }

void ShmChannel::ring_peer_doorbell(bool bulk) {
  peer_header_->doorbell.fetch_add(1, std::memory_order_seq_cst);
  // A polling peer picks up control messages itself, so waking a receive thread for them
  // only costs a syscall and a context switch. Bulk chunks are worth a wake-up even then:
  // more threads copy out of the ring in parallel.
  if (peer_header_->sleepers.load(std::memory_order_seq_cst) > 0 &&
      (bulk || peer_header_->pollers.load(std::memory_order_seq_cst) == 0))
    futex_wake(&peer_header_->doorbell, 1);
}

bool ShmChannel::try_push_ctrl(const CtrlHeader& h, const void* payload) {
  uint32_t pos = 0;
  if (!out_ctrl_.try_claim(&pos)) return false;
  char* slot = out_ctrl_.payload(pos);
  std::memcpy(slot, &h, sizeof(h));
  if (h.payload_bytes) std::memcpy(slot + sizeof(h), payload, h.payload_bytes);
  out_ctrl_.publish(pos, static_cast<uint32_t>(sizeof(h) + h.payload_bytes));
  ring_peer_doorbell(false);
  return true;
}

void ShmChannel::post_ctrl(const CtrlHeader& h, const void* payload) {
  if (sizeof(h) + h.payload_bytes > out_ctrl_.slot_payload())
    throw TransportError("internal: control message larger than a slot");
  if (gone_.load()) return;
  std::lock_guard<std::mutex> lk(produce_mu_);
  // Anything already queued must go first, or messages with one tag could overtake.
  if (queued_.empty() && try_push_ctrl(h, payload)) return;
  std::vector<uint8_t> copy(sizeof(h) + h.payload_bytes);
  std::memcpy(copy.data(), &h, sizeof(h));
  if (h.payload_bytes) std::memcpy(copy.data() + sizeof(h), payload, h.payload_bytes);
  queued_.push_back(std::move(copy));
}

bool ShmChannel::flush() {
  std::lock_guard<std::mutex> lk(produce_mu_);
  if (gone_.load()) queued_.clear();
  while (!queued_.empty()) {
    auto& m = queued_.front();
    CtrlHeader h;
    std::memcpy(&h, m.data(), sizeof(h));
    if (!try_push_ctrl(h, m.data() + sizeof(h))) return true;
    queued_.pop_front();
  }
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
  ring_peer_doorbell(true);
  return "";
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
    std::memcpy(&h, slot, sizeof(h));
    sink_.on_ctrl(peer_, h, reinterpret_cast<const uint8_t*>(slot + sizeof(h)));
    in_ctrl_.release(pos);
    any = true;
  }
  consuming_.fetch_sub(1, std::memory_order_seq_cst);
  return any;
}

bool ShmChannel::poll_bulk() {
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
  const size_t table = align_up(sizeof(uint64_t) * 2 * world_size, 64);
  const size_t ctrl_bytes = align_up(Ring::bytes_needed(options.ctrl_slots, options.ctrl_slot_payload), 4096);
  const size_t bulk_bytes = align_up(Ring::bytes_needed(options.bulk_slots, options.bulk_slot_payload), 4096);
  const size_t rings_start = align_up(sizeof(SegmentHeader) + table, 4096);
  bytes_ = rings_start + local_peers.size() * (ctrl_bytes + bulk_bytes);

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
  header_->doorbell.store(0);
  header_->sleepers.store(0);
  header_->pollers.store(0);
  uint64_t* offsets = ring_table(base_);
  size_t at = rings_start;
  for (int peer : local_peers) {
    Ring::initialize(static_cast<char*>(base_) + at, options.ctrl_slots, options.ctrl_slot_payload);
    offsets[2 * peer] = at;
    at += ctrl_bytes;
    Ring::initialize(static_cast<char*>(base_) + at, options.bulk_slots, options.bulk_slot_payload);
    offsets[2 * peer + 1] = at;
    at += bulk_bytes;
  }
}

ShmDomain::~ShmDomain() {
  stop();
  channels_.clear();
  if (base_ && base_ != MAP_FAILED) munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

bool ShmDomain::ring_offsets(void* base, int source, uint64_t* ctrl, uint64_t* bulk) {
  auto* h = static_cast<SegmentHeader*>(base);
  if (source < 0 || source >= h->world_size) return false;
  *ctrl = ring_table(base)[2 * source];
  *bulk = ring_table(base)[2 * source + 1];
  return *ctrl != 0 && *bulk != 0;
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

bool ShmDomain::progress_once() {
  bool did = false;
  for (auto& ch : channels_) {
    did |= ch->poll_ctrl();
    did |= ch->poll_bulk();
  }
  return did;
}

void ShmDomain::end_polling() {
  header_->pollers.fetch_sub(1, std::memory_order_seq_cst);
  // A producer that saw us polling did not ring; its message was published before that, so
  // one more pass after leaving catches it.
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
  const size_t n = channels_.size();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool did = false;
    for (size_t i = 0; i < n; ++i) {
      ShmChannel* ch = channels_[(start + i) % n].get();
      did |= ch->poll_ctrl();
      did |= ch->poll_bulk();
    }
    ++start;
    if (did) {
      idle_since = Clock::now();
      continue;
    }
    if (Clock::now() - idle_since < spin) {
      cpu_relax();
      continue;
    }
    // Event-count sleep: read the doorbell, announce ourselves, re-check, then wait on the
    // value read, so a publish between the check and the wait is never missed.
    uint32_t bell = header_->doorbell.load(std::memory_order_seq_cst);
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    bool pending = false;
    for (auto& ch : channels_) pending = pending || ch->inbound_pending();
    if (!pending && !stop_.load()) futex_wait(&header_->doorbell, bell, 50 * 1000 * 1000);
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    idle_since = Clock::now();
  }
}

}  // namespace strdma
