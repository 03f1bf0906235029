// llama.cpp and veloxquant on the same models (issue 18 item 2): one node process converts each
// model with our CLI and checks, in llama.cpp (CPU, F32 K/V, flash attention off, 1 thread):
//   - tokenization of the whole validation text: the same ids, token for token;
//   - greedy generation from a few prompts (200 tokens or to EOS): the same ids and the same text;
//   - perplexity over several windows, each BOS + 255 text tokens and every prediction scored
//     (eval's stream protocol, src/eval/evaluator.cpp): within 1e-5 relative of `eval --methods fp32`.
// Models: stories260K (../shared/models) and a second llama2.c checkpoint written here with seeded
// random weights and another shape (grouped-query attention 6/2 heads of 16, hidden 256, an
// unshared classifier, seq_len 256; lib/llama2c.mjs). Our side runs the llama2.c files; llama.cpp
// runs what `veloxquant convert` made of them. Every number is printed for the CI log.
import fs from "node:fs";
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch, llama} from "./lib/env.mjs";
import {writeRandomCheckpoint} from "./lib/llama2c.mjs";

const kWindow = 256, kWindows = 8, kGenerated = 200, kPplTolerance = 1e-5;
const kPrompts = ["Once upon a time", "Lily and Ben went to the park. They saw a big", "The little dog"];
const BOS = 1, EOS = 2, kVocab = 512;  // both models use tok512.bin

const failures = [];
function check(ok, what) {
  console.log(`${ok ? "ok  " : "FAIL"} ${what}`);
  if (!ok) failures.push(what);
}
function ours(args) {
  return execFileSync(cli, args, {encoding: "utf8", maxBuffer: 1 << 28, stdio: ["ignore", "pipe", "pipe"]});
}
function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; ++i) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

// The models: the llama2.c files our side runs and the GGUF files llama.cpp runs.
const tok = path.join(models, "tok512.bin");
const second = path.join(scratch, "random_gqa.bin");
writeRandomCheckpoint(second, {dim: 96, hidden: 256, layers: 3, heads: 6, kvHeads: 2, vocab: 512, seqLen: 256,
                               sharedClassifier: false}, 20261202);
const cases = [
  {name: "stories260K", bin: path.join(models, "stories260K.bin")},
  {name: "random-gqa (dim 96, 6 heads / 2 KV heads of 16, 3 layers, hidden 256, unshared classifier, seq_len 256)", bin: second},
];
for (const [i, c] of cases.entries()) {
  c.gguf = path.join(scratch, `model${i}.gguf`);
  ours(["convert", c.bin, "--tokenizer", tok, "-o", c.gguf]);
}

// The texts: the whole validation text for tokenization; its first paragraphs (under what eval
// would cut, so eval and tokenize read the same bytes) for perplexity.
const valPath = path.join(models, "tinystories_val.txt");
const val = fs.readFileSync(valPath, "utf8");
const pplText = path.join(scratch, "ppl_text.txt");
fs.writeFileSync(pplText, val.slice(0, val.lastIndexOf("\n\n", 30000)));
const tokenize = (file) => JSON.parse(ours(["tokenize", "--model", cases[0].bin, "--tokenizer", tok, "--text", file, "--json"])).tokens;
const valIds = tokenize(valPath);
const pplIds = tokenize(pplText);
if (pplIds.length < kWindows * (kWindow - 1)) throw new Error(`ppl text too short: ${pplIds.length} tokens`);

const tStart = Date.now();
const lib = await llama();
for (const c of cases) {
  console.log(`== ${c.name} (${((Date.now() - tStart) / 1000).toFixed(1)} s)`);
  const model = await lib.loadModel({modelPath: c.gguf, gpuLayers: 0});
  const seqLen = model.trainContextSize;
  // One thread: with two, each single-token decode of the greedy loop took ~0.7 s on a loaded
  // machine (llama.cpp's threads spin at a barrier waiting for a core): 420 s against 3 s.
  const context = await model.createContext({
    contextSize: seqLen, batchSize: kWindow, threads: 1, flashAttention: false,
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32"});
  const seq = context.getSequence();

  // a. Tokenization, token for token (llama.cpp adds SentencePiece's leading space as we do).
  const t0 = Date.now();
  const theirIds = Array.from(model.tokenize(val));
  const at = firstDifference(valIds, theirIds);
  check(at < 0, `tokenization of ${valPath} (${val.length} bytes): ours ${valIds.length} tokens, llama.cpp ${theirIds.length}` +
        (at < 0 ? " - identical" : `, first difference at token ${at}: ours ${valIds[at]} llama.cpp ${theirIds[at]}`) +
        ` (${Date.now() - t0} ms)`);

  // b. Greedy generation: the same ids (prompt included) and the same text.
  for (const prompt of kPrompts) {
    const promptIds = [BOS, ...model.tokenize(prompt)];
    // generate runs `steps` positions and keeps the token sampled at the last: steps + 1 tokens.
    const steps = Math.min(seqLen, promptIds.length + kGenerated - 1);
    const mine = JSON.parse(ours(["generate", "--model", c.bin, "--tokenizer", tok, "--prompt", prompt, "--temperature", "0",
                                  "--steps", String(steps), "--json"]));
    await seq.clearHistory();
    const theirs = [...promptIds];
    let input = promptIds;
    while (theirs.length < steps + 1) {
      const items = input.map((t, i) => i + 1 < input.length ? t : [t, {generateNext: {token: true, options: {temperature: 0}}}]);
      const out = await seq.controlledEvaluate(items);
      const next = out[input.length - 1].next.token;
      if (next === BOS || next === EOS) break;  // generate stops there too (and does not print it)
      theirs.push(next);
      input = [next];
    }
    const d = firstDifference(mine.tokens, theirs);
    check(d < 0, `greedy "${prompt}": ${mine.tokens.length - promptIds.length} tokens generated by ours, ` +
          `${theirs.length - promptIds.length} by llama.cpp` + (d < 0 ? " - identical" : `, first difference at position ${d}`));
    // Our text is run.c's: the pieces after BOS, the first one's leading space dropped.
    // Our text is run.c's: the pieces after BOS, the first one's leading space dropped, and a piece
    // that is one control byte (neither printable nor whitespace) not printed (safe_printf).
    const theirText = model.detokenize(theirs.slice(1)).replace(/^ /, "").replace(/[\x00-\x08\x0e-\x1f\x7f]/g, "");
    check(mine.text === theirText, `greedy "${prompt}": the same text (control bytes dropped as run.c does)` +
          (mine.text === theirText ? "" : `\n  ours:      ${JSON.stringify(mine.text)}\n  llama.cpp: ${JSON.stringify(theirText)}`));
  }

  console.log(`   (${((Date.now() - tStart) / 1000).toFixed(1)} s)`);
  // c. Perplexity: windows of BOS + 255 text tokens, every next-token prediction scored.
  const mineJson = JSON.parse(ours(["eval", "--model", c.bin, "--tokenizer", tok, "--text", pplText, "--methods", "fp32",
                                    "--window", String(kWindow), "--max-tokens", String(kWindows * (kWindow - 1)), "--json"]));
  const mineRow = mineJson.results.find((r) => r.method === "fp32");
  let nll = 0, scored = 0;
  const perWindow = [];
  for (let w = 0; w < kWindows; ++w) {
    const win = [BOS, ...pplIds.slice(w * (kWindow - 1), (w + 1) * (kWindow - 1))];
    await seq.clearHistory();
    const out = await seq.controlledEvaluate(win.map((t, i) => i + 1 < win.length ? [t, {generateNext: {probabilities: true}}] : t));
    let wNll = 0;
    for (let i = 0; i + 1 < win.length; ++i) {
      // llama.cpp's full softmax over the vocabulary (the greedy sampler keeps every candidate).
      const probs = out[i].next.probabilities;
      if (probs.size !== kVocab)
        throw new Error(`expected the whole vocabulary's probabilities, got ${probs.size}`);
      wNll -= Math.log(probs.get(win[i + 1]));
    }
    perWindow.push(Math.exp(wNll / (win.length - 1)));
    nll += wNll;
    scored += win.length - 1;
  }
  const theirPpl = Math.exp(nll / scored);
  const rel = Math.abs(theirPpl - mineRow.ppl) / mineRow.ppl;
  console.log(`   llama.cpp ppl per window: ${perWindow.map((p) => p.toFixed(4)).join(" ")}`);
  check(scored === mineRow.tokens && rel <= kPplTolerance,
        `perplexity over ${kWindows} windows of ${kWindow} (${scored} tokens scored; ours ${mineRow.tokens}): ours ${mineRow.ppl.toFixed(9)}, ` +
        `llama.cpp ${theirPpl.toFixed(9)}, relative difference ${rel.toExponential(2)} (limit ${kPplTolerance})`);

  await context.dispose();
  await model.dispose();
}

if (failures.length) {
  console.log(`${failures.length} check(s) failed`);
  process.exit(1);
}
console.log("all checks passed");
