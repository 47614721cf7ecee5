// The control segment is a wire format between a daemon and its restarted self: its sizes and
// offsets are pinned by static_asserts in the header; this test states them once more, plus the
// segment-level arithmetic.
#include "common/shm/catalog_layout.h"

#include "gtest/gtest.h"

namespace tensorshm {
namespace {

static_assert(sizeof(TensorRecord) == 1024, "TensorRecord is 1 KiB");
static_assert(offsetof(TensorRecord, state) == 0, "state word first");
static_assert(sizeof(TensorRecord::shape) == 32 * 8);
static_assert(sizeof(TensorRecord::name) == 256);
static_assert(sizeof(SegmentRecord) == 64);
static_assert(sizeof(ControlHeader) == 4096);

TEST(CatalogLayoutTest, SegmentSizeFollowsRecordCount) {
  EXPECT_EQ(RecordsOffset(), 4096u + 1024u * 64u);
  EXPECT_EQ(ControlSegmentBytes(0), RecordsOffset());
  EXPECT_EQ(ControlSegmentBytes(4096), RecordsOffset() + 4096u * 1024u);
}

TEST(CatalogLayoutTest, MagicSpellsTheFormat) {
  const char* bytes = reinterpret_cast<const char*>(&kControlMagic);
  EXPECT_EQ(std::string(bytes, 8), "TNSMCTL1");
}

TEST(CatalogLayoutTest, StateValuesAreStable) {
  EXPECT_EQ(static_cast<uint32_t>(RecordState::kFree), 0u);
  EXPECT_EQ(static_cast<uint32_t>(RecordState::kWriting), 1u);
  EXPECT_EQ(static_cast<uint32_t>(RecordState::kPublished), 2u);
  EXPECT_EQ(static_cast<uint32_t>(RecordState::kUnbound), 3u);
}

}  // namespace
}  // namespace tensorshm
