// RDMA verbs transport. Without STRDMA_HAVE_VERBS only the "unavailable" answers are built.
//
// One reliable-connected queue pair per peer, all sharing one completion queue served by a
// poller thread. Data moves receiver-pull-free: the receiver registers its buffer when an Rts
// matches and advertises (address, rkey, token) in the Cts; the sender registers its buffer
// and posts RDMA WRITEs, the last one WITH_IMM carrying the token, which consumes one posted
// receive on the peer and so tells it the data landed. The NIC moves the bytes, so there is no
// chunking across threads here; writes are only split at the port's maximum message size.
#include "verbs_transport.h"

#ifndef STRDMA_HAVE_VERBS

namespace strdma {

bool verbs_compiled() { return false; }

std::vector<std::string> verbs_device_ports(std::string* error) {
  *error = "this build has no verbs support (libibverbs headers were not found at build time)";
  return {};
}

std::unique_ptr<VerbsContext> open_verbs(const std::string&, std::string* why) {
  *why = "this build has no verbs support (libibverbs headers were not found at build time)";
  return nullptr;
}

}  // namespace strdma

#else  // STRDMA_HAVE_VERBS

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "bootstrap.h"
#include "tcp_transport.h"

namespace strdma {
namespace {

constexpr int kCqDepth = 4096;
constexpr int kSendDepth = 512;
constexpr int kRecvDepth = 256;  // posted receives per QP, each consumed by one WRITE_WITH_IMM

const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    default: return "OTHER";
  }
}

struct DeviceList {
  ibv_device** list = nullptr;
  int count = 0;
  DeviceList() { list = ibv_get_device_list(&count); }
  ~DeviceList() {
    if (list) ibv_free_device_list(list);
  }
};

// Registration of a request's tensor memory, kept in Request::transport_state.
struct Registration {
  ibv_mr* mr = nullptr;
  uint32_t token = 0;
};

class VerbsContextImpl;

class VerbsChannel : public Channel {
 public:
  VerbsChannel(VerbsContextImpl& ctx, EngineSink& sink, int peer, TcpLink& ctrl, ibv_qp* qp)
      : ctx_(ctx), sink_(sink), peer_(peer), ctrl_(ctrl), qp_(qp) {}
  ~VerbsChannel() override {
    if (qp_) ibv_destroy_qp(qp_);
  }

  const char* kind() const override { return "verbs"; }
  uint64_t eager_limit() const override { return ctrl_.eager_limit(); }
  void post_ctrl(const CtrlHeader& h, const void* payload) override { ctrl_.post_ctrl(h, payload); }
  std::string prepare_recv(Request& recv, CtrlHeader& cts) override;
  void start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader& cts) override;
  void request_finished(Request& req) override;
  void peer_gone() override { gone_.store(true); }

  // Poller thread callbacks.
  void on_send_done(uint64_t send_id, ibv_wc_status status);
  void on_recv_landed(uint32_t token, ibv_wc_status status);
  std::string post_receives(int count);
  uint32_t qp_num() const { return qp_->qp_num; }
  void report_internal_error(const std::string& what) { sink_.on_internal_error("RDMA completion thread", what); }

 private:
  VerbsContextImpl& ctx_;
  EngineSink& sink_;
  int peer_;
  TcpLink& ctrl_;
  ibv_qp* qp_;
  std::atomic<bool> gone_{false};
  std::mutex mu_;
  ImmTokenTable tokens_;
  std::unordered_map<uint64_t, std::shared_ptr<Request>> sending_;  // by send id, until the NIC is done
};

class VerbsContextImpl : public VerbsContext {
 public:
  VerbsContextImpl(ibv_context* ctx, uint8_t port, const ibv_port_attr& attr, int gid_index, const std::string& name)
      : ctx_(ctx), port_(port), attr_(attr), gid_index_(gid_index), name_(name) {
    pd_ = ibv_alloc_pd(ctx_);
    events_ = pd_ ? ibv_create_comp_channel(ctx_) : nullptr;
    cq_ = events_ ? ibv_create_cq(ctx_, kCqDepth, nullptr, events_, 0) : nullptr;
    if (!cq_) {
      release();
      throw TransportError("cannot set up RDMA device " + name + " (protection domain / completion queue)");
    }
    // Non-blocking events let the poller thread wake up periodically to notice shutdown.
    fcntl(events_->fd, F_SETFL, fcntl(events_->fd, F_GETFL) | O_NONBLOCK);
    ibv_req_notify_cq(cq_, 0);
    if (gid_index_ >= 0) ibv_query_gid(ctx_, port_, gid_index_, &gid_);
  }
  ~VerbsContextImpl() override {
    stop();
    channels_.clear();
    release();
  }

  std::string describe() const override {
    return name_ + ":" + std::to_string(port_) + (attr_.link_layer == IBV_LINK_LAYER_ETHERNET ? " RoCE" : " IB") +
           " lid=" + std::to_string(attr_.lid);
  }

  std::unique_ptr<Channel> connect_peer(EngineSink& sink, int my_rank, int peer, int fd, TcpLink& ctrl,
                                        uint64_t, Clock::time_point deadline) override;

  void start() override {
    running_.store(true);
    poller_ = std::thread([this] { poll_loop(); });
  }
  void stop() override {
    running_.store(false);
    if (poller_.joinable()) poller_.join();
  }

  ibv_mr* register_memory(void* addr, size_t bytes, int access) {
    return ibv_reg_mr(pd_, addr, bytes, access);
  }
  uint64_t max_message() const { return attr_.max_msg_sz ? attr_.max_msg_sz : (1u << 30); }

 private:
  void release() {
    if (cq_) ibv_destroy_cq(cq_);
    if (events_) ibv_destroy_comp_channel(events_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
    cq_ = nullptr;
    events_ = nullptr;
    pd_ = nullptr;
    ctx_ = nullptr;
  }
  void poll_loop();
  void poll_body();
  void drain_cq();

  ibv_context* ctx_;
  uint8_t port_;
  ibv_port_attr attr_;
  int gid_index_;
  std::string name_;
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* events_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::thread poller_;
  std::atomic<bool> running_{false};
  std::mutex channels_mu_;
  std::unordered_map<uint32_t, VerbsChannel*> by_qp_;  // qp_num -> channel (owned by the engine)
  std::vector<VerbsChannel*> channels_;
};

// ------------------------------------------------------------------------------------ channel

std::string VerbsChannel::post_receives(int count) {
  for (int i = 0; i < count; ++i) {
    // WRITE_WITH_IMM needs a posted receive but no receive buffer: zero scatter entries.
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = 0;
    wr.num_sge = 0;
    if (ibv_post_recv(qp_, &wr, &bad) != 0) return errno_text("ibv_post_recv");
  }
  return "";
}

std::string VerbsChannel::prepare_recv(Request& recv, CtrlHeader& cts) {
  auto* reg = new Registration();
  reg->mr = ctx_.register_memory(recv.data, recv.nbytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!reg->mr) {
    delete reg;
    return errno_text("cannot register the receive buffer for RDMA");
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    reg->token = tokens_.add(recv.id);
  }
  recv.transport_state = reg;
  cts.remote_addr = reinterpret_cast<uint64_t>(recv.data);
  cts.rkey = reg->mr->rkey;
  cts.token = reg->token;
  return "";
}

void VerbsChannel::start_data(const std::shared_ptr<Request>& send, uint64_t recv_id, const CtrlHeader& cts) {
  if (!sink_.send_chunk_begin(send)) return;
  ibv_mr* mr = ctx_.register_memory(send->data, send->nbytes, 0);
  if (!mr) {
    sink_.send_chunk_end(send, 0, errno_text("cannot register the send buffer for RDMA"));
    return;
  }
  auto plan = plan_rdma_writes(send->nbytes, ctx_.max_message());
  std::vector<ibv_sge> sges(plan.size());
  std::vector<ibv_send_wr> wrs(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    sges[i].addr = reinterpret_cast<uint64_t>(send->data) + plan[i].first;
    sges[i].length = static_cast<uint32_t>(plan[i].second);
    sges[i].lkey = mr->lkey;
    auto& wr = wrs[i];
    wr.sg_list = &sges[i];
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = cts.remote_addr + plan[i].first;
    wr.wr.rdma.rkey = cts.rkey;
    wr.next = i + 1 < plan.size() ? &wrs[i + 1] : nullptr;
  }
  // Only the last write is signalled; reliable connections complete writes in order, so its
  // completion means the whole tensor left this host and landed at the peer.
  auto& last = wrs.back();
  last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  last.imm_data = htonl(cts.token);
  last.send_flags = IBV_SEND_SIGNALED;
  last.wr_id = send->id;
  send->transport_state = mr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sending_[send->id] = send;
  }
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp_, wrs.data(), &bad) != 0) {
    int err = errno;
    {
      std::lock_guard<std::mutex> lk(mu_);
      sending_.erase(send->id);
    }
    ibv_dereg_mr(mr);
    send->transport_state = nullptr;
    sink_.send_chunk_end(send, 0, errno_text("ibv_post_send to rank " + std::to_string(peer_), err));
  }
  (void)recv_id;
}

void VerbsChannel::on_send_done(uint64_t send_id, ibv_wc_status status) {
  std::shared_ptr<Request> send;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = sending_.find(send_id);
    if (it == sending_.end()) return;
    send = it->second;
    sending_.erase(it);
  }
  if (send->transport_state) ibv_dereg_mr(static_cast<ibv_mr*>(send->transport_state));
  send->transport_state = nullptr;
  std::string error;
  if (status != IBV_WC_SUCCESS)
    error = "RDMA write to rank " + std::to_string(peer_) + " failed: " + ibv_wc_status_str(status);
  sink_.send_chunk_end(send, error.empty() ? send->nbytes : 0, error);
  if (!error.empty()) sink_.on_peer_gone(peer_, false, error);
}

void VerbsChannel::on_recv_landed(uint32_t token, ibv_wc_status status) {
  if (status != IBV_WC_SUCCESS) {
    sink_.on_peer_gone(peer_, false,
                       "RDMA receive from rank " + std::to_string(peer_) + " failed: " + ibv_wc_status_str(status));
    return;
  }
  uint64_t recv_id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    recv_id = tokens_.take(token);
  }
  post_receives(1);  // replace the receive this write consumed
  if (recv_id) sink_.recv_landed(peer_, recv_id);
}

void VerbsChannel::request_finished(Request& req) {
  if (req.is_send || !req.transport_state) return;
  auto* reg = static_cast<Registration*>(req.transport_state);
  {
    std::lock_guard<std::mutex> lk(mu_);
    tokens_.drop(reg->token);
  }
  ibv_dereg_mr(reg->mr);
  delete reg;
  req.transport_state = nullptr;
}

// ------------------------------------------------------------------------------------ context

std::unique_ptr<Channel> VerbsContextImpl::connect_peer(EngineSink& sink, int my_rank, int peer, int fd,
                                                        TcpLink& ctrl, uint64_t, Clock::time_point deadline) {
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = kSendDepth;
  init.cap.max_recv_wr = kRecvDepth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd_, &init);
  if (!qp) throw PeerSetupError(peer, errno_text("cannot create an RDMA queue pair for rank " + std::to_string(peer)));
  auto channel = std::make_unique<VerbsChannel>(*this, sink, peer, ctrl, qp);
  const std::string who = "rank " + std::to_string(peer);

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port_;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0)
    throw PeerSetupError(peer, errno_text("RDMA queue pair to " + who + ": INIT failed"));
  std::string err = channel->post_receives(kRecvDepth);
  if (!err.empty()) throw PeerSetupError(peer, err);

  VerbsConnInfo mine;
  mine.qp_num = qp->qp_num;
  mine.psn = (static_cast<uint32_t>(my_rank) * 7919u + static_cast<uint32_t>(peer) * 104729u) & 0xffffff;
  mine.lid = attr_.lid;
  mine.port = port_;
  mine.gid_index = static_cast<uint8_t>(gid_index_ < 0 ? 0 : gid_index_);
  mine.mtu = attr_.active_mtu;
  std::memcpy(mine.gid, gid_.raw, sizeof(mine.gid));
  // Both sides write first, then read: the record is tiny, so neither write can block.
  std::string out = mine.encode(), in(out.size(), '\0');
  if (!write_full(fd, out.data(), out.size()) || !read_full_until(fd, in.data(), in.size(), deadline))
    throw PeerSetupError(peer, "could not exchange RDMA connection info with " + who);
  VerbsConnInfo theirs = VerbsConnInfo::decode(in, peer);

  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(common_mtu(mine.mtu, theirs.mtu));
  a.dest_qp_num = theirs.qp_num;
  a.rq_psn = theirs.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = theirs.lid;
  a.ah_attr.port_num = port_;
  if (theirs.needs_global_route()) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, theirs.gid, sizeof(theirs.gid));
    a.ah_attr.grh.sgid_index = mine.gid_index;
    a.ah_attr.grh.hop_limit = 64;
  }
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
    throw PeerSetupError(peer, errno_text("RDMA queue pair to " + who + ": RTR failed (check GID index / MTU)"));
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = mine.psn;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC) != 0)
    throw PeerSetupError(peer, errno_text("RDMA queue pair to " + who + ": RTS failed"));
  {
    std::lock_guard<std::mutex> lk(channels_mu_);
    by_qp_[qp->qp_num] = channel.get();
    channels_.push_back(channel.get());
  }
  return channel;
}

void VerbsContextImpl::drain_cq() {
  ibv_wc wcs[32];
  for (;;) {
    int n = ibv_poll_cq(cq_, 32, wcs);
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      VerbsChannel* ch = nullptr;
      {
        std::lock_guard<std::mutex> lk(channels_mu_);
        auto it = by_qp_.find(wc.qp_num);
        if (it != by_qp_.end()) ch = it->second;
      }
      if (!ch) continue;
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM || (wc.status != IBV_WC_SUCCESS && wc.wr_id == 0))
        ch->on_recv_landed(ntohl(wc.imm_data), wc.status);
      else
        ch->on_send_done(wc.wr_id, wc.status);
    }
  }
}

void VerbsContextImpl::poll_loop() {
  try {
    poll_body();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lk(channels_mu_);
    for (auto* ch : channels_) ch->report_internal_error(e.what());
  }
}

void VerbsContextImpl::poll_body() {
  while (running_.load()) {
    struct pollfd p{events_->fd, POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      ibv_cq* cq = nullptr;
      void* context = nullptr;
      if (ibv_get_cq_event(events_, &cq, &context) == 0) ibv_ack_cq_events(cq, 1);
    }
    // Re-arm before draining, so a completion that lands in between raises a new event.
    ibv_req_notify_cq(cq_, 0);
    drain_cq();
  }
}

bool port_usable(const ibv_port_attr& attr) { return attr.state == IBV_PORT_ACTIVE; }

// RoCE needs a GID; take the first non-zero entry of the port's table. InfiniBand uses the LID.
int pick_gid_index(ibv_context* ctx, uint8_t port, const ibv_port_attr& attr) {
  if (attr.link_layer != IBV_LINK_LAYER_ETHERNET) return 0;
  for (int i = 0; i < attr.gid_tbl_len && i < 16; ++i) {
    ibv_gid gid{};
    static const uint8_t zero[16] = {};
    if (ibv_query_gid(ctx, port, i, &gid) == 0 && std::memcmp(gid.raw, zero, 16) != 0) return i;
  }
  return -1;
}

}  // namespace

bool verbs_compiled() { return true; }

std::vector<std::string> verbs_device_ports(std::string* error) {
  std::vector<std::string> out;
  DeviceList devices;
  if (!devices.list || devices.count == 0) {
    *error = "no RDMA devices found (is rdma-core installed and an RDMA NIC or rxe device present?)";
    return out;
  }
  for (int d = 0; d < devices.count; ++d) {
    const char* name = ibv_get_device_name(devices.list[d]);
    ibv_context* ctx = ibv_open_device(devices.list[d]);
    if (!ctx) {
      out.push_back(std::string(name) + ": cannot open device");
      continue;
    }
    ibv_device_attr dev{};
    if (ibv_query_device(ctx, &dev) == 0) {
      for (uint8_t port = 1; port <= dev.phys_port_cnt; ++port) {
        ibv_port_attr attr{};
        if (ibv_query_port(ctx, port, &attr) != 0) continue;
        out.push_back(std::string(name) + " port " + std::to_string(port) + " state=" + port_state_name(attr.state) +
                      " link=" + (attr.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet(RoCE)" : "InfiniBand") +
                      " lid=" + std::to_string(attr.lid) + " mtu_code=" + std::to_string(attr.active_mtu));
      }
    }
    ibv_close_device(ctx);
  }
  return out;
}

std::unique_ptr<VerbsContext> open_verbs(const std::string& device, std::string* why) {
  DeviceList devices;
  if (!devices.list || devices.count == 0) {
    *why = "no RDMA devices found";
    return nullptr;
  }
  for (int d = 0; d < devices.count; ++d) {
    std::string name = ibv_get_device_name(devices.list[d]);
    if (!device.empty() && name != device) continue;
    ibv_context* ctx = ibv_open_device(devices.list[d]);
    if (!ctx) continue;
    ibv_device_attr dev{};
    if (ibv_query_device(ctx, &dev) == 0) {
      for (uint8_t port = 1; port <= dev.phys_port_cnt; ++port) {
        ibv_port_attr attr{};
        if (ibv_query_port(ctx, port, &attr) != 0 || !port_usable(attr)) continue;
        int gid_index = pick_gid_index(ctx, port, attr);
        if (attr.link_layer == IBV_LINK_LAYER_ETHERNET && gid_index < 0) continue;
        try {
          return std::make_unique<VerbsContextImpl>(ctx, port, attr, gid_index, name);
        } catch (const TransportError& e) {
          *why = e.what();
          return nullptr;  // the context closed the device
        }
      }
    }
    ibv_close_device(ctx);
  }
  *why = device.empty() ? "no RDMA device has an active port" : "RDMA device '" + device + "' has no active port";
  return nullptr;
}

}  // namespace strdma

#endif  // STRDMA_HAVE_VERBS
