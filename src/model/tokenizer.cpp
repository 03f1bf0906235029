// llama2.c tokenizer: file reader, run.c-exact BPE encoder (priority queue), decoder.
#include "veloxquant/model/tokenizer.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <queue>
#include <sstream>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"

namespace vq {

namespace {

// run.c starts its best score at -1e10 and merges only strictly better pairs.
constexpr float kNoMergeScore = -1e10f;
constexpr int kMaxTokenLengthCap = 1 << 16;

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// "<0xXX>" -> the byte, else -1.
int byte_piece_value(std::string_view p) {
  if (p.size() != 6 || p[0] != '<' || p[1] != '0' || p[2] != 'x' || p[5] != '>') return -1;
  const int hi = hex_value(p[3]), lo = hex_value(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

Tokenizer Tokenizer::parse(std::string_view bytes, std::optional<int> vocab_size, const std::string& name) {
  if (vocab_size && *vocab_size < 1) throw InvalidArgument(fmt::format("{}: vocab_size must be >= 1, got {}", name, *vocab_size));
  Tokenizer t;
  std::size_t pos = 0;
  auto need = [&](std::size_t n, const char* what, int index) {
    if (n > bytes.size() - pos)
      throw FormatError(fmt::format("{}: truncated at byte {} while reading {} of token {} (file has {} bytes)", name, pos, what, index,
                                    bytes.size()));
  };
  auto i32 = [&](const char* what, int index) {
    need(4, what, index);
    std::int32_t v;
    std::memcpy(&v, bytes.data() + pos, 4);
    pos += 4;
    return v;
  };
  if (bytes.size() < 4) throw FormatError(fmt::format("{}: {} bytes is too short for a llama2.c tokenizer", name, bytes.size()));
  t.max_token_length_ = i32("max_token_length", -1);
  if (t.max_token_length_ < 1 || t.max_token_length_ > kMaxTokenLengthCap)
    throw FormatError(fmt::format("{}: max_token_length {} is outside 1..{}: not a llama2.c tokenizer file", name, t.max_token_length_,
                                  kMaxTokenLengthCap));
  for (int i = 0; vocab_size ? i < *vocab_size : pos < bytes.size(); ++i) {
    need(4, "the score", i);
    float score;
    std::memcpy(&score, bytes.data() + pos, 4);
    pos += 4;
    const std::int32_t len = i32("the length", i);
    if (len < 0 || len > t.max_token_length_)
      throw FormatError(fmt::format("{}: token {} has length {}, outside 0..max_token_length {}", name, i, len, t.max_token_length_));
    need(static_cast<std::size_t>(len), "the bytes", i);
    t.vocab_.emplace_back(bytes.substr(pos, static_cast<std::size_t>(len)));
    t.scores_.push_back(score);
    pos += static_cast<std::size_t>(len);
  }
  if (pos != bytes.size())
    throw FormatError(fmt::format("{}: {} trailing bytes after {} tokens: the model's vocab_size does not match this tokenizer", name,
                                  bytes.size() - pos, t.vocab_.size()));
  if (t.vocab_.empty()) throw FormatError(fmt::format("{}: the tokenizer holds no tokens", name));
  t.ids_.reserve(t.vocab_.size() * 2);
  for (int i = 0; i < static_cast<int>(t.vocab_.size()); ++i) t.ids_.emplace(t.vocab_[static_cast<std::size_t>(i)], i);  // first id wins
  if (auto sp = t.lookup(" ")) t.space_id_ = *sp;
  bool bytes_ok = t.vocab_.size() >= static_cast<std::size_t>(kByteBase + 256);
  for (int b = 0; bytes_ok && b < 256; ++b) bytes_ok = byte_piece_value(t.vocab_[static_cast<std::size_t>(kByteBase + b)]) == b;
  t.byte_fallback_base_ = bytes_ok ? kByteBase : -1;
  return t;
}

Tokenizer Tokenizer::load(const std::string& path, std::optional<int> vocab_size) {
  return parse(read_input_text(path, "tokenizer"), vocab_size, path);
}

const std::string& Tokenizer::piece(int id) const {
  require(id >= 0 && id < vocab_size(), "token id {} is outside the vocabulary 0..{}", id, vocab_size() - 1);
  return vocab_[static_cast<std::size_t>(id)];
}

float Tokenizer::score(int id) const {
  piece(id);
  return scores_[static_cast<std::size_t>(id)];
}

std::optional<int> Tokenizer::lookup(std::string_view p) const {
  // unordered_map<std::string> has no heterogeneous find in C++20 without a custom hash; the copy is
  // small (one token).
  auto it = ids_.find(std::string(p));
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

std::vector<int> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  std::vector<int> units;
  units.reserve(text.size() + 1);
  if (!text.empty() && space_id_ >= 0) units.push_back(space_id_);  // the dummy prefix

  // One unit per UTF-8 code point (at most 4 bytes, as run.c), byte fallback when it is unknown.
  std::string buf;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) buf.clear();
    buf.push_back(static_cast<char>(c));
    const bool next_cont = i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
    if (next_cont && buf.size() < 4) continue;
    auto it = ids_.find(buf);
    if (it != ids_.end()) {
      units.push_back(it->second);
    } else {
      if (byte_fallback_base_ < 0)
        throw InvalidArgument(fmt::format("cannot encode byte 0x{:02X}: this vocabulary has no <0xXX> byte-fallback tokens at ids 3..258",
                                          static_cast<unsigned char>(buf[0])));
      for (char b : buf) units.push_back(byte_fallback_base_ + static_cast<unsigned char>(b));
    }
    buf.clear();
  }

  // BPE merges: a doubly linked list over `units` and a max-heap of candidate pairs. An entry is
  // stale when either node changed (version bump) or died since it was pushed.
  const int n = static_cast<int>(units.size());
  std::vector<int> prev(static_cast<std::size_t>(n)), next(static_cast<std::size_t>(n));
  std::vector<std::uint32_t> ver(static_cast<std::size_t>(n), 0);
  for (int i = 0; i < n; ++i) {
    prev[static_cast<std::size_t>(i)] = i - 1;
    next[static_cast<std::size_t>(i)] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    float score;
    int left, right, id;
    std::uint32_t vl, vr;
  };
  // Highest score first; among equal scores the leftmost pair, as run.c's strict '>' scan picks it.
  auto worse = [](const Cand& a, const Cand& b) { return a.score != b.score ? a.score < b.score : a.left > b.left; };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
  std::string pair;
  auto consider = [&](int l) {
    if (l < 0) return;
    const int r = next[static_cast<std::size_t>(l)];
    if (r < 0) return;
    const std::string& a = vocab_[static_cast<std::size_t>(units[static_cast<std::size_t>(l)])];
    const std::string& b = vocab_[static_cast<std::size_t>(units[static_cast<std::size_t>(r)])];
    pair.assign(a).append(b);
    auto it = ids_.find(pair);
    if (it == ids_.end()) return;
    const float s = scores_[static_cast<std::size_t>(it->second)];
    if (!(s > kNoMergeScore)) return;
    heap.push(Cand{s, l, r, it->second, ver[static_cast<std::size_t>(l)], ver[static_cast<std::size_t>(r)]});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const auto l = static_cast<std::size_t>(c.left), r = static_cast<std::size_t>(c.right);
    if (ver[l] != c.vl || ver[r] != c.vr || next[l] != c.right) continue;
    units[l] = c.id;
    ++ver[l];
    ++ver[r];  // r dies
    next[l] = next[r];
    if (next[r] >= 0) prev[static_cast<std::size_t>(next[r])] = c.left;
    consider(prev[l]);
    consider(c.left);
  }

  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(n) + 2);
  if (bos) out.push_back(kBos);
  for (int i = n > 0 ? 0 : -1; i >= 0; i = next[static_cast<std::size_t>(i)]) out.push_back(units[static_cast<std::size_t>(i)]);
  if (eos) out.push_back(kEos);
  return out;
}

std::string Tokenizer::decode(int prev_token, int token) const {
  std::string_view p = piece(token);
  if (prev_token == kBos && !p.empty() && p[0] == ' ') p.remove_prefix(1);
  const int b = byte_piece_value(p);
  if (b >= 0) return std::string(1, static_cast<char>(b));
  return std::string(p);
}

std::string Tokenizer::decode(const std::vector<int>& tokens) const {
  std::string out;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const int t = tokens[i];
    if (t == kBos || t == kEos) {
      piece(t);
      continue;
    }
    out += decode(i > 0 ? tokens[i - 1] : -1, t);
  }
  return out;
}

}  // namespace vq
