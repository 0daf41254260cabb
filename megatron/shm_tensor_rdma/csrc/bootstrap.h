// Connection setup: TCP listener and full-mesh handshake between ranks, and the Unix-socket
// hand-over of shared-memory file descriptors between ranks on one host.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common.h"

namespace strdma {

// What a rank tells each peer when they connect.
struct Hello {
  std::string job_id;
  int rank = -1;
  int world_size = 0;
  std::string host_key;    // equal keys mean "same host": shared memory is possible
  std::string unix_name;   // abstract Unix socket that hands out our segment's fd
  bool allow_shm = true;
  bool allow_tcp = true;
  bool verbs = false;      // an RDMA device is open and usable on this rank
  std::string verbs_info;  // verbs: device/port description (diagnostics)
  std::string device_key;  // GPUs on which this rank opens CUDA IPC handles ("" for none)

  std::string encode() const;
  static Hello decode(const std::string& text);
};

struct PeerConn {
  int fd = -1;
  std::string address;
  Hello hello;
};

// Parses "host:port" or "[v6]:port"; throws ArgumentError naming `what` on malformed input.
void split_address(const std::string& address, const std::string& what, std::string* host, int* port);

// Binds and listens; returns the fd and stores the actual port (port 0 picks a free one).
int tcp_listen(const std::string& host, int port, int backlog, int* bound_port);

// Connects this rank to every other rank: it dials lower ranks and accepts higher ones, so
// the mesh forms in any start order. Result is indexed by rank (own entry has fd -1).
std::vector<PeerConn> connect_mesh(int listen_fd, const Hello& me, const std::vector<std::string>& addresses,
                                   Clock::time_point deadline);

bool write_full(int fd, const void* data, size_t n);
// Blocking read of exactly n bytes; false on EOF or error.
bool read_full(int fd, void* data, size_t n);
// Read with a deadline (setup paths only); false on EOF, error or timeout.
bool read_full_until(int fd, void* data, size_t n, Clock::time_point deadline);

// Abstract-namespace Unix sockets: nothing is created in the file system, and the name
// disappears with the process.
int unix_listen(const std::string& name);
// Accepts one connection per expected rank and passes `fd_to_send` to each.
void serve_fd(int listen_fd, int fd_to_send, std::vector<int> expected_ranks, Clock::time_point deadline);
// Connects to `name`, identifies as `my_rank`, and returns the descriptor the peer passes.
int fetch_fd(const std::string& name, int my_rank, int peer_rank, Clock::time_point deadline);

}  // namespace strdma
