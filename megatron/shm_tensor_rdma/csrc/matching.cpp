// Engine: posting, matching by (peer, tag) in posting order, the data path, and how requests
// finish or fail.
//
// Protocol: a send of at most `eager_limit` bytes travels whole in one Eager message and is
// complete once queued. A larger send first posts an Rts (size, dtype, shape); when an irecv
// matches it, the receiver checks the sizes and answers Cts, and only then do the bytes move,
// straight into the receive buffer. So unmatched data never piles up at the receiver, and a
// receive that is posted late cannot block other tags.
#include <algorithm>

#include "engine.h"

namespace strdma {

std::string Engine::dtype_name(uint32_t code) const {
  auto it = cfg_.dtype_names.find(code);
  return it != cfg_.dtype_names.end() ? it->second : "dtype#" + std::to_string(code);
}

std::string Engine::describe(const Request& r) const {
  std::string s = r.is_send ? "isend(dst=" : "irecv(src=";
  return s + std::to_string(r.peer) + ", tag=" + std::to_string(r.tag) + ", " + std::to_string(r.nbytes) + " bytes)";
}

std::string Engine::stage(const Request& r) const {
  const std::string peer = "rank " + std::to_string(r.peer);
  if (r.is_send)
    return r.matched ? std::to_string(r.bytes_done) + " of " + std::to_string(r.nbytes) + " bytes sent"
                     : peer + " had not posted a matching irecv";
  return r.matched ? std::to_string(r.bytes_done) + " of " + std::to_string(r.nbytes) + " bytes received"
                   : peer + " had not sent a matching message";
}

std::shared_ptr<Request> Engine::find(uint64_t id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second;
}

void Engine::check_ready(const char* op, int peer, const char* peer_arg) const {
  if (!connected_) throw TransportError(std::string(op) + ": the endpoint is not connected (call connect first)");
  if (closing_) throw TransportError(std::string(op) + ": the endpoint is closed");
  if (peer < 0 || peer >= cfg_.world_size)
    throw ArgumentError(std::string(op) + ": " + peer_arg + " must be in [0, " + std::to_string(cfg_.world_size) +
                        "), got " + std::to_string(peer));
  if (!broken_.empty()) throw TransportError(std::string(op) + ": " + broken_);
  if (peer == cfg_.rank)
    throw ArgumentError(std::string(op) + ": " + peer_arg + "=" + std::to_string(peer) +
                        " is this endpoint's own rank; sending to oneself is not supported");
}

std::shared_ptr<Request> Engine::make_request(bool is_send, uintptr_t data, uint64_t nbytes, uint32_t dtype,
                                              const std::vector<int64_t>& shape, int peer, int64_t tag,
                                              double timeout_s) {
  if (shape.size() > static_cast<size_t>(kMaxDims))
    throw ArgumentError("tensors with more than " + std::to_string(kMaxDims) + " dimensions are not supported (got " +
                        std::to_string(shape.size()) + ")");
  if (data == 0 && nbytes != 0) throw ArgumentError("null data pointer for a non-empty tensor");
  auto r = std::make_shared<Request>();
  r->is_send = is_send;
  r->peer = peer;
  r->tag = tag;
  r->data = reinterpret_cast<uint8_t*>(data);
  r->nbytes = nbytes;
  r->dtype = dtype;
  r->ndim = static_cast<uint32_t>(shape.size());
  std::copy(shape.begin(), shape.end(), r->shape);
  r->timeout_s = timeout_s;
  r->deadline = deadline_after(timeout_s);
  return r;
}

bool Engine::admit_send(const std::shared_ptr<Request>& req) {
  req->id = next_id_++;
  requests_[req->id] = req;
  if (!peers_[req->peer].gone) return true;
  fail(req, ErrorKind::PeerGone, describe(*req) + " failed: " + peers_[req->peer].gone_reason);
  return false;
}

CtrlHeader Engine::send_header(const Request& req) {
  CtrlHeader h;
  h.dtype = req.dtype;
  h.tag = req.tag;
  h.send_id = req.id;
  h.nbytes = req.nbytes;
  h.ndim = req.ndim;
  std::copy(req.shape, req.shape + req.ndim, h.shape);
  return h;
}

uint64_t Engine::isend(uintptr_t data, uint64_t nbytes, uint32_t dtype, const std::vector<int64_t>& shape, int dst,
                       int64_t tag, double timeout_s) {
  check_ready("isend", dst, "dst");
  auto req = make_request(true, data, nbytes, dtype, shape, dst, tag, timeout_s);
  std::lock_guard<std::mutex> lk(mu_);
  if (!admit_send(req)) return req->id;
  Channel* ch = channels_[dst];
  CtrlHeader h = send_header(*req);
  // Posting under mu_ keeps messages to one peer in id order, which is what makes matching
  // by (peer, tag) first-in first-out even when several threads post.
  if (nbytes <= ch->eager_limit()) {
    h.type = static_cast<uint32_t>(MsgType::Eager);
    h.payload_bytes = static_cast<uint32_t>(nbytes);
    ch->post_ctrl(h, req->data);
    req->bytes_done = nbytes;
    finish(req, Path::Eager);
  } else {
    h.type = static_cast<uint32_t>(MsgType::Rts);
    if (ch->offer(*req, h)) h.from_sender = ch->can_copy_direct() ? 1 : 0;  // the receiver may read it, or we write
    ch->post_ctrl(h, nullptr);
  }
  return req->id;
}

uint64_t Engine::irecv(uintptr_t data, uint64_t nbytes, uint32_t dtype, const std::vector<int64_t>& shape, int src,
                       int64_t tag, double timeout_s) {
  check_ready("irecv", src, "src");
  auto req = make_request(false, data, nbytes, dtype, shape, src, tag, timeout_s);
  bool direct = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    req->id = next_id_++;
    requests_[req->id] = req;
    PeerState& ps = peers_[src];
    auto it = ps.arrived.find(tag);
    if (it != ps.arrived.end() && !it->second.empty()) {
      Arrival a = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) ps.arrived.erase(it);
      accept_arrival(req, a.header(), a.payload());
      if (spare_payloads_.size() < kSparePayloads) spare_payloads_.push_back(std::move(a.bytes));
    } else if (ps.gone_final) {
      fail(req, ErrorKind::PeerGone, describe(*req) + " failed: " + ps.gone_reason);
    } else {
      ps.posted[tag].push_back(req);
    }
    direct = !direct_jobs_.empty();
  }
  if (direct) start_direct_jobs();
  return req->id;
}

void Engine::accept_arrival(const std::shared_ptr<Request>& recv, const CtrlHeader& h, const uint8_t* payload) {
  recv->matched = true;
  recv->remote_id = h.send_id;
  bool same_shape = h.ndim == recv->ndim && std::equal(recv->shape, recv->shape + recv->ndim, h.shape);
  if (h.dtype != recv->dtype || h.nbytes != recv->nbytes || !same_shape) {
    std::string msg = "tensor mismatch for tag " + std::to_string(h.tag) + " from rank " + std::to_string(recv->peer) +
                      ": the irecv expects " + dtype_name(recv->dtype) + " " + shape_text(recv->shape, recv->ndim) +
                      " (" + std::to_string(recv->nbytes) + " bytes) but the isend has " + dtype_name(h.dtype) + " " +
                      shape_text(h.shape, h.ndim) + " (" + std::to_string(h.nbytes) + " bytes)";
    if (h.type == static_cast<uint32_t>(MsgType::Rts) || h.type == static_cast<uint32_t>(MsgType::DeviceRts)) {
      CtrlHeader nack;
      nack.type = static_cast<uint32_t>(MsgType::Nack);
      nack.tag = h.tag;
      nack.send_id = h.send_id;
      nack.error_kind = static_cast<uint32_t>(ErrorKind::Mismatch);
      std::string text = "rank " + std::to_string(cfg_.rank) + " refused the message: " + msg;
      nack.payload_bytes = static_cast<uint32_t>(std::min<size_t>(text.size(), channels_[recv->peer]->eager_limit()));
      channels_[recv->peer]->post_ctrl(nack, text.data());
    }
    fail(recv, ErrorKind::Mismatch, msg);
    return;
  }
  if (h.type == static_cast<uint32_t>(MsgType::Eager)) {
    if (h.nbytes) std::memcpy(recv->data, payload, h.nbytes);
    recv->bytes_done = h.nbytes;
    finish(recv, Path::Eager);
    return;
  }
  if (peers_[recv->peer].gone_final) {
    fail(recv, ErrorKind::PeerGone, describe(*recv) + " failed: " + peers_[recv->peer].gone_reason);
    return;
  }
  if (h.type == static_cast<uint32_t>(MsgType::DeviceRts)) {
    // The bytes stay in the sender's GPU memory: done here, the caller copies them and answers.
    recv->bytes_done = h.nbytes;
    recv->error_kind = ErrorKind::DeviceCopy;
    recv->error = std::to_string(h.send_id) + " " + std::string(reinterpret_cast<const char*>(payload), h.payload_bytes);
    finish(recv, Path::Device);
    return;
  }
  Channel* ch = channels_[recv->peer];
  CtrlHeader cts;
  cts.type = static_cast<uint32_t>(MsgType::Cts);
  cts.tag = h.tag;
  cts.send_id = h.send_id;
  cts.recv_id = recv->id;
  cts.nbytes = recv->nbytes;
  if (h.token != 0 && ch->can_copy_direct()) {
    // Single copy. This thread reads the sender's buffer itself, unless more messages from
    // the sender wait (in the ring or unmatched) and it read the previous one: then it hands
    // this copy to the sender, which writes into our buffer. Alternating, both sides copy at
    // once instead of one copying while the other waits.
    PeerState& ps = peers_[recv->peer];
    const bool more_waiting = ch->more_inbound() || !ps.arrived.empty();
    const bool hand_over = h.from_sender && recv->nbytes >= kHandOverBytes && more_waiting && !ps.handed_last;
    ps.handed_last = false;
    if (hand_over && ch->offer(*recv, cts)) {
      ps.handed_last = true;
      ch->post_ctrl(cts, nullptr);
      return;
    }
    switch (ch->claim(h)) {
      case 1:  // read it, once mu_ is released
        recv->claim_slot = static_cast<int32_t>(h.token - 1);
        recv->claim_gen = h.rkey;
        queue_direct(recv, SendJob::Read, h.send_id, h.remote_addr);
        return;
      case -1:  // the sender withdrew the offer (it gave up); its Nack follows and fails this receive
        return;
      default:
        break;
    }
  }
  std::string error = ch->prepare_recv(*recv, cts);
  if (!error.empty()) {
    fail(recv, ErrorKind::Internal, describe(*recv) + ": " + error);
    return;
  }
  ch->post_ctrl(cts, nullptr);
}

void Engine::on_ctrl(int peer, const CtrlHeader& h, const uint8_t* payload) {
  bool direct = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    on_ctrl_locked(peer, h, payload);
    direct = !direct_jobs_.empty();
  }
  if (direct) start_direct_jobs();
}

void Engine::on_ctrl_locked(int peer, const CtrlHeader& h, const uint8_t* payload) {
  const auto type = static_cast<MsgType>(h.type);
  // While closing, only answers that release a send's buffer still matter.
  if (closing_ && type != MsgType::Pulled && type != MsgType::Pushed && type != MsgType::Nack) return;
  PeerState& ps = peers_[peer];
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::Eager:
    case MsgType::Rts:
    case MsgType::DeviceRts: {
      auto it = ps.posted.find(h.tag);
      if (it != ps.posted.end() && !it->second.empty()) {
        auto recv = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) ps.posted.erase(it);
        accept_arrival(recv, h, payload);
      } else {
        std::vector<uint8_t> buffer;
        if (!spare_payloads_.empty()) {
          buffer = std::move(spare_payloads_.back());
          spare_payloads_.pop_back();
        }
        Arrival a;
        a.store(h, payload, std::move(buffer));
        ps.arrived[h.tag].push_back(std::move(a));
      }
      break;
    }
    case MsgType::Cts: {
      auto send = find(h.send_id);
      // A Cts for a send that already failed (timeout) is stale: our Nack tells the receiver.
      if (!send || !send->is_send || send->state != ReqState::Pending || send->peer != peer) break;
      Channel* ch = channels_[peer];
      ch->release_offer(*send);  // the receiver will not read our buffer
      send->matched = true;
      send->remote_id = h.recv_id;
      // A shared-memory receiver may offer its buffer: write into it (single copy). Only where
      // this side can copy directly: a verbs Cts uses `token` for its immediate value.
      if (h.token != 0 && ch->can_copy_direct()) {
        switch (ch->claim(h)) {
          case 1:
            send->claim_slot = static_cast<int32_t>(h.token - 1);
            send->claim_gen = h.rkey;
            queue_direct(send, SendJob::Write, h.recv_id, h.remote_addr);
            break;
          case -1:  // the receiver withdrew (it gave up); its Nack follows
            break;
          default:
            fail(send, ErrorKind::Internal, describe(*send) + " failed: rank " + std::to_string(peer) +
                                               " asked this rank to write into its memory, which is not permitted here");
        }
        break;
      }
      ch->start_data(send, h.recv_id, h);
      break;
    }
    case MsgType::Nack: {
      std::string reason(reinterpret_cast<const char*>(payload), h.payload_bytes);
      auto kind = static_cast<ErrorKind>(h.error_kind);
      if (!h.from_sender) {
        auto send = find(h.send_id);
        if (send && send->is_send && send->peer == peer) {
          end_offer_hold(send);
          fail(send, kind, describe(*send) + " failed: " + reason);
        }
        break;
      }
      // The sender gave up. Its Rts may still wait unmatched here, or a receive may hold it.
      auto it = ps.arrived.find(h.tag);
      if (it != ps.arrived.end()) {
        auto& q = it->second;
        q.erase(std::remove_if(q.begin(), q.end(), [&](const Arrival& a) { return a.header().send_id == h.send_id; }),
                q.end());
        if (q.empty()) ps.arrived.erase(it);
      }
      for (auto& kv : requests_) {
        auto& r = kv.second;
        if (!r->is_send && r->peer == peer && r->matched && r->remote_id == h.send_id) {
          end_offer_hold(r);  // the sender no longer writes into this receive's buffer
          fail(r, kind, describe(*r) + " failed: " + reason);
          break;
        }
      }
      break;
    }
    case MsgType::DeviceDone: {  // the receiver copied out of our GPU memory
      auto r = find(h.send_id);
      if (r && r->is_send && r->peer == peer && r->state == ReqState::Pending) {
        r->matched = true;
        r->bytes_done = r->nbytes;
        finish(r, Path::Device);
      }
      break;
    }
    case MsgType::Pulled:
    case MsgType::Pushed: {  // the peer copied the whole message straight out of / into our buffer
      const bool pulled = type == MsgType::Pulled;
      auto r = find(pulled ? h.send_id : h.recv_id);
      if (!r || r->is_send != pulled || r->peer != peer) break;
      end_offer_hold(r);
      if (r->state == ReqState::Pending) {
        r->matched = true;
        r->remote_id = pulled ? h.recv_id : h.send_id;
        r->bytes_done = r->nbytes;
        finish(r, pulled ? Path::Read : Path::Write);
      }
      break;
    }
    default:
      break;
  }
}

void Engine::end_offer_hold(const std::shared_ptr<Request>& req) {
  channels_[req->peer]->release_offer(*req);
  if (req->offer_hold) {
    req->offer_hold = false;
    --req->busy;
    maybe_publish(req);
  }
}

void Engine::queue_direct(const std::shared_ptr<Request>& req, SendJob::Kind kind, uint64_t peer_id,
                          uint64_t remote_addr) {
  auto job = std::make_shared<SendJob>();
  job->kind = kind;
  job->req = req;
  job->channel = channels_[req->peer];
  job->recv_id = peer_id;  // the peer's request id
  job->remote_addr = remote_addr;
  // Copies above workload_bytes are split in two or more (up to 1 MiB each) so the copy
  // threads and waiting callers work in parallel; fewer, larger copies cost fewer calls.
  job->chunk = std::max<uint64_t>(cfg_.workload_bytes, std::min<uint64_t>(1u << 20, (req->nbytes + 1) / 2));
  direct_jobs_.push_back(std::move(job));
}

void Engine::start_direct_jobs() {
  std::vector<std::shared_ptr<SendJob>> jobs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    jobs.swap(direct_jobs_);
  }
  for (auto& job : jobs) {
    // A copy of one chunk is done at once by this thread (it matched the message, so it is
    // the thread that wants it): no hand-off. Larger ones are shared with the copy threads
    // and with waiting callers.
    if (job->req->nbytes <= job->chunk) {
      job->next_offset = job->req->nbytes;
      run_direct_chunk(job, 0, job->req->nbytes);
    } else {
      enqueue_send_job(job);
    }
  }
}

void Engine::run_direct_chunk(const std::shared_ptr<SendJob>& job, uint64_t offset, uint64_t bytes) {
  const auto& req = job->req;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (req->state != ReqState::Pending) return;
    ++req->busy;
  }
  const bool reading = job->kind == SendJob::Read;
  std::string error = reading ? job->channel->read(req->data + offset, job->remote_addr + offset, bytes)
                              : job->channel->write(job->remote_addr + offset, req->data + offset, bytes);
  std::lock_guard<std::mutex> lk(mu_);
  --req->busy;
  if (req->state != ReqState::Pending) {
    maybe_publish(req);
    return;
  }
  if (!error.empty()) {
    const ErrorKind kind = job->channel->peer_vanished() ? ErrorKind::PeerGone : ErrorKind::Internal;
    fail(req, kind, describe(*req) + " failed: " + error + " (" + stage(*req) + ")");
    return;
  }
  req->bytes_done += bytes;
  if (req->bytes_done < req->nbytes) return;
  job->channel->claim_over(*req);
  CtrlHeader done;
  done.type = static_cast<uint32_t>(reading ? MsgType::Pulled : MsgType::Pushed);
  done.tag = req->tag;
  done.send_id = reading ? job->recv_id : req->id;
  done.recv_id = reading ? req->id : job->recv_id;
  done.nbytes = req->nbytes;
  job->channel->post_ctrl(done, nullptr);
  finish(req, reading ? Path::Read : Path::Write);
}

DataLease Engine::data_begin(int peer, const CtrlHeader& h) {
  std::lock_guard<std::mutex> lk(mu_);
  DataLease lease;
  auto r = find(h.recv_id);
  if (!r || r->is_send || r->peer != peer || r->state != ReqState::Pending || r->remote_id != h.send_id ||
      h.offset + h.nbytes > r->nbytes)
    return lease;
  ++r->busy;
  lease.req = r;
  lease.dst = r->data + h.offset;
  return lease;
}

void Engine::data_end(DataLease& lease, uint64_t bytes) {
  if (!lease.req) return;
  std::lock_guard<std::mutex> lk(mu_);
  auto& r = lease.req;
  --r->busy;
  if (r->state == ReqState::Pending) {
    r->bytes_done += bytes;
    if (r->bytes_done == r->nbytes) finish(r);
    else settle_if_peer_gone(r);
  } else {
    maybe_publish(r);
  }
  lease.req.reset();
}

void Engine::recv_landed(int peer, uint64_t recv_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto r = find(recv_id);
  if (!r || r->is_send || r->peer != peer || r->state != ReqState::Pending) return;
  r->bytes_done = r->nbytes;
  finish(r);
}

bool Engine::send_chunk_begin(const std::shared_ptr<Request>& req) {
  std::lock_guard<std::mutex> lk(mu_);
  if (req->state != ReqState::Pending) return false;
  ++req->busy;
  return true;
}

void Engine::send_chunk_end(const std::shared_ptr<Request>& req, uint64_t bytes, const std::string& error) {
  std::lock_guard<std::mutex> lk(mu_);
  --req->busy;
  if (req->state == ReqState::Pending) {
    if (!error.empty()) {
      fail(req, ErrorKind::PeerGone, describe(*req) + " failed: " + error + " (" + stage(*req) + ")");
      return;
    }
    req->bytes_done += bytes;
    if (req->bytes_done == req->nbytes) finish(req);
    else settle_if_peer_gone(req);
  } else {
    maybe_publish(req);
  }
}

void Engine::settle_if_peer_gone(const std::shared_ptr<Request>& req) {
  const PeerState& ps = peers_[req->peer];
  if (ps.gone_final && req->busy == 0)
    fail(req, ErrorKind::PeerGone, describe(*req) + " failed: " + ps.gone_reason + " (" + stage(*req) + ")");
}

void Engine::finish(const std::shared_ptr<Request>& req, Path path) {
  if (req->state != ReqState::Pending) return;
  req->state = ReqState::Done;
  ++finished_by_path_[static_cast<size_t>(path)];
  maybe_publish(req);
}

void Engine::fail(const std::shared_ptr<Request>& req, ErrorKind kind, const std::string& message) {
  if (req->state != ReqState::Pending) return;
  req->state = ReqState::Failed;
  req->error_kind = kind;
  req->error = message;
  req->aborted.store(true);
  PeerState& ps = peers_[req->peer];
  Channel* ch = channels_[req->peer];
  if (ch && req->offer_slot >= 0 && !ps.gone && !ch->withdraw(*req)) {
    // The peer is copying out of or into this buffer: report the failure only when it is
    // done with it (Pulled, Pushed or its Nack), because Python frees the tensor then.
    req->offer_hold = true;
    ++req->busy;
  }
  // A copier stops touching the peer's buffer once its copies in flight end (busy == 0);
  // only then may the peer hear about the failure and free that buffer.
  const bool copying = req->claim_slot >= 0 && req->busy > 0;
  if (ch && req->claim_slot >= 0 && !copying) ch->claim_over(*req);
  if (!req->is_send && !req->matched) {
    auto it = ps.posted.find(req->tag);
    if (it != ps.posted.end()) {
      auto& q = it->second;
      q.erase(std::remove(q.begin(), q.end(), req), q.end());
      if (q.empty()) ps.posted.erase(it);
    }
  }
  // Tell a live peer that this side gave up, so its half of the transfer fails now instead of
  // at its own timeout. Only needed once the peer knows about the transfer.
  bool tell = !ps.gone && !closing_ && (kind == ErrorKind::Timeout || kind == ErrorKind::Internal) &&
              (req->is_send || req->matched);
  if (tell && ch && copying) {
    req->deferred_nack = message;
    req->deferred_kind = kind;
  } else if (tell && ch) {
    tell_abandoned(req, kind, message);
  }
  maybe_publish(req);
}

void Engine::tell_abandoned(const std::shared_ptr<Request>& req, ErrorKind kind, const std::string& message) {
  CtrlHeader nack;
  nack.type = static_cast<uint32_t>(MsgType::Nack);
  nack.tag = req->tag;
  nack.error_kind = static_cast<uint32_t>(kind);
  nack.from_sender = req->is_send ? 1 : 0;
  nack.send_id = req->is_send ? req->id : req->remote_id;
  nack.recv_id = req->is_send ? req->remote_id : req->id;
  std::string text = "rank " + std::to_string(cfg_.rank) + " abandoned the transfer: " + message;
  nack.payload_bytes = static_cast<uint32_t>(std::min<size_t>(text.size(), channels_[req->peer]->eager_limit()));
  channels_[req->peer]->post_ctrl(nack, text.data());
}

void Engine::maybe_publish(const std::shared_ptr<Request>& req) {
  // A failed request is reported only after every thread copying into or out of its buffer
  // finished, because the Python side frees the tensor as soon as it sees the outcome.
  if (req->state == ReqState::Pending || req->busy > 0 || req->published) return;
  Channel* ch = channels_[req->peer];
  if (ch && req->claim_slot >= 0 && req->state == ReqState::Failed) {
    // A copier's last copy into or out of the peer's buffer ended: now the peer may know.
    ch->claim_over(*req);
    if (!req->deferred_nack.empty() && !peers_[req->peer].gone && !closing_)
      tell_abandoned(req, req->deferred_kind, req->deferred_nack);
    req->deferred_nack.clear();
  }
  req->published = true;
  if (channels_[req->peer]) channels_[req->peer]->request_finished(*req);
  completed_.push_back(req->id);
  publications_.fetch_add(1, std::memory_order_release);
  done_cv_.notify_all();
}

void Engine::fail_peer_requests(int peer) {
  PeerState& ps = peers_[peer];
  ps.gone_final = true;
  for (auto& kv : requests_)
    if (kv.second->peer == peer && kv.second->offer_hold) end_offer_hold(kv.second);  // no copier left
  std::vector<std::shared_ptr<Request>> victims;
  // A request with a copy in progress may be about to complete (its last chunk already
  // reached the peer, which is why the peer could finish and leave): the copy settles it.
  for (auto& kv : requests_)
    if (kv.second->peer == peer && kv.second->state == ReqState::Pending && kv.second->busy == 0)
      victims.push_back(kv.second);
  for (auto& r : victims)
    fail(r, ErrorKind::PeerGone, describe(*r) + " failed: " + ps.gone_reason + " (" + stage(*r) + ")");
  // Rendezvous announcements can never be served now; buffered Eager data still can.
  for (auto it = ps.arrived.begin(); it != ps.arrived.end();) {
    auto& q = it->second;
    q.erase(std::remove_if(q.begin(), q.end(),
                           [](const Arrival& a) {
                             const uint32_t type = a.header().type;
                             return type == static_cast<uint32_t>(MsgType::Rts) ||
                                    type == static_cast<uint32_t>(MsgType::DeviceRts);
                           }),
            q.end());
    it = q.empty() ? ps.arrived.erase(it) : std::next(it);
  }
}

}  // namespace strdma
