// Subcommands of the veloxquant CLI. Each add_* registers its options on `app` and returns the
// function that runs it (returning the process exit code) once parsing succeeded.
#pragma once
#include <functional>

#include <CLI/CLI.hpp>

namespace vqcli {

using Runner = std::function<int()>;

Runner add_account(CLI::App& app);
Runner add_synth(CLI::App& app);
Runner add_generate(CLI::App& app);
Runner add_eval(CLI::App& app);
Runner add_rd(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_profile(CLI::App& app);
Runner add_calibrate(CLI::App& app);
Runner add_compress(CLI::App& app);
Runner add_decompress(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_store(CLI::App& app);
Runner add_demo(CLI::App& app);
Runner add_convert(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_methods(CLI::App& app);
#ifdef VQ_HAVE_PROMPT_CACHE
Runner add_prompt_cache(CLI::App& app);
#endif

}  // namespace vqcli
