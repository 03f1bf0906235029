// ctest: llama.cpp's own KV cache types agree with our emulations of them (issue 18, item 4), on
// stories260K with heads padded to 64, 4 windows x 256 tokens from BOS (protocol: lib/kv_types.mjs;
// the full table of every type, rotation and flash-attention setting: kv_types_measure.mjs and
// docs/quality.md). llama.cpp's Hadamard rotation is turned off (LLAMA_ATTN_ROT_DISABLE=1, set
// before llama.cpp is loaded) so its blocks see the values ours see; flash attention is on (without
// it llama.cpp refuses a quantized V cache).
//
// Budgets (measured gaps: over the 16 windows of docs/quality.md f16 ppl 5e-6 relative, q8_0 ΔPPL
// 0.033 percentage points and KL 7.6 %, q4_0 ppl 1.3 % and KL 1.2 %; over this test's 4 windows
// F32 6e-7, F16 4e-7, q8_0 ΔPPL 0.16 points and KL 15 %, q4_0 ppl 0.8 % and KL 0.5 %):
// - exact caches: F32 (flash attention off) within 1e-5 relative of our fp32, F16 within 1e-4 of our
//   fp16 (llama.cpp rounds Q to f16 and accumulates V in f16 with flash attention; the padded model
//   computes the unpadded function).
// - q8_0: |ΔPPL llama.cpp - ΔPPL ours| <= 0.3 points and KL within 25 % (llama.cpp quantizes Q to
//   q8_0 for its dot products; ours keeps Q in float32: a second small error of either sign, so a
//   ΔPPL of ~0.1 % is mostly which tokens each error happens to favour; a broken q8_0 K reads +1000 %).
// - q4_0: perplexity within 5 % and KL within 10 % of ours (same blocks, same rounding; a rotated
//   llama.cpp q4_0 would read ~60 % lower perplexity and ~2.5x lower KL, so the check also proves the
//   rotation is off, and a wrong block layout would be far outside).
process.env.LLAMA_ATTN_ROT_DISABLE = "1";
import assert from "node:assert/strict";
import {paddedModel, loadModel, textWindows, scoreLlama, meanKl, ourEval} from "./lib/kv_types.mjs";

const N = 4;
const file = paddedModel(64);
const model = await loadModel(file);
const windows = textWindows(model, N);
const ref = await scoreLlama(model, windows, {k: "F32", v: "F32", flash: false, keepDistributions: true});
const llamaRows = {F32: {ppl: ref.ppl, kl: 0}};
for (const t of ["F16", "Q8_0", "Q4_0"]) {
  const r = await scoreLlama(model, windows, {k: t, v: t, flash: true, keepDistributions: true});
  llamaRows[t] = {ppl: r.ppl, kl: meanKl(ref, r)};
}
await model.dispose();
const ours = ourEval(file, ["fp32", "fp16", "q8_0", "q4_0"], N);
const dppl = (rows, m, base) => 100 * (rows[m].ppl / rows[base].ppl - 1);
const rel = (a, b) => Math.abs(a / b - 1);
const report = {
  f32: [llamaRows.F32.ppl, ours.fp32.ppl], f16: [llamaRows.F16.ppl, ours.fp16.ppl],
  q8_0: {ppl: [llamaRows.Q8_0.ppl, ours.q8_0.ppl], dppl: [dppl(llamaRows, "Q8_0", "F32"), dppl(ours, "q8_0", "fp32")], kl: [llamaRows.Q8_0.kl, ours.q8_0.kl]},
  q4_0: {ppl: [llamaRows.Q4_0.ppl, ours.q4_0.ppl], kl: [llamaRows.Q4_0.kl, ours.q4_0.kl]},
};
console.log(JSON.stringify(report));  // [llama.cpp, ours] pairs

assert.ok(rel(llamaRows.F32.ppl, ours.fp32.ppl) <= 1e-5, `F32: llama.cpp ${llamaRows.F32.ppl} vs ours ${ours.fp32.ppl}`);
assert.ok(rel(llamaRows.F16.ppl, ours.fp16.ppl) <= 1e-4, `F16: llama.cpp ${llamaRows.F16.ppl} vs ours ${ours.fp16.ppl}`);
assert.ok(Math.abs(report.q8_0.dppl[0] - report.q8_0.dppl[1]) <= 0.3, `q8_0 ΔPPL %: llama.cpp ${report.q8_0.dppl[0]} vs ours ${report.q8_0.dppl[1]}`);
assert.ok(rel(llamaRows.Q8_0.kl, ours.q8_0.kl) <= 0.25, `q8_0 KL: llama.cpp ${llamaRows.Q8_0.kl} vs ours ${ours.q8_0.kl}`);
assert.ok(rel(llamaRows.Q4_0.ppl, ours.q4_0.ppl) <= 0.05, `q4_0 ppl: llama.cpp ${llamaRows.Q4_0.ppl} vs ours ${ours.q4_0.ppl}`);
assert.ok(rel(llamaRows.Q4_0.kl, ours.q4_0.kl) <= 0.10, `q4_0 KL: llama.cpp ${llamaRows.Q4_0.kl} vs ours ${ours.q4_0.kl}`);
console.log("kv_types: llama.cpp's f32/f16/q8_0/q4_0 caches agree with ours within the budgets");
