// tsm_scribble_peer: the processes of the scribble test (tests/stress/scribble_test.cc).
//
//   tsm_scribble_peer work SOCKET --worker N --workers W --seconds S [--seed X]
//       For S seconds, at random: create a uint32 tensor of 1..2048 elements, fill every element
//       with one value (the worker in the top byte), publish it with replace as "w<N>/<k>"
//       (k < 4), sometimes acquiring it in the same step (an RPC lease); acquire "w<M>/<k>" of
//       any worker (fast path, falling back to the RPC) and check that its elements are one
//       value, holding up to 4 at a time; delete one of its names; Stat; List. Every call's
//       outcome is counted by code. Prints "code <NAME> <count>" per code seen, "acquired <n>
//       uniform <u> mixed <m>", then "done" and exits 0; any other exit is a failure.
//   tsm_scribble_peer scribble PATH --seconds S [--seed X]
//       Opens PATH (a control segment in /dev/shm) read-write and, for S seconds, writes 1-8
//       random bytes at a random offset about every 500 us: an eighth of the writes into the
//       header, an eighth into the segment records, the rest into the tensor records. Prints
//       "scribbled <writes>".
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/shm/catalog_layout.h"
#include "tensorshm/client.h"

namespace {

constexpr int kNamesPerWorker = 4;
constexpr size_t kMostHeld = 4;

struct Args {
  std::string mode;
  std::string target;  // SOCKET or PATH
  int64_t worker = 0;
  int64_t workers = 1;
  int64_t seconds = 1;
  uint64_t seed = 1;
};

bool Parse(int argc, char** argv, Args* args) {
  if (argc < 3) return false;
  args->mode = argv[1];
  args->target = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    bool ok = false;
    if (flag == "--worker") ok = absl::SimpleAtoi(value, &args->worker);
    if (flag == "--workers") ok = absl::SimpleAtoi(value, &args->workers);
    if (flag == "--seconds") ok = absl::SimpleAtoi(value, &args->seconds);
    if (flag == "--seed") ok = absl::SimpleAtoi(value, &args->seed);
    if (!ok) return false;
  }
  return args->workers >= 1 && args->seconds >= 0;
}

class Worker {
 public:
  Worker(std::shared_ptr<tensorshm::Client> client, const Args& args)
      : client_(std::move(client)), args_(args), random_(args.seed) {}

  void Run() {
    const absl::Time deadline = absl::Now() + absl::Seconds(args_.seconds);
    while (absl::Now() < deadline) {
      const int op = static_cast<int>(random_() % 10);
      if (op <= 2) {
        Publish(/*acquire=*/false);
      } else if (op == 3) {
        Publish(/*acquire=*/true);
      } else if (op <= 6) {
        Acquire();
      } else if (op == 7) {
        Count(client_->Delete(OwnName()));
      } else if (op == 8) {
        Count(client_->Stat().status());
      } else {
        Count(client_->List("w").status());
      }
    }
    for (DLManagedTensorVersioned* t : held_) t->deleter(t);
    held_.clear();
    Count(client_->Flush());
  }

  void Report() const {
    for (const auto& [code, count] : codes_) {
      std::cout << "code " << tensorshm::StatusCodeName(code) << " " << count << std::endl;
    }
    std::cout << "acquired " << acquired_ << " uniform " << uniform_ << " mixed " << mixed_
              << std::endl;
  }

 private:
  std::string OwnName() {
    return absl::StrCat("w", args_.worker, "/", random_() % kNamesPerWorker);
  }

  void Count(const tensorshm::Status& status) { ++codes_[status.code()]; }

  void Publish(bool acquire) {
    const int64_t elements = 1 + static_cast<int64_t>(random_() % 2048);
    tensorshm::StatusOr<tensorshm::WritableTensor> w =
        client_->Create({{kDLUInt, 32, 1}, {elements}});
    Count(w.status());
    if (!w.ok()) return;
    const uint32_t value = (static_cast<uint32_t>(args_.worker) << 24) |
                           (static_cast<uint32_t>(++version_) & 0xffffff);
    std::fill_n(static_cast<uint32_t*>(w->data()), elements, value);
    if (acquire) {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t =
          client_->PublishAndAcquire(*w, OwnName(), /*replace=*/true);
      Count(t.status());
      if (t.ok()) Check(*t);
    } else {
      Count(client_->Publish(*w, OwnName(), /*replace=*/true));
    }
  }

  void Acquire() {
    const std::string name = absl::StrCat("w", random_() % static_cast<uint64_t>(args_.workers),
                                          "/", random_() % kNamesPerWorker);
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = client_->Acquire(name);
    Count(t.status());
    if (t.ok()) Check(*t);
  }

  // Counts whether `t` holds one value throughout, and holds it for a while (at most kMostHeld).
  void Check(DLManagedTensorVersioned* t) {
    ++acquired_;
    const DLTensor& dl = t->dl_tensor;
    bool one_value = dl.dtype.code == kDLUInt && dl.dtype.bits == 32 && dl.dtype.lanes == 1 &&
                     dl.ndim == 1 && dl.shape[0] >= 1 &&
                     (dl.strides == nullptr || dl.strides[0] == 1);
    if (one_value) {
      const auto* data =
          reinterpret_cast<const uint32_t*>(static_cast<const char*>(dl.data) + dl.byte_offset);
      one_value = std::all_of(data, data + dl.shape[0], [&](uint32_t v) { return v == data[0]; });
    }
    // A record another process overwrote can still pass every check the client makes (a new
    // offset inside the segment): such a read is of other bytes, never outside the mapping.
    ++(one_value ? uniform_ : mixed_);
    held_.push_back(t);
    if (held_.size() > kMostHeld) {
      held_.front()->deleter(held_.front());
      held_.pop_front();
    }
  }

  std::shared_ptr<tensorshm::Client> client_;
  const Args args_;
  std::mt19937_64 random_;
  uint64_t version_ = 0;
  std::deque<DLManagedTensorVersioned*> held_;
  std::map<tensorshm::StatusCode, int64_t> codes_;
  int64_t acquired_ = 0;
  int64_t uniform_ = 0;
  int64_t mixed_ = 0;
};

int Work(const Args& args) {
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect({args.target, absl::StrCat("scribble-worker-", args.worker)});
  if (!client.ok()) {
    std::cout << "connect " << client.status() << std::endl;
    return 3;
  }
  Worker worker(*client, args);
  worker.Run();
  worker.Report();
  std::cout << "done" << std::endl;
  return 0;
}

int Scribble(const Args& args) {
  const int fd = open(args.target.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    std::cout << "open " << args.target << ": " << std::strerror(errno) << std::endl;
    return 3;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) <= tensorshm::RecordsOffset()) {
    std::cout << "fstat " << args.target << ": not a control segment" << std::endl;
    close(fd);
    return 3;
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* mapped = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED) {
    std::cout << "mmap " << args.target << ": " << std::strerror(errno) << std::endl;
    return 3;
  }
  auto* base = static_cast<volatile uint8_t*>(mapped);
  std::mt19937_64 random(args.seed);
  int64_t writes = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(args.seconds);
  while (absl::Now() < deadline) {
    const uint64_t region = random() % 8;
    uint64_t begin = tensorshm::RecordsOffset();
    uint64_t end = size;
    if (region == 0) {
      begin = 0;
      end = tensorshm::kControlHeaderBytes;
    } else if (region == 1) {
      begin = tensorshm::kControlHeaderBytes;
      end = tensorshm::RecordsOffset();
    }
    const uint64_t offset = begin + random() % (end - begin);
    const uint64_t length = std::min<uint64_t>(1 + random() % 8, size - offset);
    for (uint64_t i = 0; i < length; ++i) base[offset + i] = static_cast<uint8_t>(random());
    ++writes;
    absl::SleepFor(absl::Microseconds(500));
  }
  munmap(mapped, size);
  std::cout << "scribbled " << writes << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!Parse(argc, argv, &args)) {
    std::cerr << "usage: tsm_scribble_peer work SOCKET --worker N --workers W --seconds S "
                 "[--seed X]\n       tsm_scribble_peer scribble PATH --seconds S [--seed X]\n";
    return 2;
  }
  if (args.mode == "work") return Work(args);
  if (args.mode == "scribble") return Scribble(args);
  std::cerr << "mode = \"" << args.mode << "\": expected work or scribble\n";
  return 2;
}
