// Writes the fuzzer's seed corpus into the directory given: serialized requests and
// descriptors of the shapes the tests use, valid and invalid, and a few names and dtype names.
#include <fstream>
#include <string>

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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  for (const auto& r : {Create(2, 32, {2, 3, 4}), Create(0, 8, {}), Create(2, 32, {4, 3}, {1, 4}),
                        Create(0, 32, {3, 4}, {-4, 1}), Create(17, 4, {9}),
                        Create(2, 64, {int64_t{1} << 40, int64_t{1} << 40}),
                        Create(2, 32, {4, 2}, {int64_t{1} << 62, 1}), Create(99, 7, {-3})}) {
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
  for (const char* text : {"batch/17", "a/../b", "/abs", "bfloat16", "float8_e4m3fn", "int8x4",
                           "model.v2:weights/layer-0_q"}) {
    Write(dir, 2, text);
  }
  return 0;
}
