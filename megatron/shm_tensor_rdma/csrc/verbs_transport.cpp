// RDMA verbs transport. Without STRDMA_HAVE_VERBS only the "unavailable" answers are built.
#include "verbs_transport.h"

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
