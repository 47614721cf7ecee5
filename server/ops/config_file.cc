#include "server/ops/config_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "toml.hpp"

namespace tensorshm {
namespace {

// One TOML value as the flag's text; INVALID_ARGUMENT naming the key if the flag takes no
// value of its type.
absl::StatusOr<std::string> ValueText(const std::string& path, const FlagSpec& flag,
                                      const toml::value& value) {
  auto bad = [&](absl::string_view expected) {
    return absl::InvalidArgumentError(absl::StrCat("--config ", path, ": ", flag.name, " = ",
                                                   toml::format(value), ": expected ", expected));
  };
  if (flag.kind == FlagKind::kSwitch) {
    if (!value.is_boolean()) return bad("true or false");
    return value.as_boolean() ? "true" : "false";
  }
  if (value.is_string()) return value.as_string().str;
  if (value.is_integer()) return std::to_string(value.as_integer());
  return bad(absl::StrCat("a string or a whole number (", flag.value_name, ")"));
}

}  // namespace

absl::StatusOr<FlagValues> ReadConfigFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    const int error = errno;
    const std::string message =
        absl::StrCat("--config ", path, ": cannot read: ", std::strerror(error));
    return error == ENOENT   ? absl::NotFoundError(message)
           : error == EACCES ? absl::PermissionDeniedError(message)
                             : absl::InvalidArgumentError(message);
  }
  toml::value root;
  try {
    root = toml::parse(file, path);
  } catch (const std::exception& e) {
    // toml11 names the file, line and column, and shows the line.
    return absl::InvalidArgumentError(absl::StrCat("--config ", path, ": not TOML: ", e.what()));
  }
  FlagValues values;
  for (const auto& [key, value] : root.as_table()) {
    const FlagSpec* flag = nullptr;
    for (const FlagSpec& candidate : DaemonFlags()) {
      if (candidate.name == key) flag = &candidate;
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config ", path, ": unknown key \"", key,
                       "\" (keys are tensorshmd's long flag names, see tensorshmd --help)"));
    }
    std::vector<std::string>& texts = values[key];
    if (value.is_array() && flag->kind == FlagKind::kRepeated) {
      for (const toml::value& item : value.as_array()) {
        absl::StatusOr<std::string> text = ValueText(path, *flag, item);
        if (!text.ok()) return text.status();
        texts.push_back(*std::move(text));
      }
      continue;
    }
    absl::StatusOr<std::string> text = ValueText(path, *flag, value);
    if (!text.ok()) return text.status();
    texts.push_back(*std::move(text));
  }
  return values;
}

}  // namespace tensorshm
