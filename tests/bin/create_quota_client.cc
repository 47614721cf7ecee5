// tsm_create_quota_client: creates that a quota refuses, from one client process (through the
// client library, so over the memory channel, and the gRPC Create where the channel sends it).
//
//   tsm_create_quota_client SOCKET --bytes B --count N [--as-uid U] [--hold]
//       one client creates N uint8 tensors of B bytes one after another, dropping each (so
//       unpublished buffers are given back): "created" or "refused CODE MESSAGE" per create,
//       then "done created C refused R"; with --hold "holding" and it stays connected until
//       killed.
//
// --as-uid U drops to uid and gid U first (needs root). Exit 0; 2 for bad usage, 3 if the daemon
// cannot be reached, 4 if dropping privileges failed.
#include <grp.h>
#include <unistd.h>

#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "tensorshm/client.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: tsm_create_quota_client SOCKET --bytes B --count N [--as-uid U] "
                 "[--hold]\n";
    return 2;
  }
  const std::string socket = argv[1];
  int64_t bytes = 0;
  int64_t count = 1;
  int64_t as_uid = -1;
  bool hold = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--bytes" && has_value && absl::SimpleAtoi(argv[i + 1], &bytes)) {
      ++i;
    } else if (arg == "--count" && has_value && absl::SimpleAtoi(argv[i + 1], &count)) {
      ++i;
    } else if (arg == "--as-uid" && has_value && absl::SimpleAtoi(argv[i + 1], &as_uid)) {
      ++i;
    } else if (arg == "--hold") {
      hold = true;
    } else {
      std::cerr << "bad argument " << arg << "\n";
      return 2;
    }
  }
  if (as_uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(static_cast<gid_t>(as_uid)) != 0 ||
                      setuid(static_cast<uid_t>(as_uid)) != 0)) {
    std::cerr << "cannot drop to uid " << as_uid << "\n";
    return 4;
  }
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect(tensorshm::ClientOptions{socket, "tsm_create_quota_client"});
  if (!client.ok()) {
    std::cout << "connect " << client.status() << std::endl;
    return 3;
  }
  int64_t created = 0;
  int64_t refused = 0;
  for (int64_t i = 0; i < count; ++i) {
    tensorshm::StatusOr<tensorshm::WritableTensor> tensor =
        (*client)->Create({{kDLUInt, 8, 1}, {bytes}});
    if (tensor.ok()) {
      ++created;
      std::cout << "created" << std::endl;
    } else {
      ++refused;
      std::cout << "refused " << static_cast<int>(tensor.status().code()) << " "
                << tensor.status().message() << std::endl;
    }
  }
  // Dropped buffers are given back in the sender's next batch: flushed, the daemon has them all
  // back before "done" (and "holding") says so.
  if (tensorshm::Status flushed = (*client)->Flush(); !flushed.ok()) {
    std::cout << "flush " << flushed << std::endl;
  }
  std::cout << "done created " << created << " refused " << refused << std::endl;
  if (hold) {
    std::cout << "holding" << std::endl;
    while (true) pause();  // until killed: the session stays open
  }
  return 0;
}
