// llama.cpp's sequence state built while its rows arrive (format/llama_state_image.hpp).
#include "veloxquant/format/llama_state_image.hpp"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// [n][w] elements at `in` into columns [c0, c0 + n) of the [w][stride] rows at `out` (blocks of 16
// rows: the block stays in L1 while each of its w output runs is written).
template <typename E>
void transpose_into(const E* in, std::size_t n, std::size_t w, E* out, std::size_t stride, std::size_t c0) {
  for (std::size_t i0 = 0; i0 < n; i0 += 16) {
    const std::size_t i1 = std::min(n, i0 + 16);
    for (std::size_t e = 0; e < w; ++e)
      for (std::size_t i = i0; i < i1; ++i) out[e * stride + c0 + i] = in[i * w + e];
  }
}

// Head h's first S rows of t ([1, H, >= S, D], any token stride) converted to `dtype`, row i at
// dst + i * dst_stride bytes: one conversion when both sides' rows are back to back.
void head_rows_into(const Tensor& t, std::int64_t h, std::int64_t S, DType dtype, std::byte* dst, std::size_t dst_stride) {
  if (S == 0) return;
  const std::size_t D = sz(t.dim(3)), sb = dtype_size(t.dtype());
  const std::byte* p = t.row(0, h, 0);
  const std::size_t ts = sz(t.strides()[2]) * sb;
  if (ts == D * sb && dst_stride == D * dtype_size(dtype)) return convert_elements(p, t.dtype(), dst, dtype, sz(S) * D);
  for (std::int64_t i = 0; i < S; ++i) convert_elements(p + sz(i) * ts, t.dtype(), dst + sz(i) * dst_stride, dtype, D);
}

// One layer of the image: K rows [cells][H * Dk], V rows the same or, transposed, [H * Dv][cells],
// in the state's type.
class ImageLayer final : public KVCache {
 public:
  ImageLayer(const LlamaStateModel& m, DType dtype, bool v_trans) : m_(m), dtype_(dtype), v_trans_(v_trans) {}

  // Up to `cells` cells; the buffers are sized at the first expect_tokens() (a loader's count of
  // the cells it will feed, so a long prompt with a short stored prefix holds only that prefix) or,
  // without one, at the first update().
  void begin(std::int64_t cells) {
    limit_ = cells;
    cap_ = 0;
    offset_ = 0;
  }
  void expect_tokens(std::int64_t tokens) override {
    if (offset_ == 0 && limit_ > 0) size_for(std::clamp<std::int64_t>(tokens, 1, limit_));
  }

  void update(const Tensor& keys, const Tensor& values) override {
    const auto& ks = keys.shape();
    const auto& vs = values.shape();
    require(ks[0] == 1 && vs[0] == 1 && ks[1] == m_.kv_heads && vs[1] == m_.kv_heads && ks[3] == m_.key_dim && vs[3] == m_.value_dim &&
                ks[2] == vs[2],
            "llama.cpp state image: keys {} / values {} for a layer of [1, {}, S, {} / {}]", shape_string(ks), shape_string(vs), m_.kv_heads,
            m_.key_dim, m_.value_dim);
    const std::int64_t S = ks[2];
    if (cap_ == 0) size_for(limit_);
    require(offset_ + S <= cap_, "llama.cpp state image: {} cells past the {} it was {}", offset_ + S, cap_,
            cap_ < limit_ ? "told to expect" : "begun for");
    const std::size_t es = dtype_size(dtype_);
    const std::int64_t H = m_.kv_heads, Dk = m_.key_dim, Dv = m_.value_dim;
    // Cell t's K (and untransposed V) row: head h's D values at h * D.
    const std::size_t k_row = sz(H * Dk) * es, v_row = sz(H * Dv) * es;
    for (std::int64_t h = 0; h < H; ++h) head_rows_into(keys, h, S, dtype_, k_.data() + sz(offset_) * k_row + sz(h * Dk) * es, k_row);
    if (!v_trans_) {
      for (std::int64_t h = 0; h < H; ++h) head_rows_into(values, h, S, dtype_, v_.data() + sz(offset_) * v_row + sz(h * Dv) * es, v_row);
    } else {
      // Head h's S x Dv values, converted, then transposed into rows h * Dv .. h * Dv + Dv - 1.
      stage_.resize(sz(S) * sz(Dv) * es);
      for (std::int64_t h = 0; h < H && S > 0; ++h) {
        head_rows_into(values, h, S, dtype_, stage_.data(), sz(Dv) * es);
        std::byte* rows = v_.data() + sz(h * Dv) * sz(cap_) * es;
        if (es == 2)
          transpose_into(reinterpret_cast<const std::uint16_t*>(stage_.data()), sz(S), sz(Dv), reinterpret_cast<std::uint16_t*>(rows), sz(cap_),
                         sz(offset_));
        else
          transpose_into(reinterpret_cast<const std::uint32_t*>(stage_.data()), sz(S), sz(Dv), reinterpret_cast<std::uint32_t*>(rows), sz(cap_),
                         sz(offset_));
      }
    }
    offset_ += S;
  }

  std::pair<Tensor, Tensor> update_and_fetch(const Tensor&, const Tensor&) override {
    throw InvalidArgument("a llama.cpp state image takes rows through update(); it gives none back");
  }
  KVState state() const override { throw InvalidArgument("a llama.cpp state image gives no state back (its bytes: LlamaStateImage::bytes)"); }
  void from_state(const KVState&) override { throw InvalidArgument("a llama.cpp state image is filled by update()"); }
  std::int64_t trim(std::int64_t) override { throw InvalidArgument("a llama.cpp state image cannot be trimmed"); }
  bool is_trimmable() const override { return false; }
  std::size_t nbytes() const override { return k_.capacity() + v_.capacity() + stage_.capacity(); }
  std::string kind() const override { return "LlamaStateImage"; }

  std::int64_t cap() const { return cap_; }
  void size_for(std::int64_t cells) {
    cap_ = cells;
    const std::size_t es = dtype_size(dtype_);
    k_.resize(sz(cells) * sz(m_.kv_heads) * sz(m_.key_dim) * es);
    v_.resize(sz(cells) * sz(m_.kv_heads) * sz(m_.value_dim) * es);
  }
  const std::vector<std::byte>& k() const { return k_; }
  const std::vector<std::byte>& v() const { return v_; }
  void release() {
    std::vector<std::byte>().swap(k_);
    std::vector<std::byte>().swap(v_);
    std::vector<std::byte>().swap(stage_);
    cap_ = 0;
    limit_ = 0;
    offset_ = 0;
  }

 private:
  LlamaStateModel m_;
  DType dtype_;
  bool v_trans_;
  std::int64_t limit_ = 0;  // begin()'s cells
  std::int64_t cap_ = 0;    // the cells the buffers hold (V's transposed row length); 0: not sized yet
  std::vector<std::byte> k_, v_, stage_;
};

}  // namespace

struct LlamaStateImage::Impl {
  LlamaState layout;  // without layers and tokens
  LlamaStateModel model;
  std::vector<std::shared_ptr<KVCache>> caches;
  std::vector<ImageLayer*> layers;

  // The file as pieces: the head (magic .. layer count) and each block's few bytes in `head`, the
  // rows as spans of the layers' buffers; appended in file order.
  struct Piece {
    const std::byte* p;
    std::size_t n;
  };
  std::vector<Piece> pieces(std::span<const std::int32_t> tokens, std::vector<std::uint8_t>& head) const {
    require(tokens.size() <= 0xfffffffbu, "write_llama_state: {} tokens", tokens.size());
    const std::int64_t n = cells_fed();
    require(n > 0, "llama.cpp state image: no cells were fed");
    const std::int32_t type = ggml_type_of(layout.dtype);
    const std::size_t es = dtype_size(layout.dtype);
    const std::int64_t H = model.kv_heads;
    // `head` grows while the pieces are listed: its pieces are kept as offsets, made pointers at the end.
    struct Ref {
      bool in_head;
      std::size_t off, n;
      const std::byte* p;
    };
    std::vector<Ref> refs;
    std::size_t mark = 0;
    const auto put = [&head](const auto& v) {
      const auto* b = reinterpret_cast<const std::uint8_t*>(&v);
      head.insert(head.end(), b, b + sizeof(v));
    };
    const auto flush_head = [&] {
      if (head.size() > mark) refs.push_back({true, mark, head.size() - mark, nullptr});
      mark = head.size();
    };
    const auto rows = [&](const std::byte* p, std::size_t bytes) {
      flush_head();
      refs.push_back({false, 0, bytes, p});
    };
    head.clear();
    put(kLlamaStateMagic);
    put(kLlamaStateVersion);
    if (layout.server_tokens) {  // llama-server's packing: marker, version, count, the ids, no media
      put(static_cast<std::uint32_t>(tokens.size() + 4));
      put(kLlamaServerTokensMarker);
      put(kLlamaServerTokensVersion);
      put(static_cast<std::uint32_t>(tokens.size()));
    } else {
      put(static_cast<std::uint32_t>(tokens.size()));
    }
    for (const auto t : tokens) put(t);
    if (layout.server_tokens) put(std::uint32_t{0});
    put(layout.n_stream);
    for (std::uint32_t s = 0; s < layout.n_stream; ++s) {
      if (s != layout.stream) {
        put(std::uint32_t{0});
        continue;
      }
      put(static_cast<std::uint32_t>(n));
      for (std::int64_t i = 0; i < n; ++i) {
        put(static_cast<std::int32_t>(i));
        put(std::uint32_t{1});
        put(layout.seq_id);
      }
      put(std::uint32_t{layout.v_trans ? 1u : 0u});
      put(static_cast<std::uint32_t>(layers.size()));
      const std::uint64_t k_row = static_cast<std::uint64_t>(H * model.key_dim) * es, v_row = static_cast<std::uint64_t>(H * model.value_dim) * es;
      for (const ImageLayer* l : layers) {  // type, row size, then the cells' K rows
        put(type);
        put(k_row);
        rows(l->k().data(), sz(n) * k_row);
      }
      for (const ImageLayer* l : layers) {
        put(type);
        if (!layout.v_trans) {
          put(v_row);
          rows(l->v().data(), sz(n) * v_row);
          continue;
        }
        // Transposed: element size, H * Dv rows, each the n cells' value of one element.
        put(static_cast<std::uint32_t>(es));
        put(static_cast<std::uint32_t>(H * model.value_dim));
        for (std::int64_t j = 0; j < H * model.value_dim; ++j) rows(l->v().data() + sz(j) * sz(l->cap()) * es, sz(n) * es);
      }
    }
    flush_head();
    std::vector<Piece> out;
    out.reserve(refs.size());
    for (const auto& r : refs) out.push_back({r.in_head ? reinterpret_cast<const std::byte*>(head.data()) + r.off : r.p, r.n});
    return out;
  }

  std::int64_t cells_fed() const {
    const std::int64_t n = layers.empty() ? 0 : layers[0]->offset();
    for (const ImageLayer* l : layers)
      require(l->offset() == n, "llama.cpp state image: layers hold {} and {} cells (every layer must be fed the same)", n, l->offset());
    return n;
  }
};

LlamaStateImage::LlamaStateImage(const LlamaState& layout, const LlamaStateModel& model) : impl_(std::make_unique<Impl>()) {
  require(layout.n_stream >= 1 && layout.stream < layout.n_stream, "write_llama_state: stream {} of {} streams", layout.stream, layout.n_stream);
  require(layout.seq_id >= 0, "write_llama_state: sequence id {}", layout.seq_id);
  require(model.layers > 0 && model.kv_heads > 0 && model.key_dim > 0 && model.value_dim > 0,
          "llama.cpp state image: {} layers, {} KV heads, key dim {}, value dim {}", model.layers, model.kv_heads, model.key_dim, model.value_dim);
  (void)ggml_type_of(layout.dtype);
  impl_->layout = layout;
  impl_->layout.layers.clear();
  impl_->layout.tokens.clear();
  impl_->model = model;
  for (int l = 0; l < model.layers; ++l) {
    auto c = std::make_shared<ImageLayer>(model, layout.dtype, layout.v_trans);
    impl_->layers.push_back(c.get());
    impl_->caches.push_back(std::move(c));
  }
}

LlamaStateImage::~LlamaStateImage() = default;

std::vector<std::shared_ptr<KVCache>>& LlamaStateImage::begin(std::int64_t cells) {
  require(cells >= 1 && cells <= 0x7fffffff, "llama.cpp state image: {} cells (1 .. 2^31-1)", cells);
  for (ImageLayer* l : impl_->layers) l->begin(cells);
  return impl_->caches;
}

std::int64_t LlamaStateImage::cells() const { return impl_->cells_fed(); }

std::vector<std::uint8_t> LlamaStateImage::bytes(std::span<const std::int32_t> tokens) const {
  std::vector<std::uint8_t> head;
  const auto pieces = impl_->pieces(tokens, head);
  std::size_t total = 0;
  for (const auto& p : pieces) total += p.n;
  std::vector<std::uint8_t> out(total);
  std::size_t at = 0;
  for (const auto& p : pieces) {
    if (p.n) std::memcpy(out.data() + at, p.p, p.n);
    at += p.n;
  }
  return out;
}

void LlamaStateImage::write(const std::string& path, std::span<const std::int32_t> tokens) const {
  std::vector<std::uint8_t> head;
  const auto pieces = impl_->pieces(tokens, head);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("{}: cannot write the slot file ({})", path, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  off_t at = 0;
  std::vector<iovec> iov;
  for (std::size_t i = 0; i < pieces.size();) {
    iov.clear();
    std::size_t batch = 0;
    for (; i < pieces.size() && iov.size() < IOV_MAX; ++i) {
      if (pieces[i].n == 0) continue;
      iov.push_back({const_cast<std::byte*>(pieces[i].p), pieces[i].n});
      batch += pieces[i].n;
    }
    // pwritev may write less than asked: the rest again, from where it stopped.
    std::size_t done = 0, k = 0;
    while (done < batch) {
      const ssize_t w = ::pwritev(fd, iov.data() + k, static_cast<int>(iov.size() - k), at);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw IoError(fmt::format("{}: cannot write the slot file ({})", path, w < 0 ? std::strerror(errno) : "no progress"));
      done += static_cast<std::size_t>(w);
      at += w;
      std::size_t left = static_cast<std::size_t>(w);
      while (k < iov.size() && left >= iov[k].iov_len) left -= iov[k++].iov_len;
      if (left > 0) {
        iov[k].iov_base = static_cast<std::byte*>(iov[k].iov_base) + left;
        iov[k].iov_len -= left;
      }
    }
  }
  if (::ftruncate(fd, at) != 0) throw IoError(fmt::format("{}: cannot write the slot file ({})", path, std::strerror(errno)));
}

std::size_t LlamaStateImage::nbytes() const {
  std::size_t n = 0;
  for (const ImageLayer* l : impl_->layers) n += l->nbytes();
  return n;
}

void LlamaStateImage::release() {
  for (ImageLayer* l : impl_->layers) l->release();
}

}  // namespace vq
