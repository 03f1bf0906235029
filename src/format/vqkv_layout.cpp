#include "vqkv_layout.hpp"

#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/entropy/frequency_table.hpp"

#include <bit>
#include <cmath>

#include <xxhash.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace vq::vqkv {

std::uint64_t xxh64(std::span<const std::uint8_t> bytes) { return XXH64(bytes.data(), bytes.size(), 0); }

namespace {

void write_config(ByteWriter& w, const LayerEntry& e) {
  const KVCacheConfig& c = e.config;
  w.u8(static_cast<std::uint8_t>(c.cachegen_bits));
  w.u8(static_cast<std::uint8_t>(c.cachegen_resolved_bits.value_or(0)));
  w.u32(static_cast<std::uint32_t>(c.cachegen_group_size));
  w.u8(c.cachegen_use_delta ? 1 : 0);
  w.u8(c.cachegen_per_channel ? 1 : 0);
  w.u32(static_cast<std::uint32_t>(c.cachegen_layer_groups));
  w.u8(static_cast<std::uint8_t>(c.cachegen_flush));
  w.u8(e.transform);
  w.u8(static_cast<std::uint8_t>(e.scale_bits));
}

bool flag(ByteReader& r, const char* what) { return r.ranged(r.u8(what), 0, 1, what) == 1; }

void read_config(ByteReader& r, LayerEntry& e, std::uint16_t version) {
  KVCacheConfig& c = e.config;
  c.cachegen_bits = static_cast<int>(r.ranged(r.u8("bits"), 1, 8, "bits"));
  const auto resolved = r.ranged(r.u8("resolved bits"), 0, 8, "resolved bits");
  if (resolved) c.cachegen_resolved_bits = static_cast<int>(resolved);
  c.cachegen_group_size = static_cast<int>(r.ranged(r.u32("group size"), 1, kMaxGroupSize, "group size"));
  c.cachegen_use_delta = flag(r, "use_delta");
  c.cachegen_per_channel = flag(r, "per_channel");
  c.cachegen_layer_groups = static_cast<int>(r.ranged(r.u32("layer groups"), 1, 1u << 16, "layer groups"));
  const auto flush = r.u8("flush mode");
  if (flush > 1) r.fail(fmt::format("unknown flush mode {} (0 = per_call, 1 = group_aligned)", flush));
  c.cachegen_flush = static_cast<FlushMode>(flush);
  e.transform = r.u8("symbol transform");
  if (version == 1 && e.transform != kTransformCodes)
    r.fail(fmt::format("unknown symbol transform {} (version 1 holds 0 = codes)", e.transform));
  if (e.transform != kTransformCodes && e.transform != kTransformContext)
    r.fail(fmt::format("unknown symbol transform {} (0 = codes, 2 = context)", e.transform));
  if (e.transform == kTransformContext && c.effective_bits() > kContextMaxBits)
    r.fail(fmt::format("the context transform holds codes of at most {} bits, not {}", kContextMaxBits, c.effective_bits()));
  e.scale_bits = static_cast<int>(r.ranged(r.u8("table precision"), 1, 15, "table precision"));
  if (e.transform == kTransformContext && e.scale_bits != table_scale_bits(1 << c.effective_bits()))
    r.fail(fmt::format("a context-coded layer's tables must have {} bits, not {}", table_scale_bits(1 << c.effective_bits()), e.scale_bits));
}

void f64(ByteWriter& w, double v) { w.u64(std::bit_cast<std::uint64_t>(v)); }
double f64(ByteReader& r, const char* what) {
  const double v = std::bit_cast<double>(r.u64(what));
  if (!std::isfinite(v)) r.fail(fmt::format("{} is not a finite number", what));
  return v;
}

std::uint8_t basis_number(VqBasis b) {
  switch (b) {
    case VqBasis::Identity: return kVqBasisIdentity;
    case VqBasis::Hadamard: return kVqBasisHadamard;
    case VqBasis::Profile: return kVqBasisProfile;
    case VqBasis::Weights: break;
  }
  return kVqBasisWeights;
}

void write_vq(ByteWriter& w, const LayerEntry& e) {
  f64(w, e.vq.bits);
  w.u32(static_cast<std::uint32_t>(e.vq.calib));
  w.u32(static_cast<std::uint32_t>(e.vq.residual));
  f64(w, e.vq.k_offset);
  f64(w, e.vq.v_offset);
  w.u8(e.vq_source ? 1 : 0);
  if (e.vq_source) {
    const VqModelSource& m = *e.vq_source;
    w.u64(m.fingerprint);
    w.u32(static_cast<std::uint32_t>(m.layer));
    w.u8(basis_number(m.basis.basis));
    w.u8((m.basis.shape ? 1 : 0) | (m.basis.per_head ? 2 : 0));  // bit 1: per-head blocks (block=head)
    w.u8(m.basis.rope ? 1 : 0);
    f64(w, m.basis.rope_theta);
  }
  w.u64(e.vq_quantized);
}

void read_vq(ByteReader& r, LayerEntry& e, std::uint64_t layer) {
  VqConfig& c = e.vq;
  c.bits = f64(r, "vq bits");
  c.calib = static_cast<int>(r.ranged(r.u32("vq calib"), 1, 0x7fffffff, "vq calib"));
  c.residual = static_cast<int>(r.ranged(r.u32("vq residual"), 0, 0x7fffffff, "vq residual"));
  c.k_offset = f64(r, "vq K offset");
  c.v_offset = f64(r, "vq V offset");
  try {
    c.validate();
  } catch (const InvalidArgument& ex) {
    r.fail(fmt::format("layer {}: {}", layer, ex.what()));
  }
  if (flag(r, "vq model flag")) {
    VqModelSource m;
    m.fingerprint = r.u64("vq model fingerprint");
    m.layer = static_cast<int>(r.ranged(r.u32("vq model layer"), 0, kMaxLayers - 1, "vq model layer"));
    const auto basis = r.ranged(r.u8("vq basis"), 0, 3, "vq basis");
    m.basis.basis = basis == kVqBasisIdentity   ? VqBasis::Identity
                    : basis == kVqBasisHadamard ? VqBasis::Hadamard
                    : basis == kVqBasisProfile  ? VqBasis::Profile
                                                : VqBasis::Weights;
    const auto shape = r.ranged(r.u8("vq shape flags"), 0, 3, "vq shape flags");
    m.basis.shape = (shape & 1) != 0;
    m.basis.per_head = (shape & 2) != 0;
    m.basis.rope = flag(r, "vq rope flag");
    m.basis.rope_theta = f64(r, "vq rope theta");
    if (!(m.basis.rope_theta > 0)) r.fail(fmt::format("layer {}: vq rope theta {} must be > 0", layer, m.basis.rope_theta));
    e.vq_source = m;
  }
  e.vq_quantized = r.u64("vq quantized tokens");
  if (e.vq_quantized > e.offset) r.fail(fmt::format("layer {}: {} quantized tokens of {}", layer, e.vq_quantized, e.offset));
}

}  // namespace

std::vector<std::uint8_t> write_header(const Header& h) {
  std::vector<std::uint8_t> body;
  ByteWriter w(body);
  w.u32(static_cast<std::uint32_t>(h.layers.size()));
  w.u8(static_cast<std::uint8_t>(h.dtype));
  w.u64(h.tokens);
  w.u32(h.batch);
  w.u32(h.heads);
  w.u32(h.key_dim);
  w.u32(h.value_dim);
  w.u32(h.chunk_tokens);
  w.u32(static_cast<std::uint32_t>(h.metadata.size()));
  for (const auto& [k, v] : h.metadata) {
    w.str(k);
    w.str(v);
  }
  for (const LayerEntry& e : h.layers) {
    w.u8(static_cast<std::uint8_t>(e.cls));
    w.u64(e.offset);
    if (e.cls == CacheClass::CacheGen) write_config(w, e);
    if (e.cls == CacheClass::Vq) write_vq(w, e);
  }
  require(body.size() <= kMaxHeaderBody, "vqkv: the header (metadata) is too large");
  std::vector<std::uint8_t> out;
  ByteWriter o(out);
  o.bytes(kMagic.data(), kMagic.size());
  o.u16(h.version);
  o.u16(0);
  o.u32(static_cast<std::uint32_t>(body.size()));
  o.bytes(body.data(), body.size());
  o.u64(xxh64(out));
  return out;
}

Header read_header(std::span<const std::uint8_t> file, std::size_t& consumed) {
  ByteReader p(file, "header");
  const auto magic = p.take(kMagic.size(), "magic");
  if (!std::equal(magic.begin(), magic.end(), kMagic.begin())) p.fail("not a .vqkv file (wrong magic bytes)");
  const auto version = p.u16("version");
  if (version < kOldestVersion || version > kVersion)
    p.fail(fmt::format("unsupported format version {} (this build reads versions {} to {})", version, kOldestVersion, kVersion));
  const auto flags = p.u16("flags");
  if (flags != 0) p.fail(fmt::format("unknown flags 0x{:04x} (this build knows none)", flags));
  const auto body_size = p.ranged(p.u32("header size"), 1, kMaxHeaderBody, "header size");
  const auto body = p.take(body_size, "header body");
  const std::uint64_t stored = p.u64("header checksum");
  if (stored != xxh64(file.first(kPrefixBytes + body_size))) p.fail("checksum mismatch (the header is corrupt)");
  consumed = p.pos();

  ByteReader r(body, "header");
  Header h;
  h.version = version;
  const auto n_layers = r.ranged(r.u32("layer count"), 1, kMaxLayers, "layer count");
  const auto dtype = r.u8("dtype");
  if (dtype > 2) r.fail(fmt::format("unknown dtype {} (0 = float32, 1 = float16, 2 = bfloat16)", dtype));
  h.dtype = static_cast<DType>(dtype);
  h.tokens = r.ranged(r.u64("token count"), 0, kMaxTokens, "token count");
  const std::uint64_t lo = h.tokens > 0 ? 1 : 0;  // an empty cache has no shape
  const std::uint64_t hi_if = h.tokens > 0 ? 1 : 0;
  h.batch = static_cast<std::uint32_t>(r.ranged(r.u32("batch"), lo, hi_if * kMaxBatch, "batch"));
  h.heads = static_cast<std::uint32_t>(r.ranged(r.u32("heads"), lo, hi_if * kMaxHeads, "heads"));
  h.key_dim = static_cast<std::uint32_t>(r.ranged(r.u32("key head dim"), lo, hi_if * kMaxDim, "key head dim"));
  h.value_dim = static_cast<std::uint32_t>(r.ranged(r.u32("value head dim"), lo, hi_if * kMaxDim, "value head dim"));
  h.chunk_tokens = static_cast<std::uint32_t>(r.ranged(r.u32("chunk tokens"), 1, 0xffffffffu, "chunk tokens"));
  const auto n_meta = r.ranged(r.u32("metadata count"), 0, kMaxMetadataEntries, "metadata count");
  for (std::uint64_t i = 0; i < n_meta; ++i) {
    std::string k = r.str(kMaxHeaderBody, "metadata key");
    std::string v = r.str(kMaxHeaderBody, "metadata value");
    if (!h.metadata.emplace(std::move(k), std::move(v)).second) r.fail("a metadata key appears twice");
  }
  h.layers.resize(n_layers);
  for (std::uint64_t i = 0; i < n_layers; ++i) {
    LayerEntry& e = h.layers[i];
    const auto cls = r.u8("cache class");
    if (cls > 2) r.fail(fmt::format("layer {}: unknown cache class {} (0 = KVCache, 1 = CacheGenKVCache, 2 = VqKVCache)", i, cls));
    e.cls = static_cast<CacheClass>(cls);
    e.offset = r.u64("layer offset");
    if (e.offset != 0 && e.offset != h.tokens)
      r.fail(fmt::format("layer {} holds {} tokens, the file {} (a layer holds all of them or none)", i, e.offset, h.tokens));
    if (e.cls == CacheClass::CacheGen) read_config(r, e, version);
    if (e.cls == CacheClass::Vq) read_vq(r, e, i);
  }
  if (r.remaining() != 0) r.fail(fmt::format("{} unexpected bytes after the layer table", r.remaining()));
  // The writer takes T and the shape from the non-empty layers: a header claiming tokens that no
  // layer holds describes nothing (and would report a shape with no data behind it).
  if (h.tokens > 0 && std::none_of(h.layers.begin(), h.layers.end(), [](const LayerEntry& e) { return e.offset > 0; }))
    r.fail(fmt::format("token count {} but every layer is empty (the non-empty layers hold all the tokens)", h.tokens));
  return h;
}

std::string describe(const BlockHeader& b) {
  const char* type = b.type == BlockType::Tables ? "TABLES"
                     : b.type == BlockType::Codes ? "CODES"
                     : b.type == BlockType::Rows  ? "ROWS"
                                                  : "END";
  if (b.type == BlockType::End) return "END block";
  return fmt::format("{} block of layer {} {} (tokens {}..{})", type, b.layer, side_name(b.side), b.token_begin,
                     b.token_begin + b.token_count);
}

void write_block(std::vector<std::uint8_t>& out, const BlockHeader& b, std::span<const std::uint8_t> body) {
  const std::size_t at = out.size();
  ByteWriter w(out);
  w.u8(static_cast<std::uint8_t>(b.type));
  w.u8(b.side);
  w.u16(0);
  w.u32(b.layer);
  w.u64(b.token_begin);
  w.u64(b.token_count);
  w.u64(body.size());
  w.bytes(body.data(), body.size());
  w.u64(xxh64(std::span<const std::uint8_t>(out).subspan(at)));
}

BlockHeader read_block(std::span<const std::uint8_t> file, std::size_t& pos, std::span<const std::uint8_t>& body) {
  ByteReader r(file.subspan(pos), fmt::format("block at byte {}", pos));
  BlockHeader b;
  const auto type = r.u8("block type");
  if (type < 1 || type > 4) r.fail(fmt::format("unknown block type {}", type));
  b.type = static_cast<BlockType>(type);
  b.side = static_cast<std::uint8_t>(r.ranged(r.u8("side"), 0, 1, "side"));
  if (r.u16("reserved") != 0) r.fail("reserved field is not 0");
  b.layer = r.u32("layer");
  b.token_begin = r.u64("first token");
  b.token_count = r.u64("token count");
  b.body_size = r.u64("body size");
  if (b.body_size > r.remaining()) r.fail(fmt::format("truncated or corrupt: a body of {} bytes runs past the end of the file ({} left)", b.body_size, r.remaining()));
  body = r.take(b.body_size, "body");
  const std::size_t covered = r.pos();
  if (r.u64("block checksum") != xxh64(file.subspan(pos, covered))) r.fail(fmt::format("checksum mismatch in the {}", describe(b)));
  pos += r.pos();
  return b;
}

std::vector<Group> groups_of(std::span<const std::uint64_t> pieces, std::uint64_t group_size, std::uint64_t limit) {
  std::vector<Group> out;
  std::uint64_t start = 0;
  for (const std::uint64_t p : pieces) {
    for (std::uint64_t g = 0; g < p && start + g < limit; g += group_size) out.push_back({start + g, std::min(group_size, p - g)});
    start += p;
  }
  return out;
}

std::uint64_t count_groups(std::span<const std::uint64_t> pieces, std::uint64_t group_size, std::uint64_t limit) {
  std::uint64_t n = 0, start = 0;
  for (const std::uint64_t p : pieces) {
    if (start >= limit) break;
    n += (std::min(p, limit - start) + group_size - 1) / group_size;  // groups start at start + k * group_size
    start += p;
  }
  return n;
}

std::vector<std::uint8_t> block_group_starts(const std::vector<Group>& groups, std::uint64_t g0, std::uint64_t ng, std::uint64_t t0,
                                             std::uint64_t count) {
  std::vector<std::uint8_t> starts(static_cast<std::size_t>(count), 0);
  for (std::uint64_t g = g0; g < g0 + ng; ++g) starts[static_cast<std::size_t>(groups[g].start - t0)] = 1;
  return starts;
}

unsigned __int128 min_block_bytes(const Header& h, std::uint64_t prefix) {
  using u128 = unsigned __int128;
  constexpr std::uint64_t block = kBlockHeaderBytes + kChecksumBytes;
  const std::uint64_t p = std::min(prefix, h.tokens);
  u128 need = p == h.tokens ? block : 0;  // END, read by a whole load only
  const std::uint64_t chunks = (p + h.chunk_tokens - 1) / h.chunk_tokens;
  const std::uint64_t covered = std::min<std::uint64_t>(h.tokens, chunks * h.chunk_tokens);  // whole chunks, as read
  for (const LayerEntry& e : h.layers) {
    if (e.offset == 0) continue;
    for (int side = 0; side < 2; ++side) {
      const u128 slice_bytes = u128{h.slices()} * h.dim(side) * dtype_size(h.dtype);  // one token of one side, raw
      if (e.cls == CacheClass::Plain) {
        need += u128{chunks} * block + u128{covered} * slice_bytes;
      } else if (e.cls == CacheClass::Vq) {
        // One CODES block (both sides) per chunk of the quantized tokens the load reads; the
        // residual's rows when the load needs them (it reads them whole).
        const std::uint64_t q = e.vq_quantized;
        if (side == 0) need += u128{(std::min(p, q) + h.chunk_tokens - 1) / h.chunk_tokens} * block;
        if (p > q) need += block + u128{h.tokens - q} * slice_bytes;
      } else {
        const auto g = static_cast<std::uint64_t>(e.config.cachegen_group_size);
        need += block + 4 + u128{(p + g - 1) / g} * slice_bytes;  // TABLES with its piece count, then >= one token's rows per group
      }
    }
  }
  return need;
}

BlockPlan::BlockPlan(const Header& h, const std::vector<std::array<std::vector<Group>, 2>>& groups)
    : h_(h), groups_(groups), cursor_(h.layers.size(), {0, 0}) {
  n_chunks_ = (h.tokens + h.chunk_tokens - 1) / h.chunk_tokens;
  for (std::size_t l = 0; l < h.layers.size(); ++l) {
    if (h.layers[l].offset == 0) continue;
    for (int side = 0; side < 2; ++side) {
      const auto& g = groups_[l][static_cast<std::size_t>(side)];
      if (h.layers[l].cls == CacheClass::Plain && n_chunks_ > 0) due_.emplace(0, l, side);
      if (h.layers[l].cls == CacheClass::CacheGen && !g.empty()) due_.emplace(g.front().start / h.chunk_tokens, l, side);
      if (h.layers[l].cls == CacheClass::Vq && side == 0 && h.layers[l].vq_quantized > 0) due_.emplace(0, l, side);
    }
  }
}

std::optional<std::uint64_t> BlockPlan::next_chunk(std::uint64_t chunk, std::size_t layer, int side) const {
  if (h_.layers[layer].cls == CacheClass::Plain) return chunk + 1 < n_chunks_ ? std::optional(chunk + 1) : std::nullopt;
  if (h_.layers[layer].cls == CacheClass::Vq) {
    const std::uint64_t q = h_.layers[layer].vq_quantized;
    return (chunk + 1) * std::uint64_t{h_.chunk_tokens} < q ? std::optional(chunk + 1) : std::nullopt;
  }
  const auto& g = groups_[layer][static_cast<std::size_t>(side)];
  const std::size_t c = cursor_[layer][static_cast<std::size_t>(side)];
  return c < g.size() ? std::optional(g[c].start / h_.chunk_tokens) : std::nullopt;
}

// Chunk `chunk` of (layer, side), which holds a block: the CacheGen groups starting in it, or a
// plain layer's rows.
PlannedBlock BlockPlan::chunk_block(std::uint64_t chunk, std::size_t layer, int side) {
  const LayerEntry& e = h_.layers[layer];
  const std::uint64_t begin = chunk * h_.chunk_tokens, end = std::min<std::uint64_t>(begin + h_.chunk_tokens, e.offset);
  PlannedBlock p;
  p.header.layer = static_cast<std::uint32_t>(layer);
  p.header.side = static_cast<std::uint8_t>(side);
  if (e.cls == CacheClass::Plain) {
    p.header.type = BlockType::Rows;
    p.header.token_begin = begin;
    p.header.token_count = end - begin;
    return p;
  }
  if (e.cls == CacheClass::Vq) {  // the codes of both sides of the chunk's quantized tokens
    p.header.type = BlockType::Codes;
    p.header.token_begin = begin;
    p.header.token_count = std::min<std::uint64_t>(begin + h_.chunk_tokens, e.vq_quantized) - begin;
    return p;
  }
  const auto& g = groups_[layer][static_cast<std::size_t>(side)];
  std::size_t& c = cursor_[layer][static_cast<std::size_t>(side)];
  p.header.type = BlockType::Codes;
  p.group_begin = c;
  p.header.token_begin = g[c].start;
  while (c < g.size() && g[c].start < begin + h_.chunk_tokens) ++c;
  p.n_groups = c - p.group_begin;
  p.header.token_count = g[c - 1].start + g[c - 1].n - p.header.token_begin;
  return p;
}

std::optional<PlannedBlock> BlockPlan::residual_block() {
  const LayerEntry& e = h_.layers[layer_];
  if (e.cls == CacheClass::Plain || e.offset == 0) return std::nullopt;
  const std::uint64_t q = e.cls == CacheClass::Vq ? e.vq_quantized : quantized_tokens(groups_[layer_][static_cast<std::size_t>(side_)]);
  if (q >= e.offset) return std::nullopt;
  PlannedBlock p;
  p.header.type = BlockType::Rows;
  p.header.layer = static_cast<std::uint32_t>(layer_);
  p.header.side = static_cast<std::uint8_t>(side_);
  p.header.token_begin = q;
  p.header.token_count = e.offset - q;
  return p;
}

std::optional<PlannedBlock> BlockPlan::next() {
  if (phase_ == 0) {
    if (!due_.empty()) {
      ++steps_;
      const auto [chunk, layer, side] = due_.top();
      due_.pop();
      PlannedBlock p = chunk_block(chunk, layer, side);
      if (const auto n = next_chunk(chunk, layer, side)) due_.emplace(*n, layer, side);
      ++emitted_;
      return p;
    }
    phase_ = 1;
  }
  while (phase_ == 1 && layer_ < h_.layers.size()) {
    ++steps_;
    std::optional<PlannedBlock> p = residual_block();
    if (++side_ == 2) {
      side_ = 0;
      ++layer_;
    }
    if (p) {
      ++emitted_;
      return p;
    }
  }
  if (phase_ <= 2) {
    ++steps_;
    phase_ = 3;
    PlannedBlock p;
    p.header.type = BlockType::End;
    return p;
  }
  return std::nullopt;
}

#if defined(__SSE2__)
namespace {
// Transpose 16 rows of 16 bytes in place: r[i] byte j becomes r[j] byte i.
inline void transpose16x16(__m128i r[16]) {
  for (int round = 0; round < 4; ++round) {
    __m128i t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]);
      t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
}
}  // namespace
#endif

void codes_to_symbols(const std::uint8_t* codes, std::size_t tokens, std::size_t dim, std::uint16_t* symbols, std::size_t ld) {
  std::size_t t0 = 0, c0 = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; t0 + 16 <= tokens; t0 += 16)
    for (c0 = 0; c0 + 16 <= dim; c0 += 16) {
      __m128i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (t0 + static_cast<std::size_t>(i)) * dim + c0));
      transpose16x16(r);  // r[j] = channel c0 + j, tokens t0 .. t0 + 15
      for (int j = 0; j < 16; ++j) {
        std::uint16_t* out = symbols + (c0 + static_cast<std::size_t>(j)) * ld + t0;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(r[j], zero));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm_unpackhi_epi8(r[j], zero));
      }
    }
  // Edges: the last dim % 16 channels of the blocked tokens, then the last tokens % 16 tokens.
  for (std::size_t t = 0; t < t0; ++t)
    for (std::size_t c = c0; c < dim; ++c) symbols[c * ld + t] = codes[t * dim + c];
#endif
  for (std::size_t c = 0; c < dim; ++c)
    for (std::size_t t = t0; t < tokens; ++t) symbols[c * ld + t] = codes[t * dim + c];
}

void symbols_to_codes(const std::uint16_t* symbols, std::size_t ld, std::size_t tokens, std::size_t dim, std::uint8_t* codes) {
  std::size_t t0 = 0, c0 = 0;
#if defined(__SSE2__)
  for (; t0 + 16 <= tokens; t0 += 16)
    for (c0 = 0; c0 + 16 <= dim; c0 += 16) {
      __m128i r[16];
      for (int j = 0; j < 16; ++j) {  // symbols are codes < 256: packus keeps them exactly
        const std::uint16_t* in = symbols + (c0 + static_cast<std::size_t>(j)) * ld + t0;
        r[j] = _mm_packus_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8)));
      }
      transpose16x16(r);  // r[i] = token t0 + i, channels c0 .. c0 + 15
      for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (t0 + static_cast<std::size_t>(i)) * dim + c0), r[i]);
    }
  for (std::size_t t = 0; t < t0; ++t)
    for (std::size_t c = c0; c < dim; ++c) codes[t * dim + c] = static_cast<std::uint8_t>(symbols[c * ld + t]);
#endif
  for (std::size_t t = t0; t < tokens; ++t)
    for (std::size_t c = 0; c < dim; ++c) codes[t * dim + c] = static_cast<std::uint8_t>(symbols[c * ld + t]);
}

}  // namespace vq::vqkv
