// Tokenizer: the SentencePiece-style BPE vocabulary of llama2.c, encoded exactly as run.c does.
//
// File layout (llama2.c tokenizer.bin, little-endian): int32 max_token_length, then per token:
// float32 merge score, int32 byte length, that many bytes (no terminator). The file does not store
// the token count: the model's vocab_size says how many to read.
//
// Conventions of the vocabulary (as trained by llama2.c's train_vocab.sh): id 0 <unk>, 1 <s> (BOS),
// 2 </s> (EOS), ids 3..258 the byte-fallback tokens "<0x00>".."<0xFF>" (byte b is id b + 3).
//
// encode(text) follows run.c: a dummy " " prefix when text is non-empty, one initial unit per UTF-8
// code point (bytes of a code point missing from the vocabulary fall back to byte tokens), then
// repeatedly merge the adjacent pair whose concatenation is a vocabulary token of highest score
// (leftmost on ties) until none remains. run.c rescans the whole sequence per merge (O(n^2)); here a
// priority queue over a linked list gives the identical result in O(n log n).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace vq {

class Tokenizer {
 public:
  static constexpr int kUnk = 0;
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kByteBase = 3;  // id of "<0x00>"

  // Read a tokenizer file with `vocab_size` tokens (from the model); nullopt reads tokens until the
  // end of the file. Throws IoError when unreadable, FormatError when truncated, malformed, or
  // (with vocab_size) when the file holds a different number of tokens.
  static Tokenizer load(const std::string& path, std::optional<int> vocab_size = std::nullopt);
  static Tokenizer parse(std::string_view bytes, std::optional<int> vocab_size = std::nullopt,
                         const std::string& name = "tokenizer");

  int vocab_size() const { return static_cast<int>(vocab_.size()); }
  int max_token_length() const { return max_token_length_; }
  const std::string& piece(int id) const;  // the raw vocabulary string; throws InvalidArgument on a bad id
  float score(int id) const;
  std::optional<int> lookup(std::string_view piece) const;  // id of an exact vocabulary string

  // Token ids for `text` (arbitrary bytes; invalid UTF-8 falls back to bytes), with BOS (1)
  // prepended and/or EOS (2) appended on request.
  std::vector<int> encode(std::string_view text, bool bos = true, bool eos = false) const;

  // The text of `token` when it follows `prev_token`, as run.c's decode(): a leading space is
  // dropped right after BOS, and "<0xXX>" tokens become the raw byte. BOS/EOS map to their pieces.
  std::string decode(int prev_token, int token) const;
  // Concatenated text of a sequence: BOS and EOS print nothing (but still strip the following
  // space); the first token is treated as following BOS only if it is preceded by one.
  std::string decode(const std::vector<int>& tokens) const;

 private:
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> ids_;
  int max_token_length_ = 0;
  int space_id_ = -1;          // id of " " (the dummy prefix), -1 if absent
  int byte_fallback_base_ = -1;  // kByteBase when ids 3..258 are <0x00>..<0xFF>, else -1
};

}  // namespace vq
