// docs/metrics.md lists every metric family a real tensorshmd serves, and nothing it does not:
// the table is checked against a scrape, so it cannot fall behind the daemon again (issue 21:
// it had missed tensorshm_creates_waiting and the eviction counters).
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tensorshm/client.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

// The port of "; metrics on http://127.0.0.1:PORT/metrics" in the daemon's start-up line.
int MetricsPort(const std::string& output) {
  const std::string marker = "metrics on http://127.0.0.1:";
  const size_t at = output.find(marker);
  if (at == std::string::npos) return -1;
  const size_t start = at + marker.size();
  int port = -1;
  if (!absl::SimpleAtoi(output.substr(start, output.find('/', start) - start), &port)) return -1;
  return port;
}

TEST(MetricsDocsTest, EveryServedFamilyIsDocumentedAndEveryDocumentedOneServed) {
  absl::StatusOr<TestDaemon> daemon =
      TestDaemon::Start("metrics-docs", {"--metrics", "127.0.0.1:0", "--evict", "lru"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  {
    // Some work, so that every family has what it shows after use.
    tensorshm::StatusOr<std::shared_ptr<Client>> client =
        Client::Connect(ClientOptions{daemon->socket(), "metrics-docs"});
    ASSERT_TRUE(client.ok()) << client.status();
    tensorshm::StatusOr<WritableTensor> w = (*client)->Create({{kDLFloat, 32, 1}, {256}});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*client)->Publish(*w, "t").ok());
    tensorshm::StatusOr<DLManagedTensorVersioned*> t = (*client)->Acquire("t");
    ASSERT_TRUE(t.ok()) << t.status();
    (*t)->deleter(*t);
  }
  const int port = MetricsPort(daemon->process().Output());
  ASSERT_GT(port, 0) << daemon->process().Output();
  httplib::Client http("127.0.0.1", port);
  httplib::Result scrape = http.Get("/metrics");
  ASSERT_TRUE(scrape) << httplib::to_string(scrape.error());
  ASSERT_EQ(scrape->status, 200);
  std::set<std::string> served;
  for (absl::string_view line : absl::StrSplit(scrape->body, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    served.insert(std::string(line.substr(0, line.find(' '))));
  }
  ASSERT_GE(served.size(), 10u) << scrape->body;

  std::ifstream file(std::string(TSM_SOURCE_DIR) + "/docs/metrics.md");
  ASSERT_TRUE(file) << TSM_SOURCE_DIR << "/docs/metrics.md";
  std::set<std::string> documented;  // the first column of the table
  for (std::string line; std::getline(file, line);) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "| `")) continue;
    documented.insert(std::string(rest.substr(0, rest.find('`'))));
  }
  for (const std::string& name : served) {
    EXPECT_TRUE(documented.contains(name))
        << name << " is served but not in the table of docs/metrics.md";
  }
  for (const std::string& name : documented) {
    EXPECT_TRUE(served.contains(name))
        << name << " is in the table of docs/metrics.md but not served";
  }
  std::cout << served.size() << " families served, " << documented.size() << " documented\n";
}

}  // namespace
}  // namespace tensorshm::testing
