// The footer of every command's --help: its synopsis, one example and the exit codes. The options
// and their defaults are CLI11's own listing above the footer. tests/cli/help_test.cpp checks that
// every command answers --help with exit 0 and an "Example:" line.
#pragma once
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "veloxquant/methods/method_table.hpp"

namespace vqcli {

inline constexpr const char* kExitCodes =
    "Exit codes: 0 success; 1 bad input or a failed check (one 'veloxquant: error: ...' line on stderr); 2 usage "
    "(unknown command or option, a value out of range); 3 internal error (a bug).";

struct HelpText {
  const char* synopsis;
  const char* example;
};

// Keyed by the command path ("eval", "bench codec").
inline const std::map<std::string, HelpText>& help_texts() {
  static const std::map<std::string, HelpText> texts = {
      {"demo", {"veloxquant demo [--model M] [--tokenizer T] [--text F] [--windows N] [--plot OUT.svg]",
                "veloxquant demo --windows 8 --plot /tmp/rd.svg"}},
      {"eval", {"veloxquant eval [--model M] [--tokenizer T] [--text F] [--methods LIST] [--protocol stream|reuse] [--ctx N] "
                "[--window N] [--chunk S] [--max-tokens N] [--prefill method|exact] [--json] [--engine ours|llama [--llama-server PATH] "
                "[--server-threads N]]",
                "veloxquant eval --methods 'fp16;vq:bits=2;cachegen:flush=per_call' --protocol reuse --ctx 256 --window 512"}},
      {"rd", {"veloxquant rd [--model M] [--tokenizer T] [--text F] [--methods LIST] [--protocol reuse|stream] [--ctx N] "
              "[--window N] [--chunk S] [--windows N] [--threads N] [--prefill method|exact] [--json] [--plot OUT.svg] [--engine ours|llama "
              "[--llama-server PATH] [--server-threads N]]",
              "veloxquant rd --methods 'vq,cachegen,q4_0' --windows 10 --plot rd.svg"}},
      {"generate", {"veloxquant generate [--model M] [--tokenizer T] [--prompt TEXT] [--steps N] [--temperature 0] [--topp P] "
                    "[--seed S] [--method SPEC] [--store URL] [--slo-ms N] [--bandwidth MBPS] [--threads N] [--no-recompute] [--json]",
                    "veloxquant generate --prompt 'Once upon a time' --steps 64 --method vq:bits=2"}},
      {"account", {"veloxquant account --keys K.npy --values V.npy [--bits N] [--group-size G] [--no-delta] [--pooled] "
                   "[--flush per_call|group_aligned] [--chunk S] [--recon-keys OUT.npy] [--recon-values OUT.npy] [--json]",
                   "veloxquant account --keys k.npy --values v.npy --bits 3   (k.npy, v.npy: from `veloxquant synth`)"}},
      {"synth", {"veloxquant synth --keys-out K.npy --values-out V.npy [--tokens N] [--heads H] [--head-dim D] [--batch B] "
                 "[--seed S] [--dtype float16|float32]",
                 "veloxquant synth --keys-out k.npy --values-out v.npy --tokens 2048 --dtype float16"}},
      {"compress", {"veloxquant compress (--keys K.npy --values V.npy | --kv FILE.safetensors | --llama-state FILE --model M.gguf | "
                    "--model M --tokenizer T --text F --ctx N) [--method cachegen[:...]|vq[:...]|fp32|fp16] [--bits N] [--group-size G] [--flush MODE] [--chunk S] "
                    "[--chunk-tokens C] -o OUT.vqkv [--json]",
                    "veloxquant compress --keys k.npy --values v.npy --bits 4 -o kv.vqkv"}},
      {"decompress", {"veloxquant decompress IN.vqkv (-o OUT.safetensors | --keys-out K.npy --values-out V.npy [--layer I] | "
                      "--llama-state-out OUT) [--model M]",
                      "veloxquant decompress kv.vqkv --keys-out k2.npy --values-out v2.npy"}},
      {"inspect", {"veloxquant inspect IN.vqkv [--json]", "veloxquant inspect kv.vqkv"}},
      {"profile", {"veloxquant profile [--model M] [--tokenizer T] [--text F] [-o OUT] [--tokens N] [--skip N]",
                   "veloxquant profile -o stories260K.cgprof && veloxquant eval --methods cachegen_paper:profile=stories260K.cgprof"}},
      {"calibrate", {"veloxquant calibrate [--model M] [--tokenizer T] [--text F] [-o OUT.vqprof] [--engine llama|ours] [--tokens N] [--skip N] "
                     "[--window N] [--llama-server PATH] [--server-threads N]",
                     "veloxquant calibrate --model m.gguf -o m.vqprof && veloxquant eval --engine llama --model m.gguf --methods 'vq:bits=2,profile=m.vqprof'"}},
      {"store", {"veloxquant store (put | ls | stats | rm) [OPTIONS]", "veloxquant store put --text story.txt --levels 'vq:bits=2;fp16'"}},
      {"store put", {"veloxquant store put [--store URL] [--model M] [--tokenizer T] (--text F | --prompt TEXT) [--levels LIST] "
                     "[--chunk-tokens C] [--json]",
                     "veloxquant store put --store file:./.vqkv-store --prompt 'Once upon a time' --levels 'vq:bits=2'"}},
      {"store ls", {"veloxquant store ls [--store URL] [--json]", "veloxquant store ls --store redis://127.0.0.1:6379"}},
      {"store stats", {"veloxquant store stats [--store URL] [--json]", "veloxquant store stats --json"}},
      {"store rm", {"veloxquant store rm [--store URL] (--all | KEY...)", "veloxquant store rm --all"}},
      {"convert", {"veloxquant convert M.bin --tokenizer T -o M.gguf [--pad-head P]",
                   "veloxquant convert ../shared/models/stories260K.bin --tokenizer ../shared/models/tok512.bin -o stories260K.gguf"}},
      {"methods", {"veloxquant methods [--json]", "veloxquant methods --json"}},
      {"prompt-cache", {"veloxquant prompt-cache --upstream http://HOST:PORT --model M.gguf --slot-dir DIR [--listen HOST:PORT] "
                        "[--store URL] [--levels LIST] [--chunk-tokens C] [--slot N] [--slots K]",
                        "veloxquant prompt-cache --upstream http://127.0.0.1:8080 --model m.gguf --slot-dir /tmp/slots --store file:./cache"}},
      {"tokenize", {"veloxquant tokenize [--model M] [--tokenizer T] (--text F | --prompt TEXT) [--bos] [--json]",
                    "veloxquant tokenize --prompt 'Once upon a time' --bos"}},
      {"bench", {"veloxquant bench (codec | attention | prompt-cache) [OPTIONS]", "veloxquant bench codec --synthetic --bits 4"}},
      {"bench codec", {"veloxquant bench codec [--keys K.npy --values V.npy | --model M [--tokenizer T] [--text F] [--windows N] "
                       "| --synthetic] [--bits N | --method vq:bits=B,...] [--json]",
                       "veloxquant bench codec --synthetic --bits 4 --json"}},
      {"bench prompt-cache", {"veloxquant bench prompt-cache [--llama-server PATH] [--realistic] [--tokens N] [--chunk-tokens C] "
                              "[--levels LIST] [--stores LIST] [--rounds N] [--threads N] [--slot-dir DIR] [--settle-ms MS] [--seed S] [--verbose] [--json]",
                              "veloxquant bench prompt-cache --stores 'file:auto;redis:auto' --tokens 448"}},
      {"bench attention", {"veloxquant bench attention [--context N ...] [--methods 'spec;spec'] [--threads N] [--json]",
                           "veloxquant bench attention --context 1024 --methods 'q8_0;vq:bits=2' --threads 1"}},
  };
  return texts;
}

// The commands that take method specs, and the list their --help prints (from the method table).
inline bool takes_method_specs(const std::string& path) {
  for (const char* p : {"eval", "rd", "generate", "compress", "store put", "bench codec", "bench attention", "prompt-cache"})
    if (path == p) return true;
  return false;
}
inline std::string method_specs_help() {
  std::string out = "Method specs (`veloxquant methods` lists each key's default and range):\n";
  for (const auto& r : vq::method_table()) out += "  " + vq::method_usage(r) + "\n";
  return out;
}

// Give `app` and each of its subcommands (recursively) its footer; `path` is the command path of `app`.
inline void add_help_footers(CLI::App& app, const std::string& path = "") {
  if (path.empty()) {
    app.footer(std::string("Run 'veloxquant COMMAND --help' for a command's synopsis, options, defaults and an example.\n"
                           "Example:\n  veloxquant demo\n") + kExitCodes);
  } else if (auto it = help_texts().find(path); it != help_texts().end()) {
    app.footer(std::string("Synopsis:\n  ") + it->second.synopsis + "\nExample:\n  " + it->second.example + "\n" +
               (takes_method_specs(path) ? method_specs_help() : "") + kExitCodes);
  } else {
    app.footer(kExitCodes);
  }
  for (CLI::App* sub : app.get_subcommands({})) add_help_footers(*sub, path.empty() ? sub->get_name() : path + " " + sub->get_name());
}

}  // namespace vqcli
