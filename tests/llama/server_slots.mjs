// A real llama-server's slot, saved, compressed by veloxquant, and restored (issue 30, the first
// step of the prompt cache: the way a context leaves and re-enters an unmodified server).
//
// llama-server (built from the pinned package's source by tools/llama/build-llama.sh) runs
// stories260K converted by `veloxquant convert`, one slot, its own RAM prompt cache off
// (--cache-ram 0), slot files in a scratch folder (--slot-save-path). A greedy completion of 200
// tokens of the validation text fills slot 0, which is saved (POST /slots/0?action=save). Then,
// for llama.cpp's own file and for each method's round trip (`compress --llama-state` and
// `decompress --llama-state-out`), the slot is erased, restored from that file, and the same
// request completed again:
// - every restore gives back the saved token count, and the repeated request evaluates at most a
//   few tokens (timings.prompt_n: the prompt came from the restored cache, not recomputed);
// - fp16 and fp32 give back llama.cpp's own bytes, so their text is the text of llama.cpp's own
//   restore, and that is the text of the first completion (no cache), token for token;
// - vq:bits=2's text is printed beside it (a lossy level: its quality is tests/llama/state.mjs's).
// The server is started on a port picked here and stopped by its pid.
import fs from "node:fs";
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch} from "./lib/env.mjs";
import {startServer, post} from "./lib/server.mjs";

let failures = 0;
function check(ok, what) {
  if (!ok) {
    failures++;
    console.error(`FAIL: ${what}`);
  }
}
const run = (...args) => execFileSync(cli, args, {encoding: "utf8", stdio: ["ignore", "pipe", "pipe"]});

const gguf = path.join(scratch, "stories260K.gguf");
run("convert", path.join(models, "stories260K.bin"), "--tokenizer", path.join(models, "tok512.bin"), "-o", gguf);
const slots = path.join(scratch, "slots");
fs.mkdirSync(slots);
const words = fs.readFileSync(path.join(models, "tinystories_val.txt"), "utf8").split(/\s+/).slice(0, 150).join(" ");

const server = await startServer(["-m", gguf, "-c", "1024", "-np", "1", "-t", "2", "--cache-ram", "0", "--slot-save-path", slots]);
try {
  const request = {prompt: words, n_predict: 48, temperature: 0, top_k: 1, cache_prompt: true, id_slot: 0, seed: 1};
  const first = await post(server.url, "/completion", request);
  const promptTokens = first.timings.prompt_n;
  console.log(`first completion: ${promptTokens} prompt tokens evaluated, ${first.timings.predicted_n} predicted`);
  check(promptTokens > 100, `the first request evaluated its prompt (${promptTokens} tokens)`);
  const saved = await post(server.url, "/slots/0?action=save", {filename: "own.bin"});
  const ownBytes = fs.statSync(path.join(slots, "own.bin")).size;
  console.log(`slot 0 saved: ${saved.n_saved} tokens, ${ownBytes} bytes`);

  async function restoreAndComplete(file) {
    await post(server.url, "/slots/0?action=erase", {});
    const restored = await post(server.url, "/slots/0?action=restore", {filename: file});
    const again = await post(server.url, "/completion", request);
    return {restored: restored.n_restored, promptN: again.timings.prompt_n, text: again.content};
  }

  const own = await restoreAndComplete("own.bin");
  console.log(`llama.cpp's own file: restored ${own.restored} tokens, ${own.promptN} prompt tokens evaluated`);
  check(own.restored === saved.n_saved, `llama.cpp's own file restores ${saved.n_saved} tokens (got ${own.restored})`);
  check(own.promptN <= 4, `after llama.cpp's own restore the prompt comes from the cache (${own.promptN} tokens evaluated)`);
  check(own.text === first.content, "llama.cpp's own restore continues with the first completion's text");

  for (const method of ["fp16", "fp32", "vq:bits=2"]) {
    const tag = method.replace(/[^a-z0-9]/g, "_");
    const vqkv = path.join(scratch, `${tag}.vqkv`);
    run("compress", "--llama-state", path.join(slots, "own.bin"), "--model", gguf, "--method", method, "-o", vqkv);
    run("decompress", vqkv, "--model", gguf, "--llama-state-out", path.join(slots, `${tag}.bin`));
    const r = await restoreAndComplete(`${tag}.bin`);
    const stored = fs.statSync(vqkv).size;
    const same = r.text === own.text;
    console.log(`${method}: ${stored} bytes stored (${(ownBytes / stored).toFixed(2)}x smaller than the slot file), restored ${r.restored} ` +
                `tokens, ${r.promptN} prompt tokens evaluated, text ${same ? "the same" : "differs"}`);
    check(r.restored === saved.n_saved, `${method}: restores ${saved.n_saved} tokens (got ${r.restored})`);
    check(r.promptN <= 4, `${method}: the prompt comes from the restored cache (${r.promptN} tokens evaluated)`);
    if (method !== "vq:bits=2") {
      check(fs.readFileSync(path.join(slots, `${tag}.bin`)).equals(fs.readFileSync(path.join(slots, "own.bin"))),
            `${method}: the round trip gives back llama.cpp's own slot file, byte for byte`);
      check(same, `${method}: the same greedy text as llama.cpp's own restore`);
    } else {
      check(stored * 4 < ownBytes, `${method}: stores under a quarter of the slot file (${stored} of ${ownBytes} bytes)`);
    }
  }
} finally {
  await server.stop();
}
if (failures) {
  console.error(`${failures} check(s) failed; server log tail:\n${server.log().slice(-2000)}`);
  process.exit(1);
}
console.log("ok");
