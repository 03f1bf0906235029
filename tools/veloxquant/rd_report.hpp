// `veloxquant rd`: the pieces that do not run the model (method families, the Pareto frontier, the
// SVG plot), separate from cmd_rd.cpp so each stays small.
#pragma once
#include <string>
#include <vector>

namespace vqcli::rd {

// One measured point.
struct Point {
  std::string method;  // the spec as run
  double bits = 0;     // bits per element, actual coded size, metadata included
  double resident_bits = 0;  // bits per element the caches hold in memory (nbytes)
  double delta_ppl_pct = 0, kl = 0, top1 = 0;
  bool pareto = false;
  std::string error = {};  // the setting failed (its numbers are 0): never on the frontier or the plot
};

// Which bits the frontier, the sort and the plot use: the coded size (reuse: what is stored or
// sent) or the resident memory (stream: what a live cache holds while decoding).
enum class Rate { Coded, Resident };
inline double rate_of(const Point& p, Rate r) { return r == Rate::Coded ? p.bits : p.resident_bits; }

// The family names --methods accepts and what each expands to ("fp16,kivi,vq:bits=2" -> fp16,
// kivi:bits=2, kivi:bits=4, vq:bits=2). A name with ':' is a full spec and runs as given; a bare
// name that is not a family is returned as is (MethodSpec::parse then judges it).
// With `stream`, the vq family also brings its live settings (resident=coded: the sealed form whose
// resident bits meet issue 14's goal; docs/quality.md, "Every token sealed"), which a stream table
// is about and the reuse protocol does not need.
std::vector<std::string> expand_methods(const std::vector<std::string>& items, bool stream = false);
// Every family, in table order: the default method list.
std::vector<std::string> default_families();
// The plot's series of a spec: its name and options without the rate options (bits, bin1..3), so
// cachegen:bits=2..5 is one line and cachegen:schedule=off,bits=2..5 another.
std::string series_of(const std::string& spec);

// Mark each point Pareto-optimal on (bits, KL), bits as `rate` says: no other point has bits <= and
// KL <= with one of the two strictly lower. Ties on both count as optimal for each.
void mark_pareto(std::vector<Point>& points, Rate rate = Rate::Coded);

// A self-contained SVG: KL against bits per element (as `rate` says, named on the axis), both log
// scales, one polyline with markers per series, Pareto points ringed, legend. Points with KL <= 0
// (the exact cache) are left out.
std::string plot_svg(const std::vector<Point>& points, const std::string& title, Rate rate = Rate::Coded);

}  // namespace vqcli::rd
