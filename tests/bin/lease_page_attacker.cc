// tsm_lease_attacker: a client that writes its lease pages by hand, as a hostile process of an
// admitted uid can (tests/stress/lease_page_attack_test.cc).
//
//   tsm_lease_attacker SOCKET --sessions N --ids MODE [--first F]
//       Opens N sessions (clients with the fast path), finds their lease pages among its own
//       mappings (/proc/self/maps) and fills every lease slot of every page: MODE "distinct"
//       writes ids no other slot holds (F + page * 504 + slot), MODE "range" writes F, F+1, ...,
//       F+503 into each page. Prints "pages <n>" and "filled", then keeps the sessions open until
//       it is killed. Exit 1 on any failure.
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/shm/fast_path_layout.h"
#include "tensorshm/client.h"

namespace {

int Fail(const std::string& why) {
  std::cout << "error " << why << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Fail("usage: tsm_lease_attacker SOCKET --sessions N --ids MODE");
  const std::string socket = argv[1];
  int64_t sessions = 1;
  std::string mode = "distinct";
  uint64_t first = uint64_t{1} << 40;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    bool ok = true;
    if (flag == "--sessions") {
      ok = absl::SimpleAtoi(value, &sessions);
    } else if (flag == "--ids") {
      mode = value;
    } else if (flag == "--first") {
      ok = absl::SimpleAtoi(value, &first);
    } else {
      ok = false;
    }
    if (!ok) return Fail(absl::StrCat("bad argument ", flag, " ", value));
  }
  // Two descriptors a session (its gRPC connection and its memory channel) and more.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);

  std::vector<std::shared_ptr<tensorshm::Client>> clients;
  for (int64_t n = 0; n < sessions; ++n) {
    tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client = tensorshm::Client::Connect(
        tensorshm::ClientOptions{socket, absl::StrCat("lease-attacker-", n)});
    if (!client.ok()) return Fail(absl::StrCat("connect ", n, ": ", client.status().ToString()));
    clients.push_back(*std::move(client));
  }
  // The fast path is set up with the session: each client maps its page read-write.
  std::vector<tensorshm::LeasePage*> pages;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (!absl::StrContains(line, "tensorshm-leases-")) continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 2 || fields[1].substr(0, 2) != "rw") continue;
    std::vector<std::string> range = absl::StrSplit(fields[0], '-');
    uint64_t start = 0;
    if (range.size() != 2 || !absl::SimpleHexAtoi(range[0], &start)) continue;
    pages.push_back(reinterpret_cast<tensorshm::LeasePage*>(start));
  }
  std::cout << "pages " << pages.size() << std::endl;
  if (static_cast<int64_t>(pages.size()) != sessions) return Fail("not one page a session");
  uint64_t next = first;
  for (tensorshm::LeasePage* page : pages) {
    if (mode == "range") next = first;
    for (uint32_t slot = tensorshm::kFirstLeaseSlot; slot < tensorshm::kLeaseSlots; ++slot) {
      page->slots[slot].store(next++, std::memory_order_seq_cst);
    }
  }
  std::cout << "filled" << std::endl;
  while (true) pause();
}
