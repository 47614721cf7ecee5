// libFuzzer target over the memory channel's framing (common/shm/channel_frame.h) and the daemon's
// frame loop (server/rpc/memory_channel.cc): an arbitrary byte stream, cut at arbitrary points,
// goes
//   1. through FrameReader, chunk by chunk,
//   2. through ReceiveFrame, written chunk by chunk into a socket pair (some chunks carrying
//      descriptors), and
//   3. to a real ChannelServer over a socket pair, whose answers are read back;
// and each must agree with a reference split of the whole stream: the same frames in the same
// order, stopping at the same point, no descriptor leaked, and the server answering exactly the
// requests before the first frame it must refuse.
//
// The input is a little program that builds the stream (so that large frames cost a few bytes):
// byte 0 seeds the cut points, byte 1 picks the chunks that carry a descriptor, then ops:
//   op % 4 == 0: n = next byte; the next n input bytes, raw
//   op % 4 == 1: n = next 2 bytes; a frame whose body is the next n input bytes (fewer if the
//                input ends)
//   op % 4 == 2: the next 4 bytes as a raw frame header (any length, kMaxChannelFrame + 1 too)
//   op % 4 == 3: n = next 3 bytes; a frame of n bytes, all the next byte (n up to 16 MiB)
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/shm/channel_frame.h"
#include "google/protobuf/stubs/logging.h"
#include "server/ops/log.h"
#include "server/rpc/memory_channel.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {
namespace {

// The stream is cut at most this long: the program's ops could ask for far more.
constexpr size_t kMaxStream = 1 << 20;

struct Program {
  std::string stream;
  std::vector<size_t> cuts;  // chunk lengths, summing to stream.size()
  uint8_t fd_chunks = 0;     // bit i % 8 set: chunk i carries a descriptor
};

Program Build(const uint8_t* data, size_t size) {
  Program program;
  if (size < 2) return program;
  uint32_t seed = data[0] * 2654435761u + 1;
  program.fd_chunks = data[1];
  size_t at = 2;
  auto next = [&]() -> uint32_t { return at < size ? data[at++] : 0; };
  while (at < size && program.stream.size() < kMaxStream) {
    const uint8_t op = data[at++];
    switch (op % 4) {
      case 0: {
        const size_t n = next();
        for (size_t i = 0; i < n && at < size; ++i) program.stream.push_back(char(data[at++]));
        break;
      }
      case 1: {
        const uint32_t n = next() | next() << 8;
        const size_t take = std::min<size_t>(n, size - at);
        char header[kFrameHeaderBytes];
        EncodeFrameHeader(static_cast<uint32_t>(take), header);
        program.stream.append(header, sizeof(header));
        program.stream.append(reinterpret_cast<const char*>(data + at), take);
        at += take;
        break;
      }
      case 2:
        for (int i = 0; i < 4; ++i) program.stream.push_back(char(next()));
        break;
      default: {
        const uint32_t n = next() | next() << 8 | next() << 16;
        const char fill = char(next());
        char header[kFrameHeaderBytes];
        EncodeFrameHeader(n, header);
        program.stream.append(header, sizeof(header));
        program.stream.append(std::min<size_t>(n, kMaxStream), fill);
        break;
      }
    }
  }
  if (program.stream.size() > kMaxStream) program.stream.resize(kMaxStream);
  for (size_t left = program.stream.size(); left > 0;) {
    seed = seed * 1103515245u + 12345u;
    // Mostly small cuts, sometimes large ones.
    const size_t cut = std::min<size_t>(
        left, (seed >> 16) % 4 == 0 ? 1 + (seed >> 8) % 100000 : 1 + (seed >> 16) % 13);
    program.cuts.push_back(cut);
    left -= cut;
  }
  return program;
}

struct Reference {
  std::vector<std::string> frames;  // whole frames before the end or the first too-large one
  bool too_large = false;           // stopped at a frame over kMaxChannelFrame
};

Reference Split(const std::string& stream) {
  Reference reference;
  size_t at = 0;
  while (stream.size() - at >= kFrameHeaderBytes) {
    const uint32_t length = DecodeFrameHeader(stream.data() + at);
    if (length > kMaxChannelFrame) {
      reference.too_large = true;
      break;
    }
    if (stream.size() - at - kFrameHeaderBytes < length) break;
    reference.frames.push_back(stream.substr(at + kFrameHeaderBytes, length));
    at += kFrameHeaderBytes + length;
  }
  return reference;
}

// The lowest free descriptor number: unchanged across an input, no descriptor leaked.
int LowestFreeFd() {
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  TSM_CHECK(fd >= 0);
  close(fd);
  return fd;
}

void CheckFrameReader(const Program& program, const Reference& reference) {
  FrameReader reader;
  std::vector<std::string> frames;
  bool too_large = false;
  size_t at = 0;
  for (size_t cut : program.cuts) {
    reader.Append(program.stream.data() + at, cut);
    at += cut;
    absl::string_view body;
    uint32_t length = 0;
    FrameReader::Result result;
    while ((result = reader.Next(&body, &length)) == FrameReader::Result::kFrame) {
      TSM_CHECK(length == body.size());
      frames.emplace_back(body);
    }
    if (result == FrameReader::Result::kTooLarge) {
      TSM_CHECK(length > kMaxChannelFrame);
      // It keeps saying so.
      TSM_CHECK(reader.Next(&body, &length) == FrameReader::Result::kTooLarge);
      too_large = true;
      break;
    }
  }
  TSM_CHECK(frames == reference.frames);
  TSM_CHECK(too_large == reference.too_large);
  // What a parsed request serializes to parses back to the same request.
  for (const std::string& frame : frames) {
    v1::ChannelRequest request;
    if (!request.ParseFromString(frame)) continue;
    v1::ChannelRequest again;
    TSM_CHECK(again.ParseFromString(request.SerializeAsString()));
    TSM_CHECK(again.SerializeAsString() == request.SerializeAsString());
  }
}

// Writes the program's chunks into `socket` (some with a descriptor), then shuts it for writing.
void WriteChunks(int socket, const Program& program, bool with_fds) {
  size_t at = 0;
  for (size_t i = 0; i < program.cuts.size(); ++i) {
    const bool attach = with_fds && (program.fd_chunks >> (i % 8) & 1) != 0;
    const int fd = attach ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
    const absl::Status sent = SendWithFd(
        socket, absl::string_view(program.stream.data() + at, program.cuts[i]), fd, false, "fuzz");
    if (fd >= 0) close(fd);
    // The reader may have stopped (a frame too large) and closed its end.
    if (!sent.ok()) break;
    at += program.cuts[i];
  }
  shutdown(socket, SHUT_WR);
}

void CheckReceiveFrame(const Program& program, const Reference& reference) {
  int pair[2];
  TSM_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  std::thread writer(WriteChunks, pair[1], std::cref(program), /*with_fds=*/true);
  std::vector<std::string> frames;
  absl::Status status;
  while (true) {
    std::string body;
    int fd = -1;
    status = ReceiveFrame(pair[0], &body, &fd, "fuzz");
    if (!status.ok()) {
      TSM_CHECK(fd == -1);
      break;
    }
    if (fd >= 0) close(fd);
    frames.push_back(std::move(body));
  }
  close(pair[0]);  // unblocks a writer the reader left behind
  writer.join();
  close(pair[1]);
  // A frame may end early where two descriptors came with it (INVALID_ARGUMENT); otherwise the
  // frames are the reference's, and the end is the stream's end or the frame too large.
  TSM_CHECK(frames.size() <= reference.frames.size());
  for (size_t i = 0; i < frames.size(); ++i) TSM_CHECK(frames[i] == reference.frames[i]);
  if (status.code() == absl::StatusCode::kUnavailable) {
    TSM_CHECK(frames.size() == reference.frames.size() && !reference.too_large);
  } else {
    TSM_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  }
}

// The daemon's frame loop, answering each request with its sequence.
ChannelServer& Server() {
  static ChannelServer* server = [] {
    absl::StatusOr<std::unique_ptr<ChannelServer>> started =
        ChannelServer::Start([](ChannelConnection&, const v1::ChannelRequest& request) {
          ChannelReply reply;
          reply.response.set_sequence(request.sequence());
          reply.response.set_code(static_cast<int32_t>(request.kind_case()));
          return reply;
        });
    TSM_CHECK(started.ok());
    return started->release();
  }();
  return *server;
}

void CheckChannelServer(const Program& program, const Reference& reference) {
  // What the server must answer: every request up to the first frame it refuses (too large, or
  // not a ChannelRequest); then it closes.
  std::vector<v1::ChannelRequest> expected;
  for (const std::string& frame : reference.frames) {
    v1::ChannelRequest request;
    if (!request.ParseFromString(frame)) break;
    expected.push_back(std::move(request));
  }
  // Answers are small, but a stream of thousands of empty frames could fill the socket before
  // they are read: such inputs are checked by the other two parts only.
  if (expected.size() > 2000) return;
  int pair[2];
  TSM_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  TSM_CHECK(fcntl(pair[1], F_SETFL, O_NONBLOCK) == 0);
  Server().Add(UniqueFd(pair[1]), PeerCredentials{getpid(), getuid(), getgid()});
  std::thread writer(WriteChunks, pair[0], std::cref(program), /*with_fds=*/false);
  size_t answered = 0;
  while (true) {
    std::string body;
    int fd = -1;
    if (!ReceiveFrame(pair[0], &body, &fd, "fuzz").ok()) break;  // closed (or reset)
    TSM_CHECK(fd == -1);
    v1::ChannelResponse response;
    TSM_CHECK(response.ParseFromString(body));
    TSM_CHECK(answered < expected.size());
    TSM_CHECK(response.sequence() == expected[answered].sequence());
    TSM_CHECK(response.code() == static_cast<int32_t>(expected[answered].kind_case()));
    ++answered;
  }
  writer.join();
  close(pair[0]);
  TSM_CHECK(answered == expected.size());
  TSM_CHECK(Server().connection_count() == 0);
}

}  // namespace
}  // namespace tensorshm

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  // Refused connections are logged as warnings: expected here.
  tensorshm::SetLogLevel(tensorshm::LogLevel::kError);
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tensorshm::Program program = tensorshm::Build(data, size);
  const tensorshm::Reference reference = tensorshm::Split(program.stream);
  const int lowest_fd = tensorshm::LowestFreeFd();
  tensorshm::CheckFrameReader(program, reference);
  tensorshm::CheckReceiveFrame(program, reference);
  tensorshm::CheckChannelServer(program, reference);
  TSM_CHECK(tensorshm::LowestFreeFd() == lowest_fd);
  return 0;
}
