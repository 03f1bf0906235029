// The levels a prompt cache stores when none are given (serve/prompt_cache.hpp,
// prompt_cache_default_levels): vq:bits=2, with per-head blocks for heads of 64 or more, where a
// whole-row block would cost the hit's decode 4x the multiply-adds at 4 KV heads (docs/prompt_cache.md,
// "Levels"); whole rows for smaller heads, where they are most of vq's gain.
#include <gtest/gtest.h>

#if defined(VQ_HAVE_HTTPLIB)
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/serve/prompt_cache.hpp"

TEST(PromptCacheLevels, PerHeadBlocksFromHeadsOf64) {
  for (const int head : {8, 32, 63, 64, 128}) {
    SCOPED_TRACE(head);
    const auto levels = vq::prompt_cache_default_levels(head);
    ASSERT_EQ(levels.size(), 1u);
    const vq::MethodSpec m = vq::MethodSpec::parse(levels[0]);
    EXPECT_EQ(m.kind, vq::MethodSpec::Kind::Vq);
    EXPECT_DOUBLE_EQ(m.vq.bits, 2.0);
    EXPECT_EQ(m.vq_basis.per_head, head >= 64);
    EXPECT_EQ(m.to_string(), levels[0]);  // canonical, as the store names levels
  }
}
#endif
