// veloxquant prompt-cache: a compressed, persistent prompt cache in front of an unmodified
// llama-server (serve/prompt_cache.hpp; docs/prompt_cache.md). Parses options, starts the proxy,
// prints where it listens, serves until SIGINT or SIGTERM.
#ifdef VQ_HAVE_PROMPT_CACHE
#include <csignal>
#include <pthread.h>
#include <string>
#include <thread>

#include <fmt/core.h>
#include <fmt/format.h>

#include "commands.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/serve/prompt_cache.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

namespace vqcli {

Runner add_prompt_cache(CLI::App& app) {
  struct Options {
    vq::PromptCacheOptions p;
    std::string listen = "127.0.0.1:8081", levels = "auto";
  };
  auto o = std::make_shared<Options>();
  o->p.store = vq::kDefaultStoreUrl;
  app.add_option("--upstream", o->p.upstream, "the llama-server, http://HOST:PORT")->required();
  app.add_option("--model", o->p.model, "the GGUF file the llama-server runs (its shape and fingerprint)")->required();
  app.add_option("--slot-dir", o->p.slot_dir, "the llama-server's --slot-save-path (slot files are written and read there)")->required();
  app.add_option("--listen", o->listen, "where to listen, HOST:PORT (port 0: a free one, printed)")->capture_default_str();
  app.add_option("--store", o->p.store, "the store (file:DIR, redis://..., redis-cluster://...; see `store --help`)")->capture_default_str();
  app.add_option("--levels", o->levels,
                 "what a put stores: method specs separated by ';'; auto: vq:bits=2, with block=head for heads of 64 or more")
      ->capture_default_str();
  app.add_option("--chunk-tokens", o->p.chunk_tokens, "tokens per stored chunk")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--slot", o->p.slot, "the first server slot the cache restores into")->capture_default_str()->check(CLI::Range(0, 1 << 16));
  app.add_option("--slots", o->p.slots,
                 "server slots the cache uses, from --slot on: requests through the cache run side by side, one per slot (start llama-server with -np covering them)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  return [o] {
    const auto colon = o->listen.rfind(':');
    vq::require(colon != std::string::npos && colon > 0, "--listen {}: give it as HOST:PORT", o->listen);
    const std::string port = o->listen.substr(colon + 1);
    vq::require(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos && std::stoi(port) <= 65535,
                "--listen {}: port '{}' is not in 0..65535", o->listen, port);
    o->p.listen_host = o->listen.substr(0, colon);
    o->p.listen_port = std::stoi(port);
    o->p.levels.clear();  // auto: empty, the proxy's default for the model's heads
    if (o->levels != "auto") {
      for (std::size_t s = 0; s <= o->levels.size();) {
        const auto e = std::min(o->levels.find(';', s), o->levels.size());
        if (e > s) o->p.levels.push_back(vq::MethodSpec::parse(o->levels.substr(s, e - s)).to_string());
        s = e + 1;
      }
      vq::require(!o->p.levels.empty(), "--levels '{}': give at least one method spec (or auto)", o->levels);
    }
    // SIGINT / SIGTERM end the proxy from a thread of their own (stop() is not async-signal-safe).
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    vq::PromptCacheProxy proxy(o->p);
    proxy.bind();
    fmt::print("veloxquant prompt-cache: listening on http://{}:{} for {} (store {}, levels {}, chunks of {} tokens)\n", o->p.listen_host,
               proxy.port(), o->p.upstream, o->p.store, fmt::join(proxy.levels(), ";"), o->p.chunk_tokens);
    std::fflush(stdout);
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&sigs, &sig);
      proxy.stop();
    });
    proxy.serve();
    pthread_kill(waiter.native_handle(), SIGTERM);  // serve() ended by itself: release the waiter
    waiter.join();
    return 0;
  };
}

}  // namespace vqcli

#endif  // VQ_HAVE_PROMPT_CACHE
