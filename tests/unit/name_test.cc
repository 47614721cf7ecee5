#include "common/tensor/name.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace tensorshm {
namespace {

TEST(ValidateNameTest, AcceptsTheNameAlphabet) {
  for (const char* name :
       {"a", "batch/17", "model.v2:weights/layer-0_q", "A/B/C", "x..y", ".a", "a.", "...", "0"}) {
    EXPECT_TRUE(ValidateName(name).ok()) << name << ": " << ValidateName(name);
  }
  EXPECT_TRUE(ValidateName(std::string(255, 'x')).ok());
}

TEST(ValidateNameTest, RefusesWithFieldAndValue) {
  struct Bad {
    std::string name;
    std::string mentions;
  };
  for (const Bad& bad : std::vector<Bad>{
           {"", "name = \"\""},
           {"/a", "must not start with '/'"},
           {"a/", "path element \"\""},
           {"a//b", "path element \"\""},
           {".", "path element \".\""},
           {"a/./b", "path element \".\""},
           {"..", "path element \"..\""},
           {"a/..", "path element \"..\""},
           {"a b", "byte 1"},
           {"tab\t", "\\t"},
           {"é", "byte 0"},
           {std::string("nul\0x", 5), "byte 3 (\"\\x00\")"},
           {std::string(256, 'x'), "256 bytes, at most 255"},
       }) {
    absl::Status status = ValidateName(bad.name);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad.name;
    EXPECT_TRUE(absl::StrContains(status.message(), bad.mentions))
        << status.message() << " lacks " << bad.mentions;
    EXPECT_TRUE(absl::StartsWith(status.message(), "name = ")) << status.message();
  }
}

TEST(ValidateNameTest, LongValuesAreShortenedInMessages) {
  absl::Status status = ValidateName(std::string(1000, 'y'));
  EXPECT_LT(status.message().size(), 200u);
}

TEST(ValidateNamePrefixTest, EmptyAndPartialPrefixesAreFine) {
  EXPECT_TRUE(ValidateNamePrefix("").ok());
  EXPECT_TRUE(ValidateNamePrefix("batch/").ok());
  EXPECT_EQ(ValidateNamePrefix("b*").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tensorshm
