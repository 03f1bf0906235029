// Reading a .vqkv file: verify the header, the TABLES blocks, then every block against the plan
// (vqkv_layout.hpp), decode, and rebuild the caches. inspect_prompt_cache runs the same walk
// without decoding the rANS payloads.
// Why one file of ~700 lines: FileReader walks an untrusted file once, and every check of its bytes
// (sizes against the plan, checksums, each block's fields) stays in that one walk, the surface
// fuzz/fuzz_vqkv_read.cpp covers; the layout it checks against is vqkv_layout.hpp.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <fstream>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/input_file.hpp"
#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/vq/code_buffers.hpp"
#include "veloxquant/quant/group_quant.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "vqkv_layout.hpp"

namespace vq {

namespace {

using vqkv::BlockHeader;
using vqkv::BlockType;
using vqkv::ByteReader;
using vqkv::CacheClass;
using vqkv::Group;

// Everything read for one side of one layer.
struct SideData {
  std::vector<std::uint64_t> pieces;
  std::uint64_t closed = 0;                 // tokens in closed groups (the pieces' sum)
  std::vector<FrequencyTable> tables;       // transform codes
  std::optional<ContextDecoder> context;    // transform context: the side's model (its tables are built on first decode)
  QuantizedStreamParts parts;                       // CacheGen codes, scales, minima (when decoding)
  std::uint64_t decoded_groups = 0, row_tokens = 0;  // what was decoded (all of it unless a prefix load)
  std::vector<std::span<const std::uint8_t>> rows;  // ROWS bodies in token order (views of the file)
  VqkvBytes bytes;
};

// What was read of a vq layer: its calibration (from the first CODES block; every later one must
// agree) and the decoded codes per batch row, [tokens, n] each.
struct VqData {
  bool calibrated = false;
  VqLayerCodes params;  // step, offset, shift of both sides (no codes)
  std::vector<std::vector<std::int16_t>> k, v;
  std::uint64_t tokens = 0;  // decoded
};

class FileReader {
 public:
  FileReader(std::span<const std::uint8_t> file, bool decode, RansKernel kernel, std::optional<std::int64_t> max_tokens = std::nullopt,
             VqLayerModelSource vq_models = {})
      : file_(file), decode_(decode), kernel_(kernel), max_tokens_(max_tokens), vq_models_(std::move(vq_models)) {}

  void run() {
    std::size_t pos = 0;
    h_ = vqkv::read_header(file_, pos);
    file_bytes_.headers += pos - vqkv::kChecksumBytes;
    file_bytes_.checksums += vqkv::kChecksumBytes;
    prefix_ = max_tokens_ ? std::min<std::uint64_t>(h_.tokens, static_cast<std::uint64_t>(*max_tokens_)) : h_.tokens;
    check_size_bound(pos);
    sides_.resize(h_.layers.size());
    groups_.resize(h_.layers.size());
    vq_.resize(h_.layers.size());
    std::uint64_t n_blocks = 0;
    for (std::size_t l = 0; l < h_.layers.size(); ++l) {
      const vqkv::LayerEntry& e = h_.layers[l];
      if (e.cls != CacheClass::CacheGen || e.offset == 0) continue;
      for (int side = 0; side < 2; ++side) {
        BlockHeader want;
        want.type = BlockType::Tables;
        want.layer = static_cast<std::uint32_t>(l);
        want.side = static_cast<std::uint8_t>(side);
        std::span<const std::uint8_t> body;
        const BlockHeader got = next_block(pos, want, body);
        read_tables(got, body, e, sides_[l][static_cast<std::size_t>(side)]);
        ++n_blocks;
      }
    }
    build_groups(file_.size() - pos);
    const std::uint64_t n_read = blocks_to_read();
    vqkv::BlockPlan plan(h_, groups_);
    for (std::uint64_t i = 0; auto p = plan.next(); ++i) {
      if (i >= n_read) return;  // a prefix load stops after the last block it needs
      std::span<const std::uint8_t> body;
      if (p->header.type == BlockType::End) {
        p->header.token_count = n_blocks;
        const BlockHeader got = next_block(pos, p->header, body);
        if (got.body_size != 0) fail_at(got, "has a body");
        file_bytes_.headers += vqkv::kBlockHeaderBytes;
        file_bytes_.checksums += vqkv::kChecksumBytes;
        break;
      }
      const BlockHeader got = next_block(pos, p->header, body);
      SideData& sd = sides_[got.layer][got.side];
      sd.bytes.headers += vqkv::kBlockHeaderBytes;
      sd.bytes.checksums += vqkv::kChecksumBytes;
      const bool want = needed(*p);
      if (got.type == BlockType::Codes && h_.layers[got.layer].cls == CacheClass::Vq)
        read_vq_codes(got, body, sd, vq_[got.layer], want);
      else if (got.type == BlockType::Codes)
        read_codes(got, *p, body, sd, want);
      else
        read_rows(got, body, sd, want);
      ++n_blocks;
    }
    if (pos != file_.size())
      throw FormatError(fmt::format("vqkv: {} unexpected bytes after the END block (at byte {})", file_.size() - pos, pos));
  }

  VqkvInfo info() const {
    VqkvInfo in;
    in.version = h_.version;
    in.dtype = h_.dtype;
    in.batch = h_.batch;
    in.heads = h_.heads;
    in.key_dim = h_.key_dim;
    in.value_dim = h_.value_dim;
    in.tokens = static_cast<std::int64_t>(h_.tokens);
    in.chunk_tokens = h_.chunk_tokens;
    in.metadata = h_.metadata;
    in.file = file_bytes_;
    in.file_bytes = file_.size();
    for (std::size_t l = 0; l < h_.layers.size(); ++l) {
      const vqkv::LayerEntry& e = h_.layers[l];
      VqkvLayerInfo li;
      li.kind = e.cls == CacheClass::CacheGen ? "CacheGenKVCache" : e.cls == CacheClass::Vq ? "VqKVCache" : "KVCache";
      if (e.cls == CacheClass::CacheGen) li.config = e.config;
      li.offset = static_cast<std::int64_t>(e.offset);
      li.quantized_keys = static_cast<std::int64_t>(vqkv::quantized_tokens(groups_[l][0]));
      li.quantized_values = static_cast<std::int64_t>(vqkv::quantized_tokens(groups_[l][1]));
      if (e.cls == CacheClass::Vq) {
        li.vq = e.vq;
        li.vq_model = e.vq_source;
        li.quantized_keys = li.quantized_values = static_cast<std::int64_t>(e.vq_quantized);
      }
      li.keys = sides_[l][0].bytes;
      li.values = sides_[l][1].bytes;
      in.layers.push_back(std::move(li));
    }
    return in;
  }

  PromptCache caches(bool dense_states = false, bool vq_codes = false) {
    PromptCache out;
    out.metadata = h_.metadata;
    if (dense_states && vq_codes) out.vq_layers.resize(h_.layers.size());
    for (std::size_t l = 0; l < h_.layers.size(); ++l) {
      if (!dense_states) {
        out.caches.push_back(build_layer(l));
        continue;
      }
      const vqkv::LayerEntry& e = h_.layers[l];
      // Codes as they are: a vq layer of a model (its layer model rebuilt) of codes only (no exact rows
      // after them), no trim.
      if (vq_codes && e.cls == CacheClass::Vq && e.offset > 0 && prefix_ > 0 && e.offset <= prefix_ && vq_[l].tokens == e.offset &&
          e.vq_source) {
        out.vq_layers[l] = VqStoredLayer{e.vq, vq_layer_model(l), take_codes(l), h_.dtype};
        out.states.emplace_back();
        continue;
      }
      // A vq layer whose tokens are all kept (no trim) goes straight from codes to rows.
      if (e.cls == CacheClass::Vq && e.offset > 0 && prefix_ > 0 && e.offset <= prefix_)
        out.states.push_back(vq_state(l));
      else
        out.states.push_back(build_layer(l)->state());
    }
    return out;
  }

 private:
  [[noreturn]] static void fail_at(const BlockHeader& b, const std::string& why) {
    throw FormatError(fmt::format("vqkv: {}: {}", vqkv::describe(b), why));
  }

  // Refuse a header that claims more than the file can hold before reading on (vqkv_layout.hpp's
  // min_block_bytes): what follows then costs O(file size + output size).
  void check_size_bound(std::size_t pos) const {
    const unsigned __int128 need = vqkv::min_block_bytes(h_, prefix_);
    const std::uint64_t left = file_.size() - pos;
    if (need <= left) return;
    const auto shown = static_cast<std::uint64_t>(std::min<unsigned __int128>(need, std::numeric_limits<std::uint64_t>::max()));
    const auto layers = std::count_if(h_.layers.begin(), h_.layers.end(), [](const vqkv::LayerEntry& e) { return e.offset > 0; });
    const std::string what = prefix_ == h_.tokens ? fmt::format("{} tokens", h_.tokens) : fmt::format("the first {} of {} tokens", prefix_, h_.tokens);
    throw FormatError(fmt::format("vqkv: header: {} of [B {}, H {}, D_k {} / D_v {}] {} in {} non-empty layers need at least {} bytes of "
                                  "blocks, the file has {} after its header (a corrupt header or a truncated file)",
                                  what, h_.batch, h_.heads, h_.key_dim, h_.value_dim, dtype_name(h_.dtype), layers, shown, left));
  }

  // What differs between a block found and the one expected, in one sentence: the two blocks when
  // they are different blocks, else the field that is wrong (describe() prints every END block
  // alike, so "found the END block where the END block belongs" said nothing).
  static std::string mismatch(const BlockHeader& got, const BlockHeader& want) {
    if (got.type == BlockType::End && want.type == BlockType::End) {
      if (got.layer != 0 || got.side != 0 || got.token_begin != 0)
        return fmt::format("the END block has layer {}, side {}, first token {} (all must be 0)", got.layer, got.side, got.token_begin);
      return fmt::format("the END block counts {} blocks before it, the file has {} (blocks missing or added)", got.token_count,
                         want.token_count);
    }
    if (got.type == want.type && got.layer == want.layer && got.side == want.side) {
      if (want.type == BlockType::Tables) return fmt::format("the {} starts at token {}, not 0", vqkv::describe(got), got.token_begin);
      return fmt::format("the {} should cover tokens {}..{} (its range disagrees with the header and the groups)", vqkv::describe(got),
                         want.token_begin, want.token_begin + want.token_count);
    }
    return fmt::format("found the {} where the {} belongs (blocks out of order or missing)", vqkv::describe(got), vqkv::describe(want));
  }

  // The next block, which must be the one `want` describes (type, layer, side, tokens; token
  // counts of TABLES blocks are checked by read_tables).
  BlockHeader next_block(std::size_t& pos, const BlockHeader& want, std::span<const std::uint8_t>& body) {
    if (pos >= file_.size()) throw FormatError(fmt::format("vqkv: truncated file: the {} is missing", vqkv::describe(want)));
    const BlockHeader got = vqkv::read_block(file_, pos, body);
    const bool tables = want.type == BlockType::Tables;
    if (got.type != want.type || got.layer != want.layer || got.side != want.side || got.token_begin != want.token_begin ||
        (!tables && got.token_count != want.token_count))
      throw FormatError(fmt::format("vqkv: {}", mismatch(got, want)));
    return got;
  }

  std::uint64_t slices() const { return h_.slices(); }

  void read_tables(const BlockHeader& b, std::span<const std::uint8_t> body, const vqkv::LayerEntry& e, SideData& sd) {
    sd.bytes.headers += vqkv::kBlockHeaderBytes;
    sd.bytes.checksums += vqkv::kChecksumBytes;
    ByteReader r(body, vqkv::describe(b));
    if (b.token_count > e.offset) r.fail(fmt::format("{} closed tokens in a layer of {}", b.token_count, e.offset));
    const std::uint32_t n_pieces = r.u32("piece count");
    if (std::uint64_t{n_pieces} * 4 > r.remaining()) r.fail("truncated (piece list)");
    std::uint64_t sum = 0;
    const auto g = static_cast<std::uint64_t>(e.config.cachegen_group_size);
    for (std::uint32_t i = 0; i < n_pieces; ++i) {
      const std::uint64_t t = r.ranged(r.u32("piece tokens"), 1, b.token_count - sum, "piece tokens");
      sum += t;
      sd.pieces.push_back(t);
    }
    if (sum != b.token_count) r.fail(fmt::format("pieces hold {} tokens, the block says {}", sum, b.token_count));
    sd.closed = sum;
    if (e.config.cachegen_flush == FlushMode::GroupAligned && (n_pieces > 1 || sum % g != 0))
      r.fail("a group_aligned side must be one piece of whole groups");
    const std::uint64_t d = h_.dim(b.side);
    sd.bytes.headers += r.pos();
    if (sum > 0 && e.transform == vqkv::kTransformContext) {
      std::size_t used = 0;
      try {
        sd.context.emplace(ContextModel::deserialize(body.subspan(r.pos()), e.config.effective_bits(), &used), kernel_);
      } catch (const FormatError& ex) {
        r.fail(ex.what());
      }
      r.take(used, "context model");
      sd.bytes.tables += used;
    } else if (sum > 0) {
      const std::uint64_t n_tables = slices() * d;
      if (n_tables * 3 > r.remaining()) r.fail("truncated (frequency tables)");  // a table takes >= 3 bytes
      const int alphabet = 1 << e.config.effective_bits();
      sd.tables.reserve(n_tables);
      const std::size_t t0 = r.pos();
      for (std::uint64_t i = 0; i < n_tables; ++i) {
        std::size_t used = 0;
        sd.tables.push_back(FrequencyTable::deserialize(body.subspan(r.pos()), &used));
        r.take(used, "frequency table");
        if (sd.tables.back().alphabet_size() != alphabet || sd.tables.back().scale_bits() != e.scale_bits)
          r.fail(fmt::format("table {} has alphabet {} at {} bits, expected {} at {} bits", i, sd.tables.back().alphabet_size(),
                             sd.tables.back().scale_bits(), alphabet, e.scale_bits));
      }
      sd.bytes.tables += r.pos() - t0;
    }
    if (r.remaining() != 0) r.fail(fmt::format("{} unexpected bytes after the tables", r.remaining()));
    // The per-slice vectors come later (slice_parts), when decoded data justifies them: a side
    // with no groups has nothing here to bound the slice count by.
    if (decode_) sd.parts.piece_tokens.assign(sd.pieces.begin(), sd.pieces.end());
  }

  // The group lists of every CacheGen side, once all TABLES blocks are read (`left`: the bytes after
  // them). Every group costs 8 bytes per (slice, channel) of scale and minimum in the CODES blocks to
  // come: all sides' groups together must fit in what is left before any list is built. A prefix
  // load that needs no residual reads only the chunks covering the prefix, so it builds (and
  // bounds) only the groups starting in them: a file cut after those chunks holds no more.
  void build_groups(std::uint64_t left) {
    std::uint64_t limit = std::numeric_limits<std::uint64_t>::max();
    if (prefix_ < h_.tokens) {
      bool residual = false;  // a residual block the prefix needs: the load reads every chunk
      for (std::size_t l = 0; l < h_.layers.size(); ++l)
        for (const SideData& sd : sides_[l])
          if (h_.layers[l].cls == CacheClass::CacheGen && h_.layers[l].offset > 0 && prefix_ > sd.closed) residual = true;
      for (const vqkv::LayerEntry& e : h_.layers)
        if (e.cls == CacheClass::Vq && e.offset > 0 && prefix_ > e.vq_quantized) residual = true;
      if (!residual) limit = (prefix_ + h_.chunk_tokens - 1) / h_.chunk_tokens * h_.chunk_tokens;
    }
    unsigned __int128 meta = 0;
    for (std::size_t l = 0; l < h_.layers.size(); ++l) {
      const vqkv::LayerEntry& e = h_.layers[l];
      if (e.cls != CacheClass::CacheGen || e.offset == 0) continue;
      const auto g = static_cast<std::uint64_t>(e.config.cachegen_group_size);
      for (int side = 0; side < 2; ++side) {
        const SideData& sd = sides_[l][static_cast<std::size_t>(side)];
        const std::uint64_t n = vqkv::count_groups(sd.pieces, g, limit);
        meta += static_cast<unsigned __int128>(n) * slices() * h_.dim(side) * 8;
        if (meta > left)
          throw FormatError(fmt::format("vqkv: layer {} {}: {} groups need more bytes of scales and minima than the file holds", l,
                                        vqkv::side_name(side), n));
        groups_[l][static_cast<std::size_t>(side)] = vqkv::groups_of(sd.pieces, g, limit);
      }
    }
  }

  // A side's per-slice codes, scales and minima, allocated once data of every slice was read.
  void slice_parts(SideData& sd) const {
    if (!sd.parts.codes.empty()) return;
    sd.parts.codes.resize(slices());
    sd.parts.scales.resize(slices());
    sd.parts.minima.resize(slices());
  }

  // Whether a load of prefix_ tokens needs this block's contents.
  bool needed(const vqkv::PlannedBlock& p) const {
    if (p.header.type == BlockType::End) return prefix_ == h_.tokens;
    const bool residual = p.header.type == BlockType::Rows && h_.layers[p.header.layer].cls != CacheClass::Plain;
    return residual ? prefix_ > p.header.token_begin : p.header.token_begin < prefix_;
  }

  // How many blocks of the plan a load of prefix_ tokens reads: up to the last one it needs (all of
  // them, END included, for a whole load; none when the prefix is empty).
  std::uint64_t blocks_to_read() const {
    if (prefix_ == h_.tokens) return std::numeric_limits<std::uint64_t>::max();
    vqkv::BlockPlan scan(h_, groups_);
    std::uint64_t n = 0;
    for (std::uint64_t i = 0; auto p = scan.next(); ++i) {
      if (needed(*p)) n = i + 1;
      // Each block takes >= 40 bytes: a plan longer than the file can hold is cut short here, and
      // reading reports the truncation.
      if ((i + 1) * (vqkv::kBlockHeaderBytes + vqkv::kChecksumBytes) > file_.size()) break;
    }
    return n;
  }

  void read_codes(const BlockHeader& b, const vqkv::PlannedBlock& p, std::span<const std::uint8_t> body, SideData& sd, bool keep) {
    ByteReader r(body, vqkv::describe(b));
    if (r.u64("first group") != p.group_begin) r.fail("first group disagrees with the pieces");
    if (r.u32("group count") != p.n_groups) r.fail("group count disagrees with the pieces");
    const std::size_t d = h_.dim(b.side), n_slices = slices();
    const std::size_t meta = static_cast<std::size_t>(p.n_groups) * d;
    const auto scales = r.take(meta * n_slices * 4, "scales");
    const auto minima = r.take(meta * n_slices * 4, "minima");
    sd.bytes.headers += 12;
    sd.bytes.scales_zeros += scales.size() + minima.size();
    sd.bytes.payload += r.remaining();
    const std::size_t count = b.token_count;
    const std::size_t t0 = b.token_begin;
    const auto payload = body.subspan(r.pos());
    std::optional<ContextLayout> layout;
    if (sd.context) {  // the context coder's payload: its unit count follows from the chunk's groups
      layout = ContextLayout{n_slices, count, d, h_.layers[b.layer].config.effective_bits(),
                             vqkv::block_group_starts(groups_[b.layer][b.side], p.group_begin, p.n_groups, b.token_begin, count)};
      if (context_payload_units(payload) != context_coded_units(*layout))
        r.fail("the context payload holds a different number of units than the block's tokens");
    } else {
      const unsigned __int128 n_symbols = static_cast<unsigned __int128>(count) * n_slices * d;
      if (vq::rans_stream_symbols(payload) != n_symbols) r.fail("the rANS stream holds a different number of symbols than the block's tokens");
    }
    if (!decode_ || !keep) return;
    slice_parts(sd);
    sd.decoded_groups += p.n_groups;
    for (std::size_t s = 0; s < n_slices; ++s) {
      append_floats(sd.parts.scales[s], scales.subspan(s * meta * 4, meta * 4), r, true);
      append_floats(sd.parts.minima[s], minima.subspan(s * meta * 4, meta * 4), r, false);
      sd.parts.codes[s].resize((t0 + count) * d);
    }
    if (layout) {
      std::vector<std::span<std::uint8_t>> out;
      for (std::size_t s = 0; s < n_slices; ++s) out.push_back(std::span(sd.parts.codes[s]).subspan(t0 * d, count * d));
      sd.context->decode(payload, *layout, ContextSlicesOut(out));
      return;
    }
    const std::size_t ld = count + vqkv::kSymbolPad;
    symbols_.resize(n_slices * d * ld);
    std::vector<RansDecodeSegment> segs(n_slices * d);
    for (std::size_t i = 0; i < segs.size(); ++i)
      segs[i] = {std::span<std::uint16_t>(symbols_).subspan(i * ld, count), &sd.tables[i]};
    rans_decode(payload, segs, kernel_);
    for (std::size_t s = 0; s < n_slices; ++s)
      vqkv::symbols_to_codes(symbols_.data() + s * d * ld, ld, count, d, sd.parts.codes[s].data() + t0 * d);
  }

  // A vq layer's CODES block: both sides' codes of its tokens, one vq_encode stream (vq/codec.hpp),
  // counted under the keys. Decoded by inspect too (the codec has no separate header to verify),
  // after the block's claimed codes are bounded by its size (kVqMaxCodesPerByte).
  void read_vq_codes(const BlockHeader& b, std::span<const std::uint8_t> body, SideData& sd, VqData& vd, bool keep) {
    sd.bytes.payload += body.size();
    const unsigned __int128 codes = static_cast<unsigned __int128>(b.token_count) * h_.batch * (h_.heads * std::uint64_t{h_.key_dim} + h_.heads * std::uint64_t{h_.value_dim});
    if (codes > static_cast<unsigned __int128>(vqkv::kVqMaxCodesPerByte) * body.size())
      fail_at(b, fmt::format("claims more codes than {} bytes can hold (at most {} per byte)", body.size(), vqkv::kVqMaxCodesPerByte));
    VqLayerCodes c;
    try {
      c = vq_decode(body, static_cast<std::uint64_t>(codes), kernel_, code_buffers_);
    } catch (const FormatError& ex) {
      fail_at(b, ex.what());
    }
    const auto H = static_cast<std::int64_t>(h_.heads);
    if (c.batch != h_.batch || c.tokens != static_cast<std::int64_t>(b.token_count) || c.k.n != H * h_.key_dim || c.v.n != H * h_.value_dim)
      fail_at(b, fmt::format("holds codes of batch {}, {} tokens, widths {}/{}; the block needs batch {}, {} tokens, {}/{}", c.batch, c.tokens,
                             c.k.n, c.v.n, h_.batch, b.token_count, H * h_.key_dim, H * h_.value_dim));
    for (VqSideCodes* side : {&c.k, &c.v})
      if (side->shift.empty()) side->shift.assign(static_cast<std::size_t>(side->n), 0);
    auto same = [](const VqSideCodes& x, const VqSideCodes& y) {
      return std::bit_cast<std::uint32_t>(x.step) == std::bit_cast<std::uint32_t>(y.step) && x.offset == y.offset && x.shift == y.shift;
    };
    if (!vd.calibrated) {
      vd.calibrated = true;
      vd.params.batch = c.batch;
      vd.params.k = vq_side_params(c.k);
      vd.params.v = vq_side_params(c.v);
    } else if (!same(c.k, vd.params.k) || !same(c.v, vd.params.v)) {
      fail_at(b, "its quantizer (step, offsets, shifts) differs from the layer's first CODES block");
    }
    if (!decode_ || !keep) return;
    const std::size_t count = b.token_count;
    vd.k.resize(h_.batch);
    vd.v.resize(h_.batch);
    if (h_.batch == 1 && vd.k[0].empty()) {  // a layer's first block of one batch row: its codes as they are, not copied
      vd.k[0] = std::move(c.k.codes);
      vd.v[0] = std::move(c.v.codes);
      vd.tokens += count;
      return;
    }
    for (std::size_t bi = 0; bi < h_.batch; ++bi) {
      const auto rows_k = c.k.codes.begin() + static_cast<std::ptrdiff_t>(bi * count * static_cast<std::size_t>(c.k.n));
      vd.k[bi].insert(vd.k[bi].end(), rows_k, rows_k + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(c.k.n)));
      const auto rows_v = c.v.codes.begin() + static_cast<std::ptrdiff_t>(bi * count * static_cast<std::size_t>(c.v.n));
      vd.v[bi].insert(vd.v[bi].end(), rows_v, rows_v + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(c.v.n)));
    }
    vd.tokens += count;
    if (code_buffers_) code_buffers_->give(std::move(c));
  }

  static void append_floats(UninitVector<float>& out, std::span<const std::uint8_t> raw, const ByteReader& r, bool scale) {
    const std::size_t at = out.size(), n = raw.size() / 4;
    out.resize(at + n);
    std::memcpy(out.data() + at, raw.data(), raw.size());
    for (std::size_t i = at; i < at + n; ++i)
      if (!std::isfinite(out[i]) || (scale && out[i] < 0)) r.fail(fmt::format("a {} is {} (corrupt data)", scale ? "scale" : "minimum", out[i]));
  }

  void read_rows(const BlockHeader& b, std::span<const std::uint8_t> body, SideData& sd, bool keep) {
    const unsigned __int128 want = static_cast<unsigned __int128>(b.token_count) * slices() * h_.dim(b.side) * dtype_size(h_.dtype);
    if (body.size() != want) fail_at(b, fmt::format("holds {} bytes, its rows need {}", body.size(), static_cast<std::uint64_t>(want)));
    (h_.layers[b.layer].cls != CacheClass::Plain ? sd.bytes.residual : sd.bytes.payload) += body.size();
    if (decode_ && keep) {
      sd.rows.push_back(body);
      sd.row_tokens += b.token_count;
    }
  }

  // Dense [B, H, offset, D] of one side: CacheGen reconstructions of the closed groups, then rows.
  // Tokens decoded for a side: its decoded groups, then its rows (all of them unless a prefix load).
  std::uint64_t decoded_tokens(std::size_t l, int side) const {
    const SideData& sd = sides_[l][static_cast<std::size_t>(side)];
    return vqkv::quantized_tokens(groups_[l][static_cast<std::size_t>(side)]) + sd.row_tokens;
  }

  // A prefix load decoded only the first groups: drop the others and cut the pieces to match.
  void keep_decoded_groups(std::size_t l, int side) {
    SideData& sd = sides_[l][static_cast<std::size_t>(side)];
    auto& groups = groups_[l][static_cast<std::size_t>(side)];
    groups.resize(sd.decoded_groups);  // (the list may already end early: build_groups' limit)
    std::uint64_t left = vqkv::quantized_tokens(groups);
    auto& pieces = sd.parts.piece_tokens;
    std::size_t i = 0;
    for (; i < pieces.size() && left > 0; ++i) {
      pieces[i] = static_cast<std::int64_t>(std::min<std::uint64_t>(static_cast<std::uint64_t>(pieces[i]), left));
      left -= static_cast<std::uint64_t>(pieces[i]);
    }
    pieces.resize(i);
  }

  Tensor dense_side(std::size_t l, int side) const {
    const SideData& sd = sides_[l][static_cast<std::size_t>(side)];
    const std::int64_t d = h_.dim(side);
    Tensor x = Tensor::uninitialized({h_.batch, h_.heads, static_cast<std::int64_t>(decoded_tokens(l, side)), d}, h_.dtype);
    const std::uint64_t q = vqkv::quantized_tokens(groups_[l][static_cast<std::size_t>(side)]);
    std::vector<float> buf;
    for (std::int64_t s = 0; s < static_cast<std::int64_t>(slices()); ++s) {
      const std::int64_t b = s / h_.heads, hh = s % h_.heads;
      if (q > 0) {
        const auto& codes = sd.parts.codes[static_cast<std::size_t>(s)];
        const auto& sc = sd.parts.scales[static_cast<std::size_t>(s)];
        const auto& mn = sd.parts.minima[static_cast<std::size_t>(s)];
        std::size_t g = 0;
        for (const Group& grp : groups_[l][static_cast<std::size_t>(side)]) {
          buf.resize(static_cast<std::size_t>(grp.n * d));
          dequant_group(codes.data() + grp.start * d, static_cast<int>(grp.n), static_cast<int>(d), sc.data() + g * d, mn.data() + g * d,
                        buf.data());
          from_f32(buf.data(), x.row(b, hh, static_cast<std::int64_t>(grp.start)), h_.dtype, buf.size());
          ++g;
        }
      }
    }
    copy_rows(sd, d, static_cast<std::int64_t>(q), x);  // the ROWS blocks, from token q
    return x;
  }

  // The exact rows of a CacheGen side (its ROWS blocks, tokens after the closed groups) as a tensor
  // [B, H, rows, D]: what its stream keeps as the residual.
  Tensor residual_side(std::size_t l, int side) const {
    const SideData& sd = sides_[l][static_cast<std::size_t>(side)];
    const std::int64_t d = h_.dim(side);
    const auto rows = static_cast<std::int64_t>(sd.row_tokens);
    if (rows == 0) return Tensor();
    Tensor x = Tensor::uninitialized({h_.batch, h_.heads, rows, d}, h_.dtype);
    copy_rows(sd, d, 0, x);
    return x;
  }

  // A side's ROWS blocks ([slice][token][D] per block, blocks in token order) into x's tokens from t.
  void copy_rows(const SideData& sd, std::int64_t d, std::int64_t t, Tensor& x) const {
    const std::size_t row_bytes = static_cast<std::size_t>(d) * dtype_size(h_.dtype);
    for (const auto& body : sd.rows) {
      const std::int64_t count = static_cast<std::int64_t>(body.size() / row_bytes / slices());
      const std::uint8_t* in = body.data();
      for (std::int64_t s = 0; s < static_cast<std::int64_t>(slices()); ++s)
        for (std::int64_t i = 0; i < count; ++i, in += row_bytes) std::memcpy(x.row(s / h_.heads, s % h_.heads, t + i), in, row_bytes);
      t += count;
    }
  }

  // The layer's cache as saved, or, for a prefix load, built from what was decoded (a whole number
  // of chunks) and trimmed to the prefix, as trim() would leave the saved cache.
  std::shared_ptr<KVCache> build_layer(std::size_t l) {
    const vqkv::LayerEntry& e = h_.layers[l];
    std::shared_ptr<KVCache> c;
    if (e.cls == CacheClass::Plain) {
      c = std::make_shared<KVCache>();
      if (e.offset > 0 && prefix_ > 0) c->from_state({dense_side(l, 0), dense_side(l, 1)});
    } else if (e.cls == CacheClass::Vq) {
      c = build_vq(l);
    } else {
      c = build_cachegen(l);
    }
    if (c->offset() > static_cast<std::int64_t>(prefix_)) c->trim(c->offset() - static_cast<std::int64_t>(prefix_));
    return c;
  }

  // The layer model a vq layer names: none (identity sized from the data), or the one vq_models_
  // rebuilds, which must be for the model and layer the file names.
  std::shared_ptr<const VqLayerModel> vq_layer_model(std::size_t l) const {
    const vqkv::LayerEntry& e = h_.layers[l];
    if (!e.vq_source) return nullptr;
    if (!vq_models_)
      throw FormatError(fmt::format("vqkv: layer {} is a vq cache built from the model with fingerprint {:016x}: load it with that model "
                                    "(decompress --model, load_prompt_cache(..., model=...), VqkvLoadOptions::vq_models)",
                                    l, e.vq_source->fingerprint));
    std::shared_ptr<const VqLayerModel> m;
    try {
      m = vq_models_(*e.vq_source);
    } catch (const Error& ex) {
      throw FormatError(fmt::format("vqkv: layer {}: {}", l, ex.what()));
    }
    if (!m || m->source != e.vq_source)
      throw FormatError(fmt::format("vqkv: layer {}: the vq model source returned a model for another fingerprint or layer", l));
    if (e.offset > 0 && (m->kv_heads != static_cast<int>(h_.heads) || m->k.n != m->kv_heads * static_cast<int>(h_.key_dim) ||
                         m->v.n != m->kv_heads * static_cast<int>(h_.value_dim)))
      throw FormatError(fmt::format("vqkv: layer {}: the model's layer {} has {} KV heads of K/V widths {}/{}, the file [H {}, D_k {} / D_v {}]",
                                    l, e.vq_source->layer, m->kv_heads, m->k.n, m->v.n, h_.heads, h_.key_dim, h_.value_dim));
    return m;
  }

  // Layer l's codes as one VqLayerCodes (batches concatenated); the parts read are released.
  VqLayerCodes take_codes(std::size_t l) {
    VqData& vd = vq_[l];
    VqLayerCodes codes = std::move(vd.params);
    codes.tokens = static_cast<std::int64_t>(vd.tokens);
    codes.batch = h_.batch;
    if (vd.k.size() == 1) {  // one batch row: moved, not concatenated
      codes.k.codes = std::move(vd.k[0]);
      codes.v.codes = std::move(vd.v[0]);
      vd.k[0] = {};
      vd.v[0] = {};
      return codes;
    }
    for (std::size_t b = 0; b < vd.k.size(); ++b) {
      codes.k.codes.insert(codes.k.codes.end(), vd.k[b].begin(), vd.k[b].end());
      codes.v.codes.insert(codes.v.codes.end(), vd.v[b].begin(), vd.v[b].end());
      vd.k[b] = {};
      vd.v[b] = {};
    }
    return codes;
  }

  std::shared_ptr<KVCache> build_vq(std::size_t l) {
    const vqkv::LayerEntry& e = h_.layers[l];
    std::shared_ptr<const VqLayerModel> model = vq_layer_model(l);
    if (e.offset == 0 || prefix_ == 0) return std::make_shared<VqKVCache>(e.vq, model);
    VqLayerCodes codes = take_codes(l);
    try {
      return VqKVCache::restore(e.vq, std::move(model), std::move(codes), {dense_side(l, 0), dense_side(l, 1)});
    } catch (const InvalidArgument& ex) {
      throw FormatError(fmt::format("vqkv: layer {}: {}", l, ex.what()));
    }
  }

  // build_vq(l)->state() without the cache (vq_restored_state), for a layer that needs no trim.
  KVState vq_state(std::size_t l) {
    const vqkv::LayerEntry& e = h_.layers[l];
    std::shared_ptr<const VqLayerModel> model = vq_layer_model(l);
    VqLayerCodes codes = take_codes(l);
    try {
      return vq_restored_state(e.vq, std::move(model), std::move(codes), {dense_side(l, 0), dense_side(l, 1)});
    } catch (const InvalidArgument& ex) {
      throw FormatError(fmt::format("vqkv: layer {}: {}", l, ex.what()));
    }
  }

  std::shared_ptr<KVCache> build_cachegen(std::size_t l) {
    const vqkv::LayerEntry& e = h_.layers[l];
    auto c = std::make_shared<CacheGenKVCache>(e.config);
    if (e.offset == 0 || prefix_ == 0) return c;
    keep_decoded_groups(l, 0);
    keep_decoded_groups(l, 1);
    CacheGenState st;
    st.config = e.config;
    st.offset = static_cast<std::int64_t>(decoded_tokens(l, 0));
    if (decoded_tokens(l, 1) != decoded_tokens(l, 0)) throw FormatError(fmt::format("vqkv: layer {}: keys and values cover different tokens", l));
    slice_parts(sides_[l][0]);  // the tokens decoded (> 0 here) hold bytes of every slice
    slice_parts(sides_[l][1]);
    sides_[l][0].parts.residual = residual_side(l, 0);
    sides_[l][1].parts.residual = residual_side(l, 1);
    const int bits = e.config.effective_bits();
    try {
      st.key_stream = QuantizedStream::from_parts(h_.batch, h_.heads, static_cast<int>(h_.key_dim), bits, e.config, h_.dtype,
                                                  std::move(sides_[l][0].parts));
      st.value_stream = QuantizedStream::from_parts(h_.batch, h_.heads, static_cast<int>(h_.value_dim), bits, e.config, h_.dtype,
                                                    std::move(sides_[l][1].parts));
    } catch (const InvalidArgument& ex) {
      throw FormatError(fmt::format("vqkv: layer {}: {}", l, ex.what()));
    }
    c->from_full_state(std::move(st));
    return c;
  }

  std::span<const std::uint8_t> file_;
  bool decode_;
  RansKernel kernel_;
  std::optional<std::int64_t> max_tokens_;
  std::uint64_t prefix_ = 0;  // tokens to load
  vqkv::Header h_;
  VqkvBytes file_bytes_;
  std::vector<std::array<SideData, 2>> sides_;
  std::vector<std::array<std::vector<Group>, 2>> groups_;
  std::vector<std::uint16_t> symbols_;
  VqLayerModelSource vq_models_;
  std::vector<VqData> vq_;

 public:
  VqCodeBuffers* code_buffers_ = nullptr;  // VqkvLoadOptions::vq_code_buffers
};

}  // namespace

PromptCache deserialize_prompt_cache(std::span<const std::uint8_t> bytes, const VqkvLoadOptions& options) {
  require(!options.max_tokens || *options.max_tokens >= 0, "max_tokens must be >= 0, got {}", options.max_tokens.value_or(0));
  FileReader r(bytes, true, options.kernel, options.max_tokens, options.vq_models);
  r.code_buffers_ = options.vq_code_buffers;
  r.run();
  return r.caches(options.dense_states, options.vq_codes);
}

VqkvInfo inspect_prompt_cache(std::span<const std::uint8_t> bytes) {
  FileReader r(bytes, false, RansKernel::Auto);
  r.run();
  return r.info();
}

std::vector<std::uint8_t> read_file_bytes(const std::string& path) { return read_input_file(path); }

PromptCache load_prompt_cache(const std::string& path, const VqkvLoadOptions& options) {
  const auto bytes = read_file_bytes(path);
  try {
    return deserialize_prompt_cache(bytes, options);
  } catch (const FormatError& e) {
    throw FormatError(fmt::format("{}: {}", path, e.what()));
  }
}

}  // namespace vq
