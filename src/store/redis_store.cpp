// The redis:// and redis-cluster:// backends (store/redis_store.hpp): a connection class with
// timeouts and one reconnect, a router (one server, or the cluster's slot map with MOVED/ASK), and
// the blob layout (head key, manifest, parts) on top, shared by both. URLs and key slots:
// redis_url.cpp.
#include "veloxquant/store/redis_store.hpp"

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <optional>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "redis_url.hpp"

namespace vq {

namespace {

// ---------------------------------------------------------------------------------------------
// One connection

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;
using Argv = std::vector<std::string_view>;

// The read buffer a connection keeps between replies (see Conn::connect).
constexpr std::size_t kReaderKeepBytes = std::size_t{16} << 20;

class Conn {
 public:
  Conn(std::string host, int port, const RedisOptions& o) : host_(std::move(host)), port_(port), o_(o) {}
  ~Conn() { close(); }
  std::string name() const { return fmt::format("{}:{}", host_, port_); }

  // Send every command in one write and read every reply. A broken connection is reopened and the
  // whole batch resent once (the commands are idempotent). Throws IoError.
  std::vector<Reply> pipeline(const std::vector<Argv>& cmds) {
    try {
      return pipeline_once(cmds);
    } catch (const IoError&) {
      close();
      if (deadline_passed()) throw;  // no retry past the deadline
      return pipeline_once(cmds);
    }
  }

 private:
  void close() {
    if (c_) redisFree(c_);
    c_ = nullptr;
  }
  void connect() {
    const timeval tv = wait();
    c_ = redisConnectWithTimeout(host_.c_str(), port_, tv);
    if (!c_ || c_->err) {
      const std::string why = c_ ? c_->errstr : "out of memory";
      close();
      throw IoError(fmt::format("redis {}: cannot connect: {}", name(), why));
    }
    redisSetTimeout(c_, tv);
    // hiredis frees its read buffer after every reply whose buffer is larger than maxbuf (16 KiB by
    // default), so each large reply (a 3 MB chunk) regrew it from 16 KiB by reallocations, on fresh
    // pages (a fault per page: ~5-10 us each on a virtual machine). Keep buffers up to
    // kReaderKeepBytes between replies.
    if (c_->reader) c_->reader->maxbuf = kReaderKeepBytes;
    std::vector<Argv> setup;
    if (!o_.password.empty()) setup.push_back({"AUTH", o_.password});
    if (o_.db != 0) setup.push_back({"SELECT", db_text_ = std::to_string(o_.db)});
    if (!setup.empty())
      for (auto& r : pipeline_raw(setup))
        if (r->type == REDIS_REPLY_ERROR) {
          const std::string why(r->str, r->len);
          close();
          throw IoError(fmt::format("redis {}: {} refused: {}", name(), setup.size() > 1 || !o_.password.empty() ? "AUTH/SELECT" : "SELECT", why));
        }
  }
  // Nanoseconds left before the store's deadline (KVStore::set_deadline); nullopt: none set.
  std::optional<std::int64_t> ns_left() const {
    const std::int64_t d = o_.deadline_ns ? o_.deadline_ns->load() : 0;
    if (d == 0) return std::nullopt;
    return d - std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  bool deadline_passed() const {
    const auto left = ns_left();
    return left && *left <= 0;
  }
  // The wait for this batch: timeout_ms, or less when the deadline is nearer.
  timeval wait() const {
    std::int64_t us = static_cast<std::int64_t>(o_.timeout_ms) * 1000;
    if (const auto left = ns_left()) us = std::max<std::int64_t>(1000, std::min(us, *left / 1000));
    return timeval{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  }
  std::vector<Reply> pipeline_once(const std::vector<Argv>& cmds) {
    if (deadline_passed()) throw IoError(fmt::format("redis {}: the load's deadline passed before the store answered", name()));
    if (!c_) connect();
    waited_ = wait();
    redisSetTimeout(c_, waited_);
    return pipeline_raw(cmds);
  }
  std::vector<Reply> pipeline_raw(const std::vector<Argv>& cmds) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& cmd : cmds) {
      argv.clear();
      lens.clear();
      for (const auto& a : cmd) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      if (redisAppendCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) fail("send");
    }
    std::vector<Reply> replies;
    replies.reserve(cmds.size());
    for (std::size_t i = 0; i < cmds.size(); ++i) {
      void* r = nullptr;
      if (redisGetReply(c_, &r) != REDIS_OK || !r) fail("read");
      replies.emplace_back(static_cast<redisReply*>(r));
    }
    return replies;
  }
  [[noreturn]] void fail(const char* what) {
    std::string why = c_ && c_->err ? c_->errstr : "connection lost";
    // hiredis reports a read timeout as the socket's EAGAIN ("Resource temporarily unavailable").
    if (c_ && c_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK || why.find("temporarily unavailable") != std::string::npos))
      why = fmt::format("no reply within {} ms ({})", waited_.tv_sec * 1000 + waited_.tv_usec / 1000,
                        deadline_passed() ? "the load's deadline" : "timeout_ms");
    close();
    throw IoError(fmt::format("redis {}: {} failed: {}", name(), what, why));
  }

  std::string host_;
  int port_;
  const RedisOptions& o_;
  redisContext* c_ = nullptr;
  timeval waited_{};  // the wait of the last batch (for a timeout's message)
  std::string db_text_;
};

std::string reply_error(const Reply& r) { return std::string(r->str, r->len); }

// ---------------------------------------------------------------------------------------------
// Routers: where a command goes

struct Cmd {
  std::string key;  // routes the command (its slot)
  Argv argv;
};

class Router {
 public:
  virtual ~Router() = default;
  // Replies in order. An error reply of the server comes back as it is (the caller judges it);
  // a server that cannot be reached is an IoError.
  virtual std::vector<Reply> exec(const std::vector<Cmd>& cmds) = 0;
  // Every key matching a glob pattern, over every master.
  virtual std::vector<std::string> scan(const std::string& pattern) = 0;
};

std::vector<std::string> scan_conn(Conn& c, const std::string& pattern) {
  std::vector<std::string> keys;
  std::string cursor = "0";
  do {
    auto r = std::move(c.pipeline({{"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}})[0]);
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2)
      throw IoError(fmt::format("redis {}: SCAN: {}", c.name(), r->type == REDIS_REPLY_ERROR ? reply_error(r) : "unexpected reply"));
    cursor.assign(r->element[0]->str, r->element[0]->len);
    for (std::size_t i = 0; i < r->element[1]->elements; ++i) keys.emplace_back(r->element[1]->element[i]->str, r->element[1]->element[i]->len);
  } while (cursor != "0");
  return keys;
}

class SingleRouter : public Router {
 public:
  explicit SingleRouter(const RedisOptions& o) : conn_(o.nodes[0].first, o.nodes[0].second, o) {}
  std::vector<Reply> exec(const std::vector<Cmd>& cmds) override {
    std::vector<Argv> argv;
    argv.reserve(cmds.size());
    for (const auto& c : cmds) argv.push_back(c.argv);
    return conn_.pipeline(argv);
  }
  std::vector<std::string> scan(const std::string& pattern) override { return scan_conn(conn_, pattern); }

 private:
  Conn conn_;
};

class ClusterRouter : public Router {
 public:
  explicit ClusterRouter(const RedisOptions& o) : o_(o) {
    for (const auto& [h, p] : o.nodes) seeds_.push_back(fmt::format("{}:{}", h, p));
  }

  std::vector<Reply> exec(const std::vector<Cmd>& cmds) override {
    if (!mapped_) refresh();
    std::vector<Reply> out(cmds.size());
    // Group by the node owning each key's slot: one pipeline per node.
    std::map<std::string, std::vector<std::size_t>> by_node;
    for (std::size_t i = 0; i < cmds.size(); ++i) by_node[owner(cmds[i].key)].push_back(i);
    for (const auto& [node, idx] : by_node) {
      std::vector<Argv> argv;
      for (const auto i : idx) argv.push_back(cmds[i].argv);
      std::vector<Reply> rs;
      try {
        rs = conn(node).pipeline(argv);
      } catch (const IoError&) {
        // The node may have failed over or left: refresh the map and send each command on its own.
        for (const auto i : idx) out[i] = exec_one(cmds[i], /*refresh_first=*/true);
        continue;
      }
      for (std::size_t j = 0; j < idx.size(); ++j) out[idx[j]] = std::move(rs[j]);
    }
    // Redirections, one command at a time.
    for (std::size_t i = 0; i < cmds.size(); ++i)
      if (is_redirect(out[i])) out[i] = exec_one(cmds[i], false, std::move(out[i]));
    return out;
  }

  std::vector<std::string> scan(const std::string& pattern) override {
    refresh();
    std::vector<std::string> masters;
    for (const auto& n : slot_owner_)
      if (!n.empty() && std::find(masters.begin(), masters.end(), n) == masters.end()) masters.push_back(n);
    std::vector<std::string> keys;
    for (const auto& m : masters) {
      auto k = scan_conn(conn(m), pattern);
      keys.insert(keys.end(), k.begin(), k.end());
    }
    return keys;
  }

 private:
  static bool is_redirect(const Reply& r) {
    return r->type == REDIS_REPLY_ERROR && (std::strncmp(r->str, "MOVED ", 6) == 0 || std::strncmp(r->str, "ASK ", 4) == 0);
  }

  // Send one command, following up to 5 redirections; `first` is a reply already received.
  Reply exec_one(const Cmd& cmd, bool refresh_first, Reply first = nullptr) {
    const int slot = redis_cluster_slot(cmd.key);
    if (refresh_first) refresh();
    Reply r = std::move(first);
    std::string node = owner(cmd.key);
    bool asking = false;
    for (int hop = 0; hop < 6; ++hop) {
      if (r) {
        if (!is_redirect(r)) return r;
        // "MOVED 3999 127.0.0.1:6381" or "ASK 3999 127.0.0.1:6381"
        const std::string text = reply_error(r);
        const auto sp = text.rfind(' ');
        node = text.substr(sp + 1);
        asking = text.rfind("ASK ", 0) == 0;
        if (!asking) slot_owner_[static_cast<std::size_t>(slot)] = node;
      }
      if (node.empty()) throw IoError(fmt::format("redis-cluster: no node serves slot {} (key '{}'); is the cluster complete?", slot, cmd.key));
      try {
        if (asking) {
          auto rs = conn(node).pipeline({{"ASKING"}, cmd.argv});
          r = std::move(rs[1]);
        } else {
          r = std::move(conn(node).pipeline({cmd.argv})[0]);
        }
      } catch (const IoError& e) {
        if (hop == 0 && !refresh_first) {
          refresh();
          const std::string again = owner(cmd.key);
          if (again != node) {
            node = again;
            r = nullptr;
            continue;
          }
        }
        throw IoError(fmt::format("redis-cluster: node {} (owner of slot {}, key '{}') is down: {}", node, slot, cmd.key, e.what()));
      }
    }
    throw IoError(fmt::format("redis-cluster: key '{}' (slot {}) redirected more than 5 times", cmd.key, slot));
  }

  std::string owner(const std::string& key) const { return slot_owner_[static_cast<std::size_t>(redis_cluster_slot(key))]; }

  Conn& conn(const std::string& node) {
    auto it = conns_.find(node);
    if (it == conns_.end()) {
      const auto colon = node.rfind(':');
      const std::string host = node.substr(0, colon);
      const int port = redis_detail::parse_int(std::string_view(node).substr(colon + 1), "port", 1, 65535);
      it = conns_.emplace(node, std::make_unique<Conn>(host, port, o_)).first;
    }
    return *it->second;
  }

  // Ask the known nodes (then the seeds) for CLUSTER SLOTS until one answers.
  void refresh() {
    std::vector<std::string> candidates;
    for (const auto& n : slot_owner_)
      if (!n.empty() && std::find(candidates.begin(), candidates.end(), n) == candidates.end()) candidates.push_back(n);
    for (const auto& s : seeds_)
      if (std::find(candidates.begin(), candidates.end(), s) == candidates.end()) candidates.push_back(s);
    std::string errors;
    for (const auto& n : candidates) {
      try {
        auto r = std::move(conn(n).pipeline({{"CLUSTER", "SLOTS"}})[0]);
        if (r->type != REDIS_REPLY_ARRAY) {
          errors += fmt::format("; {}: {}", n, r->type == REDIS_REPLY_ERROR ? reply_error(r) : "unexpected reply");
          continue;
        }
        std::array<std::string, 16384> map;
        for (std::size_t i = 0; i < r->elements; ++i) {
          const redisReply* e = r->element[i];
          if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
            continue;
          const auto lo = e->element[0]->integer, hi = e->element[1]->integer;
          const redisReply* master = e->element[2];
          std::string host(master->element[0]->str, master->element[0]->len);
          if (host.empty()) host = n.substr(0, n.rfind(':'));
          const std::string name = fmt::format("{}:{}", host, master->element[1]->integer);
          for (auto s = std::max<long long>(lo, 0); s <= std::min<long long>(hi, 16383); ++s) map[static_cast<std::size_t>(s)] = name;
        }
        slot_owner_ = std::move(map);
        mapped_ = true;
        return;
      } catch (const IoError& e) {
        errors += fmt::format("; {}", e.what());
      }
    }
    throw IoError(fmt::format("redis-cluster: no node answered CLUSTER SLOTS{}", errors));
  }

  const RedisOptions& o_;
  std::vector<std::string> seeds_;
  std::array<std::string, 16384> slot_owner_{};
  bool mapped_ = false;
  std::map<std::string, std::unique_ptr<Conn>> conns_;
};

// ---------------------------------------------------------------------------------------------
// The blob layout

constexpr char kTagBlob = 'B', kTagManifest = 'M';
constexpr std::size_t kManifestBytes = 1 + 3 * 8;
constexpr std::uint64_t kMaxParts = 1 << 16;  // 4 TiB at the default part size

void put_u64(std::string& s, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
}
std::uint64_t get_u64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

struct Manifest {
  std::uint64_t parts = 0, size = 0, hash = 0;
};

class RedisStore : public KVStore {
 public:
  explicit RedisStore(RedisOptions o) : o_(std::move(o)) {
    if (o_.cluster) router_ = std::make_unique<ClusterRouter>(o_);
    else router_ = std::make_unique<SingleRouter>(o_);
  }

  void set_deadline(std::optional<std::chrono::steady_clock::time_point> until) override {
    o_.deadline_ns->store(until ? std::max<std::int64_t>(1, std::chrono::duration_cast<std::chrono::nanoseconds>(until->time_since_epoch()).count())
                                : 0);
  }

  std::string describe() const override {
    std::string nodes;
    for (const auto& [h, p] : o_.nodes) nodes += fmt::format("{}{}:{}", nodes.empty() ? "" : ",", h, p);
    return fmt::format("{}://{}{}", o_.cluster ? "redis-cluster" : "redis", nodes, o_.db ? fmt::format("/{}", o_.db) : "");
  }

  void put(std::string_view key, std::span<const std::uint8_t> blob) override { write(key, blob, true); }
  // Parts, then the head: a reader of the old head that meets new parts fails the checksum.
  void replace(std::string_view key, std::span<const std::uint8_t> blob) override { write(key, blob, false); }

  void write(std::string_view key, std::span<const std::uint8_t> blob, bool keep_existing) {
    check_store_key(key);
    std::lock_guard lock(mu_);
    const std::string head = head_key(key);
    if (keep_existing && exists_locked(head)) return;
    const std::string_view bytes(reinterpret_cast<const char*>(blob.data()), blob.size());
    std::string value;
    if (blob.size() <= o_.part_bytes) {
      value.reserve(blob.size() + 1);
      value += kTagBlob;
      value += bytes;
    } else {
      // Parts first, so the head (written last) never names a part that is not there yet.
      const std::uint64_t parts = (blob.size() + o_.part_bytes - 1) / o_.part_bytes;
      std::vector<std::string> names;
      for (std::uint64_t i = 0; i < parts; ++i) names.push_back(part_key(head, i));
      std::vector<Cmd> cmds;
      for (std::uint64_t i = 0; i < parts; ++i)
        cmds.push_back({names[i], {"SET", names[i], bytes.substr(i * o_.part_bytes, o_.part_bytes)}});
      for (auto& r : router_->exec(cmds)) ok_or_throw(r, "SET", key);
      value += kTagManifest;
      put_u64(value, parts);
      put_u64(value, blob.size());
      put_u64(value, XXH64(blob.data(), blob.size(), 0));
    }
    auto r = std::move(router_->exec({{head, keep_existing ? Argv{"SET", head, value, "NX"}
                                                         : Argv{"SET", head, value}}})[0]);
    if (r->type == REDIS_REPLY_ERROR) ok_or_throw(r, "SET", key);
  }

  std::optional<Blob> get(std::string_view key) override { return get_at_most(key, UINT64_MAX); }
  std::vector<std::optional<Blob>> get_many(std::span<const std::string> keys) override { return get_many_at_most(keys, UINT64_MAX); }
  std::optional<Blob> get_at_most(std::string_view key, std::uint64_t max_bytes) override {
    const std::string k(key);
    return std::move(get_many_at_most(std::span<const std::string>(&k, 1), max_bytes)[0]);
  }

  std::vector<std::optional<Blob>> get_many_at_most(std::span<const std::string> keys, std::uint64_t max_bytes) override {
    for (const auto& k : keys) check_store_key(k);
    std::lock_guard lock(mu_);
    std::vector<std::string> heads;
    for (const auto& k : keys) heads.push_back(head_key(k));
    // Bounded: a head is read up to one byte past what an allowed blob's head can hold (its tag
    // byte, then max_bytes, or a manifest), so a longer value is known to be too long unread.
    const std::uint64_t head_max = std::max<std::uint64_t>(kManifestBytes, max_bytes >= UINT64_MAX - 2 ? max_bytes : max_bytes + 1);
    const bool bounded = head_max < (std::uint64_t{1} << 40);
    const std::string last = std::to_string(head_max);  // outlives the commands: Argv holds views
    std::vector<Cmd> cmds;
    for (const auto& h : heads) {
      if (bounded) cmds.push_back({h, {"GETRANGE", h, "0", last}});
      else cmds.push_back({h, {"GET", h}});
    }
    auto replies = router_->exec(cmds);
    std::vector<std::optional<Blob>> out(keys.size());
    // Heads that are manifests: fetch all their parts in one more round.
    std::vector<Cmd> part_cmds;
    std::vector<std::pair<std::size_t, Manifest>> split;
    std::vector<std::string> part_names;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const Reply& r = replies[i];
      if (r->type == REDIS_REPLY_NIL) continue;
      if (r->type == REDIS_REPLY_ERROR) ok_or_throw(replies[i], "GET", keys[i]);
      if (bounded && r->type == REDIS_REPLY_STRING && r->len == 0) continue;  // GETRANGE of a missing key is ""
      if (r->type != REDIS_REPLY_STRING || r->len < 1) throw not_ours(keys[i], "an empty or non-string value");
      if (r->str[0] == kTagBlob) {
        if (static_cast<std::uint64_t>(r->len) - 1 > max_bytes) throw_blob_too_large(describe(), keys[i], 0, max_bytes);
        out[i] = Blob(reinterpret_cast<const std::uint8_t*>(r->str) + 1, reinterpret_cast<const std::uint8_t*>(r->str) + r->len);
      } else if (r->str[0] == kTagManifest && r->len == kManifestBytes) {
        const Manifest m{get_u64(r->str + 1), get_u64(r->str + 9), get_u64(r->str + 17)};
        // Bounds before anything is sized by them: a forged head must not make us allocate.
        if (m.parts == 0 || m.parts > kMaxParts || m.parts > m.size || m.size / m.parts > (std::uint64_t{512} << 20))
          throw not_ours(keys[i], "a manifest with impossible sizes");
        if (m.size > max_bytes) throw_blob_too_large(describe(), keys[i], m.size, max_bytes);
        split.emplace_back(i, m);
        for (std::uint64_t p = 0; p < m.parts; ++p) part_names.push_back(part_key(heads[i], p));
      } else {
        throw not_ours(keys[i], "a value without our tag byte");
      }
    }
    if (split.empty()) return out;
    for (const auto& n : part_names) part_cmds.push_back({n, {"GET", n}});
    auto parts = router_->exec(part_cmds);
    std::size_t next = 0;
    for (const auto& [i, m] : split) {
      Blob b;
      b.reserve(std::min<std::uint64_t>(m.size, std::uint64_t{256} << 20));  // grows further only as parts arrive
      for (std::uint64_t p = 0; p < m.parts; ++p, ++next) {
        const Reply& r = parts[next];
        if (r->type == REDIS_REPLY_ERROR) ok_or_throw(parts[next], "GET", keys[i]);
        if (r->type != REDIS_REPLY_STRING) throw not_ours(keys[i], fmt::format("part {} of {} missing", p, m.parts));
        if (b.size() + r->len > m.size) throw not_ours(keys[i], "parts longer than the manifest says");
        b.insert(b.end(), reinterpret_cast<const std::uint8_t*>(r->str), reinterpret_cast<const std::uint8_t*>(r->str) + r->len);
      }
      if (b.size() != m.size || XXH64(b.data(), b.size(), 0) != m.hash)
        throw not_ours(keys[i], "reassembled parts that do not match the manifest's size or checksum");
      out[i] = std::move(b);
    }
    return out;
  }

  bool exists(std::string_view key) override {
    check_store_key(key);
    std::lock_guard lock(mu_);
    return exists_locked(head_key(key));
  }

  bool remove(std::string_view key) override {
    check_store_key(key);
    std::lock_guard lock(mu_);
    const std::string head = head_key(key);
    auto r = std::move(router_->exec({{head, {"GETRANGE", head, "0", std::to_string(kManifestBytes - 1)}}})[0]);
    if (r->type == REDIS_REPLY_ERROR) ok_or_throw(r, "GETRANGE", key);
    if (r->type != REDIS_REPLY_STRING || r->len == 0) return false;
    std::uint64_t parts = 0;
    if (r->str[0] == kTagManifest && r->len == kManifestBytes) parts = get_u64(r->str + 1);
    // A forged count costs no more than the most parts a put ever writes (a 2^40 count once took 18 GB).
    parts = std::min(parts, kMaxParts);
    // Head first: once it is gone no reader looks for the parts.
    auto d = std::move(router_->exec({{head, {"DEL", head}}})[0]);
    if (d->type == REDIS_REPLY_ERROR) ok_or_throw(d, "DEL", key);
    std::vector<std::string> names;
    for (std::uint64_t p = 0; p < parts; ++p) names.push_back(part_key(head, p));
    std::vector<Cmd> cmds;
    for (const auto& n : names) cmds.push_back({n, {"DEL", n}});
    if (!cmds.empty()) router_->exec(cmds);
    return d->type == REDIS_REPLY_INTEGER && d->integer > 0;
  }

  std::vector<std::string> list() override {
    std::lock_guard lock(mu_);
    return list_locked();
  }

  StoreStats stats() override {
    std::lock_guard lock(mu_);
    StoreStats s;
    s.backend = o_.cluster ? "redis-cluster" : "redis";
    const auto keys = list_locked();
    std::vector<std::string> heads;
    for (const auto& k : keys) heads.push_back(head_key(k));
    std::vector<Cmd> cmds;
    // Argv holds views: the range end must outlive cmds, so it is a named string, not a temporary.
    const std::string last = std::to_string(kManifestBytes - 1);
    for (const auto& h : heads) cmds.push_back({h, {"GETRANGE", h, "0", last}});
    for (const auto& h : heads) cmds.push_back({h, {"STRLEN", h}});
    auto rs = router_->exec(cmds);
    for (std::size_t i = 0; i < heads.size(); ++i) {
      const Reply& g = rs[i];
      const Reply& n = rs[heads.size() + i];
      if (g->type != REDIS_REPLY_STRING || g->len == 0 || n->type != REDIS_REPLY_INTEGER) continue;  // removed meanwhile
      ++s.blobs;
      s.bytes += g->str[0] == kTagManifest && g->len == kManifestBytes ? get_u64(g->str + 9) : static_cast<std::uint64_t>(n->integer - 1);
    }
    return s;
  }

 private:
  std::string head_key(std::string_view key) const { return o_.prefix + "{" + std::string(key) + "}"; }
  static std::string part_key(const std::string& head, std::uint64_t i) { return head + "#" + std::to_string(i); }

  bool exists_locked(const std::string& head) {
    auto r = std::move(router_->exec({{head, {"EXISTS", head}}})[0]);
    if (r->type == REDIS_REPLY_ERROR) ok_or_throw(r, "EXISTS", head);
    return r->type == REDIS_REPLY_INTEGER && r->integer > 0;
  }

  std::vector<std::string> list_locked() {
    std::string pattern;
    for (const char c : o_.prefix) {
      if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') pattern += '\\';
      pattern += c;
    }
    pattern += "{*}";  // heads only: parts end in "}#N"
    std::vector<std::string> keys;
    for (const auto& k : router_->scan(pattern)) {
      const std::size_t open = o_.prefix.size();
      if (k.size() < open + 3 || k[open] != '{' || k.back() != '}') continue;
      keys.push_back(k.substr(open + 1, k.size() - open - 2));
    }
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    return keys;
  }

  void ok_or_throw(const Reply& r, const char* cmd, std::string_view key) const {
    if (r->type == REDIS_REPLY_ERROR)
      throw IoError(fmt::format("{}: {} of '{}' failed: {}", describe(), cmd, std::string(key), reply_error(r)));
  }
  FormatError not_ours(std::string_view key, const std::string& what) const {
    return FormatError(fmt::format("{}: key '{}' holds {}, not a blob this store wrote", describe(), std::string(key), what));
  }

  RedisOptions o_;
  std::mutex mu_;
  std::unique_ptr<Router> router_;
};

}  // namespace

std::unique_ptr<KVStore> make_redis_store(const RedisOptions& options) { return std::make_unique<RedisStore>(options); }

}  // namespace vq
