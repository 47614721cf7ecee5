// The RAII owners of descriptors and mappings (common/base/unique_fd.h, mapping.h): each closes
// or unmaps exactly once, moves hand ownership on, release() gives it up.
#include "common/base/unique_fd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <utility>

#include "common/base/mapping.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1; }

int Pipe(int* other) {
  int ends[2];
  EXPECT_EQ(pipe(ends), 0);
  *other = ends[1];
  return ends[0];
}

TEST(UniqueFdTest, ClosesOnceWhenItGoesAndMovesHandOwnershipOn) {
  int writer = -1;
  const int reader = Pipe(&writer);
  {
    UniqueFd owner(reader);
    EXPECT_TRUE(owner.valid());
    UniqueFd moved = std::move(owner);
    EXPECT_FALSE(owner.valid());  // NOLINT(bugprone-use-after-move): what a move leaves
    EXPECT_EQ(moved.get(), reader);
    EXPECT_TRUE(IsOpen(reader));
  }
  EXPECT_FALSE(IsOpen(reader));
  UniqueFd kept(writer);
  const int number = kept.release();
  EXPECT_FALSE(kept.valid());
  EXPECT_TRUE(IsOpen(number));
  kept.reset(number);
  kept = UniqueFd();  // assigning closes what was held
  EXPECT_FALSE(IsOpen(number));
}

TEST(MappingTest, UnmapsWhenItGoesAndTakesMapFailedAsNone) {
  const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(address, MAP_FAILED);
  unsigned char resident = 0;
  {
    Mapping owner(address, size);
    Mapping moved = std::move(owner);
    EXPECT_FALSE(owner.valid());  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(moved.size(), size);
    moved.data()[0] = 1;
    EXPECT_EQ(mincore(address, size, &resident), 0);
  }
  // mincore on an unmapped range fails with ENOMEM.
  EXPECT_EQ(mincore(address, size, &resident), -1);
  Mapping none(MAP_FAILED, size);
  EXPECT_FALSE(none.valid());
  EXPECT_EQ(none.size(), 0u);
}

}  // namespace
}  // namespace tensorshm
