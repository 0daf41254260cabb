// TCP link to one peer. Every peer pair has one: it carried the handshake, and its EOF is how a
// dead peer is noticed (the kernel closes a killed process's sockets). For peers on other
// hosts it is also the transport: control frames and Data chunks share the stream, written by
// one writer thread that interleaves chunks of different transfers so a small message is not
// stuck behind a large one.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "transport.h"

namespace strdma {

class TcpLink : public Channel {
 public:
  // `carries_data`: this link is the peer's transport (needs the writer thread).
  TcpLink(EngineSink& sink, int my_rank, int peer, int fd, uint64_t chunk_bytes, uint64_t eager_bytes,
          bool carries_data);
  ~TcpLink() override;

  void start();
  // Says goodbye and waits (bounded) for the peer to acknowledge by closing its side.
  void close(double grace_s);

  const char* kind() const override { return "tcp"; }
  uint64_t eager_limit() const override { return eager_bytes_; }
  void post_ctrl(const CtrlHeader& h, const void* payload) override;
  void start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader& cts) override;
  void peer_gone() override;

 private:
  void reader_loop();
  bool read_frames(std::string* problem);  // true after a goodbye, false on EOF or error
  void writer_loop();
  void writer_body();
  bool write_frame(const CtrlHeader& h, const void* payload, size_t n);

  EngineSink& sink_;
  int my_rank_;
  int peer_;
  int fd_;
  uint64_t chunk_bytes_;
  uint64_t eager_bytes_;
  bool carries_data_;
  std::thread reader_, writer_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<uint8_t>> frames_;  // control frames, sent before any chunk
  std::deque<std::shared_ptr<SendJob>> jobs_;  // round-robin, one chunk per turn
  bool stop_writer_ = false;
  bool bye_sent_ = false;
  bool reader_done_ = false;
  bool broken_ = false;
  std::mutex write_mu_;  // the link's only writer when no writer thread exists
};

}  // namespace strdma
