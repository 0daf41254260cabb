// TCP link: frame reader, chunk-interleaving writer, goodbye handshake.
#include "tcp_transport.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include "bootstrap.h"

namespace strdma {
namespace {

bool writev_full(int fd, struct iovec* iov, int count) {
  while (count > 0) {
    struct msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    auto left = static_cast<size_t>(w);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

bool discard(int fd, uint64_t n) {
  char buf[65536];
  while (n > 0) {
    size_t take = n < sizeof(buf) ? static_cast<size_t>(n) : sizeof(buf);
    if (!read_full(fd, buf, take)) return false;
    n -= take;
  }
  return true;
}

}  // namespace

TcpLink::TcpLink(EngineSink& sink, int my_rank, int peer, int fd, uint64_t chunk_bytes, uint64_t eager_bytes,
                 bool carries_data)
    : sink_(sink),
      my_rank_(my_rank),
      peer_(peer),
      fd_(fd),
      chunk_bytes_(chunk_bytes),
      eager_bytes_(eager_bytes),
      carries_data_(carries_data) {}

TcpLink::~TcpLink() {
  close(0);
  if (fd_ >= 0) ::close(fd_);
}

void TcpLink::start() {
  reader_ = std::thread([this] { reader_loop(); });
  if (carries_data_) writer_ = std::thread([this] { writer_loop(); });
}

bool TcpLink::write_frame(const CtrlHeader& h, const void* payload, size_t n) {
  struct iovec iov[2] = {{const_cast<CtrlHeader*>(&h), sizeof(h)}, {const_cast<void*>(payload), n}};
  return writev_full(fd_, iov, n ? 2 : 1);
}

void TcpLink::post_ctrl(const CtrlHeader& h, const void* payload) {
  std::vector<uint8_t> frame(sizeof(h) + h.payload_bytes);
  std::memcpy(frame.data(), &h, sizeof(h));
  if (h.payload_bytes) std::memcpy(frame.data() + sizeof(h), payload, h.payload_bytes);
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_ || stop_writer_) return;
  frames_.push_back(std::move(frame));
  cv_.notify_one();
}

void TcpLink::start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader&) {
  auto job = std::make_shared<SendJob>();
  job->req = send;
  job->channel = this;
  job->recv_id = recv_id;
  job->chunk = chunk_bytes_;
  std::lock_guard<std::mutex> lk(mu_);
  jobs_.push_back(std::move(job));
  cv_.notify_one();
}

void TcpLink::peer_gone() {
  std::lock_guard<std::mutex> lk(mu_);
  broken_ = true;
  cv_.notify_all();
}

void TcpLink::writer_loop() {
  try {
    writer_body();
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      broken_ = true;
      cv_.notify_all();
    }
    sink_.on_internal_error("TCP writer for rank " + std::to_string(peer_), e.what());
  }
}

void TcpLink::writer_body() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_writer_ || broken_ || !frames_.empty() || !jobs_.empty(); });
    if (!frames_.empty() && !broken_) {
      std::vector<uint8_t> frame = std::move(frames_.front());
      frames_.pop_front();
      lk.unlock();
      struct iovec iov{frame.data(), frame.size()};
      bool ok = writev_full(fd_, &iov, 1);
      lk.lock();
      CtrlHeader h;
      std::memcpy(&h, frame.data(), sizeof(h));
      if (!ok) broken_ = true;
      if (h.type == static_cast<uint32_t>(MsgType::Bye)) {
        bye_sent_ = true;
        cv_.notify_all();
        return;
      }
      continue;
    }
    if (!jobs_.empty()) {
      auto job = jobs_.front();
      jobs_.pop_front();
      uint64_t offset = job->next_offset;
      uint64_t bytes = std::min<uint64_t>(job->chunk, job->req->nbytes - offset);
      job->next_offset += bytes;
      if (job->next_offset < job->req->nbytes) jobs_.push_back(job);
      bool broken = broken_;
      lk.unlock();
      if (sink_.send_chunk_begin(job->req)) {
        std::string error;
        if (broken) {
          error = "connection to rank " + std::to_string(peer_) + " is broken";
        } else {
          CtrlHeader h;
          h.type = static_cast<uint32_t>(MsgType::Data);
          h.send_id = job->req->id;
          h.recv_id = job->recv_id;
          h.offset = offset;
          h.nbytes = bytes;
          h.payload_bytes = static_cast<uint32_t>(bytes);
          if (!write_frame(h, job->req->data + offset, bytes))
            error = "connection to rank " + std::to_string(peer_) + " lost while sending";
        }
        sink_.send_chunk_end(job->req, bytes, error);
      }
      lk.lock();
      continue;
    }
    if (stop_writer_ || broken_) return;
  }
}

void TcpLink::reader_loop() {
  std::string problem;
  bool graceful = false;
  try {
    graceful = read_frames(&problem);
  } catch (const std::exception& e) {
    problem = std::string("internal error in the TCP reader: ") + e.what();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    reader_done_ = true;
    // After the peer's goodbye nothing more may be sent to it; dropping the queue also lets
    // our writer exit.
    if (graceful) stop_writer_ = true;
    cv_.notify_all();
  }
  // Closing our sending side tells a departing peer that its goodbye arrived.
  if (graceful) ::shutdown(fd_, SHUT_WR);
  const std::string who = "rank " + std::to_string(peer_);
  sink_.on_peer_gone(peer_, graceful,
                     graceful ? who + " closed its endpoint"
                     : problem.empty() ? "lost the connection to " + who + " (the process died or the network failed)"
                                       : "connection to " + who + " dropped: " + problem);
}

bool TcpLink::read_frames(std::string* problem) {
  std::vector<uint8_t> payload;
  for (;;) {
    CtrlHeader h;
    if (!read_full(fd_, &h, sizeof(h))) return false;
    auto type = static_cast<MsgType>(h.type);
    // Control payloads are bounded by the eager limit; anything larger is a corrupt stream
    // (or a different program on the port), and must not turn into a huge allocation.
    if (type != MsgType::Data && h.payload_bytes > eager_bytes_ + 65536) {
      *problem = "protocol error: control frame of " + std::to_string(h.payload_bytes) + " bytes";
      return false;
    }
    if (type == MsgType::Bye) return true;
    if (type == MsgType::Data) {
      DataLease lease = sink_.data_begin(peer_, h);
      bool ok = lease.dst ? read_full(fd_, lease.dst, h.nbytes) : discard(fd_, h.nbytes);
      sink_.data_end(lease, ok ? h.nbytes : 0);
      if (!ok) return false;
      continue;
    }
    payload.resize(h.payload_bytes);
    if (h.payload_bytes && !read_full(fd_, payload.data(), h.payload_bytes)) return false;
    sink_.on_ctrl(peer_, h, payload.data());
  }
}

void TcpLink::close(double grace_s) {
  if (fd_ < 0) return;
  const auto deadline = deadline_after(grace_s);
  if (reader_.joinable()) {
    CtrlHeader bye;
    bye.type = static_cast<uint32_t>(MsgType::Bye);
    if (carries_data_) {
      std::unique_lock<std::mutex> lk(mu_);
      if (!reader_done_ && !broken_) {
        frames_.push_back(std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&bye),
                                               reinterpret_cast<uint8_t*>(&bye) + sizeof(bye)));
        cv_.notify_all();
        cv_.wait_until(lk, deadline, [&] { return bye_sent_ || broken_ || reader_done_; });
      }
    } else {
      std::lock_guard<std::mutex> lk(write_mu_);
      write_frame(bye, nullptr, 0);
    }
    ::shutdown(fd_, SHUT_WR);
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_until(lk, deadline, [&] { return reader_done_; });
    stop_writer_ = true;
    cv_.notify_all();
  }
  // Unblocks a reader or writer still inside a socket call.
  ::shutdown(fd_, SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

}  // namespace strdma
