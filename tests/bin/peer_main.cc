// tsm_peer: a producer or consumer process for the integration tests.
//
//   tsm_peer produce SOCKET NAME --dtype D --shape 2,3 [--strides 3,1] [--seed N] [--replace]
//                                [--hang-before-publish]
//   tsm_peer consume SOCKET NAME [--wait-ms N] [--legacy]
//   tsm_peer hold SOCKET NAME...      acquire all, print "held", sleep until killed
//   tsm_peer write SOCKET NAME        acquire, print "acquired", write into the tensor
//   tsm_peer escalate SOCKET NAME     acquire, try to make the mapping writable; prints
//                                     "mprotect <errno name>" or "mprotect succeeded"
//   tsm_peer probe-channel SOCKET     on a raw memory channel bound to its own session, asks
//                                     for segment 1 writable ("writable 1: code C") and read-only,
//                                     then tries to reopen that descriptor read-write through
//                                     /proc ("reopen rw: <errno name>" or "reopen rw: succeeded")
//   tsm_peer reuse SOCKET NAME --shape N   create N bytes, fill with 0xee, publish, delete, then
//                                     create N bytes again (the freed buffer); prints
//                                     "reused nonzero <count of non-zero bytes>"
//   tsm_peer churn SOCKET NAME... [--seed N]         hold, create, drop at random until killed
//   tsm_peer load SOCKET NAME... --ops N --seed S     N mixed operations, all must succeed
//   tsm_peer cuda-produce SOCKET NAME --device N --shape S [--seed N]   fill through the driver
//   tsm_peer cuda-consume SOCKET NAME [--stream]   acquire twice, copy to host, release; prints
//                                                  the emulated driver's counters as it goes
//   tsm_peer cuda-write SOCKET NAME [--how memset|store]   acquire, then write 16 bytes through
//                                     the device pointer (cuMemsetD8, or a store of this
//                                     process); prints "wrote" or "refused <CUDA error name>"
//   tsm_peer replace-loop SOCKET NAME --count N --bytes B [--max-bytes M] [--seed S]
//                                     N times: create a uint32 tensor of B bytes (with M: a
//                                     multiple of 4 in [B, M] picked by a hash of the version,
//                                     VersionBytes), fill every element with
//                                     the version number (1..N), publish with replace; prints
//                                     "published N"
//   tsm_peer verify-loop SOCKET NAME (--until-version N | --forever) --bytes B [--max-bytes M]
//                    [--keep K] [--wait-ms W]
//                                     acquire (waiting up to W ms for a publish), check that
//                                     every element equals one version v, that the tensor has
//                                     the size replace-loop gives v (same B, M), v >= the last one
//                                     seen (and <= N), yield, check again; keep the last K
//                                     acquired, re-check them all, release the oldest; until it
//                                     acquired version N (or killed). Prints "verifying" after
//                                     the first check, then "verified <count> wrong 0 last <v>";
//                                     wrong bytes: "wrong <bytes> ..." and exit 1; no version N
//                                     within 250 s: "timeout ..." and exit 5 (TSan beside
//                                     other builds reached version 9986 of 10000 in 100 s)
//
// Output lines: "checksum <storage hash> <logical hash>", "meta <dtype> <shape> <strides>
// <byte_offset> <flags>", "error <code> <message>" (exit 3).
#include <dlfcn.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iostream>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_driver.h"
#include "common/shm/channel_frame.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "common/tensor/wire.h"
#include "tensorshm/client.h"
#include "tests/support/fake_cuda/fake_cuda.h"
#include "tests/support/raw_session.h"
#include "tests/support/tensor_bytes.h"

namespace {

using tensorshm::testing::LogicalHash;
using tensorshm::testing::StorageHash;

template <typename AnyStatus>  // the client's tensorshm::Status, or the CUDA helpers' absl one
int Fail(const AnyStatus& status) {
  std::cout << "error " << static_cast<int>(status.code()) << " " << status.message() << std::endl;
  return 3;
}

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> values;
  if (text.empty() || text == "-") return values;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      std::cerr << "bad number: " << part << "\n";
      std::exit(2);
    }
    values.push_back(v);
  }
  return values;
}

void PrintTensor(const DLTensor& t, uint64_t flags) {
  std::cout << "meta " << tensorshm::DataTypeName(t.dtype) << " ["
            << absl::StrJoin(t.shape, t.shape + t.ndim, ",") << "] ["
            << absl::StrJoin(t.strides, t.strides + t.ndim, ",") << "] " << t.byte_offset << " "
            << flags << "\n";
  std::cout << "checksum " << StorageHash(t) << " " << LogicalHash(t) << std::endl;
}

// Copies between host and device `ordinal` through the driver, in its primary context.
absl::Status DeviceCopy(int ordinal, void* host, CUdeviceptr device, size_t bytes, bool to_device) {
  absl::StatusOr<const tensorshm::CudaDriver*> driver = tensorshm::CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  const tensorshm::CudaDriver* d = *driver;
  CUdevice dev;
  CUcontext context;
  if (absl::Status s = TSM_CU(d, ordinal, cuDeviceGet, &dev, ordinal); !s.ok()) return s;
  if (absl::Status s = TSM_CU(d, ordinal, cuDevicePrimaryCtxRetain, &context, dev); !s.ok()) {
    return s;
  }
  absl::Status status;
  {
    tensorshm::ScopedContext scope(d, context);
    status = to_device ? TSM_CU(d, ordinal, cuMemcpyHtoD_v2, device, host, bytes)
                       : TSM_CU(d, ordinal, cuMemcpyDtoH_v2, host, device, bytes);
  }
  d->cuDevicePrimaryCtxRelease_v2(dev);
  return status;
}

// The emulated driver's test functions, from the library TENSORSHM_LIBCUDA names (already
// loaded by tensorshm); nullptr members with another driver.
struct FakeCuda {
  decltype(&tsm_fake_cuda_counters) counters = nullptr;
  decltype(&tsm_fake_cuda_open_mappings) open_mappings = nullptr;
  decltype(&tsm_fake_cuda_vmm_allocations) vmm_allocations = nullptr;
};

FakeCuda FindFakeCuda() {
  const char* library = std::getenv("TENSORSHM_LIBCUDA");
  void* handle = library != nullptr ? dlopen(library, RTLD_NOW | RTLD_NOLOAD) : nullptr;
  if (handle == nullptr) return {};
  return {
      reinterpret_cast<decltype(&tsm_fake_cuda_counters)>(dlsym(handle, "tsm_fake_cuda_counters")),
      reinterpret_cast<decltype(&tsm_fake_cuda_open_mappings)>(
          dlsym(handle, "tsm_fake_cuda_open_mappings")),
      reinterpret_cast<decltype(&tsm_fake_cuda_vmm_allocations)>(
          dlsym(handle, "tsm_fake_cuda_vmm_allocations"))};
}

void PrintCounters(const char* label) {
  const FakeCuda fake = FindFakeCuda();
  if (fake.counters == nullptr || fake.open_mappings == nullptr ||
      fake.vmm_allocations == nullptr) {
    std::cout << label << " no-counters" << std::endl;
    return;
  }
  const TsmFakeCudaCounters* c = fake.counters();
  std::cout << label << " ipc_open_calls=" << c->ipc_open_calls
            << " ipc_open_mappings=" << c->ipc_open_mappings
            << " ipc_unmappings=" << c->ipc_unmappings << " open_now=" << fake.open_mappings()
            << " ipc_open_event=" << c->ipc_open_event_handle
            << " stream_wait_event=" << c->stream_wait_event
            << " event_synchronize=" << c->event_synchronize
            << " waits_on_recorded=" << c->waits_on_recorded << " event_record=" << c->event_record
            << " vmm_import=" << c->vmm_import << " vmm_now=" << fake.vmm_allocations()
            << std::endl;
}

// verify-loop: one acquired tensor and the version its elements all held when first checked.
struct Verified {
  DLManagedTensorVersioned* tensor = nullptr;
  uint32_t version = 0;
};

// replace-loop and verify-loop: the bytes of version `version`, a multiple of 4 from `min` to
// `max`, picked by a hash of the version alone: a consumer knows the size each version must
// have (a buffer freed early and reused by another version shows in the size too).
int64_t VersionBytes(uint64_t version, int64_t min, int64_t max) {
  uint64_t x = version + 0x9e3779b97f4a7c15ull;  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return min + 4 * static_cast<int64_t>(x % static_cast<uint64_t>((max - min) / 4 + 1));
}

// Counts the bytes of `t` (a 1-d uint32 tensor) that differ from `version` in every element.
// Reports the first wrong element on stdout, with `phase`.
int64_t WrongBytes(const DLTensor& t, uint32_t version, const char* phase) {
  const auto* elements =
      reinterpret_cast<const volatile uint32_t*>(static_cast<const char*>(t.data) + t.byte_offset);
  const int64_t n = t.shape[0];
  int64_t wrong = 0;
  int64_t first = -1;
  uint32_t first_value = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t value = elements[i];
    if (value == version) continue;
    for (int b = 0; b < 4; ++b) wrong += ((value ^ version) >> (8 * b) & 0xff) != 0;
    if (first < 0) {
      first = i;
      first_value = value;
    }
  }
  if (wrong > 0) {
    std::cout << "wrong " << wrong << " bytes " << phase << ": version " << version << ", " << n
              << " elements, first wrong element " << first << " = " << first_value << std::endl;
  }
  return wrong;
}

int Main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: tsm_peer produce|consume|hold|write SOCKET NAME ...\n";
    return 2;
  }
  const std::string mode = argv[1];
  tensorshm::ClientOptions options;
  options.socket = argv[2];
  options.client_name = "tsm_peer-" + mode;
  // Generous: under ThreadSanitizer, a daemon serving dozens of peers answers slowly.
  options.connect_timeout = std::chrono::seconds(30);
  std::vector<std::string> names;
  std::string dtype = "float32", shape, strides;
  uint64_t seed = 1;
  int64_t wait_ms = 0;
  int64_t ops = 0;
  int as_uid = -1;  // drop to this uid (and gid) before connecting
  int device = 0;   // cuda-produce: this process's CUDA ordinal
  bool replace = false, hang = false, legacy = false, on_stream = false;
  int64_t count = 0, bytes_min = 0, bytes_max = 0;  // replace-loop
  int64_t until_version = 0, keep = 1;              // verify-loop
  std::string how = "memset";                       // cuda-write
  bool forever = false;                             // verify-loop
  for (int i = 3; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (arg == "--dtype")
      dtype = value();
    else if (arg == "--shape")
      shape = value();
    else if (arg == "--strides")
      strides = value();
    else if (arg == "--seed")
      seed = std::stoull(value());
    else if (arg == "--wait-ms")
      wait_ms = std::stoll(value());
    else if (arg == "--ops")
      ops = std::stoll(value());
    else if (arg == "--as-uid")
      as_uid = std::stoi(value());
    else if (arg == "--replace")
      replace = true;
    else if (arg == "--hang-before-publish")
      hang = true;
    else if (arg == "--legacy")
      legacy = true;
    else if (arg == "--device")
      device = std::stoi(value());
    else if (arg == "--stream")
      on_stream = true;
    else if (arg == "--count")
      count = std::stoll(value());
    else if (arg == "--bytes")
      bytes_min = std::stoll(value());
    else if (arg == "--max-bytes")
      bytes_max = std::stoll(value());
    else if (arg == "--until-version")
      until_version = std::stoll(value());
    else if (arg == "--keep")
      keep = std::stoll(value());
    else if (arg == "--forever")
      forever = true;
    else if (arg == "--how")
      how = value();
    else
      names.push_back(arg);
  }
  if (as_uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(as_uid) != 0 || setuid(as_uid) != 0)) {
    std::cerr << "cannot drop privileges to uid " << as_uid << "\n";
    return 4;
  }
  tensorshm::StatusOr<std::shared_ptr<tensorshm::Client>> client =
      tensorshm::Client::Connect(options);
  if (!client.ok()) return Fail(client.status());

  if (mode == "produce") {
    absl::StatusOr<DLDataType> dt = tensorshm::ParseDataType(dtype);
    if (!dt.ok()) return Fail(dt.status());
    tensorshm::TensorSpec spec{*dt, ParseList(shape), ParseList(strides)};
    tensorshm::StatusOr<tensorshm::WritableTensor> w = (*client)->Create(spec);
    if (!w.ok()) return Fail(w.status());
    // Fill every byte of the storage the tensor spans from a seeded generator.
    std::mt19937_64 random(seed);
    auto* bytes = static_cast<unsigned char*>(w->dl_tensor().data);
    for (int64_t i = 0; i < w->nbytes(); ++i) bytes[i] = static_cast<unsigned char>(random());
    PrintTensor(w->dl_tensor(), 0);
    if (hang) {
      std::cout << "created" << std::endl;
      pause();
    }
    if (tensorshm::Status s = (*client)->Publish(*w, names.at(0), replace); !s.ok()) return Fail(s);
    std::cout << "published" << std::endl;
    return 0;
  }
  if (mode == "cuda-produce") {
    absl::StatusOr<DLDataType> dt = tensorshm::ParseDataType(dtype);
    if (!dt.ok()) return Fail(dt.status());
    tensorshm::TensorSpec spec{*dt, ParseList(shape), {}, {kDLCUDA, device}};
    tensorshm::StatusOr<tensorshm::WritableTensor> w = (*client)->Create(spec);
    if (!w.ok()) return Fail(w.status());
    if (w->dl_tensor().device.device_type != kDLCUDA || w->dl_tensor().device.device_id != device) {
      return Fail(absl::InternalError("created tensor is not on the requested device"));
    }
    std::vector<unsigned char> host(static_cast<size_t>(w->nbytes()));
    std::mt19937_64 random(seed);
    for (unsigned char& b : host) b = static_cast<unsigned char>(random());
    if (absl::Status s =
            DeviceCopy(device, host.data(), reinterpret_cast<CUdeviceptr>(w->dl_tensor().data),
                       host.size(), /*to_device=*/true);
        !s.ok()) {
      return Fail(s);
    }
    DLTensor view = w->dl_tensor();
    view.data = host.data();
    view.device = {kDLCPU, 0};
    PrintTensor(view, 0);
    if (tensorshm::Status s = (*client)->Publish(*w, names.at(0), replace); !s.ok()) return Fail(s);
    PrintCounters("counters");
    std::cout << "published" << std::endl;
    // Stays until killed: the ready event lives in this process.
    while (true) pause();
  }
  if (mode == "cuda-consume") {
    const tensorshm::ReadySync sync =
        on_stream ? tensorshm::ReadySync::Stream(tensorshm::kLegacyDefaultStream)
                  : tensorshm::ReadySync::Host();
    std::vector<DLManagedTensorVersioned*> held;
    for (int round = 0; round < 2; ++round) {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t =
          (*client)->Acquire(names.at(0), std::chrono::milliseconds(wait_ms), sync);
      if (!t.ok()) return Fail(t.status());
      const DLTensor& dl = (*t)->dl_tensor;
      std::cout << "device " << tensorshm::DeviceName(dl.device) << " flags " << (*t)->flags
                << std::endl;
      absl::StatusOr<tensorshm::TensorLayout> layout =
          tensorshm::ComputeLayout(dl.dtype, absl::MakeConstSpan(dl.shape, dl.ndim), {}, false);
      if (!layout.ok()) return Fail(layout.status());
      std::vector<unsigned char> host(static_cast<size_t>(layout->nbytes));
      if (absl::Status s = DeviceCopy(dl.device.device_id, host.data(),
                                      reinterpret_cast<CUdeviceptr>(dl.data) + dl.byte_offset,
                                      host.size(), /*to_device=*/false);
          !s.ok()) {
        return Fail(s);
      }
      DLTensor view = dl;
      view.data = host.data();
      view.byte_offset = 0;
      view.device = {kDLCPU, 0};
      PrintTensor(view, 0);
      PrintCounters(round == 0 ? "first" : "second");
      held.push_back(*t);
    }
    for (DLManagedTensorVersioned* t : held) t->deleter(t);
    if (tensorshm::Status s = (*client)->Flush(); !s.ok()) return Fail(s);
    PrintCounters("released");
    client->reset();
    // The client's core goes with its sender thread; give it a moment to close the handles.
    const FakeCuda fake = FindFakeCuda();
    for (int i = 0; i < 200 && fake.open_mappings != nullptr &&
                    (fake.open_mappings() > 0 || fake.vmm_allocations() > 0);
         ++i) {
      usleep(10000);
    }
    PrintCounters("closed");
    return 0;
  }
  if (mode == "cuda-write") {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(
        names.at(0), std::chrono::milliseconds(wait_ms), tensorshm::ReadySync::Host());
    if (!t.ok()) return Fail(t.status());
    const DLTensor& dl = (*t)->dl_tensor;
    const CUdeviceptr data = reinterpret_cast<CUdeviceptr>(dl.data) + dl.byte_offset;
    std::cout << "acquired" << std::endl;
    if (how == "store") {
      // The emulated device's memory is this process's: a store through the device pointer.
      *reinterpret_cast<volatile unsigned char*>(data) = 0x5A;
      std::cout << "wrote" << std::endl;
    } else {
      absl::StatusOr<const tensorshm::CudaDriver*> driver = tensorshm::CudaDriver::Get();
      if (!driver.ok()) return Fail(driver.status());
      CUdevice dev;
      CUcontext context;
      if ((*driver)->cuDeviceGet(&dev, dl.device.device_id) != CUDA_SUCCESS ||
          (*driver)->cuDevicePrimaryCtxRetain(&context, dev) != CUDA_SUCCESS) {
        return Fail(absl::InternalError("no context"));
      }
      CUresult result;
      {
        tensorshm::ScopedContext scope(*driver, context);
        result = (*driver)->cuMemsetD8_v2(data, 0x5A, 16);
      }
      (*driver)->cuDevicePrimaryCtxRelease_v2(dev);
      const char* name = "?";
      (*driver)->cuGetErrorName(result, &name);
      std::cout << (result == CUDA_SUCCESS ? "wrote" : "refused ")
                << (result == CUDA_SUCCESS ? "" : name) << std::endl;
    }
    (*t)->deleter(*t);
    return 0;
  }
  if (mode == "consume") {
    const tensorshm::Duration timeout =
        wait_ms < 0 ? tensorshm::kForever : std::chrono::milliseconds(wait_ms);
    if (legacy) {
      tensorshm::StatusOr<DLManagedTensor*> t = (*client)->AcquireLegacy(names.at(0), timeout);
      if (!t.ok()) return Fail(t.status());
      PrintTensor((*t)->dl_tensor, 0);
      (*t)->deleter(*t);
    } else {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(names.at(0), timeout);
      if (!t.ok()) return Fail(t.status());
      if ((*t)->version.major != DLPACK_MAJOR_VERSION ||
          (*t)->version.minor != DLPACK_MINOR_VERSION) {
        return Fail(absl::InternalError("wrong DLPack version in acquired tensor"));
      }
      PrintTensor((*t)->dl_tensor, (*t)->flags);
      (*t)->deleter(*t);
    }
    if (tensorshm::Status s = (*client)->Flush(); !s.ok()) return Fail(s);
    return 0;
  }
  if (mode == "hold") {
    for (const std::string& name : names) {
      tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(name);
      if (!t.ok()) return Fail(t.status());
      PrintTensor((*t)->dl_tensor, (*t)->flags);  // never released: the process is killed
    }
    std::cout << "held" << std::endl;
    while (true) pause();
  }
  if (mode == "churn") {
    // Until killed: acquire and hold published tensors, create buffers and write half of them,
    // drop some of each. NAMES are the published tensors to acquire.
    std::mt19937_64 random(seed);
    std::vector<DLManagedTensorVersioned*> held;
    std::vector<tensorshm::WritableTensor> writing;
    std::cout << "churning" << std::endl;
    while (true) {
      const uint64_t dice = random() % 6;
      if (dice < 2) {
        tensorshm::StatusOr<DLManagedTensorVersioned*> t =
            (*client)->Acquire(names.at(random() % names.size()));
        if (!t.ok()) return Fail(t.status());
        held.push_back(*t);
      } else if (dice == 2 && !held.empty()) {
        held.back()->deleter(held.back());
        held.pop_back();
      } else if (dice == 3) {
        tensorshm::StatusOr<tensorshm::WritableTensor> w = (*client)->Create(
            {{kDLUInt, 8, 1}, {static_cast<int64_t>(4096 * (1 + random() % 64))}});
        if (!w.ok()) return Fail(w.status());
        std::memset(w->data(), 0x5a, w->nbytes() / 2);  // half-written
        writing.push_back(*std::move(w));
      } else if (dice == 4 && !writing.empty()) {
        writing.pop_back();  // dropped unpublished
      }
      if (held.size() > 16 || writing.size() > 8) {
        for (auto* t : held) t->deleter(t);
        held.clear();
        writing.clear();
      }
    }
  }
  if (mode == "load") {
    // OPS mixed operations in this process's own namespace load/<seed>/, plus reads of NAMES.
    // Every operation must succeed; at the end everything created is deleted again.
    std::mt19937_64 random(seed);
    std::vector<std::string> mine;
    std::vector<DLManagedTensorVersioned*> held;
    int next = 0;
    for (int i = 0; i < ops; ++i) {
      const uint64_t dice = random() % 8;
      tensorshm::Status status;
      if (dice == 0 || mine.empty()) {
        tensorshm::StatusOr<tensorshm::WritableTensor> w =
            (*client)->Create({{kDLFloat, 32, 1}, {static_cast<int64_t>(1 + random() % 20000)}});
        if (!w.ok()) return Fail(w.status());
        std::memset(w->data(), static_cast<int>(i & 0xff), w->nbytes());
        const std::string name = absl::StrCat("load/", seed, "/", next++);
        status = (*client)->Publish(*w, name);
        mine.push_back(name);
      } else if (dice == 1) {
        tensorshm::StatusOr<tensorshm::WritableTensor> w =
            (*client)->Create({{kDLInt, 8, 1}, {static_cast<int64_t>(random() % 5000)}});
        if (!w.ok()) return Fail(w.status());
        status = (*client)->Publish(*w, mine[random() % mine.size()], /*replace=*/true);
      } else if (dice <= 3) {
        tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(
            dice == 2 ? mine[random() % mine.size()] : names.at(random() % names.size()));
        if (!t.ok()) return Fail(t.status());
        held.push_back(*t);
      } else if (dice == 4 && !held.empty()) {
        held.back()->deleter(held.back());
        held.pop_back();
      } else if (dice == 5 && mine.size() > 4) {
        const size_t k = random() % mine.size();
        status = (*client)->Delete(mine[k]);
        mine.erase(mine.begin() + k);
      } else if (dice == 6) {
        status = (*client)->List(absl::StrCat("load/", seed, "/")).status();
      } else {
        status = (*client)->Stat().status();
      }
      if (!status.ok()) return Fail(status);
    }
    for (auto* t : held) t->deleter(t);
    for (const std::string& name : mine) {
      if (tensorshm::Status s = (*client)->Delete(name); !s.ok()) return Fail(s);
    }
    if (tensorshm::Status s = (*client)->Flush(); !s.ok()) return Fail(s);
    std::cout << "load ok " << ops << std::endl;
    return 0;
  }
  if (mode == "crashload") {
    // Publishes (and replaces) tensors under crash/<seed>/<k> until the daemon goes away:
    // "publishing NAME SUM" before each publish, "published NAME" once it is acknowledged.
    std::mt19937_64 random(seed);
    for (int i = 0;; ++i) {
      const std::string name = absl::StrCat("crash/", seed, "/", i % 30);
      tensorshm::StatusOr<tensorshm::WritableTensor> w =
          (*client)->Create({{kDLFloat, 32, 1}, {static_cast<int64_t>(1 + random() % 50000)}});
      if (!w.ok()) break;
      auto* bytes = static_cast<unsigned char*>(w->dl_tensor().data);
      for (int64_t b = 0; b < w->nbytes(); ++b) bytes[b] = static_cast<unsigned char>(random());
      std::cout << "publishing " << name << " " << StorageHash(w->dl_tensor()) << std::endl;
      if (!(*client)->Publish(*w, name, /*replace=*/true).ok()) break;
      std::cout << "published " << name << std::endl;
    }
    std::cout << "daemon gone" << std::endl;
    return 0;
  }
  if (mode == "replace-loop") {
    bytes_max = std::max(bytes_max, bytes_min);
    for (int64_t version = 1; version <= count; ++version) {
      const int64_t bytes = VersionBytes(version, bytes_min, bytes_max);
      tensorshm::StatusOr<tensorshm::WritableTensor> w =
          (*client)->Create({{kDLUInt, 32, 1}, {bytes / 4}});
      if (!w.ok()) return Fail(w.status());
      std::fill_n(static_cast<uint32_t*>(w->data()), bytes / 4, static_cast<uint32_t>(version));
      if (tensorshm::Status s = (*client)->Publish(*w, names.at(0), /*replace=*/true); !s.ok()) {
        return Fail(s);
      }
    }
    if (tensorshm::Status s = (*client)->Flush(); !s.ok()) return Fail(s);
    std::cout << "published " << count << std::endl;
    return 0;
  }
  if (mode == "verify-loop") {
    if (bytes_min <= 0) {
      std::cerr << "verify-loop: --bytes (and --max-bytes) as the producer's replace-loop\n";
      return 2;
    }
    bytes_max = std::max(bytes_max, bytes_min);
    std::mt19937_64 random(seed);
    std::deque<Verified> held;
    uint32_t last = 0;
    int64_t verified = 0;
    const absl::Time deadline = absl::Now() + absl::Seconds(250);
    auto release_all = [&] {
      for (Verified& v : held) v.tensor->deleter(v.tensor);
      held.clear();
    };
    while (forever || last < until_version) {
      if (absl::Now() > deadline) {
        std::cout << "timeout verified " << verified << " last " << last << std::endl;
        return 5;
      }
      tensorshm::StatusOr<DLManagedTensorVersioned*> t =
          (*client)->Acquire(names.at(0), std::chrono::milliseconds(wait_ms));
      if (!t.ok()) return Fail(t.status());
      const DLTensor& dl = (*t)->dl_tensor;
      if (dl.dtype.code != kDLUInt || dl.dtype.bits != 32 || dl.dtype.lanes != 1 || dl.ndim != 1 ||
          dl.shape[0] < 1 || (dl.strides != nullptr && dl.strides[0] != 1)) {
        std::cout << "wrong meta: " << tensorshm::DataTypeName(dl.dtype) << " ndim " << dl.ndim
                  << std::endl;
        return 1;
      }
      const uint32_t version =
          *reinterpret_cast<const uint32_t*>(static_cast<const char*>(dl.data) + dl.byte_offset);
      int64_t wrong = WrongBytes(dl, version, "at acquire");
      if (version < last || version == 0 || (!forever && version > until_version)) {
        std::cout << "wrong version " << version << " after " << last << std::endl;
        wrong += 4;
      }
      if (dl.shape[0] * 4 != VersionBytes(version, bytes_min, bytes_max)) {
        std::cout << "wrong size: version " << version << " has " << dl.shape[0] * 4
                  << " bytes, not " << VersionBytes(version, bytes_min, bytes_max) << std::endl;
        wrong += 4;
      }
      // A premature free and reuse of the buffer would show now, or while it is kept.
      sched_yield();
      if (random() % 16 == 0) usleep(static_cast<useconds_t>(random() % 300));
      wrong += WrongBytes(dl, version, "re-checked");
      held.push_back({*t, version});
      while (static_cast<int64_t>(held.size()) > std::max<int64_t>(keep, 1)) {
        held.front().tensor->deleter(held.front().tensor);
        held.pop_front();
      }
      for (const Verified& v : held) wrong += WrongBytes(v.tensor->dl_tensor, v.version, "kept");
      if (wrong > 0) {
        std::cout << "verified " << verified << " wrong " << wrong << " last " << version
                  << std::endl;
        return 1;
      }
      if (verified++ == 0) std::cout << "verifying" << std::endl;
      last = version;
    }
    release_all();
    if (tensorshm::Status s = (*client)->Flush(); !s.ok()) return Fail(s);
    std::cout << "verified " << verified << " wrong 0 last " << last << std::endl;
    return 0;
  }
  if (mode == "delete") {
    if (tensorshm::Status s = (*client)->Delete(names.at(0)); !s.ok()) return Fail(s);
    std::cout << "deleted" << std::endl;
    return 0;
  }
  if (mode == "stat") {
    tensorshm::StatusOr<tensorshm::ServerStats> stats = (*client)->Stat();
    if (!stats.ok()) return Fail(stats.status());
    std::cout << "sessions " << stats->sessions << std::endl;
    return 0;
  }
  if (mode == "escalate") {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(names.at(0));
    if (!t.ok()) return Fail(t.status());
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    void* start =
        reinterpret_cast<void*>(reinterpret_cast<uintptr_t>((*t)->dl_tensor.data) & ~(page - 1));
    if (mprotect(start, page, PROT_READ | PROT_WRITE) == 0) {
      std::cout << "mprotect succeeded" << std::endl;
    } else {
      std::cout << "mprotect " << strerrorname_np(errno) << std::endl;
    }
    (*t)->deleter(*t);
    return 0;
  }
  if (mode == "probe-channel") {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, options.socket.data(), options.socket.size());
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return 5;
    auto call = [&](const tensorshm::v1::ChannelRequest& request, int* received) {
      std::string frame(tensorshm::kFrameHeaderBytes, '\0');
      request.AppendToString(&frame);
      tensorshm::EncodeFrameHeader(static_cast<uint32_t>(frame.size() - 4), frame.data());
      tensorshm::v1::ChannelResponse response;
      std::string body;
      if (!tensorshm::SendWithFd(fd, frame, -1, false, "probe").ok() ||
          !tensorshm::ReceiveFrame(fd, &body, received, "probe").ok() ||
          !response.ParseFromString(body)) {
        response.set_code(-1);
      }
      return response;
    };
    if (write(fd, tensorshm::kChannelHello, tensorshm::kChannelHelloBytes) != 8) return 5;
    int received = -1;
    // A session of this process's own: Client::session_id is a number, never the token.
    tensorshm::testing::RawSession session(options.socket, "probe-channel");
    tensorshm::v1::ChannelRequest bind;
    bind.mutable_bind()->set_session_id(session.token());
    const tensorshm::v1::ChannelResponse bound = call(bind, &received);
    std::cout << "bind: code " << bound.code() << std::endl;
    tensorshm::v1::ChannelRequest want;
    want.mutable_segment()->set_segment_id(1);
    want.mutable_segment()->set_segment_instance(bound.bound().instance_id());
    want.mutable_segment()->set_writable(true);
    const tensorshm::v1::ChannelResponse writable = call(want, &received);
    std::cout << "writable 1: code " << writable.code() << " " << writable.message() << std::endl;
    if (received >= 0) close(received);
    want.mutable_segment()->set_writable(false);
    const tensorshm::v1::ChannelResponse readable = call(want, &received);
    std::cout << "readable 1: code " << readable.code() << std::endl;
    if (received < 0) return 6;
    const int reopened = open(absl::StrCat("/proc/self/fd/", received).c_str(), O_RDWR | O_CLOEXEC);
    std::cout << "reopen rw: " << (reopened >= 0 ? "succeeded" : strerrorname_np(errno))
              << std::endl;
    return 0;
  }
  if (mode == "reuse") {
    const int64_t n = ParseList(shape).at(0);
    const tensorshm::TensorSpec spec{{kDLUInt, 8, 1}, {n}};
    tensorshm::StatusOr<tensorshm::WritableTensor> first = (*client)->Create(spec);
    if (!first.ok()) return Fail(first.status());
    std::memset(first->data(), 0xee, static_cast<size_t>(n));
    if (tensorshm::Status s = (*client)->Publish(*first, names.at(0)); !s.ok()) return Fail(s);
    if (tensorshm::Status s = (*client)->Delete(names.at(0)); !s.ok()) return Fail(s);
    tensorshm::StatusOr<tensorshm::WritableTensor> second = (*client)->Create(spec);
    if (!second.ok()) return Fail(second.status());
    // Buffers are reused without clearing: zeros, or this uid's own leftovers (0xee), and
    // nothing else (no other uid's bytes).
    const auto* bytes = static_cast<const unsigned char*>(second->data());
    int64_t foreign = 0;
    for (int64_t i = 0; i < n; ++i) foreign += bytes[i] != 0 && bytes[i] != 0xee;
    std::cout << "reused foreign " << foreign << std::endl;
    return 0;
  }
  if (mode == "write") {
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire(names.at(0));
    if (!t.ok()) return Fail(t.status());
    std::cout << "acquired" << std::endl;
    auto* data = static_cast<volatile char*>((*t)->dl_tensor.data);
    data[0] = 42;  // the mapping is read-only: this faults
    std::cout << "write succeeded" << std::endl;
    return 0;
  }
  std::cerr << "unknown mode " << mode << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
