// `veloxquant compress --llama-state FILE --model M` and `decompress --llama-state-out OUT`: a state
// in stories260K's shape (written by our writer; tests/llama/state.mjs does the same with states
// llama.cpp saved and loads ours back there) goes through the .vqkv and comes back.
#include <algorithm>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/format/llama_state.hpp"

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/llama_state_cli_" + name; }
vqtest::CliRun run(const std::string& args) { return vqtest::run_cli(args); }

// stories260K: 5 layers, 4 KV heads of 8.
vq::LlamaState stories_state(vq::DType dtype, bool v_trans, std::int64_t cells) {
  vq::LlamaState st;
  for (std::int64_t i = 0; i < cells; ++i) st.tokens.push_back(static_cast<std::int32_t>((i * 37 + 1) % 512));
  st.dtype = dtype;
  st.v_trans = v_trans;
  for (int l = 0; l < 5; ++l)
    st.layers.push_back({vqtest::random_walk({1, 4, cells, 8}, 100 + l, dtype, 0.3f), vqtest::random_walk({1, 4, cells, 8}, 200 + l, dtype, 0.3f)});
  return st;
}

TEST(LlamaStateCli, ExactMethodsGiveTheSameStateBack) {
  const std::string model = vqtest::model_path();
  for (const auto dtype : {vq::DType::F16, vq::DType::F32})
    for (const bool v_trans : {false, true}) {
      SCOPED_TRACE(testing::Message() << vq::dtype_name(dtype) << " v_trans " << v_trans);
      vq::save_llama_state(p("in.bin"), stories_state(dtype, v_trans, 70));
      for (const std::string method : {"fp32", "fp16"}) {
        if (method == "fp16" && dtype == vq::DType::F32) continue;  // fp16 rounds an F32 state (checked below)
        auto r = run("compress --llama-state " + p("in.bin") + " --model " + model + " --method " + method + " -o " + p("a.vqkv") + " --json");
        ASSERT_EQ(r.code, 0) << r.err;
        EXPECT_EQ(nlohmann::json::parse(r.out).at("llama_state_bytes").get<std::uint64_t>(), std::filesystem::file_size(p("in.bin")));
        r = run("decompress " + p("a.vqkv") + " --llama-state-out " + p("out.bin"));
        ASSERT_EQ(r.code, 0) << r.err;
        EXPECT_EQ(vqtest::slurp(p("out.bin")), vqtest::slurp(p("in.bin"))) << method;
      }
    }
  // An F32 state through fp16: the same layout and type, every value rounded to float16.
  const auto st = stories_state(vq::DType::F32, true, 70);
  vq::save_llama_state(p("in32.bin"), st);
  ASSERT_EQ(run("compress --llama-state " + p("in32.bin") + " --model " + model + " --method fp16 -o " + p("h.vqkv")).code, 0);
  ASSERT_EQ(run("decompress " + p("h.vqkv") + " --llama-state-out " + p("h.bin")).code, 0);
  const auto back = vq::load_llama_state(p("h.bin"), {5, 4, 8, 8});
  EXPECT_EQ(back.dtype, vq::DType::F32);
  EXPECT_TRUE(back.v_trans);
  EXPECT_EQ(back.tokens, st.tokens);
  EXPECT_TRUE(back.layers[3].values.bit_equal(st.layers[3].values.to(vq::DType::F16).to(vq::DType::F32)));
  EXPECT_FALSE(back.layers[3].values.bit_equal(st.layers[3].values));
}

TEST(LlamaStateCli, LossyMethodsKeepTheLayoutAndStayClose) {
  const std::string model = vqtest::model_path();
  const auto st = stories_state(vq::DType::F16, true, 130);
  vq::save_llama_state(p("l.bin"), st);
  for (const std::string method : {"vq:bits=2", "cachegen:bits=4"}) {
    SCOPED_TRACE(method);
    auto r = run("compress --llama-state " + p("l.bin") + " --model " + model + " --method " + method + " -o " + p("l.vqkv"));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_LT(std::filesystem::file_size(p("l.vqkv")), std::filesystem::file_size(p("l.bin")) / 2);
    r = run("decompress " + p("l.vqkv") + " --model " + model + " --llama-state-out " + p("l2.bin"));
    ASSERT_EQ(r.code, 0) << r.err;
    const auto back = vq::load_llama_state(p("l2.bin"), {5, 4, 8, 8});
    EXPECT_EQ(back.tokens, st.tokens);
    EXPECT_EQ(back.dtype, vq::DType::F16);
    EXPECT_TRUE(back.v_trans);
    // Within a loose budget of the K/V scale (a random walk of step 0.3: values of a few units): the
    // lossy methods' quality is measured on llama.cpp's own K/V in tests/llama/state.mjs.
    double err = 0, ref = 0;
    for (int l = 0; l < 5; ++l) {
      const auto a = st.layers[l].keys.to_f32_vector(), b = back.layers[l].keys.to_f32_vector();
      for (std::size_t i = 0; i < a.size(); ++i) err += (a[i] - b[i]) * (a[i] - b[i]), ref += a[i] * a[i];
    }
    EXPECT_LT(err / ref, 0.1) << "relative squared error of the keys";
  }
}

TEST(LlamaStateCli, BadInputIsOneLineAndExitOne) {
  const std::string model = vqtest::model_path();
  vq::save_llama_state(p("g.bin"), stories_state(vq::DType::F16, false, 20));
  const std::string good = vqtest::slurp(p("g.bin"));
  vqtest::spit(p("cut.bin"), good.substr(0, good.size() - 3));
  auto r = run("compress --llama-state " + p("cut.bin") + " --model " + model + " --method fp32 -o " + p("x.vqkv"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("llama.cpp state: truncated"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(p("x.vqkv")));
  // A state of another model shape (6 layers).
  vq::LlamaState six = stories_state(vq::DType::F16, false, 20);
  six.layers.push_back(six.layers[0]);
  vq::save_llama_state(p("six.bin"), six);
  r = run("compress --llama-state " + p("six.bin") + " --model " + model + " -o " + p("x.vqkv"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("the state has 6 layers"), std::string::npos) << r.err;
  // A token id outside the model's vocabulary (issue 36: id 100000 with a vocabulary of 512 was taken).
  vq::LlamaState far = stories_state(vq::DType::F16, false, 20);
  far.tokens[7] = 100000;
  vq::save_llama_state(p("far.bin"), far);
  r = run("compress --llama-state " + p("far.bin") + " --model " + model + " -o " + p("x.vqkv"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("token 7 is id 100000, outside the vocabulary of 512"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(p("x.vqkv")));
  // Not a state at all: the model file itself.
  r = run("compress --llama-state " + model + " --model " + model + " -o " + p("x.vqkv"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("not a sequence state saved by llama.cpp"), std::string::npos) << r.err;
  // No model.
  r = run("compress --llama-state " + p("g.bin") + " -o " + p("x.vqkv"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--llama-state needs --model"), std::string::npos) << r.err;
  // A .vqkv that did not come from a state.
  r = run("compress --llama-state " + p("g.bin") + " --model " + model + " --method fp32 -o " + p("g.vqkv"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run("decompress " + p("g.vqkv") + " --llama-state-out " + p("g2.bin") + " -o " + p("g2.safetensors"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("give either -o"), std::string::npos) << r.err;
  r = run("compress --model " + model + " --tokenizer " + vqtest::tokenizer_path() + " --text " + vqtest::models_dir() +
          "/tinystories_val.txt --ctx 20 --method fp32 -o " + p("m.vqkv"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run("decompress " + p("m.vqkv") + " --llama-state-out " + p("m.bin"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("not compressed from a llama.cpp state"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(p("m.bin")));
}

}  // namespace
