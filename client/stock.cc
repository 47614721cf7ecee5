// ClientCore's stock (buffers the daemon made ahead of need, kept on a StockShelf), and the
// expectation of a publish it gives the daemon while a stocked buffer is filled.
#include <algorithm>
#include <utility>

#include "client/client_core.h"

namespace tensorshm {

void ClientCore::AddStock(const google::protobuf::RepeatedPtrField<v1::StockedBuffer>& stocked) {
  for (const v1::StockedBuffer& buffer : stocked) {
    // Populated on the sender thread: the publish or create that brought the stock does not
    // wait for it (CreateOnce populates whatever is left when it takes the buffer).
    absl::StatusOr<HostBuffer> mapped = mappings_.Buffer(buffer.location(), /*populate=*/false);
    if (!mapped.ok()) continue;
    PopulateLater([segment = mapped->segment, offset = buffer.location().offset(),
                   length = buffer.location().length()] { segment->Populate(offset, length); });
    stock_.Put({buffer.tensor_id(), *std::move(mapped), buffer.location()});
  }
}

void ClientCore::ExpectFill(uint64_t length) {
  // A fill at a conservative 4 GB/s (a single-threaded copy from cold memory), plus what the
  // caller does around it; the daemon bounds the wait to 1 ms anyway.
  constexpr uint64_t kBytesPerMicro = 4096;
  constexpr uint64_t kAround = 100;
  memory_.Expect(session_id(), static_cast<uint32_t>(
                                   std::min<uint64_t>(length / kBytesPerMicro + kAround, 1000)));
}

}  // namespace tensorshm
