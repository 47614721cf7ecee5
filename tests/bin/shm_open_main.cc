// tsm_shm_open: opens a POSIX shm object by name the way Triton's system shared-memory extension
// registers a region (shm_open(key, O_RDWR), then mmap(PROT_READ | PROT_WRITE, MAP_SHARED)),
// then fills or checks a byte range of it. Run as another uid (setpriv) by shm_group_tests.
//
//   tsm_shm_open NAME OFFSET LENGTH fill BYTE     writes BYTE over [OFFSET, OFFSET + LENGTH)
//   tsm_shm_open NAME OFFSET LENGTH expect BYTE   checks that every byte there is BYTE
//   tsm_shm_open NAME                             only opens and maps it
//
// Prints "mapped NAME: N bytes" once mapped. Exits 0 on success; 2 on bad usage; 3 if shm_open
// fails (printing "shm_open(NAME, O_RDWR): <strerror>"); 4 if mmap fails; 5 on a byte that
// differs, or a range past the object.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2 && argc != 6) {
    std::cerr << "usage: tsm_shm_open NAME [OFFSET LENGTH fill|expect BYTE]\n";
    return 2;
  }
  const std::string name = argv[1];
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    std::cout << "shm_open(" << name << ", O_RDWR): " << std::strerror(errno) << std::endl;
    return 3;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    std::cout << "fstat(" << name << "): " << std::strerror(errno) << std::endl;
    return 4;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) {
    std::cout << "mmap(" << name << ", PROT_READ | PROT_WRITE): " << std::strerror(errno)
              << std::endl;
    return 4;
  }
  close(fd);
  std::cout << "mapped " << name << ": " << size << " bytes" << std::endl;
  if (argc == 2) return 0;
  const uint64_t offset = std::strtoull(argv[2], nullptr, 10);
  const uint64_t length = std::strtoull(argv[3], nullptr, 10);
  const std::string mode = argv[4];
  const auto byte = static_cast<unsigned char>(std::strtoul(argv[5], nullptr, 0));
  if (offset > size || length > size - offset || (mode != "fill" && mode != "expect")) {
    std::cout << "range [" << offset << ", +" << length << ") or mode " << mode
              << " does not fit an object of " << size << " bytes" << std::endl;
    return 5;
  }
  unsigned char* data = static_cast<unsigned char*>(address) + offset;
  if (mode == "fill") {
    std::memset(data, byte, length);
    std::cout << "filled " << length << " bytes" << std::endl;
    return 0;
  }
  for (uint64_t i = 0; i < length; ++i) {
    if (data[i] != byte) {
      std::cout << "byte " << offset + i << " is " << static_cast<int>(data[i]) << ", expected "
                << static_cast<int>(byte) << std::endl;
      return 5;
    }
  }
  std::cout << "checked " << length << " bytes" << std::endl;
  return 0;
}
