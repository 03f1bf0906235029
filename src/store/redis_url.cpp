// The store URLs of the Redis backends (redis://, redis-cluster://) and Redis Cluster's key slots
// (store/redis_store.hpp).
#include <charconv>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/redis_store.hpp"
#include "redis_url.hpp"

namespace vq {

using redis_detail::parse_int;

namespace {
std::pair<std::string, int> parse_host_port(std::string_view hp) {
  const auto colon = hp.rfind(':');
  if (colon == std::string_view::npos || colon == 0)
    throw InvalidArgument(fmt::format("store URL: '{}' is not host:port", std::string(hp)));
  return {std::string(hp.substr(0, colon)), parse_int(hp.substr(colon + 1), "port", 1, 65535)};
}
}  // namespace

RedisOptions parse_redis_url(const std::string& url) {
  RedisOptions o;
  std::string_view rest(url);
  if (rest.rfind("redis://", 0) == 0) {
    rest.remove_prefix(8);
  } else if (rest.rfind("redis-cluster://", 0) == 0) {
    rest.remove_prefix(16);
    o.cluster = true;
  } else {
    throw InvalidArgument(fmt::format("store URL '{}' does not start with redis:// or redis-cluster://", url));
  }
  std::string_view query;
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  if (const auto at = rest.rfind('@'); at != std::string_view::npos) {
    std::string_view auth = rest.substr(0, at);
    if (auth.empty() || auth[0] != ':') throw InvalidArgument("store URL: credentials must be written :password@ (no user name)");
    o.password = std::string(auth.substr(1));
    rest = rest.substr(at + 1);
  }
  if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    if (o.cluster) throw InvalidArgument("store URL: a Redis Cluster has only database 0; drop the /db part");
    o.db = parse_int(rest.substr(slash + 1), "database", 0, 1 << 20);
    rest = rest.substr(0, slash);
  }
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    o.nodes.push_back(parse_host_port(rest.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  if (o.nodes.empty()) throw InvalidArgument(fmt::format("store URL '{}' names no host:port", url));
  if (!o.cluster && o.nodes.size() > 1) throw InvalidArgument("store URL: redis:// takes one host:port (use redis-cluster:// for several)");
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    const auto eq = kv.find('=');
    const std::string_view k = kv.substr(0, eq), v = eq == std::string_view::npos ? std::string_view() : kv.substr(eq + 1);
    if (k == "prefix") {
      o.prefix = std::string(v);
      if (o.prefix.find_first_of("{}") != std::string::npos) throw InvalidArgument("store URL: prefix may not hold '{' or '}'");
    } else if (k == "timeout_ms") {
      o.timeout_ms = parse_int(v, "timeout_ms", 1, 3600000);
    } else if (k == "part_bytes") {
      o.part_bytes = static_cast<std::uint64_t>(parse_int(v, "part_bytes", 1, 512 << 20));
    } else {
      throw InvalidArgument(fmt::format("store URL: unknown option '{}' (valid: prefix, timeout_ms, part_bytes)", std::string(k)));
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return o;
}

int redis_cluster_slot(std::string_view key) {
  if (const auto open = key.find('{'); open != std::string_view::npos) {
    const auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  // CRC16-XMODEM: polynomial 0x1021, initial value 0, no reflection.
  std::uint16_t crc = 0;
  for (const char c : key) {
    crc ^= static_cast<std::uint16_t>(static_cast<unsigned char>(c) << 8);
    for (int i = 0; i < 8; ++i) crc = static_cast<std::uint16_t>(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return crc & 16383;
}


}  // namespace vq
