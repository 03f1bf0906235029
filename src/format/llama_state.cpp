// llama.cpp sequence state files (format/llama_state.hpp has the layout).
#include "veloxquant/format/llama_state.hpp"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state_image.hpp"
#include "veloxquant/format/vqkv.hpp"  // read_file_bytes

namespace vq {

namespace {

// ggml_type values (ggml.h); only F32, F16 and BF16 are read, the others are named in errors.
constexpr std::int32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlBF16 = 30;

// Bytes of one cell's metadata: i32 pos, u32 n_seq_id (= 1), i32 seq_id.
constexpr std::uint64_t kCellMetaBytes = 12;

// A bounds-checked little-endian cursor; every failure names the field and where it was.
class Cursor {
 public:
  Cursor(std::span<const std::uint8_t> b, const std::string& name) : b_(b), name_(name) {}
  std::size_t pos() const { return pos_; }
  std::uint64_t left() const { return b_.size() - pos_; }
  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(fmt::format("{}: llama.cpp state: {}", name_, why));
  }
  void need(std::uint64_t n, const char* what) const {
    if (n > left()) fail(fmt::format("truncated at byte {}: {} needs {} bytes, {} left", pos_, what, n, left()));
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));  // the file is little-endian, as is every target we build for
    pos_ += sizeof(T);
    return v;
  }
  const std::uint8_t* take(std::uint64_t n, const char* what) {
    need(n, what);
    const std::uint8_t* p = b_.data() + pos_;
    pos_ += static_cast<std::size_t>(n);
    return p;
  }

 private:
  std::span<const std::uint8_t> b_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

DType dtype_of_ggml(std::int32_t t, bool* ok) {
  *ok = true;
  if (t == kGgmlF32) return DType::F32;
  if (t == kGgmlF16) return DType::F16;
  if (t == kGgmlBF16) return DType::BF16;
  *ok = false;
  return DType::F32;
}

// Reads one side's type field and checks it against the first one seen (all must agree).
DType read_type(Cursor& c, const char* side, int layer, std::int32_t* first) {
  const std::size_t at = c.pos();
  const std::int32_t t = c.get<std::int32_t>("a layer's type");
  bool ok;
  const DType d = dtype_of_ggml(t, &ok);
  if (!ok)
    c.fail(fmt::format("layer {} {} are {} (byte {}): only f32, f16 and bf16 caches are read", layer, side, ggml_type_name(t), at));
  if (*first < 0) *first = t;
  if (t != *first)
    c.fail(fmt::format("layer {} {} are {} but the first layer's keys are {} (byte {}): mixed cache types are not read", layer, side,
                       ggml_type_name(t), ggml_type_name(*first), at));
  return d;
}

void check_finite(Cursor& c, const Tensor& t, const char* side, int layer) {
  if (!t.all_finite()) c.fail(fmt::format("layer {} {} hold a NaN or infinity", layer, side));
}

}  // namespace

std::int32_t ggml_type_of(DType dtype) {
  switch (dtype) {
    case DType::F32: return kGgmlF32;
    case DType::F16: return kGgmlF16;
    case DType::BF16: return kGgmlBF16;
  }
  throw InvalidArgument("unknown dtype");
}

std::string ggml_type_name(std::int32_t type) {
  switch (type) {
    case 0: return "f32";
    case 1: return "f16";
    case 2: return "q4_0";
    case 3: return "q4_1";
    case 6: return "q5_0";
    case 7: return "q5_1";
    case 8: return "q8_0";
    case 20: return "iq4_nl";
    case 30: return "bf16";
    default: return fmt::format("ggml type {}", type);
  }
}

LlamaState read_llama_state(std::span<const std::uint8_t> bytes, const LlamaStateModel& model, const std::string& name) {
  require(model.layers > 0 && model.kv_heads > 0 && model.key_dim > 0 && model.value_dim > 0,
          "read_llama_state: the model shape must be positive (layers {}, kv heads {}, dims {}/{})", model.layers, model.kv_heads,
          model.key_dim, model.value_dim);
  Cursor c(bytes, name);
  if (bytes.size() < 8) c.fail(fmt::format("the file has {} bytes, fewer than its 8-byte magic and version", bytes.size()));
  const auto magic = c.get<std::uint32_t>("magic");
  if (magic != kLlamaStateMagic)
    c.fail(fmt::format("magic {:08x} is not 'ggsq' ({:08x}): not a sequence state saved by llama.cpp", magic, kLlamaStateMagic));
  const auto version = c.get<std::uint32_t>("version");
  if (version != kLlamaStateVersion) c.fail(fmt::format("version {} (this reader reads version {})", version, kLlamaStateVersion));

  LlamaState st;
  const auto n_token = c.get<std::uint32_t>("token count");
  c.need(std::uint64_t{n_token} * 4, "the token ids");
  st.tokens.resize(n_token);
  const std::uint8_t* tokens = c.take(std::uint64_t{n_token} * 4, "the token ids");
  if (n_token > 0) std::memcpy(st.tokens.data(), tokens, std::size_t{n_token} * 4);  // data() may be null when empty
  std::size_t first = 0;  // byte offset of token 0 is 12 + 4 * first
  if (n_token > 0 && st.tokens[0] == kLlamaServerTokensMarker) {
    // llama-server's packing: marker, version, count, the ids, the media count.
    if (n_token < 4) c.fail(fmt::format("a llama-server token list of {} words (at least 4: marker, version, count, media count)", n_token));
    if (st.tokens[1] != static_cast<std::int32_t>(kLlamaServerTokensVersion))
      c.fail(fmt::format("llama-server token list version {} (this reader reads version {})", static_cast<std::uint32_t>(st.tokens[1]),
                         kLlamaServerTokensVersion));
    const auto count = static_cast<std::uint32_t>(st.tokens[2]);
    if (std::uint64_t{count} + 4 > n_token)
      c.fail(fmt::format("llama-server token list: {} ids claimed in {} words", count, n_token));
    const auto media = static_cast<std::uint32_t>(st.tokens[3 + std::size_t{count}]);
    if (media != 0) c.fail(fmt::format("llama-server token list with {} media chunks: a multimodal slot is not read", media));
    if (std::uint64_t{count} + 4 != n_token)
      c.fail(fmt::format("llama-server token list: {} words after its {} ids and media count", n_token - count - 4, count));
    st.server_tokens = true;
    first = 3;
    st.tokens = std::vector<std::int32_t>(st.tokens.begin() + 3, st.tokens.begin() + 3 + count);
  }
  for (std::size_t i = 0; i < st.tokens.size(); ++i)
    if (st.tokens[i] < 0)
      c.fail(fmt::format("token {} is {} (byte {}): token ids are not negative", i, st.tokens[i], 12 + 4 * (first + i)));

  st.n_stream = c.get<std::uint32_t>("stream count");
  if (st.n_stream == 0) c.fail("the stream count is 0");
  // Each stream takes at least its 4-byte cell count.
  c.need(std::uint64_t{st.n_stream} * 4, "the streams' cell counts");

  const std::uint64_t heads = static_cast<std::uint64_t>(model.kv_heads);
  const std::uint64_t n_k = heads * static_cast<std::uint64_t>(model.key_dim);
  const std::uint64_t n_v = heads * static_cast<std::uint64_t>(model.value_dim);
  bool found = false;
  for (std::uint32_t s = 0; s < st.n_stream; ++s) {
    const std::size_t at = c.pos();
    const auto cell_count = c.get<std::uint32_t>("a stream's cell count");
    if (cell_count == 0) continue;
    if (found) c.fail(fmt::format("stream {} holds cells too (byte {}): only a state of one sequence in one stream is read", s, at));
    found = true;
    st.stream = s;
    // Its cells' metadata must be present before it is read; each layer's rows are checked against
    // the bytes left (c.take) before their tensor is allocated, so nothing is sized by a claim alone.
    if (std::uint64_t{cell_count} * kCellMetaBytes > c.left())
      c.fail(fmt::format("stream {} claims {} cells (byte {}): their metadata needs {} bytes, the file has {} left", s, cell_count, at,
                         std::uint64_t{cell_count} * kCellMetaBytes, c.left()));
    for (std::uint32_t i = 0; i < cell_count; ++i) {
      const std::size_t cat = c.pos();
      const auto pos = c.get<std::int32_t>("a cell's position");
      const auto n_seq = c.get<std::uint32_t>("a cell's sequence count");
      if (n_seq != 1)
        c.fail(fmt::format("cell {} belongs to {} sequences (byte {}): a sequence's state has one per cell (or the model's cells carry "
                           "data this reader does not read)", i, n_seq, cat));
      const auto seq = c.get<std::int32_t>("a cell's sequence id");
      if (seq < 0) c.fail(fmt::format("cell {} has sequence id {} (byte {})", i, seq, cat));
      if (i == 0) st.seq_id = seq;
      if (seq != st.seq_id) c.fail(fmt::format("cell {} is of sequence {} but cell 0 of sequence {} (byte {})", i, seq, st.seq_id, cat));
      if (pos != static_cast<std::int64_t>(i))
        c.fail(fmt::format("cell {} is at position {} (byte {}): only a sequence at positions 0 .. n-1 in order is read", i, pos, cat));
    }
    const std::size_t vat = c.pos();
    const auto v_trans = c.get<std::uint32_t>("v_trans");
    if (v_trans > 1) c.fail(fmt::format("v_trans is {} (byte {}), not 0 or 1", v_trans, vat));
    st.v_trans = v_trans == 1;
    const std::size_t lat = c.pos();
    const auto n_layer = c.get<std::uint32_t>("the layer count");
    if (n_layer != static_cast<std::uint32_t>(model.layers))
      c.fail(fmt::format("the state has {} layers (byte {}) but the model has {}: saved from another model", n_layer, lat, model.layers));

    const std::int64_t n = cell_count;
    std::int32_t first = -1;
    st.layers.resize(n_layer);
    for (std::uint32_t l = 0; l < n_layer; ++l) {
      const DType d = read_type(c, "keys", static_cast<int>(l), &first);
      const std::size_t rat = c.pos();
      const auto row = c.get<std::uint64_t>("a key row size");
      if (row != n_k * dtype_size(d))
        c.fail(fmt::format("layer {} key rows have {} bytes (byte {}) but the model's have {} ({} heads x {} x {}): saved from another model", l,
                           row, rat, n_k * dtype_size(d), model.kv_heads, model.key_dim, ggml_type_name(first)));
      const std::uint8_t* src = c.take(row * cell_count, "the key rows");
      Tensor k = Tensor::uninitialized({1, model.kv_heads, n, model.key_dim}, d);
      const std::size_t es = dtype_size(d), hb = static_cast<std::size_t>(model.key_dim) * es;
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < model.kv_heads; ++h) std::memcpy(k.row(0, h, t), src + static_cast<std::size_t>(t) * row + h * hb, hb);
      check_finite(c, k, "keys", static_cast<int>(l));
      st.layers[l].keys = std::move(k);
      st.dtype = d;
    }
    for (std::uint32_t l = 0; l < n_layer; ++l) {
      const DType d = read_type(c, "values", static_cast<int>(l), &first);
      const std::size_t es = dtype_size(d), hb = static_cast<std::size_t>(model.value_dim) * es;
      Tensor v = Tensor::uninitialized({1, model.kv_heads, n, model.value_dim}, d);
      if (!st.v_trans) {
        const std::size_t rat = c.pos();
        const auto row = c.get<std::uint64_t>("a value row size");
        if (row != n_v * es)
          c.fail(fmt::format("layer {} value rows have {} bytes (byte {}) but the model's have {}: saved from another model", l, row, rat, n_v * es));
        const std::uint8_t* src = c.take(row * cell_count, "the value rows");
        for (std::int64_t t = 0; t < n; ++t)
          for (int h = 0; h < model.kv_heads; ++h) std::memcpy(v.row(0, h, t), src + static_cast<std::size_t>(t) * row + h * hb, hb);
      } else {
        const std::size_t eat = c.pos();
        const auto el = c.get<std::uint32_t>("a value element size");
        if (el != es) c.fail(fmt::format("layer {} values have {}-byte elements (byte {}), {} has {}", l, el, eat, ggml_type_name(first), es));
        const std::size_t nat = c.pos();
        const auto channels = c.get<std::uint32_t>("a value channel count");
        if (channels != n_v)
          c.fail(fmt::format("layer {} values have {} channels (byte {}) but the model's have {}: saved from another model", l, channels, nat, n_v));
        const std::uint8_t* src = c.take(std::uint64_t{channels} * cell_count * es, "the transposed values");
        for (std::uint64_t j = 0; j < channels; ++j) {
          const int h = static_cast<int>(j / static_cast<std::uint64_t>(model.value_dim));
          const std::size_t dofs = static_cast<std::size_t>(j % static_cast<std::uint64_t>(model.value_dim)) * es;
          const std::uint8_t* col = src + static_cast<std::size_t>(j) * static_cast<std::size_t>(n) * es;
          for (std::int64_t t = 0; t < n; ++t) std::memcpy(v.row(0, h, t) + dofs, col + static_cast<std::size_t>(t) * es, es);
        }
      }
      check_finite(c, v, "values", static_cast<int>(l));
      st.layers[l].values = std::move(v);
    }
  }
  if (!found) c.fail("no stream holds a cell: the state is empty");
  if (c.left() != 0) c.fail(fmt::format("{} bytes follow the state at byte {}", c.left(), c.pos()));
  return st;
}

LlamaState load_llama_state(const std::string& path, const LlamaStateModel& model) {
  const std::vector<std::uint8_t> bytes = read_file_bytes(path);
  return read_llama_state(bytes, model, path);
}

std::vector<std::uint8_t> write_llama_state(const LlamaState& st) {
  require(!st.layers.empty(), "write_llama_state: no layers");
  const Shape4 ks = st.layers[0].keys.shape(), vs = st.layers[0].values.shape();
  require(ks[0] == 1 && vs[0] == 1 && ks[1] == vs[1] && ks[2] == vs[2] && ks[2] > 0 && ks[2] <= 0x7fffffff,
          "write_llama_state: keys {} / values {}: one batch row, the same heads and cells (1 .. 2^31-1)", shape_string(ks), shape_string(vs));
  for (const auto& l : st.layers)
    require(l.keys.shape() == ks && l.values.shape() == vs, "write_llama_state: layers differ in shape ({} / {} against {} / {})",
            shape_string(l.keys.shape()), shape_string(l.values.shape()), shape_string(ks), shape_string(vs));
  // The image's layout is the file's (format/llama_state_image.hpp): each layer fed as one chunk.
  LlamaStateImage image(st, {static_cast<int>(st.layers.size()), static_cast<int>(ks[1]), static_cast<int>(ks[3]), static_cast<int>(vs[3])});
  auto& caches = image.begin(ks[2]);
  for (std::size_t l = 0; l < st.layers.size(); ++l) caches[l]->update(st.layers[l].keys, st.layers[l].values);
  return image.bytes(st.tokens);
}

void save_llama_state(const std::string& path, const LlamaState& state) {
  const std::vector<std::uint8_t> bytes = write_llama_state(state);
  write_file_atomically(path, std::span<const std::uint8_t>(bytes));
}

}  // namespace vq
