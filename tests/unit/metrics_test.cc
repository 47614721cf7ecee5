// --metrics: the rendering of the figures (names, HELP and TYPE, label escaping, histogram
// buckets), the parsing of the address, and the HTTP server's own behaviour (port in use, 404,
// stop). The daemon's figures against real work are checked by tests/python/test_metrics.py.
#include "server/ops/metrics.h"

#include <dlpack/dlpack.h>
#include <httplib.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/ops/metrics_http.h"
#include "server/rpc/channel_handler.h"

namespace tensorshm {
namespace {

StoreFigures SomeStat() {
  StoreFigures stat;
  stat.tensors = 5;
  stat.names = 3;
  stat.leases = 7;
  stat.sessions = 2;
  stat.pools.push_back(PoolFigures{
      .device = {kDLCPU, 0}, .capacity_bytes = 1 << 30, .used_bytes = 4096, .segments = 1});
  stat.pools.push_back(PoolFigures{
      .device = {kDLCUDA, 0}, .capacity_bytes = 1 << 20, .used_bytes = 256, .segments = 2});
  return stat;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// Every sample line, "name{labels}" -> value text.
std::map<std::string, std::string> Samples(const std::string& text) {
  std::map<std::string, std::string> samples;
  for (const std::string& line : Lines(text)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    samples[line.substr(0, space)] = line.substr(space + 1);
  }
  return samples;
}

TEST(MetricsRender, GaugesAreStatsFiguresWithDeviceLabels) {
  Metrics metrics;
  const std::string text = RenderMetrics(SomeStat(), metrics, MetricsInfo{"1.2.3", 1700000000.5});
  std::map<std::string, std::string> samples = Samples(text);
  EXPECT_EQ(samples["tensorshm_pool_capacity_bytes{device=\"cpu\"}"], "1073741824");
  EXPECT_EQ(samples["tensorshm_pool_used_bytes{device=\"cpu\"}"], "4096");
  EXPECT_EQ(samples["tensorshm_pool_segments{device=\"cpu\"}"], "1");
  EXPECT_EQ(samples["tensorshm_pool_capacity_bytes{device=\"cuda:0\"}"], "1048576");
  EXPECT_EQ(samples["tensorshm_pool_used_bytes{device=\"cuda:0\"}"], "256");
  EXPECT_EQ(samples["tensorshm_pool_segments{device=\"cuda:0\"}"], "2");
  EXPECT_EQ(samples["tensorshm_tensors"], "5");
  EXPECT_EQ(samples["tensorshm_names"], "3");
  EXPECT_EQ(samples["tensorshm_leases"], "7");
  EXPECT_EQ(samples["tensorshm_sessions"], "2");
  EXPECT_EQ(samples["tensorshm_build_info{version=\"1.2.3\"}"], "1");
  EXPECT_EQ(std::stod(samples["process_start_time_seconds"]), 1700000000.5);
}

TEST(MetricsRender, EveryFamilyHasHelpAndTypeBeforeItsSamples) {
  Metrics metrics;
  metrics.CountOp(MetricOp::kCreate, absl::StatusCode::kOk);
  metrics.ObserveAcquireWait(absl::Milliseconds(3), absl::StatusCode::kDeadlineExceeded);
  const std::string text = RenderMetrics(SomeStat(), metrics, MetricsInfo{"v", 0});
  std::map<std::string, std::string> types;
  std::set<std::string> helped;
  int samples = 0;
  for (const std::string& line : Lines(text)) {
    if (absl::StartsWith(line, "# HELP ")) {
      std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      ASSERT_EQ(parts.size(), 4u) << line;
      EXPECT_TRUE(helped.insert(parts[2]).second) << "HELP twice: " << line;
      continue;
    }
    if (absl::StartsWith(line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      ASSERT_EQ(parts.size(), 4u) << line;
      EXPECT_TRUE(helped.count(parts[2])) << "TYPE before HELP: " << line;
      EXPECT_TRUE(types.emplace(parts[2], parts[3]).second) << "TYPE twice: " << line;
      continue;
    }
    ++samples;
    const std::string name = line.substr(0, line.find_first_of("{ "));
    // A sample belongs to the family declared last whose name it extends.
    std::string family = name;
    if (!types.count(family)) {
      for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
        if (absl::EndsWith(name, suffix)) family = name.substr(0, name.size() - suffix.size());
      }
    }
    ASSERT_TRUE(types.count(family)) << "no TYPE for " << line;
    if (family != name) {
      EXPECT_EQ(types[family], "histogram") << line;
    }
    if (family != "process_start_time_seconds") {
      EXPECT_TRUE(absl::StartsWith(family, "tensorshm_")) << line;
    }
    if (types[family] == "counter") {
      EXPECT_TRUE(absl::EndsWith(family, "_total")) << line;
    }
  }
  EXPECT_GT(samples, 20);
  EXPECT_EQ(types["tensorshm_operations_total"], "counter");
  EXPECT_EQ(types["tensorshm_allocation_failures_total"], "counter");
  EXPECT_EQ(types["tensorshm_reclaimed_bytes_total"], "counter");
  EXPECT_EQ(types["tensorshm_acquire_wait_seconds"], "histogram");
  EXPECT_EQ(types["tensorshm_pool_used_bytes"], "gauge");
  EXPECT_EQ(types["tensorshm_sessions"], "gauge");
}

TEST(MetricsRender, LabelValuesAreEscaped) {
  EXPECT_EQ(EscapeLabelValue("plain-1.0"), "plain-1.0");
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  Metrics metrics;
  const std::string text =
      RenderMetrics(SomeStat(), metrics, MetricsInfo{"1.0 \"dev\"\\\nnext", 0});
  EXPECT_TRUE(
      absl::StrContains(text, "tensorshm_build_info{version=\"1.0 \\\"dev\\\"\\\\\\nnext\"} 1\n"))
      << text;
  // The newline in the value did not start a line of its own.
  for (const std::string& line : Lines(text)) EXPECT_FALSE(absl::StartsWith(line, "next")) << line;
}

TEST(MetricsRender, OperationsByOpAndCode) {
  Metrics metrics;
  metrics.CountOp(MetricOp::kCreate, absl::StatusCode::kOk);
  metrics.CountOp(MetricOp::kCreate, absl::OkStatus());
  metrics.CountOp(MetricOp::kCreate, absl::ResourceExhaustedError("full"));
  metrics.CountOp(MetricOp::kSessionOpen, absl::StatusCode::kPermissionDenied);
  metrics.CountOp(MetricOp::kFastPath, static_cast<absl::StatusCode>(99));  // not a gRPC code
  metrics.CountAllocationFailure(AllocationFailure::kQuota);
  metrics.CountReclaimed(8192, 2, 3);
  metrics.CountReclaimed(4096, 1, 0);
  std::map<std::string, std::string> samples =
      Samples(RenderMetrics(SomeStat(), metrics, MetricsInfo{"v", 0}));
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"create\",code=\"OK\"}"], "2");
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"create\",code=\"RESOURCE_EXHAUSTED\"}"], "1");
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"session_open\",code=\"PERMISSION_DENIED\"}"],
            "1");
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"fast_path\",code=\"UNKNOWN\"}"], "1");
  // OK is there for every operation from the start; other codes once they happened.
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"acquire\",code=\"OK\"}"], "0");
  EXPECT_EQ(samples.count("tensorshm_operations_total{op=\"acquire\",code=\"NOT_FOUND\"}"), 0u);
  EXPECT_EQ(samples["tensorshm_allocation_failures_total{reason=\"quota\"}"], "1");
  EXPECT_EQ(samples["tensorshm_allocation_failures_total{reason=\"pool\"}"], "0");
  EXPECT_EQ(samples["tensorshm_reclaimed_bytes_total"], "12288");
  EXPECT_EQ(samples["tensorshm_reclaimed_tensors_total"], "3");
  EXPECT_EQ(samples["tensorshm_reclaimed_leases_total"], "3");
}

TEST(MetricsRender, FastAcquiresAreAcquiresAnsweredOkAndCountedApart) {
  Metrics metrics;
  metrics.CountOp(MetricOp::kAcquire, absl::StatusCode::kOk);
  metrics.CountFastAcquires(40);
  metrics.CountFastAcquires(2);
  std::map<std::string, std::string> samples =
      Samples(RenderMetrics(SomeStat(), metrics, MetricsInfo{"v", 0}));
  EXPECT_EQ(samples["tensorshm_operations_total{op=\"acquire\",code=\"OK\"}"], "43");
  EXPECT_EQ(samples["tensorshm_fast_path_acquires_total"], "42");
}

TEST(MetricsRender, StockIsApartFromUsed) {
  StoreFigures stat = SomeStat();
  stat.stocked_tensors = 3;
  stat.pools[0].stock_bytes = 12288;
  Metrics metrics;
  std::map<std::string, std::string> samples =
      Samples(RenderMetrics(stat, metrics, MetricsInfo{"v", 0}));
  EXPECT_EQ(samples["tensorshm_stocked_tensors"], "3");
  EXPECT_EQ(samples["tensorshm_pool_stock_bytes{device=\"cpu\"}"], "12288");
  EXPECT_EQ(samples["tensorshm_pool_used_bytes{device=\"cpu\"}"], "4096");
  EXPECT_EQ(samples["tensorshm_pool_stock_bytes{device=\"cuda:0\"}"], "0");
}

TEST(MetricsRender, HistogramBucketsAreCumulativeWithSumAndCount) {
  Metrics metrics;
  for (double seconds : {0.0005, 0.001, 0.003, 0.003, 2.0, 100.0}) {
    metrics.ObserveAcquireWait(absl::Seconds(seconds), absl::StatusCode::kOk);
  }
  metrics.ObserveAcquireWait(absl::Milliseconds(50), absl::StatusCode::kDeadlineExceeded);
  std::map<std::string, std::string> samples =
      Samples(RenderMetrics(SomeStat(), metrics, MetricsInfo{"v", 0}));
  auto bucket = [&](const std::string& code, const std::string& le) {
    const std::string key =
        "tensorshm_acquire_wait_seconds_bucket{code=\"" + code + "\",le=\"" + le + "\"}";
    EXPECT_TRUE(samples.count(key)) << key;
    return samples[key];
  };
  // An observation on a bound falls in that bucket (le: less or equal).
  EXPECT_EQ(bucket("OK", "0.001"), "2");
  EXPECT_EQ(bucket("OK", "0.0025"), "2");
  EXPECT_EQ(bucket("OK", "0.005"), "4");
  EXPECT_EQ(bucket("OK", "1"), "4");
  EXPECT_EQ(bucket("OK", "2.5"), "5");
  EXPECT_EQ(bucket("OK", "60"), "5");
  EXPECT_EQ(bucket("OK", "+Inf"), "6");
  EXPECT_EQ(samples["tensorshm_acquire_wait_seconds_count{code=\"OK\"}"], "6");
  EXPECT_NEAR(std::stod(samples["tensorshm_acquire_wait_seconds_sum{code=\"OK\"}"]), 102.0075,
              1e-9);
  EXPECT_EQ(bucket("DEADLINE_EXCEEDED", "0.025"), "0");
  EXPECT_EQ(bucket("DEADLINE_EXCEEDED", "0.05"), "1");
  EXPECT_EQ(bucket("DEADLINE_EXCEEDED", "+Inf"), "1");
  EXPECT_EQ(samples["tensorshm_acquire_wait_seconds_count{code=\"DEADLINE_EXCEEDED\"}"], "1");
  // Codes never observed have no series; OK always has one.
  EXPECT_EQ(samples.count("tensorshm_acquire_wait_seconds_count{code=\"CANCELLED\"}"), 0u);
  // Every bucket of a series is at least the one before it, and +Inf equals the count.
  Metrics empty;
  std::map<std::string, std::string> none =
      Samples(RenderMetrics(SomeStat(), empty, MetricsInfo{"v", 0}));
  EXPECT_EQ(none["tensorshm_acquire_wait_seconds_bucket{code=\"OK\",le=\"+Inf\"}"], "0");
  EXPECT_EQ(none["tensorshm_acquire_wait_seconds_count{code=\"OK\"}"], "0");
}

TEST(MetricsRender, WaitingGauge) {
  Metrics metrics;
  metrics.WaitStarted();
  metrics.WaitStarted();
  metrics.WaitEnded();
  EXPECT_EQ(
      Samples(RenderMetrics(SomeStat(), metrics, MetricsInfo{"v", 0}))["tensorshm_acquire_waiting"],
      "1");
}

TEST(MetricsRender, ChannelRequestsCountAsTheirOperation) {
  v1::ChannelRequest request;
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kUnknown);
  request.mutable_create();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kCreate);
  request.mutable_publish();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kPublish);
  request.mutable_delete_();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kDelete);
  request.mutable_bind();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kBind);
  request.mutable_segment();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kSegment);
  request.mutable_fast_path();
  EXPECT_EQ(ChannelRequestOp(request), MetricOp::kFastPath);
}

TEST(MetricsAddress, Parses) {
  absl::StatusOr<MetricsAddress> v4 = ParseMetricsAddress("127.0.0.1:9464");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(v4->host, "127.0.0.1");
  EXPECT_EQ(v4->port, 9464);
  absl::StatusOr<MetricsAddress> v6 = ParseMetricsAddress("[::1]:0");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 0);
  EXPECT_EQ(FormatMetricsAddress(*v6), "[::1]:0");
  absl::StatusOr<MetricsAddress> name = ParseMetricsAddress("localhost:65535");
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_EQ(name->host, "localhost");
  EXPECT_EQ(name->port, 65535);
}

TEST(MetricsAddress, RefusesNamingTheFlagAndValue) {
  for (const char* bad : {"", "9464", "127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:65536",
                          "127.0.0.1:-1", "127.0.0.1:94x", "::1:9464", "[::1]9464", "[::1",
                          "[1.2.3.4]:80", "host name:80", "a/b:80"}) {
    absl::StatusOr<MetricsAddress> address = ParseMetricsAddress(bad);
    ASSERT_FALSE(address.ok()) << bad;
    EXPECT_EQ(address.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(
        absl::StartsWith(address.status().message(), absl::StrCat("--metrics = \"", bad, "\": ")))
        << address.status();
  }
}

TEST(MetricsAddress, Loopback) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.1.2.3"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("::"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
}

TEST(MetricsServer, ServesMetricsOnlyAndRefusesAPortInUse) {
  int renders = 0;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(MetricsAddress{"127.0.0.1", 0}, [&renders] {
        ++renders;  // requests are served one at a time here
        return std::string("tensorshm_sessions 0\n");
      });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->address().port;
  ASSERT_GT(port, 0);

  httplib::Client client("127.0.0.1", port);
  httplib::Result metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics) << httplib::to_string(metrics.error());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->body, "tensorshm_sessions 0\n");
  EXPECT_EQ(metrics->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  for (const char* path : {"/", "/metrics/x", "/metricsx", "/debug"}) {
    httplib::Result other = client.Get(path);
    ASSERT_TRUE(other) << path;
    EXPECT_EQ(other->status, 404) << path;
  }
  EXPECT_EQ(renders, 1);

  // A second server on the same port is refused, naming the flag and the address.
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start(MetricsAddress{"127.0.0.1", port}, [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::StartsWith(second.status().message(),
                               absl::StrCat("--metrics = \"127.0.0.1:", port, "\": ")))
      << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "in use")) << second.status();

  // Stopped, it no longer answers; stopping twice is harmless.
  (*server)->Stop();
  (*server)->Stop();
  httplib::Client after("127.0.0.1", port);
  after.set_connection_timeout(1);
  EXPECT_FALSE(after.Get("/metrics"));
}

TEST(MetricsServer, RefusesAHostThatDoesNotResolve) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(MetricsAddress{"no-such-host.invalid", 0}, [] { return std::string(); });
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(
      absl::StartsWith(server.status().message(), "--metrics = \"no-such-host.invalid:0\": host"))
      << server.status();
}

TEST(MetricsServer, StopsAtOnceAfterStart) {
  // Stop right after Start: whether or not the listening thread has begun, it ends.
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server =
        MetricsServer::Start(MetricsAddress{"127.0.0.1", 0}, [] { return std::string(); });
    ASSERT_TRUE(server.ok()) << server.status();
    (*server)->Stop();
  }
}

}  // namespace
}  // namespace tensorshm
