// Tokenizer: tok512.bin, run.c-exact encoding (against a naive O(n^2) reference), round trips.
#include "veloxquant/model/tokenizer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"
#include "model_support.hpp"

namespace {

using vq::Tokenizer;

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load(vqtest::tokenizer_path(), 512);
  return t;
}

// run.c's encode, transcribed naively: rescan all pairs for the best merge each round.
std::vector<int> naive_encode(const Tokenizer& t, const std::string& text) {
  std::vector<int> ids;
  if (!text.empty()) ids.push_back(*t.lookup(" "));
  std::string buf;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) buf.clear();
    buf += text[i];
    if (i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 && buf.size() < 4) continue;
    if (auto id = t.lookup(buf)) {
      ids.push_back(*id);
    } else {
      for (char c : buf) ids.push_back(static_cast<unsigned char>(c) + 3);
    }
    buf.clear();
  }
  while (true) {
    float best = -1e10f;
    int best_id = -1;
    std::size_t best_i = 0;
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
      auto id = t.lookup(t.piece(ids[i]) + t.piece(ids[i + 1]));
      if (id && t.score(*id) > best) {
        best = t.score(*id);
        best_id = *id;
        best_i = i;
      }
    }
    if (best_id < 0) break;
    ids[best_i] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_i) + 1);
  }
  return ids;
}

std::string validation_prefix(std::size_t bytes) {
  std::string s = vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt");
  if (s.size() > bytes) {
    s.resize(bytes);
    while (!s.empty() && (static_cast<unsigned char>(s.back()) & 0xC0) == 0x80) s.pop_back();  // whole code points
    if (!s.empty() && static_cast<unsigned char>(s.back()) >= 0xC0) s.pop_back();
  }
  return s;
}

TEST(Tokenizer, LoadsTok512) {
  const Tokenizer& t = tok();
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.piece(0), "<unk>");
  EXPECT_EQ(t.piece(1), "\n<s>\n");  // llama2.c's tokenizer.py exports BOS/EOS wrapped in newlines
  EXPECT_EQ(t.piece(2), "\n</s>\n");
  EXPECT_EQ(t.piece(3), "<0x00>");
  EXPECT_EQ(t.piece(3 + 0x0A), "<0x0A>");
  EXPECT_EQ(t.piece(258), "<0xFF>");
  EXPECT_TRUE(t.lookup(" ").has_value());
  EXPECT_THROW(t.piece(512), vq::InvalidArgument);
  // Without a vocab size the whole file is read: the same 512 tokens.
  EXPECT_EQ(Tokenizer::load(vqtest::tokenizer_path()).vocab_size(), 512);
}

TEST(Tokenizer, MalformedFilesAreFormatErrors) {
  const std::string full = vqtest::read_file(vqtest::tokenizer_path());
  EXPECT_THROW(Tokenizer::parse(full, 513), vq::FormatError);               // the model wants more tokens
  EXPECT_THROW(Tokenizer::parse(full, 511), vq::FormatError);               // trailing bytes
  EXPECT_THROW(Tokenizer::parse(full.substr(0, 2)), vq::FormatError);       // no header
  EXPECT_THROW(Tokenizer::parse(full.substr(0, full.size() - 1)), vq::FormatError);
  std::string bad_len = full;
  const std::int32_t huge = 1 << 30;
  std::memcpy(bad_len.data() + 8, &huge, 4);  // token 0's length
  try {
    Tokenizer::parse(bad_len, 512, "tok.bin");
    ADD_FAILURE();
  } catch (const vq::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tok.bin: token 0 has length"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::load(vqtest::temp_dir() + "/missing.bin"), vq::IoError);
}

TEST(Tokenizer, EncodeMatchesRunCReference) {
  const std::string text = validation_prefix(6000);
  // Paragraph by paragraph and whole: the priority-queue BPE equals run.c's rescanning loop.
  std::size_t start = 0;
  int checked = 0;
  while (start < text.size() && checked < 12) {
    auto end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    const std::string para = text.substr(start, end - start);
    std::vector<int> want = naive_encode(tok(), para);
    want.insert(want.begin(), 1);
    EXPECT_EQ(tok().encode(para, true, false), want) << para;
    start = end + 2;
    ++checked;
  }
  const std::string big = text.substr(0, 2500);
  std::vector<int> want = naive_encode(tok(), big);
  EXPECT_EQ(tok().encode(big, false, false), want);
}

TEST(Tokenizer, KnownEncodings) {
  EXPECT_EQ(tok().encode("", true, false), (std::vector<int>{1}));
  EXPECT_EQ(tok().encode("", false, true), (std::vector<int>{2}));
  EXPECT_EQ(tok().encode("", false, false), (std::vector<int>{}));
  const auto ids = tok().encode("Once upon a time", true, true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(ids.back(), 2);
  EXPECT_EQ(tok().piece(ids[1]).front(), ' ');  // the dummy prefix merged into the first word
  // A code point outside the vocabulary falls back to its UTF-8 bytes (id = byte + 3).
  const auto snow = tok().encode("\xE2\x98\x83", false, false);  // U+2603
  EXPECT_EQ(snow, naive_encode(tok(), "\xE2\x98\x83"));
  for (int b : {0xE2, 0x98, 0x83}) EXPECT_NE(std::find(snow.begin(), snow.end(), b + 3), snow.end());
}

TEST(Tokenizer, DecodeRules) {
  const int space = *tok().lookup(" ");
  EXPECT_EQ(tok().decode(1, space), "");
  EXPECT_EQ(tok().decode(5, space), " ");
  EXPECT_EQ(tok().decode(5, 3 + 0x0A), "\n");
  EXPECT_EQ(tok().decode(5, 3 + 0xFF), std::string(1, '\xFF'));
  EXPECT_EQ(tok().decode(5, 1), "\n<s>\n");
  EXPECT_EQ(tok().decode(std::vector<int>{1, space, 2}), "");
}

TEST(Tokenizer, TrickyStringsRoundTrip) {
  const std::vector<std::string> cases{
      " ",
      "  two leading spaces",
      "a",
      "\n\nnewlines\n",
      "h\xC3\xA9llo w\xC3\xB6rld \xE2\x9C\x93 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x99\x82",  // héllo wörld ✓ 日本語 🙂
      std::string("\x01\x7F bytes \xFF\xFE and a NUL \0 inside", 29),
      "\x80\x80 lone continuation bytes \xC3",  // invalid UTF-8 survives via byte fallback
      "\xF0\x9F\x99\x82\x82\x82 over-long continuation run",
      "Lily's mom said, \"Don't worry!\"",
  };
  for (const auto& s : cases) {
    const auto ids = tok().encode(s, true, true);
    for (int id : ids) ASSERT_TRUE(id >= 0 && id < 512);
    EXPECT_EQ(tok().decode(ids), s) << s;
    EXPECT_EQ(tok().encode(s, false, false), naive_encode(tok(), s)) << s;
  }
}

TEST(Tokenizer, ValidationPrefixRoundTripsFast) {
  const std::string text = validation_prefix(200 * 1024);
  ASSERT_GT(text.size(), 200000u);
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok().encode(text, true, false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "encoding 200 KB took " << s << " s";
  EXPECT_LT(ids.size(), text.size() / 2);  // BPE actually merges
  EXPECT_EQ(tok().decode(ids), text);
}

}  // namespace
