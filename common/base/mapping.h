// Mapping: the one owner of an mmap()ed range; unmapped when it goes (or on reset). Move-only.
#ifndef TENSORSHM_COMMON_BASE_MAPPING_H_
#define TENSORSHM_COMMON_BASE_MAPPING_H_

#include <sys/mman.h>

#include <cstddef>
#include <utility>

namespace tensorshm {

class Mapping {
 public:
  Mapping() = default;
  // Takes [address, address + size) as mmap() returned it (MAP_FAILED or null: none).
  Mapping(void* address, size_t size)
      : address_(address == MAP_FAILED ? nullptr : address), size_(address_ ? size : 0) {}
  ~Mapping() { reset(); }
  Mapping(Mapping&& other) noexcept
      : address_(std::exchange(other.address_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      reset();
      address_ = std::exchange(other.address_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  char* data() const { return static_cast<char*>(address_); }
  size_t size() const { return size_; }
  bool valid() const { return address_ != nullptr; }
  explicit operator bool() const { return valid(); }

  // Unmaps what is held.
  void reset() {
    if (address_ != nullptr) ::munmap(address_, size_);
    address_ = nullptr;
    size_ = 0;
  }
  // The range, no longer owned here: the caller unmaps it.
  [[nodiscard]] std::pair<void*, size_t> release() {
    return {std::exchange(address_, nullptr), std::exchange(size_, 0)};
  }

 private:
  void* address_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_BASE_MAPPING_H_
