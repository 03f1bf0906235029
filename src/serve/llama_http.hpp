// A JSON request to a llama-server and its checked reply: what the prompt cache proxy and the llama
// engine (serve/llama_engine.hpp) both send (private to src/serve).
#pragma once
#include <httplib.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/error.hpp"

namespace vq::serve_detail {

// Bodies read from or buffered for a llama-server; a larger reply is an error.
inline constexpr std::size_t kMaxLlamaBodyBytes = std::size_t{64} << 20;

// A reply read through a bound: the body is taken as it arrives and the read stops once it would
// pass `limit` bytes (nothing more is read or kept), never after the whole reply sits in memory.
struct BoundedReply {
  httplib::Error error = httplib::Error::Success;  // Success: a reply came (status, body)
  int status = 0;
  httplib::Headers headers;
  std::string body;
  bool over_limit = false;  // the reply was longer than the limit (error is then Canceled)
};

inline BoundedReply send_bounded(httplib::Client& client, httplib::Request req, std::size_t limit) {
  BoundedReply out;
  req.content_receiver = [&out, limit](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
    if (n > limit - out.body.size()) {
      out.over_limit = true;
      return false;
    }
    out.body.append(data, n);
    return true;
  };
  const auto r = client.send(req);
  if (!r) {
    out.error = r.error();
    return out;
  }
  out.status = r->status;
  out.headers = r->headers;
  return out;
}

// POST `body` to `route`; its JSON reply. IoError naming `server` (e.g. "http://127.0.0.1:8080")
// when there is no reply, a status other than 200 or a reply over `limit` bytes (read no further);
// FormatError when the reply is not JSON.
inline nlohmann::json post_json(httplib::Client& client, const std::string& server, const std::string& route, const nlohmann::json& body,
                                std::size_t limit = kMaxLlamaBodyBytes) {
  httplib::Request req;
  req.method = "POST";
  req.path = route;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  const BoundedReply r = send_bounded(client, std::move(req), limit);
  if (r.over_limit) throw IoError(fmt::format("llama-server {}: POST {}: reply over {} bytes (read no further)", server, route, limit));
  if (r.error != httplib::Error::Success)
    throw IoError(fmt::format("llama-server {}: POST {} failed ({})", server, route, httplib::to_string(r.error)));
  if (r.status != 200) throw IoError(fmt::format("llama-server {}: POST {} answered {}: {}", server, route, r.status, r.body.substr(0, 300)));
  try {
    return nlohmann::json::parse(r.body);
  } catch (const nlohmann::json::exception&) {
    throw FormatError(fmt::format("llama-server {}: POST {}: the reply is not JSON", server, route));
  }
}

}  // namespace vq::serve_detail
