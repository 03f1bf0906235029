// veloxquant: compress the key/value cache of LLMs, CacheGen-style. See README.md.
#include <cstdio>
#include <exception>
#include <map>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "commands.hpp"
#include "help_footers.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"

int main(int argc, char** argv) {
  vq::remove_temporaries_on_signals();  // an interrupted write leaves no temporary file behind
  CLI::App app{"veloxquant: CacheGen-style KV cache compression for LLM inference", "veloxquant"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "veloxquant 0.1.0");
  std::map<CLI::App*, vqcli::Runner> runners;
  auto add = [&](const char* name, const char* help, vqcli::Runner (*fn)(CLI::App&)) {
    CLI::App* sub = app.add_subcommand(name, help);
    runners[sub] = fn(*sub);
  };
  add("demo", "the main job: ours, the reference's CacheGen and the peers on the real model, one table and what the best row buys",
      vqcli::add_demo);
  add("account", "feed K/V .npy files through a CacheGenKVCache and print its byte counters", vqcli::add_account);
  add("synth", "write a synthetic LLM-like K/V pair as .npy files", vqcli::add_synth);
  add("generate", "generate text with a llama2.c model through a chosen KV cache method", vqcli::add_generate);
  add("eval", "score KV cache methods against the exact fp32 cache on a real model (perplexity, KL, top-1, bits)", vqcli::add_eval);
  add("rd", "rate-distortion table: every method at its usual settings, actual coded bits against dPPL, KL and top-1, Pareto frontier",
      vqcli::add_rd);
  add("convert", "write a llama2.c checkpoint and tokenizer as a llama-architecture GGUF file (optionally with padded heads)",
      vqcli::add_convert);
  add("methods", "list the KV cache methods: their spec keys with defaults and ranges, whose each is, its cache", vqcli::add_methods);
#ifdef VQ_HAVE_PROMPT_CACHE
  add("prompt-cache", "a compressed, persistent prompt cache in front of a llama-server (a proxy: requests pass through)",
      vqcli::add_prompt_cache);
#endif
  add("tokenize", "print the token ids the model's tokenizer gives a text (as eval and generate tokenize it)", vqcli::add_tokenize);
  add("compress", "save a KV cache (from .npy, safetensors or a model run) as a .vqkv file", vqcli::add_compress);
  add("decompress", "load a .vqkv file and write its K/V as safetensors or .npy", vqcli::add_decompress);
  add("inspect", "show a .vqkv file's shape, configuration and where its bytes go", vqcli::add_inspect);
  add("profile", "profile the CacheGen paper codec's tables (per layer and channel) of a model over text, for cachegen_paper:profile=PATH",
      vqcli::add_profile);
  add("calibrate", "fit a vq profile on a model's own K/V over text (through llama.cpp for a GGUF), for vq:...,profile=PATH",
      vqcli::add_calibrate);
  add("store", "prefix KV store: put a text's KV in chunks at several levels, ls, stats, rm (file:, redis://, redis-cluster://)",
      vqcli::add_store);
  add("bench", "benchmarks: 'bench codec' compares veloxquant's rANS with htscodecs, zstd and lz4 on KV codes", vqcli::add_bench);

  vqcli::add_help_footers(app);

  std::string names;
  bool known = false;
  for (const auto* sub : app.get_subcommands({})) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known = known || (argc > 1 && sub->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    fmt::print(stderr, "veloxquant: error: unknown command '{}' (commands: {})\n", argv[1], names);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // An input file that does not exist (CLI11's ExistingFile check) is bad input like any other
    // unreadable input (exit 1, as when the library finds it missing); the rest is usage (exit 2).
    const std::string what = e.what();
    const bool missing_input = what.find("File does not exist: ") != std::string::npos;
    fmt::print(stderr, "veloxquant: error: {}{}\n", what, missing_input ? "" : " (see veloxquant --help)");
    return missing_input ? 1 : 2;
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const vq::Error& e) {
    fmt::print(stderr, "veloxquant: error: {}\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {  // std::bad_array_new_length included
    fmt::print(stderr, "veloxquant: error: out of memory\n");
    return 1;
  } catch (const std::length_error& e) {
    // A size no container can hold: the input or the options ask for it, the tool is not at fault.
    fmt::print(stderr, "veloxquant: error: the input or options ask for a buffer larger than memory can address ({})\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "veloxquant: internal error: {}\n", e.what());
    return 3;
  }
  return 0;
}
