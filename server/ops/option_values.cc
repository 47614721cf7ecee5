// The values of tensorshmd's flags that need more than a number: sizes ("64Gi"), --cuda-pool,
// --evict, and whether a pool fits /dev/shm.
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/ops/options.h"

namespace tensorshm {
namespace {

uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t SaturatingMultiply(uint64_t a, uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

}  // namespace

absl::StatusOr<CudaPoolSpec> ParseCudaPool(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda-pool = \"", text, "\": ", why));
  };
  const size_t eq = text.find('=');
  if (text.substr(0, 5) != "cuda:" || eq == absl::string_view::npos) {
    return bad("expected cuda:N=SIZE, e.g. cuda:0=4Gi");
  }
  CudaPoolSpec spec;
  if (!absl::SimpleAtoi(text.substr(5, eq - 5), &spec.ordinal) || spec.ordinal < 0) {
    return bad("the device N must be a number >= 0");
  }
  absl::StatusOr<uint64_t> size = ParseSize(text.substr(eq + 1), "size");
  if (!size.ok()) return bad(size.status().message());
  if (*size == 0) return bad("the size must be positive");
  // Device buffers are handed out in 256-byte units.
  spec.bytes = (*size + 255) / 256 * 256;
  return spec;
}

absl::StatusOr<EvictPolicy> ParseEvictPolicy(absl::string_view text) {
  if (text == "none") return EvictPolicy::kNone;
  if (text == "lru") return EvictPolicy::kLru;
  return absl::InvalidArgumentError(absl::StrCat("--evict = \"", text, "\": expected none or lru"));
}

absl::StatusOr<uint64_t> ParseSize(absl::string_view text, absl::string_view flag) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " = \"", text, "\": ", why));
  };
  constexpr absl::string_view kUnits =
      "units are B (bytes), K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024), "
      "e.g. 64Mi, 4Gi, 4096B";
  absl::string_view digits = text;
  const bool bytes = !digits.empty() && (digits.back() == 'B' || digits.back() == 'b');
  if (bytes) digits.remove_suffix(1);
  uint64_t multiplier = 1;
  const bool binary = !digits.empty() && digits.back() == 'i';
  if (binary) digits.remove_suffix(1);
  const bool scaled = !digits.empty() && absl::ascii_isalpha(digits.back());
  if (scaled) {
    const int power = absl::string_view("KMGT").find(absl::ascii_toupper(digits.back())) + 1;
    if (power == 0) return bad(absl::StrCat("unknown unit; ", kUnits));
    for (int i = 0; i < power; ++i) multiplier *= binary ? 1024 : 1000;
    digits.remove_suffix(1);
  } else if (binary) {
    return bad(absl::StrCat("unknown unit; ", kUnits));
  }
  uint64_t value;
  if (digits.empty() || !absl::ascii_isdigit(digits.front()) || !absl::SimpleAtoi(digits, &value)) {
    return bad(absl::StrCat("not a size; ", kUnits));
  }
  // A bare number was once taken as bytes, so "host-pool = 1024" meant a 4 KiB pool: a size
  // says its unit (zero aside, the same in every unit).
  if (!bytes && !scaled && value != 0) {
    return bad(absl::StrCat("a size needs a unit (", value, "B if bytes are meant); ", kUnits));
  }
  if (value > kMaxSizeBytes / multiplier) {
    return bad(
        absl::StrCat("too large; at most ", kMaxSizeBytes, " bytes (", kMaxSizeBytes >> 40, "Ti)"));
  }
  return value * multiplier;
}

absl::Status CheckShmCapacity(uint64_t pool_bytes, uint64_t control_bytes,
                              const struct statvfs& shm, std::string* warning) {
  // A file system larger than 2^64 bytes holds anything: its size saturates rather than wraps.
  const uint64_t total = SaturatingMultiply(shm.f_frsize, shm.f_blocks);
  const uint64_t available = SaturatingMultiply(shm.f_frsize, shm.f_bavail);
  const uint64_t needed = SaturatingAdd(pool_bytes, control_bytes);
  if (total < needed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--host-pool = ", pool_bytes, " bytes (plus ", control_bytes,
        " for the catalog, --max-tensors) does not fit /dev/shm, which holds ", total, " bytes (",
        available,
        " free): enlarge /dev/shm (docker run --shm-size=..., Kubernetes: an emptyDir with "
        "medium: Memory and sizeLimit mounted at /dev/shm) or lower --host-pool"));
  }
  if (available < needed) {
    *warning = absl::StrCat("/dev/shm has ", available, " bytes free for a pool of ", pool_bytes,
                            " bytes: creates will fail with RESOURCE_EXHAUSTED once it is full");
  }
  return absl::OkStatus();
}

}  // namespace tensorshm
