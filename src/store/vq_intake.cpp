#include "vq_intake.hpp"

#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"

namespace vq {

namespace {

// Whether a host vq cache is of the stored layer's config and layer model (then its codes may be
// taken as they are, if the calibration matches too: VqKVCache::append_codes checks that).
bool same_vq_layer(const VqKVCache& host, const VqStoredLayer& v) {
  const VqConfig& a = host.config();
  const VqConfig& b = v.config;
  const VqLayerModel* lm = host.layer_model();
  return a.bits == b.bits && a.calib == b.calib && a.residual == b.residual && a.sinks == b.sinks && a.k_offset == b.k_offset &&
         a.v_offset == b.v_offset && lm && v.layer && (lm == v.layer.get() || (lm->source && lm->source == v.layer->source));
}

}  // namespace

std::unique_ptr<VqIntake> VqIntake::for_caches(const std::vector<std::shared_ptr<KVCache>>& caches) {
  std::vector<VqKVCache*> hosts;
  for (const auto& c : caches) {
    auto* v = dynamic_cast<VqKVCache*>(c.get());
    if (!v || v->model_from_data() || !v->layer_model()) return nullptr;
    hosts.push_back(v);
  }
  if (hosts.empty()) return nullptr;
  return std::unique_ptr<VqIntake>(new VqIntake(std::move(hosts)));
}

bool VqIntake::decodes(const std::string& level) { return MethodSpec::parse(level).kind == MethodSpec::Kind::Vq; }

ChunkCodes VqIntake::decode(std::span<const std::uint8_t> blob, std::uint64_t fingerprint, const std::string& level, int index,
                            std::uint64_t chain, std::span<const int> tokens, const VqLayerModelSource& models) {
  return decode_chunk_codes(blob, fingerprint, level, index, chain, tokens, models, &buffers_);
}

VqIntake::Layouts VqIntake::hinted(int entry, std::size_t l, const std::vector<std::uint8_t>& w) {
  std::lock_guard<std::mutex> g(mu_);
  auto [it, fresh] = hints_.try_emplace(entry);
  if (fresh) {
    std::size_t at = 0;
    try {
      for (const VqKVCache* h : hosts_) {
        const int kn = h->layer_model()->k.n, vn = h->layer_model()->v.n, heads = h->layer_model()->kv_heads;
        if (w.size() < at + static_cast<std::size_t>(kn + vn)) throw FormatError("short");
        const auto part = [&](int count) {
          std::vector<std::uint8_t> p(w.begin() + static_cast<std::ptrdiff_t>(at), w.begin() + static_cast<std::ptrdiff_t>(at) + count);
          at += static_cast<std::size_t>(count);
          return std::make_shared<const VqFieldLayout>(VqFieldLayout::from_widths(std::move(p), heads));
        };
        auto k = part(kn);
        it->second.push_back({std::move(k), part(vn)});
      }
      if (at != w.size()) throw FormatError("long");
    } catch (const std::exception&) {
      it->second.clear();  // no hint, or not this host's shape: none
    }
  }
  return l < it->second.size() ? it->second[l] : Layouts{};
}

std::vector<std::optional<VqPackedCodes>> VqIntake::pack(ChunkCodes& kv, int entry, const std::vector<std::uint8_t>& hint_widths) {
  std::vector<std::optional<VqPackedCodes>> packed(kv.vq.size());
  for (std::size_t l = 0; l < kv.vq.size(); ++l) {
    if (!kv.vq[l] || l >= hosts_.size() || !same_vq_layer(*hosts_[l], *kv.vq[l])) continue;
    Layouts at;
    VqPackedCodes reuse;
    {
      std::lock_guard<std::mutex> g(mu_);
      at = pack_at_[l];
      if (!packed_free_.empty()) reuse = std::move(packed_free_.back()), packed_free_.pop_back();
    }
    if (!at[0] || !at[1]) at = hinted(entry, l, hint_widths);  // no host layout yet: the directory's widths, if any
    if (!at[0] || !at[1]) continue;                              // neither (chunk 0 not fed): feed() takes the codes
    packed[l] = vq_pack_codes(kv.vq[l]->codes, at[0], at[1], std::move(reuse));
    buffers_.give(std::move(kv.vq[l]->codes));
  }
  return packed;
}

void VqIntake::publish_layout(std::size_t l) {
  const VqKVCache& h = *hosts_[l];
  std::lock_guard<std::mutex> g(mu_);
  auto& at = pack_at_[l];
  if (at[0] && at[1] && at[0]->width == h.key_widths() && at[1]->width == h.value_widths()) return;  // widths fix the layout
  at = {std::make_shared<const VqFieldLayout>(h.field_layout(0)), std::make_shared<const VqFieldLayout>(h.field_layout(1))};
}

bool VqIntake::feed(std::size_t l, VqStoredLayer& v, std::optional<VqPackedCodes>* p) {
  VqKVCache& host = *hosts_[l];
  if (p && host.append_packed(**p, v.dtype)) {
    publish_layout(l);
    std::lock_guard<std::mutex> g(mu_);
    packed_free_.push_back(std::move(**p));
    return true;
  }
  if (p) v.codes = vq_unpack_codes(**p);  // refused: the caller's rows need the codes
  if (same_vq_layer(host, v) && host.append_codes(v.codes, v.dtype)) {
    buffers_.give(std::move(v.codes));
    publish_layout(l);
    return true;
  }
  return false;
}

}  // namespace vq
