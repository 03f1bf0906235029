// JSON output of the CLI. Paths and metadata need not be UTF-8; nlohmann's plain dump() throws on
// such strings (exit 3, "internal error"). Every command prints through this: invalid bytes become
// U+FFFD and the output stays valid JSON.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace vqcli {

inline std::string json_text(const nlohmann::json& j, int indent = 2) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace vqcli
