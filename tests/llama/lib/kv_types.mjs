// llama.cpp's own KV cache types scored beside our emulations (issue 18, item 4), with one protocol
// on both sides: windows of 256 tokens of the validation text, each evaluated from BOS as ONE batch
// (so every token attends to the window's own tokens as the cache stores them: quantized on
// arrival), every position scored. In llama.cpp that is one context per cache type, cleared before
// each window; in veloxquant it is `eval --protocol stream --ctx 256 --window 257 --chunk 256`
// (BOS + 256 text tokens per window, all 256 prefilled in one chunk and scored).
//
// KL is against the exact cache on each side: llama.cpp's F32 K/V (flash attention off), our fp32.
// Both sides get the full next-token distribution: node-llama-cpp's controlledEvaluate returns the
// softmax of the raw logits when sampling is greedy (no top-k cut).
import {execFileSync} from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {cli, models, scratch, nlc, llama} from "./env.mjs";

export const WINDOW = 256;  // tokens evaluated per window (BOS + 255 text tokens in, 256 targets)

// stories260K with its heads padded from 8 to 64 dims (llama.cpp's quantized K needs blocks of 32
// to divide the head): the same function as the .bin (docs/gguf.md).
export function paddedModel(padHead = 64) {
  const out = path.join(scratch, `stories260K-p${padHead}.gguf`);
  execFileSync(cli, ["convert", path.join(models, "stories260K.bin"), "--tokenizer", path.join(models, "tok512.bin"),
                     "-o", out, "--pad-head", String(padHead)], {stdio: ["ignore", "ignore", "inherit"]});
  return out;
}

export const textPath = path.join(models, "tinystories_val.txt");
// The text stories3M-h64 never saw (its training took the first 90 % of tinystories_val.txt).
export const tailTextPath = path.join(models, "tinystories_val_tail.txt");

// The first `n` windows of the validation text as llama.cpp tokenizes it (no BOS): window w holds
// the text tokens [w*256, w*256 + 256). Our eval cuts its own tokenization the same way.
export function textWindows(model, n, text = textPath) {
  const tokens = model.tokenize(fs.readFileSync(text, "utf8"));
  if (tokens.length < n * WINDOW) throw new Error(`the text holds ${tokens.length} tokens, fewer than ${n} windows`);
  const windows = [];
  for (let w = 0; w < n; ++w) windows.push(tokens.slice(w * WINDOW, (w + 1) * WINDOW));
  return windows;
}

export async function loadModel(file) {
  return (await llama()).loadModel({modelPath: file, gpuLayers: 0});
}

// Scores `windows` in llama.cpp with K type `k`, V type `v` (GgmlType names: F32, F16, Q8_0, ...).
// Returns {ppl, nll, tokens, logp}: logp[i] is a Float64Array of log-probabilities over the vocabulary
// at scored position i (kept only when keepDistributions). Throws llama.cpp's error when it refuses
// the combination (e.g. a quantized V cache without flash attention).
export async function scoreLlama(model, windows, {k, v, flash, keepDistributions = false, threads = 2}) {
  const context = await model.createContext({
    contextSize: 2 * WINDOW,  // larger than the window: a full context would shift, and the RoPE
    batchSize: WINDOW,        // shift of a quantized K cache crashes; one window = one batch
    sequences: 1, threads, flashAttention: flash,
    experimentalKvCacheKeyType: k, experimentalKvCacheValueType: v,
    ignoreMemorySafetyChecks: true,
  });
  try {
    if (context.kvCacheKeyType !== nlc.GgmlType[k] || context.kvCacheValueType !== nlc.GgmlType[v])
      throw new Error(`asked for K ${k} / V ${v}, got K ${nlc.GgmlType[context.kvCacheKeyType]} / V ${nlc.GgmlType[context.kvCacheValueType]}`);
    const seq = context.getSequence();
    const bos = model.tokens.bos;
    let nll = 0, count = 0;
    const logp = [];
    for (const win of windows) {
      await seq.clearHistory();
      const input = [bos, ...win.slice(0, WINDOW - 1)].map(t => [t, {generateNext: {probabilities: true}}]);
      const out = await seq.controlledEvaluate(input);
      for (let i = 0; i < WINDOW; ++i) {
        const probs = out[i]?.next?.probabilities;
        if (!probs) throw new Error(`no distribution at position ${i}`);
        const p = probs.get(win[i]) ?? 0;
        nll -= Math.log(p);
        ++count;
        if (keepDistributions) {
          const lp = new Float64Array(probs.size);
          lp.fill(-Infinity);
          for (const [t, q] of probs) lp[t] = Math.log(q);
          logp.push(lp);
        }
      }
    }
    return {ppl: Math.exp(nll / count), nll, tokens: count, logp};
  } finally {
    await context.dispose();
  }
}

// Mean KL(ref || run) over scored positions, from two keepDistributions results.
export function meanKl(ref, run) {
  let kl = 0;
  for (let i = 0; i < ref.logp.length; ++i) {
    const a = ref.logp[i], b = run.logp[i];
    let s = 0;
    for (let t = 0; t < a.length; ++t) if (a[t] > -Infinity) s += Math.exp(a[t]) * (a[t] - b[t]);
    kl += Math.max(0, s);
  }
  return kl / ref.logp.length;
}

// Our eval over the same windows (see the header): {method: {ppl, kl, bits}} from its JSON.
export function ourEval(modelFile, methods, nWindows, text = textPath) {
  const out = execFileSync(cli, ["eval", "--model", modelFile, "--text", text, "--methods", methods.join(";"),
                                 "--protocol", "stream", "--ctx", String(WINDOW), "--window", String(WINDOW + 1),
                                 "--chunk", String(WINDOW), "--max-tokens", String(nWindows * WINDOW), "--json"],
                           {encoding: "utf8", stdio: ["ignore", "pipe", "inherit"], maxBuffer: 1 << 24});
  const res = {};
  for (const r of JSON.parse(out).results) {
    if (r.tokens !== nWindows * WINDOW) throw new Error(`${r.method}: eval scored ${r.tokens} tokens, expected ${nWindows * WINDOW}`);
    res[r.method] = {ppl: r.ppl, kl: r.kl, bits: r.bits_per_element_fixed};
  }
  return res;
}

// Bits per element each llama.cpp type stores (ggml block sizes: bytes per 32 values x 8 / 32).
export const typeBits = {F32: 32, F16: 16, Q8_0: 8.5, Q5_0: 5.5, Q4_0: 4.5, Q4_1: 5.0, IQ4_NL: 4.5};
