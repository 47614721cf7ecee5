// Writes the fuzzers' seed corpora: into the first directory given, request_fuzzer's
// (serialized requests and descriptors of the shapes the tests use, valid and invalid, and a few
// names and dtype names); into the second, if given, channel_frame_fuzzer's (streams of framed
// ChannelRequests of every kind, in that fuzzer's program format).
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/shm/channel_frame.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace {

int count = 0;

void Write(const std::string& dir, char kind, const std::string& bytes) {
  std::ofstream out(dir + "/seed-" + std::to_string(count++), std::ios::binary);
  out << kind << bytes;
}

tensorshm::v1::CreateRequest Create(uint32_t code, uint32_t bits, std::vector<int64_t> shape,
                                    std::vector<int64_t> strides = {}) {
  tensorshm::v1::CreateRequest r;
  r.mutable_dtype()->set_code(code);
  r.mutable_dtype()->set_bits(bits);
  r.mutable_dtype()->set_lanes(1);
  for (int64_t d : shape) r.add_shape(d);
  for (int64_t s : strides) r.add_strides(s);
  r.mutable_device()->set_type(1);
  return r;
}

// channel_frame_fuzzer's program: cut seed, descriptor mask, then one "frame" op per request.
void WriteChannelSeed(const std::string& dir, uint8_t cut_seed, uint8_t fd_mask,
                      const std::vector<tensorshm::v1::ChannelRequest>& requests,
                      const std::string& tail = "") {
  std::string program;
  program.push_back(static_cast<char>(cut_seed));
  program.push_back(static_cast<char>(fd_mask));
  for (const auto& request : requests) {
    const std::string body = request.SerializeAsString();
    program.push_back(1);  // op: a frame of the next n bytes
    program.push_back(static_cast<char>(body.size() & 0xff));
    program.push_back(static_cast<char>(body.size() >> 8));
    program += body;
  }
  program += tail;
  std::ofstream out(dir + "/channel-seed-" + std::to_string(count++), std::ios::binary);
  out << program;
}

void WriteChannelSeeds(const std::string& dir) {
  using tensorshm::v1::ChannelRequest;
  std::vector<ChannelRequest> all;
  ChannelRequest bind;
  bind.set_sequence(1);
  bind.mutable_bind()->set_session_id("0123456789abcdef0123456789abcdef");
  all.push_back(bind);
  ChannelRequest segment;
  segment.set_sequence(2);
  segment.mutable_segment()->set_segment_id(1);
  segment.mutable_segment()->set_segment_instance(0x1234567890abcdefull);
  segment.mutable_segment()->set_writable(true);
  all.push_back(segment);
  ChannelRequest fast_path;
  fast_path.set_sequence(3);
  fast_path.mutable_fast_path()->set_part(tensorshm::v1::FastPathRequest::LEASE_PAGE);
  all.push_back(fast_path);
  ChannelRequest create;
  create.set_sequence(4);
  *create.mutable_create() = Create(2, 32, {2, 3, 4});
  create.mutable_create()->set_stock(8);
  all.push_back(create);
  ChannelRequest publish;
  publish.set_sequence(5);
  publish.mutable_publish()->set_tensor_id(7);
  publish.mutable_publish()->set_name("batch/17");
  publish.mutable_publish()->set_acquire(true);
  publish.mutable_publish()->set_ready_event(std::string(64, 'e'));
  *publish.mutable_publish()->mutable_desc()->mutable_dtype() = Create(2, 32, {}).dtype();
  publish.mutable_publish()->mutable_desc()->add_shape(6);
  publish.mutable_publish()->set_stock(2);
  publish.mutable_publish()->set_stock_bytes(4096);
  all.push_back(publish);
  ChannelRequest remove;
  remove.set_sequence(6);
  remove.mutable_delete_()->set_name("batch/17");
  all.push_back(remove);
  WriteChannelSeed(dir, 0, 0, all);
  WriteChannelSeed(dir, 7, 0x21, all);
  for (const ChannelRequest& request : all) WriteChannelSeed(dir, 3, 0, {request});
  // An empty request, then a frame over the limit; a partial frame at the end.
  WriteChannelSeed(dir, 1, 0, {ChannelRequest()}, std::string("\x02\x01\x00\x01\x00", 5));
  WriteChannelSeed(dir, 2, 1, all, std::string("\x00\x03\x01\x02\x03", 5));
  // A large frame of one byte repeated (op 3), and raw bytes that are no frame (op 0).
  WriteChannelSeed(dir, 9, 0, all, std::string("\x03\x00\x00\x01\x08", 5));
  WriteChannelSeed(dir, 5, 0, {}, std::string("\x00\x08garbage!", 10));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) return 2;
  const std::string dir = argv[1];
  if (argc == 3) WriteChannelSeeds(argv[2]);
  for (const auto& r :
       {Create(2, 32, {2, 3, 4}), Create(0, 8, {}), Create(2, 32, {4, 3}, {1, 4}),
        Create(0, 32, {3, 4}, {-4, 1}), Create(17, 4, {9}),
        Create(2, 64, {int64_t{1} << 40, int64_t{1} << 40}),
        Create(2, 32, {4, 2}, {int64_t{1} << 62, 1}), Create(99, 7, {-3}),
        Create(2, 32, {int64_t{1} << 40}, {0}), Create(2, 32, {int64_t{1} << 62}, {0})}) {
    Write(dir, 0, r.SerializeAsString());
  }
  tensorshm::v1::AcquireResponse a;
  a.set_lease_id(1);
  a.set_tensor_id(2);
  *a.mutable_desc()->mutable_dtype() = Create(2, 32, {}).dtype();
  a.mutable_desc()->add_shape(6);
  a.mutable_desc()->add_strides(1);
  a.mutable_desc()->set_nbytes(24);
  a.mutable_desc()->mutable_device()->set_type(1);
  a.mutable_location()->set_segment_id(1);
  a.mutable_location()->set_offset(4096);
  a.mutable_location()->set_length(4096);
  a.mutable_location()->set_segment_size(1 << 20);
  a.mutable_location()->mutable_host()->set_shm_name("/tsm-0123.cpu.1");
  Write(dir, 1, a.SerializeAsString());
  a.mutable_desc()->set_nbytes(1 << 30);
  Write(dir, 1, a.SerializeAsString());
  // Session openings: names and versions at the bound, one byte past it, and far past it.
  for (const auto& [name, version] :
       {std::pair<size_t, size_t>{9, 5}, {256, 256}, {257, 5}, {5, 257}, {1000, 0}}) {
    tensorshm::v1::SessionOpen open;
    open.set_pid(1234);
    open.set_client_name(std::string(name, 'n'));
    open.set_client_version(std::string(version, 'v'));
    open.add_held_tensor_ids(7);
    Write(dir, 3, open.SerializeAsString());
  }
  for (const char* text : {"batch/17", "a/../b", "/abs", "bfloat16", "float8_e4m3fn", "int8x4",
                           "model.v2:weights/layer-0_q"}) {
    Write(dir, 2, text);
  }
  return 0;
}
