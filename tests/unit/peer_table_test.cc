// PeerTable (server/core/access.h): credentials by descriptor, never answered for a descriptor that
// is no longer the socket they were read from, and dropped once their connection is gone.
#include <sys/socket.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/core/access.h"

namespace tensorshm {
namespace {

std::pair<int, int> SocketPair() {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {fds[0], fds[1]};
}

TEST(PeerTableTest, FindsTheCredentialsOfAnOpenConnection) {
  PeerTable peers;
  auto [a, b] = SocketPair();
  ASSERT_TRUE(peers.Add(a, PeerCredentials{11, 1000, 1001}).ok());
  absl::StatusOr<PeerCredentials> found = peers.Find(absl::StrCat("fd:", a));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->pid, 11);
  EXPECT_EQ(found->uid, 1000u);
  EXPECT_EQ(found->gid, 1001u);
  for (const std::string& peer :
       {absl::StrCat("fd:", b), std::string("fd:"), std::string("fd:x"), std::string("fd:-1"),
        std::string("unix:/tmp/s"), absl::StrCat("ipv4:127.0.0.1:", a)}) {
    EXPECT_TRUE(absl::IsNotFound(peers.Find(peer).status())) << peer;
  }
  close(a);
  close(b);
}

TEST(PeerTableTest, ReusedDescriptorNeverInheritsTheOldPeersCredentials) {
  PeerTable peers;
  auto [a, b] = SocketPair();
  // The daemon's own uid: what a later connection on the same number must not inherit.
  ASSERT_TRUE(peers.Add(a, PeerCredentials{1, 0, 0}).ok());
  close(a);
  close(b);
  // Another connection gets the same number (the lowest free one; made certain with dup2).
  auto [c, d] = SocketPair();
  if (c != a) {
    ASSERT_EQ(dup2(c, a), a);
    close(c);
  }
  absl::StatusOr<PeerCredentials> found = peers.Find(absl::StrCat("fd:", a));
  ASSERT_FALSE(found.ok()) << "fd " << a << " answered uid " << found->uid;
  EXPECT_TRUE(absl::IsNotFound(found.status()));
  EXPECT_TRUE(absl::StrContains(found.status().message(), absl::StrCat("fd:", a)))
      << found.status();
  // Added for the new connection, it answers with the new credentials.
  ASSERT_TRUE(peers.Add(a, PeerCredentials{2, 65534, 65534}).ok());
  found = peers.Find(absl::StrCat("fd:", a));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->uid, 65534u);
  close(a);
  close(d);
}

TEST(PeerTableTest, EntriesOfClosedConnectionsAreDropped) {
  PeerTable peers;
  // A few connections stay open throughout.
  std::vector<std::pair<int, int>> open;
  for (int i = 0; i < 10; ++i) {
    open.push_back(SocketPair());
    ASSERT_TRUE(peers.Add(open.back().first, PeerCredentials{i, 1000, 1000}).ok());
  }
  // 300 connect at once, then all go: their numbers are not reused below.
  std::vector<std::pair<int, int>> burst;
  for (int i = 0; i < 300; ++i) {
    burst.push_back(SocketPair());
    ASSERT_TRUE(peers.Add(burst.back().first, PeerCredentials{100 + i, 1000, 1000}).ok());
  }
  const size_t after_burst = peers.size();
  for (auto [a, b] : burst) {
    close(a);
    close(b);
  }
  // Then connections come and go one at a time.
  for (int i = 0; i < 200; ++i) {
    auto [a, b] = SocketPair();
    ASSERT_TRUE(peers.Add(a, PeerCredentials{1000 + i, 1000, 1000}).ok());
    close(a);
    close(b);
  }
  std::cout << "10 connections open, 300 came and went at once, then 200 one by one: "
            << after_burst << " entries after the burst, " << peers.size() << " at the end\n";
  EXPECT_EQ(after_burst, 310u);
  EXPECT_LE(peers.size(), 11u);
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<PeerCredentials> found = peers.Find(absl::StrCat("fd:", open[i].first));
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->pid, i);
    close(open[i].first);
    close(open[i].second);
  }
}

TEST(PeerTableTest, AddRefusesADescriptorThatIsNotOpen) {
  PeerTable peers;
  auto [a, b] = SocketPair();
  close(a);
  close(b);
  const absl::Status added = peers.Add(a, PeerCredentials{});
  EXPECT_FALSE(added.ok());
  EXPECT_TRUE(absl::StrContains(added.message(), absl::StrCat("fd ", a))) << added;
  EXPECT_EQ(peers.size(), 0u);
}

}  // namespace
}  // namespace tensorshm
