#include "rd_report.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>

#include "veloxquant/methods/method_table.hpp"

namespace vqcli::rd {

namespace {

// A family is a row of the method table with rd settings (its `rd` list: the usual settings, from
// below every peer's rate up to where each method matches fp16; docs/methods.md says why each).
std::vector<const vq::MethodRow*> families() {
  std::vector<const vq::MethodRow*> f;
  for (const auto& r : vq::method_table())
    if (!r.rd.empty()) f.push_back(&r);
  return f;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> default_families() {
  std::vector<std::string> out;
  for (const auto* f : families()) out.push_back(f->name);
  return out;
}

std::vector<std::string> expand_methods(const std::vector<std::string>& items, bool stream) {
  static const std::vector<std::string> vq_live = {"vq:bits=2,resident=coded", "vq:bits=2.5,residual=5,resident=coded",
                                                   "vq:bits=3,residual=4,resident=coded", "vq:bits=4,resident=coded",
                                                   "vq:bits=6,resident=coded"};
  std::vector<std::string> out;
  for (const auto& item : items) {
    const vq::MethodRow* row = vq::find_method(item);
    if (!row || row->rd.empty()) {
      out.push_back(item);
      continue;
    }
    out.insert(out.end(), row->rd.begin(), row->rd.end());
    if (stream && row->name == std::string("vq")) out.insert(out.end(), vq_live.begin(), vq_live.end());
  }
  // A spec named twice (e.g. "vq,vq:bits=2") runs once.
  std::vector<std::string> unique;
  for (const auto& s : out)
    if (std::find(unique.begin(), unique.end(), s) == unique.end()) unique.push_back(s);
  return unique;
}

std::string series_of(const std::string& spec) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos) return spec;
  std::string kept;
  std::size_t start = colon + 1;
  while (start <= spec.size()) {
    const auto comma = spec.find(',', start);
    const std::string item = spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    const std::string key = item.substr(0, item.find('='));
    if (key == "bits" || key == "bin1" || key == "bin2" || key == "bin3") continue;
    kept += (kept.empty() ? "" : ",") + item;
  }
  return kept.empty() ? spec.substr(0, colon) : spec.substr(0, colon) + ":" + kept;
}

void mark_pareto(std::vector<Point>& points, Rate rate) {
  for (auto& p : points) {
    const double pb = rate_of(p, rate);
    p.pareto = p.error.empty() && std::none_of(points.begin(), points.end(), [&](const Point& q) {
      const double qb = rate_of(q, rate);
      return q.error.empty() && qb <= pb && q.kl <= p.kl && (qb < pb || q.kl < p.kl);
    });
  }
}

std::string plot_svg(const std::vector<Point>& points, const std::string& title, Rate rate) {
  const auto bits_of = [rate](const Point* p) { return rate_of(*p, rate); };
  constexpr double W = 960, H = 600, L = 90, R = 300, T = 50, B = 70;  // size and margins
  std::vector<const Point*> shown;
  for (const auto& p : points)
    if (p.error.empty() && p.kl > 0 && rate_of(p, rate) > 0 && std::isfinite(p.kl)) shown.push_back(&p);
  double bmin = 1, bmax = 16, kmin = 1e-6, kmax = 1e-1;
  if (!shown.empty()) {
    bmin = bmax = bits_of(shown[0]);
    kmin = kmax = shown[0]->kl;
    for (const auto* p : shown) {
      bmin = std::min(bmin, bits_of(p)), bmax = std::max(bmax, bits_of(p));
      kmin = std::min(kmin, p->kl), kmax = std::max(kmax, p->kl);
    }
  }
  // Whole octaves on x, whole decades on y.
  const double x0 = std::floor(std::log2(bmin)), x1 = std::max(x0 + 1, std::ceil(std::log2(bmax)));
  const double y0 = std::floor(std::log10(kmin)), y1 = std::max(y0 + 1, std::ceil(std::log10(kmax)));
  auto X = [&](double bits) { return L + (std::log2(bits) - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double kl) { return H - B - (std::log10(kl) - y0) / (y1 - y0) * (H - T - B); };

  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"28\" font-size=\"16\">{}</text>\n",
      W, H, W, H, L, xml_escape(title));
  // Grid, ticks and tick labels.
  for (double e = x0; e <= x1 + 1e-9; e += 1) {
    const double x = L + (e - x0) / (x1 - x0) * (W - L - R), v = std::exp2(e);
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#ddd\"/>\n", x, T, x, H - B);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x, H - B + 18, fmt::format("{:g}", v));
  }
  for (double e = y0; e <= y1 + 1e-9; e += 1) {
    const double y = H - B - (e - y0) / (y1 - y0) * (H - T - B);
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L, y, W - R, y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">1e{}</text>\n", L - 6, y + 4, static_cast<int>(e));
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"black\"/>\n", L, T, W - L - R, H - T - B);
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{} (log scale)</text>\n", (L + W - R) / 2, H - 25,
                   rate == Rate::Coded ? "bits per element (actual coded size, metadata included)"
                                       : "resident bits per element (the memory the caches hold, nbytes)");
  s += fmt::format(
      "<text x=\"22\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 22 {})\">mean KL(fp32 || method) per scored token (log scale)</text>\n",
      (T + H - B) / 2, (T + H - B) / 2);

  // Series in order of first appearance; each a polyline through its points sorted by bits.
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"};
  std::vector<std::string> order;
  std::map<std::string, std::vector<const Point*>> series;
  for (const auto* p : shown) {
    const std::string k = series_of(p->method);
    if (!series.count(k)) order.push_back(k);
    series[k].push_back(p);
  }
  for (std::size_t i = 0; i < order.size(); ++i) {
    auto& pts = series[order[i]];
    std::sort(pts.begin(), pts.end(), [&](const Point* a, const Point* b) { return bits_of(a) < bits_of(b); });
    const bool ours = order[i].rfind("vq", 0) == 0;
    const std::string color = ours ? "#000000" : kColors[i % (sizeof kColors / sizeof kColors[0])];
    // Three styles in turn (solid line and filled marker; dashed and a wide hollow marker; dotted
    // and a small marker), so series that coincide (cachegen's two flush modes in the reuse
    // protocol) both stay visible.
    const int style = ours ? 0 : static_cast<int>(i % 3);
    const std::string dash = style == 1 ? " stroke-dasharray=\"6,3\"" : (style == 2 ? " stroke-dasharray=\"2,2\"" : "");
    const std::string fill = style == 1 ? fmt::format("r=\"5.5\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"", color)
                                        : fmt::format("r=\"{}\" fill=\"{}\"", style == 2 ? 2.5 : 4.0, color);
    if (pts.size() > 1) {
      s += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"{}\"{} points=\"", color, ours ? 2.5 : 1.5, dash);
      for (const auto* p : pts) s += fmt::format("{:.1f},{:.1f} ", X(bits_of(p)), Y(p->kl));
      s += "\"/>\n";
    }
    for (const auto* p : pts) {
      s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" {}><title>{}: {:.3f} bits, KL {:.3e}</title></circle>\n", X(bits_of(p)),
                       Y(p->kl), fill, xml_escape(p->method), bits_of(p), p->kl);
      if (p->pareto)
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"7.5\" fill=\"none\" stroke=\"{}\"/>\n", X(bits_of(p)), Y(p->kl), color);
    }
    const double ly = T + 10 + 18 * static_cast<double>(i);
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"{}\"{}/>\n", W - R + 15, ly, W - R + 40,
                     ly, color, ours ? 2.5 : 1.5, dash);
    s += fmt::format("<circle cx=\"{}\" cy=\"{:.1f}\" {}/>\n", W - R + 27.5, ly, fill);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\">{}</text>\n", W - R + 48, ly + 4, xml_escape(order[i]));
  }
  const double ly = T + 10 + 18 * static_cast<double>(order.size()) + 8;
  s += fmt::format("<circle cx=\"{}\" cy=\"{:.1f}\" r=\"7.5\" fill=\"none\" stroke=\"black\"/>\n", W - R + 27.5, ly);
  s += fmt::format("<text x=\"{}\" y=\"{:.1f}\">ringed: Pareto frontier on ({}, KL)</text>\n", W - R + 48, ly + 4,
                   rate == Rate::Coded ? "bits" : "resident bits");
  s += "</svg>\n";
  return s;
}

}  // namespace vqcli::rd
