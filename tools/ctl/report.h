// tensorshmctl's reports: what each subcommand learns from the daemon, as one JSON document (the
// `-o json` output, keys in docs/tensorshmctl.md), and the same document rendered as text for a
// person (`-o text`). The JSON is the single model: text is made from it, never from the daemon's
// answers directly, so the two outputs cannot disagree.
#ifndef TENSORSHM_TOOLS_CTL_REPORT_H_
#define TENSORSHM_TOOLS_CTL_REPORT_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tensorshm/client.h"

namespace tensorshm::ctl {

// Reports from the client's answers; `now_unix_ms` (this host's clock) gives the ages.
nlohmann::json StatusReport(const ServerStats& stats);
nlohmann::json TensorReport(const TensorInfo& tensor, int64_t now_unix_ms);  // inspect
nlohmann::json ListReport(const std::vector<TensorInfo>& tensors, int64_t now_unix_ms);
nlohmann::json SessionsReport(const std::vector<SessionInfo>& sessions, int64_t now_unix_ms);

// Text renderings of the reports above, each ending in a newline.
std::string StatusText(const nlohmann::json& report);
std::string InspectText(const nlohmann::json& report);
std::string ListText(const nlohmann::json& report, const std::string& prefix);
std::string SessionsText(const nlohmann::json& report);

// 1536 -> "1.5 KiB"; below 1 KiB in bytes ("24 B").
std::string FormatBytes(int64_t bytes);
// An age in seconds as the largest two units: "45s", "3m05s", "2h07m", "4d03h".
std::string FormatAge(int64_t seconds);

}  // namespace tensorshm::ctl

#endif  // TENSORSHM_TOOLS_CTL_REPORT_H_
