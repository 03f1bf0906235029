// A JSON request to a llama-server and its checked reply: what the prompt cache proxy and the llama
// engine (serve/llama_engine.hpp) both send (private to src/serve).
#pragma once
#include <httplib.h>

#include <cstddef>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/error.hpp"

namespace vq::serve_detail {

// Bodies read from or buffered for a llama-server; a larger reply is an error.
inline constexpr std::size_t kMaxLlamaBodyBytes = std::size_t{64} << 20;

// POST `body` to `route`; its JSON reply. IoError naming `server` (e.g. "http://127.0.0.1:8080")
// when there is no reply, a status other than 200 or a reply over kMaxLlamaBodyBytes; FormatError
// when the reply is not JSON.
inline nlohmann::json post_json(httplib::Client& client, const std::string& server, const std::string& route, const nlohmann::json& body) {
  const auto r = client.Post(route, body.dump(), "application/json");
  if (!r) throw IoError(fmt::format("llama-server {}: POST {} failed ({})", server, route, httplib::to_string(r.error())));
  if (r->status != 200) throw IoError(fmt::format("llama-server {}: POST {} answered {}: {}", server, route, r->status, r->body.substr(0, 300)));
  if (r->body.size() > kMaxLlamaBodyBytes) throw IoError(fmt::format("llama-server {}: POST {}: reply over 64 MiB", server, route));
  try {
    return nlohmann::json::parse(r->body);
  } catch (const nlohmann::json::exception&) {
    throw FormatError(fmt::format("llama-server {}: POST {}: the reply is not JSON", server, route));
  }
}

}  // namespace vq::serve_detail
