#include "client/sealed_ranges.h"

#include <dlpack/dlpack.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/shm/catalog_layout.h"
#include "common/shm/tensor_record.h"

namespace tensorshm {
namespace sealed_ranges {
namespace {

// A slot's address: 0 free, kClaimed while its other fields are written.
constexpr uintptr_t kClaimed = 1;

struct SegmentSlot {
  std::atomic<uintptr_t> address;
  std::atomic<uint64_t> size;
  std::atomic<uint64_t> instance;
  std::atomic<uint64_t> segment_id;
};

struct CatalogSlot {
  std::atomic<uintptr_t> address;
  std::atomic<uint64_t> size;
};

// Zero-initialized before any code runs (static storage, constant initialization).
constexpr size_t kSegmentSlots = 4 * kMaxSegments;
constexpr size_t kCatalogSlots = 64;
SegmentSlot segment_slots[kSegmentSlots];
CatalogSlot catalog_slots[kCatalogSlots];

struct sigaction previous_action;  // written once, before the handler is installed
std::atomic<bool> reported{false};

// Appends to a fixed buffer, never past its end (no allocation: the handler calls these).
class Text {
 public:
  Text(char* out, uint64_t capacity) : out_(out), capacity_(capacity) {}
  Text& Add(const char* text) { return Add(text, std::strlen(text)); }
  Text& Add(const char* text, uint64_t length) {
    for (uint64_t i = 0; i < length && length_ < capacity_; ++i) out_[length_++] = text[i];
    return *this;
  }
  Text& Decimal(uint64_t value) {
    char digits[20];
    int n = 0;
    do {
      digits[n++] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value != 0);
    while (n > 0 && length_ < capacity_) out_[length_++] = digits[--n];
    return *this;
  }
  Text& Hex(uint64_t value) {
    Add("0x");
    char digits[16];
    int n = 0;
    do {
      digits[n++] = "0123456789abcdef"[value % 16];
      value /= 16;
    } while (value != 0);
    while (n > 0 && length_ < capacity_) out_[length_++] = digits[--n];
    return *this;
  }
  uint64_t length() const { return length_; }

 private:
  char* out_;
  uint64_t capacity_;
  uint64_t length_ = 0;
};

// The record of the sealed tensor that the control segments say lies at `offset` of segment
// (`instance`, `segment_id`), copied into `found`; false if none says so.
bool FindTensor(uint64_t instance, uint64_t segment_id, uint64_t offset, TensorRecord* found) {
  if (segment_id < 1 || segment_id > kMaxSegments) return false;
  for (CatalogSlot& slot : catalog_slots) {
    const uintptr_t address = slot.address.load(std::memory_order_acquire);
    if (address <= kClaimed) continue;
    const uint64_t size = slot.size.load(std::memory_order_relaxed);
    const auto* base = reinterpret_cast<const char*>(address);
    if (size < RecordsOffset()) continue;
    const auto* header = reinterpret_cast<const ControlHeader*>(base);
    const uint32_t count = __atomic_load_n(&header->record_count, __ATOMIC_RELAXED);
    if (ControlSegmentBytes(count) > size) continue;
    const auto* segment = reinterpret_cast<const SegmentRecord*>(
        base + kControlHeaderBytes + (segment_id - 1) * sizeof(SegmentRecord));
    if (__atomic_load_n(&segment->instance, __ATOMIC_RELAXED) != instance ||
        __atomic_load_n(&segment->segment_id, __ATOMIC_RELAXED) != segment_id) {
      continue;  // another daemon's catalog, or the segment's id was given to another object
    }
    const auto* records = reinterpret_cast<const TensorRecord*>(base + RecordsOffset());
    for (uint32_t i = 0; i < count; ++i) {
      const TensorRecord& record = records[i];
      const auto state = static_cast<RecordState>(record.state.load(std::memory_order_acquire));
      if (state != RecordState::kPublished && state != RecordState::kUnbound) continue;
      const uint64_t start = __atomic_load_n(&record.offset, __ATOMIC_RELAXED);
      const uint64_t length = __atomic_load_n(&record.length, __ATOMIC_RELAXED);
      if (__atomic_load_n(&record.segment_id, __ATOMIC_RELAXED) != segment_id ||
          record.device_type != kDLCPU || offset < start || offset - start >= length) {
        continue;
      }
      CopyRecord(record, *found);
      return true;
    }
  }
  return false;
}

void OnSegv(int signal, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (info != nullptr && info->si_code == SEGV_ACCERR &&
      !reported.exchange(true, std::memory_order_relaxed)) {
    char report[1536];
    const uint64_t length =
        Describe(reinterpret_cast<uintptr_t>(info->si_addr), report, sizeof(report));
    if (length > 0) {
      uint64_t written = 0;
      while (written < length) {
        const ssize_t n = write(STDERR_FILENO, report + written, length - written);
        if (n <= 0 && errno != EINTR) break;
        if (n > 0) written += static_cast<uint64_t>(n);
      }
    } else {
      reported.store(false, std::memory_order_relaxed);  // not ours: a later one may be
    }
  }
  errno = saved_errno;
  // What would have happened without this handler: the one before it, or the default action
  // (restored: the write faults again on return and stops the process as a SIGSEGV).
  if ((previous_action.sa_flags & SA_SIGINFO) != 0) {
    if (previous_action.sa_sigaction != nullptr)
      previous_action.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_action.sa_handler == SIG_DFL || previous_action.sa_handler == SIG_IGN) {
    struct sigaction default_action;
    std::memset(&default_action, 0, sizeof(default_action));
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    sigaction(signal, &default_action, nullptr);
    return;
  }
  previous_action.sa_handler(signal);
}

void InstallHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* setting = std::getenv("TENSORSHM_SEGV_REPORT");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return;
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnSegv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    // The handler reads previous_action only once it is installed, and it is written before.
    if (sigaction(SIGSEGV, nullptr, &previous_action) != 0) return;
    sigaction(SIGSEGV, &action, nullptr);
  });
}

}  // namespace

void AddSegment(const void* address, uint64_t size, uint64_t instance, uint64_t segment_id) {
  InstallHandler();
  for (SegmentSlot& slot : segment_slots) {
    uintptr_t free = 0;
    if (!slot.address.compare_exchange_strong(free, kClaimed, std::memory_order_acquire)) {
      continue;
    }
    slot.size.store(size, std::memory_order_relaxed);
    slot.instance.store(instance, std::memory_order_relaxed);
    slot.segment_id.store(segment_id, std::memory_order_relaxed);
    slot.address.store(reinterpret_cast<uintptr_t>(address), std::memory_order_release);
    return;
  }
}

void RemoveSegment(const void* address) {
  for (SegmentSlot& slot : segment_slots) {
    uintptr_t expected = reinterpret_cast<uintptr_t>(address);
    if (slot.address.compare_exchange_strong(expected, 0, std::memory_order_release)) return;
  }
}

void AddCatalog(const void* address, uint64_t size) {
  for (CatalogSlot& slot : catalog_slots) {
    uintptr_t free = 0;
    if (!slot.address.compare_exchange_strong(free, kClaimed, std::memory_order_acquire)) {
      continue;
    }
    slot.size.store(size, std::memory_order_relaxed);
    slot.address.store(reinterpret_cast<uintptr_t>(address), std::memory_order_release);
    return;
  }
}

void RemoveCatalog(const void* address) {
  for (CatalogSlot& slot : catalog_slots) {
    uintptr_t expected = reinterpret_cast<uintptr_t>(address);
    if (slot.address.compare_exchange_strong(expected, 0, std::memory_order_release)) return;
  }
}

uint64_t Describe(uintptr_t fault, char* out, uint64_t capacity) {
  for (SegmentSlot& slot : segment_slots) {
    const uintptr_t address = slot.address.load(std::memory_order_acquire);
    if (address <= kClaimed) continue;
    const uint64_t size = slot.size.load(std::memory_order_relaxed);
    if (fault < address || fault - address >= size) continue;
    const uint64_t instance = slot.instance.load(std::memory_order_relaxed);
    const uint64_t segment_id = slot.segment_id.load(std::memory_order_relaxed);
    const uint64_t offset = fault - address;
    Text text(out, capacity);
    text.Add("\ntensorshm: this process wrote to ");
    TensorRecord record;
    if (FindTensor(instance, segment_id, offset, &record)) {
      const auto state = static_cast<RecordState>(record.state.load(std::memory_order_relaxed));
      text.Add(state == RecordState::kPublished ? "the published tensor \""
                                                : "the tensor published as \"")
          .Add(record.name, record.name_length <= kRecordNameBytes ? record.name_length : 0)
          .Add(state == RecordState::kPublished ? "\"" : "\" (that name since deleted or replaced)")
          .Add(": its bytes lie at ")
          .Hex(address + record.offset + record.byte_offset)
          .Add("-")
          .Hex(address + record.offset + record.byte_offset +
               static_cast<uint64_t>(record.nbytes > 0 ? record.nbytes : 0))
          .Add(", the write hit ")
          .Hex(fault);
    } else {
      text.Add("a published tensor at ")
          .Hex(fault)
          .Add(" (offset ")
          .Decimal(offset)
          .Add(" of tensorshm segment ")
          .Decimal(segment_id)
          .Add(", mapped at ")
          .Hex(address)
          .Add("-")
          .Hex(address + size)
          .Add(")");
    }
    text.Add(
        ".\ntensorshm: a published tensor is sealed: read-only in every process, because every "
        "consumer maps the same memory and relies on it not changing. Write to a private copy "
        "instead (torch: torch.from_dlpack(t).clone(); numpy: np.array(np.from_dlpack(t)); "
        "C/C++: copy the bytes), or create, fill and publish a new tensor.\n"
        "tensorshm: the process stops now (SIGSEGV); $TENSORSHM_SEGV_REPORT=0 leaves this "
        "report out.\n");
    return text.length();
  }
  return 0;
}

}  // namespace sealed_ranges
}  // namespace tensorshm
