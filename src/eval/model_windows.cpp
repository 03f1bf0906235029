#include "veloxquant/eval/model_windows.hpp"

#include <algorithm>

namespace vq {

int run_model_windows(Transformer& model, std::span<const int> tokens, int windows, const MethodSpec& spec,
                      const std::function<void(const WindowCaches&)>& take) {
  const std::size_t per_window = static_cast<std::size_t>(std::max(model.config().seq_len - 1, 1));  // BOS + these fill the context
  const int n = std::min<int>(std::max(windows, 0), static_cast<int>(tokens.size() / per_window));
  for (int w = 0; w < n; ++w) {
    std::vector<int> win{1};  // BOS
    const auto text = tokens.subspan(static_cast<std::size_t>(w) * per_window, per_window);
    win.insert(win.end(), text.begin(), text.end());
    auto caches = make_caches(spec, model);
    model.forward(win, caches);
    take(caches);
  }
  return n;
}

}  // namespace vq
