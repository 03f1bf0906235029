// Writing a .vqkv file: the header, then the blocks in the order BlockPlan gives (docs/format.md).
#include <cstring>
#include <functional>
#include <optional>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/cache/stream_codec.hpp"
#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "vqkv_layout.hpp"

namespace vq {

namespace {

using Sink = std::function<void(std::span<const std::uint8_t>)>;
using vqkv::BlockHeader;
using vqkv::BlockType;
using vqkv::ByteWriter;
using vqkv::CacheClass;
using vqkv::Group;

// What the writer needs of one CacheGen side.
struct SideSource {
  const QuantizedStream* stream = nullptr;
  std::vector<std::uint64_t> pieces;
  std::vector<Group> groups;
  std::vector<FrequencyTable> tables;     // transform codes: [slice * D + c]
  std::optional<ContextEncoder> context;  // transform context: the side's model
};

struct LayerSource {
  const KVCache* cache = nullptr;
  const CacheGenKVCache* cachegen = nullptr;
  VqLayerCodes vq;  // a vq layer's quantized tokens
  KVState state;  // views of the dense contents
  std::array<SideSource, 2> sides;
};

vqkv::Header make_header(const std::vector<std::shared_ptr<KVCache>>& caches, const PromptMetadata& metadata,
                         const VqkvSaveOptions& options, std::vector<LayerSource>& layers) {
  require(!caches.empty(), "save_prompt_cache: no caches to save");
  require(caches.size() <= vqkv::kMaxLayers, "save_prompt_cache: {} layers is more than the format's {}", caches.size(), vqkv::kMaxLayers);
  require(options.chunk_tokens >= 1 && options.chunk_tokens <= 0xffffffffLL,
          "save_prompt_cache: chunk_tokens {} is out of range 1..4294967295", options.chunk_tokens);
  vqkv::Header h;
  h.chunk_tokens = static_cast<std::uint32_t>(options.chunk_tokens);
  h.metadata = metadata;
  layers.resize(caches.size());
  bool shaped = false;
  for (std::size_t i = 0; i < caches.size(); ++i) {
    const KVCache* c = caches[i].get();
    require(c != nullptr, "save_prompt_cache: layer {} has no cache", i);
    LayerSource& src = layers[i];
    src.cache = c;
    vqkv::LayerEntry e;
    if (const auto* cg = dynamic_cast<const CacheGenKVCache*>(c); cg && c->kind() == "CacheGenKVCache") {
      src.cachegen = cg;
      e.cls = CacheClass::CacheGen;
      e.config = cg->config();
      // The configured width: an empty cache's streams are not made yet (their bits() is a placeholder).
      const int bits = cg->config().effective_bits();
      const SymbolTransform tr = options.transform.value_or(default_transform(bits));
      require(tr == SymbolTransform::Codes || (tr == SymbolTransform::Context && bits <= kContextMaxBits),
              "save_prompt_cache: layer {}: a .vqkv file holds the codes or (up to 4 bits) the context coder, not transform {}", i,
                          static_cast<int>(tr));
      e.transform = static_cast<std::uint8_t>(tr);
      e.scale_bits = table_scale_bits(1 << bits);
      require(e.config.cachegen_group_size <= static_cast<int>(vqkv::kMaxGroupSize),
              "save_prompt_cache: layer {}: group size {} is above the format's limit {}", i,
                          e.config.cachegen_group_size, vqkv::kMaxGroupSize);
    } else if (const auto* v = dynamic_cast<const VqKVCache*>(c); v && c->kind() == "VqKVCache") {
      e.cls = CacheClass::Vq;
      e.vq = v->config();
      require(e.vq.sinks == 0, "save_prompt_cache: layer {} is a VqKVCache with sinks={}, whose exact sink rows a .vqkv file does not hold yet", i,
              e.vq.sinks);
      if (!v->model_from_data()) {
        const VqLayerModel* m = v->layer_model();
        require(m != nullptr && m->source.has_value(),
                "save_prompt_cache: layer {} is a VqKVCache whose layer model names no model it came from (build it with make_caches "
                "from a checkpoint, which records the model's fingerprint)", i);
        e.vq_source = m->source;
      }
      e.vq_quantized = static_cast<std::uint64_t>(v->quantized_tokens());
      if (e.vq_quantized > 0) src.vq = v->codes();
    } else if (c->kind() == "KVCache") {
      e.cls = CacheClass::Plain;
    } else {
      throw InvalidArgument(fmt::format("save_prompt_cache: layer {} is a {}, which a .vqkv file cannot hold "
                                        "(it holds KVCache, CacheGenKVCache and VqKVCache layers)", i, c->kind()));
    }
    e.offset = static_cast<std::uint64_t>(c->offset());
    if (e.offset > 0) {
      src.state = c->state();
      const Tensor& k = src.state.keys;
      const Tensor& v = src.state.values;
      if (!shaped) {
        require(e.offset <= vqkv::kMaxTokens && k.dim(0) <= vqkv::kMaxBatch && k.dim(1) <= vqkv::kMaxHeads &&
                    k.dim(3) <= vqkv::kMaxDim && v.dim(3) <= vqkv::kMaxDim,
                "save_prompt_cache: shape {} is beyond the format's limits", shape_string(k.shape()));
        h.tokens = e.offset;
        h.dtype = k.dtype();
        h.batch = static_cast<std::uint32_t>(k.dim(0));
        h.heads = static_cast<std::uint32_t>(k.dim(1));
        h.key_dim = static_cast<std::uint32_t>(k.dim(3));
        h.value_dim = static_cast<std::uint32_t>(v.dim(3));
        shaped = true;
      }
      require(e.offset == h.tokens && k.dtype() == h.dtype && k.dim(0) == h.batch && k.dim(1) == h.heads && k.dim(3) == h.key_dim &&
                  v.dim(3) == h.value_dim,
              "save_prompt_cache: layer {} ({} tokens, keys {} {}) disagrees with the first non-empty layer "
                          "({} tokens, {}): a file holds the caches of one sequence",
                          i, e.offset, shape_string(k.shape()), dtype_name(k.dtype()), h.tokens, dtype_name(h.dtype));
    }
    h.layers.push_back(e);
  }
  return h;
}

// The context layout of a side's tokens [t0, t0 + count), those of its groups [g0, g0 + ng).
ContextLayout chunk_layout(const QuantizedStream& q, const std::vector<Group>& groups, std::uint64_t g0, std::uint64_t ng, std::size_t t0,
                           std::size_t count) {
  return {static_cast<std::size_t>(q.slices()), count, static_cast<std::size_t>(q.dim()), q.bits(),
          vqkv::block_group_starts(groups, g0, ng, t0, count)};
}

// The TABLES block of a CacheGen side: its pieces, then the models of its codes over every closed
// token: one table per (slice, channel) (transform codes), or the context model (transform
// context).
void tables_block(std::vector<std::uint8_t>& body, SideSource& side, const vqkv::LayerEntry& e, RansKernel kernel) {
  const QuantizedStream& q = *side.stream;
  for (const auto t : q.segment_tokens()) side.pieces.push_back(static_cast<std::uint64_t>(t));
  side.groups = vqkv::groups_of(side.pieces, static_cast<std::uint64_t>(e.config.cachegen_group_size));
  body.clear();
  ByteWriter w(body);
  w.u32(static_cast<std::uint32_t>(side.pieces.size()));
  for (const auto t : side.pieces) {
    require(t <= 0xffffffffu, "save_prompt_cache: a quantized piece of more than 2^32 tokens");
    w.u32(static_cast<std::uint32_t>(t));
  }
  const auto n = static_cast<std::size_t>(q.quantized_tokens());
  if (n == 0) return;
  if (e.transform == vqkv::kTransformContext) {
    const auto codes = context_slices(q);
    const ContextModel model = ContextModel::build(ContextSlices(codes), context_layout(q));
    model.serialize_to(body);
    side.context.emplace(model, kernel);
    return;
  }
  const auto d = static_cast<std::size_t>(q.dim());
  const std::size_t alphabet = std::size_t{1} << q.bits();
  std::vector<std::uint32_t> counts(d * alphabet);
  side.tables.reserve(static_cast<std::size_t>(q.slices()) * d);
  for (std::int64_t s = 0; s < q.slices(); ++s) {
    std::fill(counts.begin(), counts.end(), 0u);
    const std::vector<std::uint8_t> unpacked = q.codes(s);
    const std::uint8_t* codes = unpacked.data();
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t c = 0; c < d; ++c) ++counts[c * alphabet + codes[t * d + c]];
    for (std::size_t c = 0; c < d; ++c) {
      side.tables.push_back(FrequencyTable::from_histogram(std::span(counts).subspan(c * alphabet, alphabet), e.scale_bits));
      side.tables.back().serialize_to(body);
    }
  }
}

// A CODES block: groups [g0, g0 + ng) of a side, tokens [t0, t0 + count).
void codes_block(std::vector<std::uint8_t>& body, std::vector<std::uint16_t>& symbols, const SideSource& side,
                 const vqkv::PlannedBlock& p, RansKernel kernel) {
  const QuantizedStream& q = *side.stream;
  const auto d = static_cast<std::size_t>(q.dim());
  const auto slices = static_cast<std::size_t>(q.slices());
  const auto t0 = static_cast<std::size_t>(p.header.token_begin), count = static_cast<std::size_t>(p.header.token_count);
  body.clear();
  ByteWriter w(body);
  w.u64(p.group_begin);
  w.u32(static_cast<std::uint32_t>(p.n_groups));
  const std::size_t meta = static_cast<std::size_t>(p.n_groups) * d, m0 = static_cast<std::size_t>(p.group_begin) * d;
  for (std::size_t s = 0; s < slices; ++s) w.bytes(q.scales(static_cast<std::int64_t>(s)).data() + m0, meta * 4);
  for (std::size_t s = 0; s < slices; ++s) w.bytes(q.minima(static_cast<std::int64_t>(s)).data() + m0, meta * 4);
  if (side.context) {  // the context coder's payload of these tokens, with the side's model
    const auto codes = context_slices(q, t0, count);
    side.context->encode(ContextSlices(codes), chunk_layout(q, side.groups, p.group_begin, p.n_groups, t0, count), body);
    return;
  }
  // Channel-major symbols: segment (slice, channel) holds its tokens in order.
  const std::size_t ld = count + vqkv::kSymbolPad;
  symbols.resize(slices * d * ld);
  std::vector<RansEncodeSegment> segs(slices * d);
  std::vector<std::uint8_t> unpacked(count * d);
  for (std::size_t s = 0; s < slices; ++s) {
    q.unpack_codes(static_cast<std::int64_t>(s), static_cast<std::int64_t>(t0), static_cast<std::int64_t>(count), unpacked.data());
    const std::uint8_t* codes = unpacked.data();
    std::uint16_t* out = symbols.data() + s * d * ld;
    vqkv::codes_to_symbols(codes, count, d, out, ld);
    for (std::size_t c = 0; c < d; ++c)
      segs[s * d + c] = {std::span<const std::uint16_t>(out + c * ld, count), &side.tables[s * d + c]};
  }
  rans_encode_append(body, segs, kernel);
}

// A vq layer's CODES block: both sides' codes of tokens [t0, t0 + count), coded by vq_encode.
void vq_codes_block(std::vector<std::uint8_t>& body, const VqLayerCodes& all, const vqkv::PlannedBlock& p, RansKernel kernel) {
  const auto t0 = static_cast<std::size_t>(p.header.token_begin), count = static_cast<std::size_t>(p.header.token_count);
  VqLayerCodes part;
  part.batch = all.batch;
  part.tokens = static_cast<std::int64_t>(count);
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& from = side == 0 ? all.k : all.v;
    VqSideCodes& to = side == 0 ? part.k : part.v;
    to = vq_side_params(from);
    const std::size_t n = static_cast<std::size_t>(from.n), q = static_cast<std::size_t>(all.tokens);
    to.codes.reserve(static_cast<std::size_t>(all.batch) * count * n);
    for (std::size_t b = 0; b < static_cast<std::size_t>(all.batch); ++b) {
      const auto at = from.codes.begin() + static_cast<std::ptrdiff_t>((b * q + t0) * n);
      to.codes.insert(to.codes.end(), at, at + static_cast<std::ptrdiff_t>(count * n));
    }
  }
  body = vq_encode(part, kernel);
  const unsigned __int128 codes = static_cast<unsigned __int128>(count) * static_cast<std::uint64_t>(all.batch) *
                                  static_cast<std::uint64_t>(all.k.n + all.v.n);
  require(codes <= static_cast<unsigned __int128>(vqkv::kVqMaxCodesPerByte) * body.size(),
          "save_prompt_cache: layer {}: the vq codes of tokens {}..{} code to {} bytes, fewer than a reader accepts for their count "
          "(nearly constant K/V; use smaller chunk_tokens)", p.header.layer, t0, t0 + count, body.size());
}

// A ROWS block: tokens [t0, t0 + count) of every slice of a dense tensor, raw.
void rows_block(std::vector<std::uint8_t>& body, const Tensor& x, const vqkv::PlannedBlock& p) {
  const auto t0 = static_cast<std::int64_t>(p.header.token_begin), count = static_cast<std::int64_t>(p.header.token_count);
  const std::size_t row_bytes = static_cast<std::size_t>(x.dim(3)) * dtype_size(x.dtype());
  body.resize(static_cast<std::size_t>(x.dim(0) * x.dim(1) * count) * row_bytes);
  std::uint8_t* out = body.data();
  for (std::int64_t b = 0; b < x.dim(0); ++b)
    for (std::int64_t h = 0; h < x.dim(1); ++h)
      for (std::int64_t t = t0; t < t0 + count; ++t, out += row_bytes) std::memcpy(out, x.row(b, h, t), row_bytes);
}

void write_all(const std::vector<std::shared_ptr<KVCache>>& caches, const PromptMetadata& metadata, const VqkvSaveOptions& options,
               const Sink& sink) {
  std::vector<LayerSource> layers;
  const vqkv::Header h = make_header(caches, metadata, options, layers);
  sink(vqkv::write_header(h));

  std::vector<std::uint8_t> body, block;
  std::vector<std::uint16_t> symbols;
  std::uint64_t n_blocks = 0;
  auto emit = [&](const BlockHeader& bh) {
    block.clear();
    vqkv::write_block(block, bh, body);
    sink(block);
    ++n_blocks;
  };
  std::vector<std::array<std::vector<Group>, 2>> groups(h.layers.size());
  for (std::size_t l = 0; l < h.layers.size(); ++l) {
    const vqkv::LayerEntry& e = h.layers[l];
    if (e.cls != CacheClass::CacheGen || e.offset == 0) continue;
    for (int side = 0; side < 2; ++side) {
      SideSource& src = layers[l].sides[static_cast<std::size_t>(side)];
      src.stream = side == 0 ? &layers[l].cachegen->key_stream() : &layers[l].cachegen->value_stream();
      tables_block(body, src, e, options.kernel);
      groups[l][static_cast<std::size_t>(side)] = src.groups;
      BlockHeader bh;
      bh.type = BlockType::Tables;
      bh.layer = static_cast<std::uint32_t>(l);
      bh.side = static_cast<std::uint8_t>(side);
      bh.token_count = static_cast<std::uint64_t>(src.stream->quantized_tokens());
      emit(bh);
    }
  }
  vqkv::BlockPlan plan(h, groups);
  while (auto p = plan.next()) {
    if (p->header.type == BlockType::End) {
      body.clear();
      BlockHeader end;
      end.type = BlockType::End;
      end.token_count = n_blocks;
      emit(end);
      break;
    }
    const LayerSource& src = layers[p->header.layer];
    const Tensor& dense = p->header.side == 0 ? src.state.keys : src.state.values;
    if (p->header.type == BlockType::Codes && h.layers[p->header.layer].cls == CacheClass::Vq)
      vq_codes_block(body, src.vq, *p, options.kernel);
    else if (p->header.type == BlockType::Codes)
      codes_block(body, symbols, src.sides[p->header.side], *p, options.kernel);
    else
      rows_block(body, dense, *p);
    emit(p->header);
  }
}

}  // namespace

void VqkvBytes::add(const VqkvBytes& o) {
  payload += o.payload;
  tables += o.tables;
  scales_zeros += o.scales_zeros;
  residual += o.residual;
  headers += o.headers;
  checksums += o.checksums;
}

std::vector<std::uint8_t> serialize_prompt_cache(const std::vector<std::shared_ptr<KVCache>>& caches, const PromptMetadata& metadata,
                                                 const VqkvSaveOptions& options) {
  std::vector<std::uint8_t> out;
  write_all(caches, metadata, options, [&](std::span<const std::uint8_t> b) { out.insert(out.end(), b.begin(), b.end()); });
  return out;
}

void save_prompt_cache(const std::string& path, const std::vector<std::shared_ptr<KVCache>>& caches, const PromptMetadata& metadata,
                       const VqkvSaveOptions& options) {
  AtomicFile out(path);
  write_all(caches, metadata, options, [&](std::span<const std::uint8_t> b) { out.write(b); });
  out.commit();
}

}  // namespace vq
