// `veloxquant prompt-cache` in front of a real llama-server (issue 30): misses store, hits restore,
// a restarted server and proxy keep the cache (persistence), a shared prefix is a partial hit, and
// a corrupt store costs a recompute, never a wrong answer.
//
// llama-server (tools/llama/build-llama.sh) runs stories260K (`veloxquant convert`), one slot, its
// RAM prompt cache off; the proxy stores chunks of 64 tokens at `fp16` (exact for llama.cpp's F16
// cache) in a file store. Every server and proxy is started on 127.0.0.1 at a port picked here (the
// proxy's own, --listen 127.0.0.1:0, is read from its first line) and stopped by its pid.
import fs from "node:fs";
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch} from "./lib/env.mjs";
import {startServer, post} from "./lib/server.mjs";
import {checks, storiesGguf} from "./lib/checks.mjs";
import {startProxy, lastLine} from "./lib/proxy.mjs";
import {writeRopePatched} from "./lib/gguf.mjs";

const {check, finish} = checks();
const C = 64;
const gguf = storiesGguf();
const slots = path.join(scratch, "slots"), storeDir = path.join(scratch, "store");
fs.mkdirSync(slots);
const serverArgs = ["-m", gguf, "-c", "512", "-np", "1", "-t", "2", "--cache-ram", "0", "--slot-save-path", slots];

const startProxyOn = (upstream) => startProxy(["--upstream", upstream, "--model", gguf, "--slot-dir", slots, "--store", `file:${storeDir}`,
                                                 "--levels", "fp16", "--chunk-tokens", String(C)]);

const words = fs.readFileSync(path.join(models, "tinystories_val.txt"), "utf8").split(/\s+/).slice(0, 110).join(" ");
const request = (prompt) => ({prompt, n_predict: 32, temperature: 0, top_k: 1, seed: 1});

let server = await startServer(serverArgs);
let proxy = await startProxyOn(server.url);
let first, tokens;
try {
  // 1. A miss: the server computes the whole prompt; the proxy stores its whole chunks.
  first = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
  tokens = (await post(server.url, "/tokenize", {content: words, add_special: true})).tokens;
  console.log(`miss: ${tokens.length} prompt tokens, ${first.timings.prompt_n} evaluated; proxy: ${lastLine(proxy.log())}`);
  check(first.timings.prompt_n === tokens.length, `a miss evaluates the whole prompt (${first.timings.prompt_n} of ${tokens.length})`);
  check(/0 restored from the store, [1-9]\d* stored/.test(lastLine(proxy.log())), "the miss stored chunks");
  check(fs.existsSync(storeDir) && fs.readdirSync(storeDir).length > 0, "the store holds blobs");
} finally {
  await proxy.stop();
  await server.stop();
}

// 2. Persistence: a fresh server and a fresh proxy, the same request: a hit from the store.
const whole = Math.floor((tokens.length - 1) / C) * C;
server = await startServer(serverArgs);
proxy = await startProxyOn(server.url);
try {
  const again = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
  console.log(`hit after restart: ${again.timings.prompt_n} evaluated; proxy: ${lastLine(proxy.log())}`);
  check(new RegExp(`${whole} restored from the store`).test(lastLine(proxy.log())), `the restarted proxy restores ${whole} tokens`);
  check(again.timings.prompt_n === tokens.length - whole, `only the tail is evaluated (${again.timings.prompt_n}, want ${tokens.length - whole})`);
  check(again.content === first.content, "the same greedy text as without the cache");
  if (again.content !== first.content) console.error(`without: ${JSON.stringify(first.content)}\nwith:    ${JSON.stringify(again.content)}`);

  // 3. A partial hit: the first two chunks shared, then other tokens (a token-array prompt).
  const other = [...tokens.slice(0, 2 * C + 10), ...tokens.slice(5, 60)];
  await post(server.url, "/slots/0?action=erase", {});
  const partial = await proxy.logged(() => post(proxy.url, "/completion", request(other)));
  console.log(`partial hit: ${other.length} prompt tokens, ${partial.timings.prompt_n} evaluated; proxy: ${lastLine(proxy.log())}`);
  check(partial.timings.prompt_n <= other.length - 2 * C, `a partial hit evaluates at most the tokens after the shared chunks (${partial.timings.prompt_n})`);

  // 4. Streaming through the cache: server-sent events as they come, the same text; the slot is
  // stored after the stream ends.
  let streamed = null;
  const streamedText = await proxy.logged(async () => {
    streamed = await fetch(`${proxy.url}/completion`, {method: "POST", headers: {"content-type": "application/json"},
                                                       body: JSON.stringify({...request(words), stream: true})});
    return streamed.text();
  });
  check(streamed.ok && (streamed.headers.get("content-type") || "").startsWith("text/event-stream"), "a streaming request streams");
  const events = streamedText.split("\n").filter((l) => l.startsWith("data: ")).map((l) => JSON.parse(l.slice(6)));
  const text = events.map((e) => e.content || "").join("");
  console.log(`stream: ${events.length} events; proxy: ${lastLine(proxy.log())}`);
  check(events.length > 5, `the reply came as many events (${events.length})`);
  check(text === first.content, "the streamed text is the text without the cache");

  // 5. OpenAI chat through the cache: the messages keyed through the server's own chat template; a
  // second identical chat after the slot was erased is restored from the store, with the same reply.
  const chat = {messages: [{role: "system", content: words.slice(0, 300)}, {role: "user", content: words.slice(300, 600)}],
                max_tokens: 24, temperature: 0, top_k: 1, seed: 1};
  const c1 = await proxy.logged(() => post(proxy.url, "/v1/chat/completions", chat));
  const chatMiss = lastLine(proxy.log());
  await post(server.url, "/slots/0?action=erase", {});
  const c2 = await proxy.logged(() => post(proxy.url, "/v1/chat/completions", chat));
  console.log(`chat: ${c1.usage.prompt_tokens} prompt tokens; then ${c2.timings.prompt_n} evaluated; ${chatMiss} / ${lastLine(proxy.log())}`);
  check(c1.choices[0].message.content === c2.choices[0].message.content, "chat: the same reply from the cache");
  check(/ [1-9]\d* restored from the store/.test(lastLine(proxy.log())), "chat: the second request was restored from the store");
  check(c2.timings.prompt_n < c1.usage.prompt_tokens, `chat: fewer tokens evaluated (${c2.timings.prompt_n} of ${c1.usage.prompt_tokens})`);

  // 6. Pass-through: other routes reach the server unchanged.
  const health = await fetch(`${proxy.url}/health`);
  check(health.ok, "GET /health passes through");
  const tk = await post(proxy.url, "/tokenize", {content: "Once upon a time", add_special: false});
  check(Array.isArray(tk.tokens) && tk.tokens.length > 0, "POST /tokenize passes through");
} finally {
  await proxy.stop();
  await server.stop();
}

// 7. A corrupt store: every blob's bytes flipped in the middle. The request is computed by the
// server (nothing restored), the text is the text without the cache, and the proxy says why.
for (const f of fs.readdirSync(storeDir, {recursive: true})) {
  const p = path.join(storeDir, f);
  if (!fs.statSync(p).isFile()) continue;
  const b = fs.readFileSync(p);
  if (b.length > 16) {
    b[Math.floor(b.length / 2)] ^= 0x5a;
    fs.writeFileSync(p, b);
  }
}
server = await startServer(serverArgs);
proxy = await startProxyOn(server.url);
try {
  const hurt = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
  console.log(`corrupt store: ${hurt.timings.prompt_n} evaluated; proxy log:\n${proxy.log().trim()}`);
  check(/ 0 restored from the store/.test(lastLine(proxy.log())), "nothing is restored from a corrupt store");
  check(hurt.timings.prompt_n === tokens.length, `the whole prompt is computed (${hurt.timings.prompt_n})`);
  check(hurt.content === first.content, "the same text as without the cache");
} finally {
  await proxy.stop();
  await server.stop();
}
// 8. The RAM tier (`?ram=BYTES` on the store URL): what a request stored stays in the proxy's RAM
// within its bound. With room for every chunk, a hit comes from RAM even after the level blobs left
// the disk store (the index is still read from it); with room for one chunk, the earlier chunks
// were evicted from RAM, so the same loss costs the prefix (a recompute, the same text).
const levelBlobs = (dir) => fs.readdirSync(path.join(dir, "blobs")).filter((n) => n.startsWith("76712d") && !n.startsWith("76712d6469722d"));
for (const [ram, restores] of [[400000, true], [30000, false]]) {
  const dir = path.join(scratch, `store-ram-${ram}`);
  server = await startServer(serverArgs);
  proxy = await startProxy(["--upstream", server.url, "--model", gguf, "--slot-dir", slots, "--store", `file:${dir}?ram=${ram}`,
                            "--levels", "fp16", "--chunk-tokens", String(C)]);
  try {
    await proxy.logged(() => post(proxy.url, "/completion", request(words)));
    for (const n of levelBlobs(dir)) fs.rmSync(path.join(dir, "blobs", n));
    await post(server.url, "/slots/0?action=erase", {});
    const r = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
    console.log(`RAM tier of ${ram} bytes, the disk's level blobs gone: ${r.timings.prompt_n} evaluated; ${lastLine(proxy.log())}`);
    if (restores) check(new RegExp(`${whole} restored from the store`).test(lastLine(proxy.log())), "a RAM tier that holds the prefix serves it");
    else check(/ 0 restored from the store/.test(lastLine(proxy.log())), "a RAM tier of one chunk kept only the last: the prefix is lost with the disk's");
    check(r.content === first.content, `RAM tier of ${ram} bytes: the same text`);
  } finally {
    await proxy.stop();
    await server.stop();
  }
}
// 9. A GGUF whose weights our reader does not load (here: rope.freq_base 20000, which llama.cpp runs
// and our engine refuses; K-quant weights take the same path): the proxy reads only its shape and
// names it by a hash of the file, vq transforms come from the data. A miss, then a hit after the
// proxy restarts: the same text as the server alone.
{
  const foreign = path.join(scratch, "stories260K-rope20k.gguf");
  check(writeRopePatched(gguf, foreign, 20000) === 10000, "the converted GGUF held rope.freq_base 10000");
  const foreignArgs = serverArgs.map((a) => (a === gguf ? foreign : a));
  const dir = path.join(scratch, "store-foreign");
  const startOn = (url) => startProxy(["--upstream", url, "--model", foreign, "--slot-dir", slots, "--store", `file:${dir}`,
                                       "--levels", "fp16;vq:bits=2", "--chunk-tokens", String(C)]);
  server = await startServer(foreignArgs);
  let plain;
  try {
    plain = await post(server.url, "/completion", request(words));
    await post(server.url, "/slots/0?action=erase", {});
    for (let round = 0; round < 2; ++round) {
      proxy = await startOn(server.url);
      try {
        const r = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
        console.log(`foreign GGUF, proxy ${round + 1}: ${r.timings.prompt_n} evaluated; ${lastLine(proxy.log())}`);
        check(proxy.log().includes("its weights are not ours to read") && proxy.log().includes("rope.freq_base"),
              "the proxy says it reads only the shape, and why");
        if (round === 1) check(new RegExp(`${whole} restored from the store`).test(lastLine(proxy.log())), "foreign GGUF: a hit after a restart");
        check(r.content === plain.content, `foreign GGUF, proxy ${round + 1}: the same text as the server alone`);
      } finally {
        await proxy.stop();
      }
      await post(server.url, "/slots/0?action=erase", {});
    }
    // 10. The same GGUF with a vq level on a profile fitted through llama.cpp (calibrate --engine
    // llama): stored, then restored from that level alone after a restart, the restarted proxy
    // reading the same profile from another path (the store names it by its hash; no path is written
    // into the store); a profile of another model file stops the proxy at start with one line.
    const prof = path.join(scratch, "rope20k.vqprof");
    execFileSync(cli, ["calibrate", "--engine", "llama", "--llama-server", process.env.VQ_LLAMA_SERVER, "--model", foreign, "--skip", "20000",
                       "--tokens", "2048", "-o", prof, "--text", path.join(models, "tinystories_val.txt")], {stdio: "ignore"});
    const level = `vq:bits=2,profile=${prof}`;
    const moved = path.join(scratch, "elsewhere-copy.vqprof");
    fs.copyFileSync(prof, moved);
    const pdir = path.join(scratch, "store-profile");
    for (let round = 0; round < 2; ++round) {
      proxy = await startProxy(["--upstream", server.url, "--model", foreign, "--slot-dir", slots, "--store", `file:${pdir}`, "--levels",
                                round === 0 ? level : `vq:bits=2,profile=${moved}`, "--chunk-tokens", String(C)]);
      try {
        const r = await proxy.logged(() => post(proxy.url, "/completion", request(words)));
        console.log(`profile level, proxy ${round + 1}: ${r.timings.prompt_n} evaluated; ${lastLine(proxy.log())}`);
        check(typeof r.content === "string" && r.content.length > 0, `profile level, proxy ${round + 1}: a completion`);
        if (round === 0) {
          check(/0 restored from the store, [1-9]\d* stored/.test(lastLine(proxy.log())), "profile level: the prompt's chunks stored");
          const written = fs.readdirSync(pdir, {recursive: true}).map((f) => path.join(pdir, String(f))).filter((f) => fs.statSync(f).isFile());
          check(written.length > 0 && written.every((f) => !fs.readFileSync(f).includes(Buffer.from(scratch))),
                "profile level: the store holds no local path (the profile is named by its hash)");
        }
        if (round === 1) {
          check(new RegExp(`${whole} restored from the store`).test(lastLine(proxy.log())), "profile level: a hit after a restart");
          check(!/warning|refused|fault/i.test(proxy.log()), "profile level: no fault on the way");
        }
      } finally {
        await proxy.stop();
      }
      await post(server.url, "/slots/0?action=erase", {});
    }
    let refused = "";
    try {
      proxy = await startProxy(["--upstream", server.url, "--model", gguf, "--slot-dir", slots, "--store", `file:${pdir}`, "--levels", level]);
      await proxy.stop();
    } catch (e) {
      refused = String(e.message);
    }
    check(/calibrated on another model file/.test(refused), `a profile of another model file: the proxy refuses to start (${refused.split("\n").filter(Boolean).pop()})`);
  } finally {
    await server.stop();
  }
}
finish("ok");
