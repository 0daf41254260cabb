// Connection setup between ranks: TCP mesh with a hello exchange, Unix fd hand-over.
#include "bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <thread>

namespace strdma {
namespace {

int remaining_ms(Clock::time_point deadline) {
  double s = seconds_until(deadline);
  if (s <= 0) return 0;
  return static_cast<int>(std::min(s * 1000.0 + 1, 1e8));
}

bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    struct pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return false;
  }
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Frames used during setup: u32 length + text.
bool send_text(int fd, const std::string& text) {
  uint32_t n = static_cast<uint32_t>(text.size());
  return write_full(fd, &n, 4) && write_full(fd, text.data(), n);
}

bool recv_text(int fd, std::string* text, Clock::time_point deadline) {
  uint32_t n = 0;
  if (!read_full_until(fd, &n, 4, deadline) || n > (1u << 20)) return false;
  text->assign(n, '\0');
  return read_full_until(fd, text->data(), n, deadline);
}

// Non-blocking connect bounded by the deadline, so an unreachable host cannot stall setup
// for the kernel's multi-minute SYN retry period.
int connect_until(const std::string& host, int port, Clock::time_point deadline, std::string* why) {
  struct addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    *why = std::string("cannot resolve host: ") + gai_strerror(rc);
    return -1;
  }
  int result = -1;
  for (auto* ai = res; ai && result < 0; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ||
        (errno == EINPROGRESS && wait_fd(fd, POLLOUT, deadline))) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) {
        int flags = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
        set_nodelay(fd);
        result = fd;
        continue;
      }
      *why = std::strerror(err);
    } else {
      *why = errno == EINPROGRESS ? "connect timed out" : std::strerror(errno);
    }
    ::close(fd);
  }
  freeaddrinfo(res);
  return result;
}

bool to_bool(const std::string& v) { return v == "1"; }

}  // namespace

// Built and parsed with plain string operations, not iostreams: in a process where PyTorch's
// CUDA build was loaded first, formatting a number through an ostringstream crashed in the
// locale's facets (seen on a GPU machine: a segmentation fault in every connect).
std::string Hello::encode() const {
  std::string out;
  auto put = [&out](const char* key, const std::string& value) {
    out += key;
    out += '=';
    out += value;
    out += '\n';
  };
  put("job_id", job_id);
  put("rank", std::to_string(rank));
  put("world_size", std::to_string(world_size));
  put("host_key", host_key);
  put("unix_name", unix_name);
  put("allow_shm", allow_shm ? "1" : "0");
  put("allow_tcp", allow_tcp ? "1" : "0");
  put("verbs", verbs ? "1" : "0");
  put("verbs_info", verbs_info);
  put("device_key", device_key);
  put("endian", std::to_string(0x01020304u));
  return out;
}

Hello Hello::decode(const std::string& text) {
  std::map<std::string, std::string> kv;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    const auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    start = end + 1;
  }
  if (kv.count("error")) throw TransportError(kv["error"]);
  if (kv["endian"] != std::to_string(0x01020304u))
    throw TransportError("peer has a different byte order; shm_tensor_rdma needs little-endian hosts");
  Hello h;
  h.job_id = kv["job_id"];
  h.rank = std::stoi(kv.count("rank") ? kv["rank"] : "-1");
  h.world_size = std::stoi(kv.count("world_size") ? kv["world_size"] : "0");
  h.host_key = kv["host_key"];
  h.unix_name = kv["unix_name"];
  h.allow_shm = to_bool(kv["allow_shm"]);
  h.allow_tcp = to_bool(kv["allow_tcp"]);
  h.verbs = to_bool(kv["verbs"]);
  h.verbs_info = kv["verbs_info"];
  h.device_key = kv["device_key"];
  return h;
}

void split_address(const std::string& address, const std::string& what, std::string* host, int* port) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    throw ArgumentError(what + " must look like 'host:port', got '" + address + "'");
  std::string h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  char* end = nullptr;
  long p = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p < 0 || p > 65535)
    throw ArgumentError(what + " has an invalid port in '" + address + "'");
  *host = h;
  *port = static_cast<int>(p);
}

int tcp_listen(const std::string& host, int port, int backlog, int* bound_port) {
  struct addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* res = nullptr;
  const char* node = (host.empty() || host == "0.0.0.0" || host == "*") ? nullptr : host.c_str();
  if (!node) hints.ai_family = AF_INET;
  int rc = getaddrinfo(node, std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) throw TransportError("cannot resolve listen address '" + host + "': " + gai_strerror(rc));
  std::string why = "no usable address";
  int fd = -1;
  for (auto* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) throw TransportError("cannot listen on " + host + ":" + std::to_string(port) + ": " + why);
  struct sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  *bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

bool write_full(int fd, const void* data, size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_full(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool read_full_until(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return false;
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::vector<PeerConn> connect_mesh(int listen_fd, const Hello& me, const std::vector<std::string>& addresses,
                                   Clock::time_point deadline) {
  const int world = static_cast<int>(addresses.size());
  std::vector<PeerConn> peers(world);
  auto check = [&](const Hello& h, int expect_rank, const std::string& addr) {
    if (h.job_id != me.job_id || h.world_size != me.world_size || (expect_rank >= 0 && h.rank != expect_rank))
      throw PeerSetupError(expect_rank >= 0 ? expect_rank : h.rank,
                           "the process at " + addr + " is job '" + h.job_id + "' rank " + std::to_string(h.rank) +
                               " of " + std::to_string(h.world_size) + ", expected job '" + me.job_id + "' rank " +
                               std::to_string(expect_rank) + " of " + std::to_string(me.world_size) +
                               ": check the peer addresses and job id");
  };
  // Dial every lower rank. A refused connection only means the peer is not listening yet.
  for (int r = 0; r < me.rank; ++r) {
    std::string host, why;
    int port = 0;
    split_address(addresses[r], "peer address of rank " + std::to_string(r), &host, &port);
    int fd = -1;
    while (fd < 0) {
      fd = connect_until(host, port, deadline, &why);
      if (fd >= 0) break;
      if (seconds_until(deadline) <= 0)
        throw PeerSetupError(r, "timed out connecting to rank " + std::to_string(r) + " at " + addresses[r] + " (" +
                                    why + "): is that rank running with the same job id?");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string reply;
    if (!send_text(fd, me.encode()) || !recv_text(fd, &reply, deadline)) {
      ::close(fd);
      throw PeerSetupError(r, "rank " + std::to_string(r) + " at " + addresses[r] +
                                  " accepted the connection but did not complete the handshake in time");
    }
    Hello h;
    try {
      h = Hello::decode(reply);
    } catch (const TransportError& e) {
      ::close(fd);
      throw PeerSetupError(r, "rank " + std::to_string(r) + " at " + addresses[r] + " refused us: " + e.what());
    }
    try {
      check(h, r, addresses[r]);
    } catch (...) {
      ::close(fd);
      throw;
    }
    peers[r] = PeerConn{fd, addresses[r], h};
  }
  // Accept every higher rank; a stray connection (another job, a port scanner) is refused
  // and ignored rather than failing this job.
  int missing = world - 1 - me.rank;
  while (missing > 0) {
    if (!wait_fd(listen_fd, POLLIN, deadline)) {
      std::string which;
      for (int r = me.rank + 1; r < world; ++r)
        if (peers[r].fd < 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
      int first = std::stoi(which.substr(0, which.find(',')));
      throw PeerSetupError(first, "timed out waiting for rank(s) " + which + " to connect to rank " +
                                      std::to_string(me.rank) + " at " + addresses[me.rank]);
    }
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nodelay(fd);
    std::string text;
    if (!recv_text(fd, &text, std::min(deadline, Clock::now() + std::chrono::seconds(5)))) {
      ::close(fd);
      continue;
    }
    Hello h;
    try {
      h = Hello::decode(text);
    } catch (const TransportError&) {
      ::close(fd);
      continue;
    }
    bool ok = h.job_id == me.job_id && h.world_size == me.world_size && h.rank > me.rank && h.rank < world &&
              peers[h.rank].fd < 0;
    if (!ok) {
      send_text(fd, "error=rank " + std::to_string(me.rank) + " of job '" + me.job_id + "' (world size " +
                        std::to_string(me.world_size) + ") does not expect job '" + h.job_id + "' rank " +
                        std::to_string(h.rank) + " of " + std::to_string(h.world_size) + "\n");
      ::close(fd);
      continue;
    }
    if (!send_text(fd, me.encode())) {
      ::close(fd);
      continue;
    }
    peers[h.rank] = PeerConn{fd, addresses[h.rank], h};
    --missing;
  }
  return peers;
}

static sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr.sun_path)) throw TransportError("unix socket name too long: " + name);
  addr.sun_path[0] = '\0';  // abstract namespace
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

int unix_listen(const std::string& name) {
  socklen_t len = 0;
  sockaddr_un addr = abstract_address(name, &len);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw TransportError(errno_text("unix socket"));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, 128) != 0) {
    int err = errno;
    ::close(fd);
    throw TransportError(errno_text("cannot listen on unix socket @" + name, err));
  }
  return fd;
}

void serve_fd(int listen_fd, int fd_to_send, std::vector<int> expected_ranks, Clock::time_point deadline) {
  while (!expected_ranks.empty()) {
    if (!wait_fd(listen_fd, POLLIN, deadline))
      throw PeerSetupError(expected_ranks.front(), "timed out handing our shared-memory segment to rank " +
                                                       std::to_string(expected_ranks.front()));
    int conn = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {
      // The setup gave up elsewhere and shut the listener down: stop instead of spinning.
      if (errno == EINVAL || errno == EBADF) throw TransportError("shared-memory hand-over was cancelled");
      continue;
    }
    int32_t rank = -1;
    auto it = expected_ranks.end();
    if (read_full_until(conn, &rank, sizeof(rank), deadline))
      it = std::find(expected_ranks.begin(), expected_ranks.end(), rank);
    if (it != expected_ranks.end()) {
      char byte = 'F';
      struct iovec iov{&byte, 1};
      alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      struct msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cm), &fd_to_send, sizeof(int));
      if (::sendmsg(conn, &msg, MSG_NOSIGNAL) == 1) expected_ranks.erase(it);
    }
    ::close(conn);
  }
}

int fetch_fd(const std::string& name, int my_rank, int peer_rank, Clock::time_point deadline) {
  socklen_t len = 0;
  sockaddr_un addr = abstract_address(name, &len);
  const std::string who = "rank " + std::to_string(peer_rank);
  for (;;) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw TransportError(errno_text("unix socket"));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      int err = errno;
      ::close(fd);
      if (seconds_until(deadline) <= 0)
        throw PeerSetupError(peer_rank, errno_text("cannot reach " + who + "'s shared-memory hand-over socket", err));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    int32_t me = my_rank;
    char byte = 0;
    struct iovec iov{&byte, 1};
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    struct msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got = -1;
    if (write_full(fd, &me, sizeof(me)) && wait_fd(fd, POLLIN, deadline)) got = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    ::close(fd);
    struct cmsghdr* cm = got == 1 ? CMSG_FIRSTHDR(&msg) : nullptr;
    if (!cm || cm->cmsg_type != SCM_RIGHTS)
      throw PeerSetupError(peer_rank, who + " did not hand over its shared-memory segment");
    int received = -1;
    std::memcpy(&received, CMSG_DATA(cm), sizeof(int));
    return received;
  }
}

}  // namespace strdma
