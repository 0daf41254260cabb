// Engine: sends whose bytes stay in the sender's GPU memory (CUDA IPC). The core only carries
// the caller's descriptor (DeviceRts) and the receiver's answer (DeviceDone, or a Nack); the copy
// itself runs in the receiving process's caller (megatron/shm_tensor_rdma/cuda_ipc.py). Matching a
// DeviceRts to a receive is the common path in matching.cpp.
#include <algorithm>

#include "engine.h"

namespace strdma {

uint64_t Engine::isend_device(const std::string& descriptor, uint64_t nbytes, uint32_t dtype,
                              const std::vector<int64_t>& shape, int dst, int64_t tag, double timeout_s) {
  check_ready("isend", dst, "dst");
  Channel* ch = channels_[dst];
  if (std::string(ch->kind()) != "shm")
    throw ArgumentError("isend: GPU memory moves by IPC handle only to a peer on the same host (rank " +
                        std::to_string(dst) + " is reached over " + ch->kind() + ")");
  if (descriptor.empty() || descriptor.size() > ch->eager_limit())
    throw ArgumentError("isend: an IPC descriptor must be 1.." + std::to_string(ch->eager_limit()) + " bytes, got " +
                        std::to_string(descriptor.size()));
  // No host bytes: the request only records what is sent; the caller keeps the GPU memory alive.
  auto req = make_request(true, 0, 0, dtype, shape, dst, tag, timeout_s);
  req->nbytes = nbytes;
  std::lock_guard<std::mutex> lk(mu_);
  if (!admit_send(req)) return req->id;
  CtrlHeader h = send_header(*req);
  h.type = static_cast<uint32_t>(MsgType::DeviceRts);
  h.payload_bytes = static_cast<uint32_t>(descriptor.size());
  ch->post_ctrl(h, descriptor.data());  // in posting order with the peer's other messages (see isend)
  return req->id;
}

void Engine::device_done(int peer, uint64_t send_id, bool ok, const std::string& reason) {
  check_ready("device_done", peer, "peer");
  std::lock_guard<std::mutex> lk(mu_);
  if (peers_[peer].gone) return;  // nobody left to tell
  CtrlHeader h;
  h.send_id = send_id;
  if (ok) {
    h.type = static_cast<uint32_t>(MsgType::DeviceDone);
    channels_[peer]->post_ctrl(h, nullptr);
    return;
  }
  h.type = static_cast<uint32_t>(MsgType::Nack);
  h.error_kind = static_cast<uint32_t>(ErrorKind::Internal);
  const std::string text = "rank " + std::to_string(cfg_.rank) + " could not copy the message: " + reason;
  h.payload_bytes = static_cast<uint32_t>(std::min<size_t>(text.size(), channels_[peer]->eager_limit()));
  channels_[peer]->post_ctrl(h, text.data());
}

}  // namespace strdma
