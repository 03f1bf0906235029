// llama.cpp's own saved state through veloxquant (issue 18 item 3), measured by llama.cpp itself.
//
// llama.cpp (node-llama-cpp 3.21.1, CPU, 2 threads) runs stories260K converted by `veloxquant
// convert`, evaluates 256 tokens of the validation text (BOS first) with an F16 KV cache and saves
// the sequence's state (saveStateToFile). Every state below is loaded into the same context
// (loadStateFromFile) and continued over the next 256 tokens, asking llama.cpp for the full
// next-token distribution at each:
// - the state as llama.cpp saved it: the reference distributions (equal to the live sequence's);
// - exact round trips (`compress --llama-state --method fp16|fp32`, `decompress --llama-state-out`):
//   the same state bytes, and every probability equal bit for bit to the reference;
// - lossy round trips (vq:bits=2, cachegen): llama.cpp's perplexity of the continuation against the
//   reference's (ΔPPL) and the mean KL(reference || restored) per token, printed and held to the
//   budgets below.
// With flash attention off llama.cpp stores V transposed; one more context with it on checks the
// other layout's exact round trip.
import fs from "node:fs";
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch, llama} from "./lib/env.mjs";

const PROMPT = 256, CONT = 256;
// Budgets (docs/gguf.md, "llama.cpp's saved state"; measured: vq:bits=2 6.67x, dPPL -0.31 %, KL
// 2.2e-3; cachegen 3.22x, dPPL -1.73 %, KL 2.2e-2). The goal for vq:bits=2 is 6x smaller than the F16
// state with |dPPL| <= 1 %; cachegen (4 bits with its layer schedule, float32 scales per group and
// channel: 2 bits per element at head size 8) is the peer, held to a looser budget. Over 256 tokens
// dPPL of either sign is noise of this size, so the budgets bound |dPPL| and the KL.
const BUDGETS = {
  "vq:bits=2": {minRatio: 6, maxDppl: 0.01, maxKl: 0.01},
  "cachegen": {minRatio: 3, maxDppl: 0.03, maxKl: 0.05},
};

let failures = 0;
function check(ok, what) {
  if (!ok) {
    failures++;
    console.error(`FAIL: ${what}`);
  }
}
function run(...args) {
  return execFileSync(cli, args, {encoding: "utf8", stdio: ["ignore", "pipe", "pipe"]});
}

const gguf = path.join(scratch, "stories260K.gguf");
run("convert", path.join(models, "stories260K.bin"), "--tokenizer", path.join(models, "tok512.bin"), "-o", gguf);

const l = await llama();
const model = await l.loadModel({modelPath: gguf});
const text = fs.readFileSync(path.join(models, "tinystories_val.txt"), "utf8").slice(0, 20000);
const all = [model.tokens.bos, ...model.tokenize(text)];
if (all.length < PROMPT + CONT + 1) throw new Error(`the validation text has only ${all.length} tokens`);
const prompt = all.slice(0, PROMPT), cont = all.slice(PROMPT, PROMPT + CONT + 1);

// The next-token distributions after each of cont[0 .. CONT-1], as arrays over the vocabulary.
async function continuation(seq) {
  const out = await seq.controlledEvaluate(cont.slice(0, CONT).map((t) => [t, {generateNext: {probabilities: true}}]));
  return out.map((o) => {
    const p = new Float64Array(o.next.probabilities.size);
    for (const [tok, prob] of o.next.probabilities) p[tok] = prob;
    return p;
  });
}
async function fromState(seq, file) {
  await seq.clearHistory();
  await seq.loadStateFromFile(file, {acceptRisk: true});
  check(seq.contextTokens.length === PROMPT && seq.contextTokens.every((t, i) => t === prompt[i]),
        `${path.basename(file)}: the restored sequence holds the ${PROMPT} prompt tokens`);
  return continuation(seq);
}
function ppl(d) {
  let s = 0;
  for (let i = 0; i < CONT; i++) s += Math.log(d[i][cont[i + 1]]);
  return Math.exp(-s / CONT);
}
function meanKl(ref, d) {
  let s = 0;
  for (let i = 0; i < CONT; i++)
    for (let v = 0; v < ref[i].length; v++)
      if (ref[i][v] > 0) s += ref[i][v] * Math.log(ref[i][v] / d[i][v]);
  return s / CONT;
}
function identical(a, b) {
  for (let i = 0; i < a.length; i++)
    for (let v = 0; v < a[i].length; v++)
      if (!Object.is(a[i][v], b[i][v])) return `position ${i}, token ${v}: ${a[i][v]} vs ${b[i][v]}`;
  return null;
}
function roundTrip(state, method, tag) {
  const vqkv = path.join(scratch, `${tag}.vqkv`), back = path.join(scratch, `${tag}.state`);
  const j = JSON.parse(run("compress", "--llama-state", state, "--model", gguf, "--method", method, "-o", vqkv, "--json"));
  run("decompress", vqkv, "--model", gguf, "--llama-state-out", back);
  return {bytes: j.bytes, back};
}

for (const flashAttention of [false, true]) {
  const ctx = await model.createContext({contextSize: 1024, threads: 2, flashAttention,
                                         experimentalKvCacheKeyType: "F16", experimentalKvCacheValueType: "F16"});
  const seq = ctx.getSequence();
  await seq.evaluateWithoutGeneratingNewTokens(prompt);
  const state = path.join(scratch, `fa${flashAttention}.state`);
  const {fileSize} = await seq.saveStateToFile(state);
  console.log(`flash attention ${flashAttention}: llama.cpp saved ${fileSize} bytes (${PROMPT} tokens, F16 KV)`);
  // The sequence continued without saving gives what its loaded state gives: loading restores it.
  const direct = await continuation(seq);
  const ref = await fromState(seq, state);
  const same = identical(direct, ref);
  check(same === null, `llama.cpp's own state continues as the live sequence did (${same})`);
  const refPpl = ppl(ref);
  console.log(`  reference (llama.cpp's own state): continuation ppl ${refPpl.toFixed(6)} over ${CONT} tokens`);

  for (const method of flashAttention ? ["fp32"] : ["fp16", "fp32"]) {
    const {bytes, back} = roundTrip(state, method, `fa${flashAttention}_${method}`);
    check(Buffer.compare(fs.readFileSync(back), fs.readFileSync(state)) === 0, `${method}: the decompressed state equals llama.cpp's bytes`);
    const diff = identical(ref, await fromState(seq, back));
    check(diff === null, `${method}: probabilities bit for bit (${diff})`);
    console.log(`  ${method}: ${bytes} bytes, state bytes identical, ${CONT} x ${ref[0].length} probabilities bit for bit: ${diff === null}`);
  }
  if (flashAttention) {
    await ctx.dispose();
    continue;
  }
  for (const [method, budget] of Object.entries(BUDGETS)) {
    const {bytes, back} = roundTrip(state, method, method.replace(/[^a-z0-9]/gi, "_"));
    const d = await fromState(seq, back);
    const p = ppl(d), dppl = p / refPpl - 1, kl = meanKl(ref, d), ratio = fileSize / bytes;
    console.log(`  ${method}: ${bytes} bytes (${ratio.toFixed(2)}x smaller than the state), ppl ${p.toFixed(6)}, ` +
                `dPPL ${(100 * dppl).toFixed(3)} %, KL ${kl.toExponential(3)} nats/token`);
    check(ratio >= budget.minRatio, `${method}: ${ratio.toFixed(2)}x smaller, budget ${budget.minRatio}x`);
    check(Math.abs(dppl) <= budget.maxDppl, `${method}: |dPPL| ${(100 * dppl).toFixed(3)} %, budget ${100 * budget.maxDppl} %`);
    check(kl <= budget.maxKl, `${method}: KL ${kl}, budget ${budget.maxKl}`);
    check(kl > 0, `${method}: a lossy state changes the distributions (KL ${kl} > 0: the loaded K/V are the ones used)`);
  }
  await ctx.dispose();
}

// A state llama.cpp did not write: truncated, it is refused by our reader with one line and exit 1.
const cut = path.join(scratch, "cut.state");
fs.writeFileSync(cut, fs.readFileSync(path.join(scratch, "fafalse.state")).subarray(0, 100000));
try {
  run("compress", "--llama-state", cut, "--model", gguf, "-o", path.join(scratch, "cut.vqkv"));
  check(false, "a truncated state is refused");
} catch (e) {
  check(e.status === 1 && /cut\.state: llama\.cpp state: /.test(e.stderr) && e.stderr.trim().split("\n").length === 1,
        `a truncated state: exit 1 and one line (got ${e.status}: ${e.stderr})`);
}

await model.dispose();
if (failures) {
  console.error(`${failures} check(s) failed`);
  process.exit(1);
}
console.log("all checks passed");
