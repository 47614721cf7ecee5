#include "common/tensor/name.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tensorshm {
namespace {

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '/' || c == '-';
}

// Quotes a user-supplied value for an error message, escaping what is not printable and
// shortening what is long, so a message stays one readable line.
std::string Quote(absl::string_view value) {
  constexpr size_t kShown = 64;
  std::string shown = absl::CHexEscape(value.substr(0, kShown));
  if (value.size() > kShown) absl::StrAppend(&shown, "...");
  return absl::StrCat("\"", shown, "\"");
}

absl::Status CheckAlphabet(absl::string_view value, absl::string_view field) {
  if (value.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %s: %d bytes, at most %d allowed",
                                                      field, Quote(value), value.size(),
                                                      kMaxNameLength));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    if (!IsNameChar(value[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s = %s: byte %d (%s) is not one of [A-Za-z0-9._:/-]", field,
                          Quote(value), i, Quote(value.substr(i, 1))));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateName(absl::string_view name, absl::string_view field) {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = \"\": names must not be empty"));
  }
  if (absl::Status s = CheckAlphabet(name, field); !s.ok()) return s;
  if (name.front() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", Quote(name), ": names must not start with '/'"));
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == absl::string_view::npos) end = name.size();
    absl::string_view element = name.substr(start, end - start);
    if (element.empty() || element == "." || element == "..") {
      return absl::InvalidArgumentError(absl::StrCat(field, " = ", Quote(name), ": path element ",
                                                     Quote(element),
                                                     " is not allowed (empty, '.' or '..')"));
    }
    start = end + 1;
  }
  return absl::OkStatus();
}

absl::Status ValidateNamePrefix(absl::string_view prefix, absl::string_view field) {
  return CheckAlphabet(prefix, field);
}

absl::Status ValidateClientText(const std::string& client_name, const std::string& client_version) {
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"open.client_name", &client_name},
        {"open.client_version", &client_version}}) {
    if (value->size() > kMaxClientText) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", value->size(), " bytes; at most ", kMaxClientText));
    }
  }
  return absl::OkStatus();
}

}  // namespace tensorshm
