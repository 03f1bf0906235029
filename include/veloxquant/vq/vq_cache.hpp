// VqKVCache: our own method (spec `vq`), the cache of one layer.
//
// What a reader needs first:
// - Per token, K and V each: the row of all KV heads (keys un-rotated) goes through the layer's fixed
//   transform y = F x (vq/basis.hpp, derived from the weights; src/vq/transform.hpp), each
//   coefficient is quantized with one step per side, y_hat = o_c + q_c * step (src/vq/quantizer.hpp),
//   and x_hat = F^-1 y_hat. Nothing dense is kept for quantized tokens.
// - The first `calib` tokens wait exact, then calibrate and are quantized; the first `sinks` and the
//   last `residual` tokens are also served exact. Everything depends on token counts only.
// - Resident: codes in packed rows (or Rice-coded sealed tiles with resident=coded), escapes in a
//   side list, the exact tokens in the input dtype, the calibration (a few bytes per coefficient).
// - attend() reads the codes (vq_cache_attend.cpp); update_and_fetch / state() rebuild dense rows.
// - codes() / restore() / vq_reconstruct are the codec's side (vq_cache_codes.cpp, vq/codec.hpp).
// The whole design (packed layout, sealed tiles, invariants, what is billed): docs/methods.md,
// "The layer cache in full".
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/page_vector.hpp"
#include "veloxquant/vq/basis.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/packed_codes.hpp"

namespace vq {

namespace vq_attention {  // src/vq/vq_attention_kernels.hpp (private)
struct HeadFields;
struct FieldEscape;
}  // namespace vq_attention

struct VqConfig {
  double bits = 2.0;               // nominal code rate per element (see above), 0 < bits <= 10
  int calib = 64;                  // calibration tokens, >= 1
  int residual = 0;                // most recent tokens kept exact (in the input dtype), >= 0
  int sinks = 0;                   // first tokens also kept exact (in the input dtype), >= 0
  double k_offset = 0, v_offset = 0;  // bits added to this layer's K / V (the layer allocation)
  bool coded = false;                 // resident=coded: full tiles of quantized tokens held Rice-coded ("Sealed tiles")
  void validate() const;              // throws InvalidArgument
};

class VqKVCache : public KVCache {
 public:
  // `layer` null: identity transforms and no RoPE handling, sized from the first chunk. Otherwise
  // chunks must have layer->kv_heads heads of layer->head_dim. Throws InvalidArgument on a bad config.
  explicit VqKVCache(VqConfig config = {}, std::shared_ptr<const VqLayerModel> layer = nullptr);

  // Throws InvalidArgument (cache unchanged) on a mismatch, NaN/Inf input, or a code beyond the
  // coder's reach (see above).
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Appends and quantizes what is due; rebuilds nothing dense.
  void update(const Tensor& keys, const Tensor& values) override;
  // KVCache::expect_tokens, for the code-domain loads (append_codes / append_packed; the store's
  // loader gives the prefix's length): at their first rows each side's packed rows reserve this
  // many tokens in huge pages (PageVector::reserve_huge: one fault per 2 MiB instead of 512).
  // update() ignores it.
  void expect_tokens(std::int64_t tokens) override { expected_tokens_ = std::max<std::int64_t>(tokens, 0); }
  KVState state() const override;  // rebuilt into fresh tensors in the input dtype
  // Drops the last tokens' codes and rows (each token's codes are independent). Trimming to 0
  // forgets the calibration.
  std::int64_t trim(std::int64_t n) override;
  void from_state(const KVState& state) override;  // feeds `state` as one chunk
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "VqKVCache"; }
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  // On the packed codes (vq/vq_attention_kernels.hpp) where a side's tiles are its codes'
  // values: the identity transform, keys without RoPE, float32 or float16 input (values rounded
  // through float16 as state() holds them), SIMD on. Otherwise (and for exact tokens) the float
  // tiles of read_key_tile / read_value_tile.
  void score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                      float* scores, float* scratch) const override;
  void accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                             std::int64_t nq, float* acc, float* scratch) const override;
  // A transform that mixes every head (src/vq/mixed_attention.cpp): the whole call on the codes,
  // every head at once: values (and keys without RoPE) summed in coefficient space with F^-1 moved
  // to the query and output rows, keys with RoPE rebuilt once per token for all heads. Float32
  // input, packed rows, some quantized tokens; declines otherwise (the tile loop below).
  bool attend_own(const Tensor& queries, float scale, Tensor& out) const override;
  // kCodeTileTokens when both sides run on their codes (the per-tile work of the code kernels:
  // listing the tile's escapes, the field-order sum's epilogue, is then spread over more tokens;
  // no float32 tile is formed, so a longer tile costs no cache space); the default otherwise.
  std::int64_t attention_tile_tokens() const override;
  static constexpr std::int64_t kCodeTileTokens = 256;
  // Tokens per sealed tile (config.coded).
  static constexpr std::int64_t kSealTokens = 64;
  // Tokens held Rice-coded (config.coded: every quantized token between updates; else 0).
  std::int64_t sealed_tokens() const { return sealed_; }

  const VqConfig& config() const { return config_; }
  std::int64_t quantized_tokens() const { return quantized_; }
  // The quantized part (tokens [0, quantized_tokens())) as the codec sees it.
  VqLayerCodes codes() const;
  // The same for quantized tokens [t0, t1) only (0 <= t0 <= t1 <= quantized_tokens(); throws
  // InvalidArgument otherwise), with the cache's calibration as it is now: what the prefix store
  // writes for one chunk of a live cache (store/prefix_chunks.hpp).
  VqLayerCodes codes(std::int64_t t0, std::int64_t t1) const;

  // Code-domain append (the store's loads, store/prefix_loader.hpp): take `codes.tokens` quantized
  // tokens as codes, with no dense rows and no inverse transform. After it the cache is bit for bit,
  // in codes(), state(), fetch and attend, the cache that update() with those tokens' rows would
  // have left (packed field widths may differ: they change memory, never values), and it continues
  // (update) as that cache would. An empty cache takes the codes' calibration (step, offsets,
  // splits) and `dtype` as its input dtype; widths are chosen from these codes, as restore() does.
  // A non-empty cache takes codes of exactly its own step and offsets (splits may be wider: the
  // cache's widen) and packs them at its widths (escapes beyond).
  // Returns false, the cache unchanged, where update() would not have left all these tokens
  // quantized under this calibration: config residual > 0 or sinks > 0, a model-less cache (the
  // identity sized from data), exact tokens held (an uncalibrated cache, or a tail), an empty cache
  // given fewer than calib tokens, another step or offsets, another dtype. Throws InvalidArgument
  // (cache unchanged) on codes that do not fit the layer model or are malformed.
  bool append_codes(const VqLayerCodes& codes, DType dtype = DType::F32);
  // append_codes for codes packed off the cache (vq/packed_codes.hpp: the store loader's decoder
  // threads): the same refusals and the same cache after it. Where a side's layout is the cache's
  // (or the cache is empty: it takes the chunk's layouts instead of choosing widths from the codes)
  // its rows are copied as they are; otherwise the codes are unpacked and appended as append_codes.
  bool append_packed(const VqPackedCodes& codes, DType dtype = DType::F32);
  // A side's packed layout now (0: K, 1: V; n = 0 before calibration): what to pack chunks at.
  VqFieldLayout field_layout(int side) const;
  // vq_encode(codes()); its size is memoised for stored_bytes until the next change.
  std::vector<std::uint8_t> encode() const;
  const VqLayerModel* layer_model() const { return layer_.get(); }
  // Whether the layer model is the identity sized from the data (the cache was built without one).
  bool model_from_data() const { return identity_from_data_; }

  // Rebuild a cache from what a saved one holds (the .vqkv reader, format/vqkv.hpp): its config,
  // its layer model (null: the identity sized from the data, as the constructor takes it), the
  // codes of its quantized tokens [0, Q) with their frozen calibration (step, offsets, shifts;
  // Q = codes.tokens, 0 when the cache had not calibrated yet) and the exact rows of the tokens
  // after them, `exact` [B, H, offset - Q, D] (any token count, 0 included; it gives the dtype and
  // shape). The result fetches bit for bit what the saved cache fetched (the quantized tokens are
  // reconstructed with vq_reconstruct, the cache's own arithmetic) and continues identically.
  // Throws InvalidArgument when the parts disagree with each other or with a cache that
  // update_and_fetch could have built (e.g. Q > 0 but fewer than offset - residual tokens).
  // The codes are packed at widths chosen from the codes themselves (calibration's widths are not
  // saved; widths change memory, never values). config.sinks > 0 is refused: the format does not
  // hold the sinks' exact rows yet.
  static std::shared_ptr<VqKVCache> restore(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes,
                                            const KVState& exact);
  // Packed field width of each coefficient (empty before calibration) and the escaped codes held.
  const std::vector<std::uint8_t>& key_widths() const { return kq_.width; }
  const std::vector<std::uint8_t>& value_widths() const { return vq_.width; }
  std::size_t escapes() const;

  // One batch row's packed code rows (the codes of its quantized tokens, "Packed layout" above):
  // bytes in a PageVector (core/page_vector.hpp), on the heap while small and then in a mapping
  // of their own grown without copies, so that many caches growing side by side leave no holes
  // in malloc's heap (with std::vector growth, 16 caches of 4096 tokens at bits=2 grew the RSS by
  // 1.64x their nbytes). Invariant: every byte past the last row's bits is zero (fields are OR-ed
  // in; get_field reads 8 bytes, hence the 8 bytes of slack packed_bytes adds).
  class PackedRows {
   public:
    std::uint8_t* data() { return bytes_.data(); }
    const std::uint8_t* data() const { return bytes_.data(); }
    std::size_t size() const { return bytes_.size(); }
    // Grows with zero bytes, or drops the bytes past n (and returns their pages).
    void resize(std::size_t n);
    void clear() { bytes_.clear(); }
    // Address space for n bytes in huge pages (PageVector::reserve_huge).
    void reserve_huge(std::size_t n) { bytes_.reserve_huge(n); }
    const PageVector<std::uint8_t>& bytes() const { return bytes_; }

   private:
    PageVector<std::uint8_t> bytes_;
  };
  // The packed rows of batch row b of a side (0: K, 1: V); for tests (their residency).
  const PackedRows& packed_rows(int side, std::int64_t b) const { return (side == 0 ? ks_ : vs_).packed.at(static_cast<std::size_t>(b)); }
  // The part of nbytes() held in page mappings rather than on the heap (the packed rows past
  // kPageVectorHeapBytes each: their backed pages).
  std::size_t nbytes_mapped() const;

 private:
  struct SideQuant {
    float step = 1.0f;
    std::vector<std::int32_t> offset;  // grid offsets, quarter steps
    std::vector<float> mean;           // their values
    std::vector<std::uint8_t> shift;   // code splits (vq/codec.hpp)
    std::vector<std::uint8_t> width;   // packed field bits, 1..8 or 16 (its group's)
    std::vector<std::uint32_t> bit_at; // [n + 1]: first bit of coefficient c in a packed row; [n] = row bits
    std::vector<std::int32_t> order;   // [n]: coefficient at field position p of head h's segment (h*d + p)
    std::vector<std::uint32_t> group_byte;  // per group of 8 field positions: its first byte in a row
    std::vector<std::uint8_t> group_width;  // and its field width
    std::vector<float> field_mean;          // [n]: mean[order[i]]
  };
  struct Escape {
    std::int32_t t, c, q;  // token, coefficient, code
  };
  struct SideStore {
    std::vector<PackedRows> packed;                 // per batch: quantized_ rows of bit_at[n] bits (+ 8 zero bytes)
    std::vector<std::vector<Escape>> escapes;       // per batch, sorted by (t, c)
    std::vector<std::uint8_t> tail;                 // exact rows [quantized_, offset_), token-major [t][b][h][d], input dtype
    std::vector<std::uint8_t> sinks;                // exact rows [0, min(sinks, offset_)), same layout
    // config.coded: per batch, the full tiles of tokens [0, sealed_) Rice-coded back to back (+ 8 zero bytes), each tile's
    // first byte, and the open tile (tokens [sealed_ / kSealTokens * kSealTokens, sealed_) when that is not empty; + 8 zero bytes).
    std::vector<PageVector<std::uint8_t>> sealed;
    std::vector<std::vector<std::uint32_t>> tile_at;
    std::vector<std::vector<std::uint8_t>> open;
  };
  // Tokens [t0, t0 + n) of (b, h), one side, as float32 rows (what state() holds).
  void read_rows(int side, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* out) const;
  Tensor materialise(int side) const;
  bool codes_direct(int side) const;  // whether score/accumulate run on this side's codes
  vq_attention::HeadFields head_fields(int side, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t t1,
                                       std::vector<vq_attention::FieldEscape>& esc) const;
  void reset();
  // append_codes / append_packed: whether codes of this calibration (`c`'s batch, tokens, steps,
  // offsets; not its code arrays) may be appended (false where update() would not have left them
  // quantized under it); throws InvalidArgument when they do not fit the layer model.
  bool takes_codes(const VqLayerCodes& c, DType dtype) const;
  // An empty cache starts from `c`'s calibration (steps, offsets, shifts; widths left to the caller).
  void start_from_codes(const VqLayerCodes& c, DType dtype);
  // config.coded: seal every quantized token past sealed_ (codes out of the packed rows; the open tile coded again), then
  // drop the packed layout's arrays.
  void seal_due();
  // The packed layout's arrays of both sides (lay_out), when seal_due dropped them.
  void ensure_layout();
  // Back to packed rows for every quantized token (sealed_ = 0).
  void unseal();
  // Token t < sealed_ of batch b, one side: its n codes, decoded into the per-thread tile scratch.
  const std::int16_t* sealed_row(int side, std::int64_t b, std::int64_t t) const;

  VqConfig config_;
  std::shared_ptr<const VqLayerModel> layer_;
  bool identity_from_data_ = false;  // layer_ is the identity sized from the data (no model given)
  bool calibrated_ = false;
  SideQuant kq_, vq_;
  std::int64_t quantized_ = 0;
  std::int64_t expected_tokens_ = 0;  // expect_tokens
  std::int64_t sealed_ = 0;     // tokens [0, sealed_) are in sealed tiles; packed row r is token sealed_ + r
  std::uint64_t seal_gen_ = 0;  // names the sealed tiles' contents for the readers' scratch (new at each change but appending)
  SideStore ks_, vs_;
  mutable std::optional<std::size_t> encoded_size_;
};

// The decoder's last step: dense K and V [batch, H, tokens, D] in `dtype` from decoded codes and
// the layer's transforms; bit-identical to what the cache returned for those tokens.
KVState vq_reconstruct(const VqLayerCodes& codes, const VqLayerModel& layer, DType dtype);

// restore(config, layer, codes, exact)->state() without building the cache: the same checks (throws
// InvalidArgument for what restore refuses) and the same bits, the codes reconstructed straight into
// the dense tensors (no packing, no unpacking). For readers that want the K/V only (the store's
// decode_chunk, via VqkvLoadOptions::dense_states).
KVState vq_restored_state(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes, const KVState& exact);

}  // namespace vq
