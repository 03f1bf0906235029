// `veloxquant prompt-cache --slots 2` in front of a llama-server with two slots (issue 30): two
// requests through the cache at once each get a slot of their own, both are restored from the
// store and give the text the server gives without the cache; a third waits for a free slot and is
// served too; a request goes to the slot whose tokens share its prefix; the proxy refuses slots
// the server does not have.
//
// llama-server runs stories260K (`veloxquant convert`) with -np 2, its RAM prompt cache off; the
// proxy stores chunks of 64 tokens at `fp16` (exact for llama.cpp's F16 cache) in a file store.
// Every process is started on 127.0.0.1 at a port picked here and stopped by its pid.
import fs from "node:fs";
import path from "node:path";
import {spawnSync} from "node:child_process";
import {cli, models, scratch} from "./lib/env.mjs";
import {startServer, post} from "./lib/server.mjs";
import {checks, storiesGguf} from "./lib/checks.mjs";
import {startProxy} from "./lib/proxy.mjs";

const {check, finish} = checks();
const C = 64;
const gguf = storiesGguf();
const slotDir = path.join(scratch, "slots"), storeDir = path.join(scratch, "store");
fs.mkdirSync(slotDir);
// Two slots of 512 tokens each.
const server = await startServer(["-m", gguf, "-c", "1024", "-np", "2", "-t", "2", "--cache-ram", "0", "--slot-save-path", slotDir]);

const text = fs.readFileSync(path.join(models, "tinystories_val.txt"), "utf8").split(/\s+/);
const prompts = [text.slice(0, 110).join(" "), text.slice(400, 510).join(" "), text.slice(900, 1010).join(" ")];
const request = (prompt) => ({prompt, n_predict: 24, temperature: 0, top_k: 1, seed: 1});
const lines = (log) => log.split("\n").filter((l) => l.includes("prompt tokens"));

try {
  // The text without the cache, straight from the server (each prompt on its own, slot erased).
  const direct = [];
  for (const p of prompts) {
    for (const id of [0, 1]) await post(server.url, `/slots/${id}?action=erase`, {});
    direct.push((await post(server.url, "/completion", request(p))).content);
  }

  // A slot the server does not have: one line, nonzero exit.
  const bad = spawnSync(cli, ["prompt-cache", "--upstream", server.url, "--model", gguf, "--slot-dir", slotDir, "--store", `file:${storeDir}`,
                              "--slot", "1", "--slots", "2", "--listen", "127.0.0.1:0"], {encoding: "utf8", timeout: 60000});
  check(bad.status === 1 && /has no slot 2/.test(bad.stderr) && bad.stderr.trim().split("\n").length === 1,
        `--slot 1 --slots 2 on a two-slot server is refused in one line (exit ${bad.status}: ${bad.stderr.trim()})`);

  const proxy = await startProxy(["--upstream", server.url, "--model", gguf, "--slot-dir", slotDir, "--store", `file:${storeDir}`,
                                  "--levels", "fp16", "--chunk-tokens", String(C), "--slots", "2"]);
  try {
    // Misses, one after the other, store every prompt's chunks.
    for (const p of prompts) await proxy.logged(() => post(proxy.url, "/completion", request(p)));
    check(lines(proxy.log()).every((l) => /0 restored from the store, [1-9]\d* stored/.test(l)), "the misses stored chunks");

    // Three at once through two slots, both slots erased first: every one a hit from the store
    // (the third after a slot is free), and the same text as without the cache.
    for (const id of [0, 1]) await post(server.url, `/slots/${id}?action=erase`, {});
    const before = lines(proxy.log()).length;
    const replies = await Promise.all(prompts.map((p) => post(proxy.url, "/completion", request(p))));
    for (let i = 0; i < 3000 && lines(proxy.log()).length < before + 3; i++) await new Promise((r) => setTimeout(r, 20));
    const logged = lines(proxy.log()).slice(before);
    console.log(logged.join("\n"));
    check(logged.length === 3, `three lines for three requests (${logged.length})`);
    const restored = logged.filter((l) => /[1-9]\d* restored from the store/.test(l) || /the slot already holds/.test(l));
    check(restored.length === 3, `all three served from the store or the slot (${restored.length})`);
    check(logged.some((l) => /slot 0:/.test(l)) && logged.some((l) => /slot 1:/.test(l)), "both slots restored into");
    replies.forEach((r, i) => check(r.content === direct[i], `prompt ${i}: the same greedy text as without the cache`));

    // The slot that holds a prompt gets it again: sent alone, nothing to restore.
    const again = await proxy.logged(() => post(proxy.url, "/completion", request(prompts[2])));
    const last = lines(proxy.log()).pop();
    check(/the slot already holds/.test(last) || /0 restored/.test(last), `a prompt goes back to the slot holding it (${last})`);
    check(again.content === direct[2], "and gives the same text");
  } finally {
    await proxy.stop();
  }
} finally {
  await server.stop();
}
finish("prompt-cache over two slots: ok");
