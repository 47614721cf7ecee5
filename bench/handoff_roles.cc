// The child processes' roles of handoff_bench (see handoff_bench.cc for what each row measures).
#include "handoff_roles.h"

#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench.grpc.pb.h"
#include "common/cuda/cuda_driver.h"
#include "tensorshm/client.h"

namespace handoff {
namespace {

constexpr size_t kPage = 4096;

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Reads one byte per page, so every page is really mapped and present.
uint64_t TouchPages(const void* data, size_t size) {
  const auto* bytes = static_cast<const volatile unsigned char*>(data);
  uint64_t sum = 0;
  for (size_t i = 0; i < size; i += kPage) sum += bytes[i];
  if (size > 0) sum += bytes[size - 1];
  return sum;
}

int64_t MinorFaults() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

bool ReadLine(std::string& line) { return static_cast<bool>(std::getline(std::cin, line)); }

void Say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::shared_ptr<tensorshm::Client> ConnectOrDie(const std::string& socket) {
  auto client = tensorshm::Client::Connect({socket, "handoff_bench"});
  if (!client.ok()) Die(client.status());
  return *client;
}

}  // namespace

double Median(std::vector<int64_t> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

// ---- roles (child processes) ----

int TsmProducer(const std::string& socket, uint64_t size, int iterations) {
  auto client = ConnectOrDie(socket);
  std::string line;
  for (int i = 0; i < iterations && ReadLine(line); ++i) {
    const int64_t faults = MinorFaults();
    const int64_t start = NowNs();
    auto tensor = client->Create({{kDLUInt, 8, 1}, {static_cast<int64_t>(size)}});
    if (!tensor.ok()) Die(tensor.status());
    std::memset(tensor->data(), i & 0xff, size);
    if (tensorshm::Status s = client->Publish(*tensor, absl::StrFormat("bench/%d", i)); !s.ok())
      Die(s);
    Say(absl::StrFormat("start %d %d", start, MinorFaults() - faults));
  }
  return 0;
}

int TsmConsumer(const std::string& socket, uint64_t size, int iterations) {
  auto client = ConnectOrDie(socket);
  uint64_t sink = 0;
  for (int i = 0; i < iterations; ++i) {
    const std::string name = absl::StrFormat("bench/%d", i);
    Say("ready");
    const int64_t faults = MinorFaults();
    auto tensor = client->Acquire(name, tensorshm::kForever);
    if (!tensor.ok()) Die(tensor.status());
    sink += TouchPages((*tensor)->dl_tensor.data, size);
    const int64_t end = NowNs();
    (*tensor)->deleter(*tensor);
    const int64_t consumer_faults = MinorFaults() - faults;
    // Warm: the tensor is published and its segment already mapped.
    const int64_t warm_start = NowNs();
    auto again = client->Acquire(name);
    if (!again.ok()) Die(again.status());
    sink += TouchPages((*again)->dl_tensor.data, size);
    const int64_t warm = NowNs() - warm_start;
    (*again)->deleter(*again);
    if (tensorshm::Status s = client->Delete(name); !s.ok()) Die(s);
    if (tensorshm::Status s = client->Flush(); !s.ok()) Die(s);
    Say(absl::StrFormat("end %d %d %d", end, warm, consumer_faults));
  }
  return sink == 42 ? 1 : 0;  // keeps the reads from being optimised away
}

// A memcpy of `size` bytes into a destination touched beforehand, `iterations` times; says the
// median time (and the median page faults per copy, 0 when the destination is warm).
int WarmMemcpy(uint64_t size, int iterations) {
  std::vector<unsigned char> source(size, 0x5a), destination(size, 0);
  std::vector<int64_t> times, faults;
  uint64_t sink = 0;
  for (int i = 0; i < iterations; ++i) {
    source[0] = static_cast<unsigned char>(i);
    const int64_t faults_before = MinorFaults();
    const int64_t start = NowNs();
    std::memcpy(destination.data(), source.data(), size);
    times.push_back(NowNs() - start);
    faults.push_back(MinorFaults() - faults_before);
    sink += destination[i % size];
  }
  Say(absl::StrFormat("memcpy %d %d", static_cast<int64_t>(Median(times)),
                      static_cast<int64_t>(Median(faults))));
  return sink == 42 ? 1 : 0;
}

// ---- CUDA roles ----

// Device `ordinal`'s primary context, retained for the process's life and made current.
CUcontext EnterCuda(const tensorshm::CudaDriver* driver, int ordinal) {
  CUdevice device;
  CUcontext context;
  if (absl::Status s = TSM_CU(driver, ordinal, cuDeviceGet, &device, ordinal); !s.ok()) Die(s);
  if (absl::Status s = TSM_CU(driver, ordinal, cuDevicePrimaryCtxRetain, &context, device);
      !s.ok()) {
    Die(s);
  }
  if (absl::Status s = TSM_CU(driver, ordinal, cuCtxPushCurrent_v2, context); !s.ok()) Die(s);
  return context;
}

const tensorshm::CudaDriver* DriverOrDie() {
  absl::StatusOr<const tensorshm::CudaDriver*> driver = tensorshm::CudaDriver::Get();
  if (!driver.ok()) Die(driver.status());
  return *driver;
}

int CudaProducer(const std::string& socket, uint64_t size, int iterations) {
  const tensorshm::CudaDriver* driver = DriverOrDie();
  EnterCuda(driver, 0);
  auto client = ConnectOrDie(socket);
  std::vector<char> host(size, 0x5a);
  std::string line;
  for (int i = 0; i < iterations && ReadLine(line); ++i) {
    const int64_t start = NowNs();
    auto tensor = client->Create({{kDLUInt, 8, 1}, {static_cast<int64_t>(size)}, {}, {kDLCUDA, 0}});
    if (!tensor.ok()) Die(tensor.status());
    host[0] = static_cast<char>(i);
    if (absl::Status s = TSM_CU(driver, 0, cuMemcpyHtoD_v2,
                                reinterpret_cast<CUdeviceptr>(tensor->data()), host.data(), size);
        !s.ok()) {
      Die(s);
    }
    if (tensorshm::Status s = client->Publish(*tensor, absl::StrFormat("cuda/%d", i)); !s.ok())
      Die(s);
    Say(absl::StrFormat("start %d", start));
  }
  // The ready events live in this process: stay until the consumer is done.
  while (ReadLine(line)) {
  }
  return 0;
}

int CudaConsumer(const std::string& socket, uint64_t size, int iterations) {
  const tensorshm::CudaDriver* driver = DriverOrDie();
  EnterCuda(driver, 0);
  auto client = ConnectOrDie(socket);
  CUdeviceptr scratch;
  if (absl::Status s = TSM_CU(driver, 0, cuMemAlloc_v2, &scratch, size); !s.ok()) Die(s);
  for (int i = 0; i < iterations; ++i) {
    const std::string name = absl::StrFormat("cuda/%d", i);
    Say("ready");
    auto tensor = client->Acquire(name, tensorshm::kForever, tensorshm::ReadySync::Host());
    if (!tensor.ok()) Die(tensor.status());
    const int64_t end = NowNs();
    (*tensor)->deleter(*tensor);
    const int64_t warm_start = NowNs();
    auto again = client->Acquire(name, tensorshm::Duration::zero(), tensorshm::ReadySync::Host());
    if (!again.ok()) Die(again.status());
    const int64_t warm = NowNs() - warm_start;
    const int64_t copy_start = NowNs();
    if (absl::Status s =
            TSM_CU(driver, 0, cuMemcpyDtoDAsync_v2, scratch,
                   reinterpret_cast<CUdeviceptr>((*again)->dl_tensor.data), size, nullptr);
        !s.ok()) {
      Die(s);
    }
    if (absl::Status s = TSM_CU(driver, 0, cuStreamSynchronize, nullptr); !s.ok()) Die(s);
    const int64_t copy = NowNs() - copy_start;
    (*again)->deleter(*again);
    if (tensorshm::Status s = client->Delete(name); !s.ok()) Die(s);
    if (tensorshm::Status s = client->Flush(); !s.ok()) Die(s);
    Say(absl::StrFormat("end %d %d %d", end, warm, copy));
  }
  driver->cuMemFree_v2(scratch);
  return 0;
}

// Why the CUDA row cannot run here, or OK.
absl::Status CudaAvailable() {
  absl::StatusOr<const tensorshm::CudaDriver*> driver = tensorshm::CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  absl::StatusOr<int> count = (*driver)->DeviceCount();
  if (!count.ok()) return count.status();
  if (*count == 0) return absl::FailedPreconditionError("the CUDA driver sees no device");
  return absl::OkStatus();
}

class BytesService final : public tensorshm::bench::BytesBench::Service {
  grpc::Status Send(grpc::ServerContext*, const tensorshm::bench::Blob* blob,
                    tensorshm::bench::Empty*) override {
    sink_ += TouchPages(blob->data().data(), blob->data().size());
    Say(absl::StrFormat("end %d", NowNs()));
    return grpc::Status::OK;
  }
  grpc::Status Ping(grpc::ServerContext*, const tensorshm::bench::Empty*,
                    tensorshm::bench::Empty*) override {
    return grpc::Status::OK;
  }
  uint64_t sink_ = 0;
};

int GrpcConsumer(const std::string& socket) {
  BytesService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(INT32_MAX);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 1;
  Say("listening");
  std::string line;
  while (ReadLine(line)) {
  }
  server->Shutdown();
  return 0;
}

int GrpcProducer(const std::string& socket, uint64_t size, int iterations) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(INT32_MAX);
  auto stub = tensorshm::bench::BytesBench::NewStub(
      grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args));
  std::string line;
  for (int i = 0; i < iterations && ReadLine(line); ++i) {
    const int64_t start = NowNs();
    tensorshm::bench::Blob blob;
    blob.mutable_data()->resize(size);
    std::memset(blob.mutable_data()->data(), i & 0xff, size);
    grpc::ClientContext context;
    tensorshm::bench::Empty reply;
    grpc::Status status = stub->Send(&context, blob, &reply);
    if (!status.ok()) {
      std::cerr << "Send: " << status.error_message() << "\n";
      return 1;
    }
    Say(absl::StrFormat("start %d", start));
  }
  std::vector<int64_t> pings;
  for (int i = 0; i < 2000; ++i) {
    grpc::ClientContext context;
    tensorshm::bench::Empty request, reply;
    const int64_t start = NowNs();
    if (!stub->Ping(&context, request, &reply).ok()) return 1;
    pings.push_back(NowNs() - start);
  }
  Say(absl::StrFormat("ping %d", static_cast<int64_t>(Median(pings))));
  return 0;
}

}  // namespace handoff
