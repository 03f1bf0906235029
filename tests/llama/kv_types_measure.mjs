// The full measurement behind docs/quality.md's "llama.cpp's own KV types" table (issue 18, item 4):
// llama.cpp's K/V cache types f16, q8_0, q4_0, q4_1, q5_0, iq4_nl (K and V of the same type), with
// flash attention on and off, with and without llama.cpp's Hadamard rotation of K and V, on
// stories260K with its heads padded to 64, beside our fp16 / q8_0 / q4_0 / q4_1 (and :rotate=1) on
// the same windows (protocol: lib/kv_types.mjs). Not a ctest (minutes of CPU); run it as
//   VQ_NODE_LLAMA_DIR=/path/to/prefix VQ_CLI=build/veloxquant VQ_MODELS=../shared/models \
//   VQ_SCRATCH=/tmp/kv_types node tests/llama/kv_types_measure.mjs [--windows 16] [--bin stories3M-h64.bin] [--json]
// llama.cpp reads LLAMA_ATTN_ROT_DISABLE when it builds a context, from the environment it was
// started with, so each rotation setting runs in a child process of its own (--pass on|off).
import {execFileSync, spawnSync} from "node:child_process";
import {fileURLToPath} from "node:url";
import path from "node:path";
import {cli, models, scratch} from "./lib/env.mjs";
import {paddedModel, loadModel, textWindows, scoreLlama, meanKl, ourEval, typeBits, WINDOW, textPath, tailTextPath} from "./lib/kv_types.mjs";

const args = process.argv.slice(2);
const opt = (name, def) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : def; };
const nWindows = Number(opt("--windows", "16"));
if (!Number.isInteger(nWindows) || nWindows < 1 || nWindows > 64) {
  console.error(`kv_types_measure: --windows must be an integer 1..64, got '${opt("--windows")}'`);
  process.exit(2);
}
const types = ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "IQ4_NL"];  // K; V the same (F16 with flash attention off)
// stories3M-h64 is scored on the text it never saw (../shared/models/README.md).
const text = (opt("--bin") ?? "").startsWith("stories3M") ? tailTextPath : textPath;

async function pass(modelFile) {
  const model = await loadModel(modelFile);
  const windows = textWindows(model, nWindows, text);
  const ref = await scoreLlama(model, windows, {k: "F32", v: "F32", flash: false, keepDistributions: true});
  const rows = [{type: "F32", v: "F32", flash: false, ppl: ref.ppl, kl: 0, tokens: ref.tokens}];
  for (const type of types)
    for (const flash of [true, false]) {
      try {
        // llama.cpp refuses a quantized V cache without flash attention: there V stays F16.
        const v = flash || type === "F16" ? type : "F16";
        const r = await scoreLlama(model, windows, {k: type, v, flash, keepDistributions: true});
        rows.push({type, v, flash, ppl: r.ppl, kl: meanKl(ref, r), tokens: r.tokens});
      } catch (e) {
        rows.push({type, flash, error: String(e.message ?? e).split("\n")[0]});
      }
    }
  await model.dispose();
  return rows;
}

if (opt("--pass")) {
  const rows = await pass(opt("--model"));
  process.stdout.write("KV_TYPES_JSON " + JSON.stringify(rows) + "\n");
  process.exit(0);
}

// --bin NAME: a llama2.c model of ../shared/models converted as it is (e.g. stories3M-h64.bin, whose
// heads are 64 wide already); default stories260K padded to head 64.
const bin = opt("--bin");
let modelFile;
if (bin) {
  if (!/^[\w.-]+\.bin$/.test(bin)) {
    console.error(`kv_types_measure: --bin takes a model file name in the models folder, got '${bin}'`);
    process.exit(2);
  }
  modelFile = path.join(scratch, bin.replace(/\.bin$/, ".gguf"));
  execFileSync(cli, ["convert", path.join(models, bin), "--tokenizer", path.join(models, "tok512.bin"), "-o", modelFile],
               {stdio: ["ignore", "ignore", "inherit"]});
} else {
  modelFile = paddedModel(64);
}
const self = fileURLToPath(import.meta.url);
const llamaRows = {};
for (const rot of ["on", "off"]) {
  // env.mjs empties VQ_SCRATCH when it loads: the child gets a folder of its own.
  const env = {...process.env, VQ_SCRATCH: path.join(scratch, `pass-${rot}`)};
  if (rot === "off") env.LLAMA_ATTN_ROT_DISABLE = "1"; else delete env.LLAMA_ATTN_ROT_DISABLE;
  const r = spawnSync(process.execPath, [self, "--pass", rot, "--model", modelFile, "--windows", String(nWindows), ...(bin ? ["--bin", bin] : [])],
                      {env, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"], maxBuffer: 1 << 24});
  const line = (r.stdout ?? "").split("\n").find(l => l.startsWith("KV_TYPES_JSON "));
  if (r.status !== 0 || !line) throw new Error(`the rotation=${rot} pass failed (exit ${r.status})`);
  llamaRows[rot] = JSON.parse(line.slice("KV_TYPES_JSON ".length));
}
const ourMethods = ["fp16", "q8_0", "q8_0:rotate=1", "q4_0", "q4_0:rotate=1", "q4_1", "q4_1:rotate=1"];
const ours = ourEval(modelFile, ["fp32", ...ourMethods], nWindows, text);

const f16 = (rot, flash) => llamaRows[rot].find(r => r.type === "F16" && r.flash === flash);
const fmt = (x, d) => (x === undefined ? "-" : x.toFixed(d));
if (args.includes("--json")) {
  console.log(JSON.stringify({windows: nWindows, window: WINDOW, llama: llamaRows, ours}, null, 1));
} else {
  console.log(`${bin ?? "stories260K padded to head 64"}, ${nWindows} windows x ${WINDOW} tokens from BOS, K and V of one type`);
  console.log("| who | cache | rotation | flash attn | bits | ppl | ΔPPL % vs f16 | KL vs exact |");
  console.log("|---|---|---|---|---|---|---|---|");
  for (const rot of ["off", "on"])
    for (const r of llamaRows[rot]) {
      if (r.error) { console.log(`| llama.cpp | ${r.type.toLowerCase()} | ${rot} | ${r.flash ? "on" : "off"} | ${typeBits[r.type]} | refused: ${r.error} | | |`); continue; }
      const base = f16(rot, r.flash);
      const d = base && !base.error ? 100 * (r.ppl / base.ppl - 1) : undefined;
      const cache = r.v === r.type ? r.type.toLowerCase() : `K ${r.type.toLowerCase()}, V ${r.v.toLowerCase()}`;
      const bits = (typeBits[r.type] + typeBits[r.v]) / 2;
      console.log(`| llama.cpp | ${cache} | ${rot} | ${r.flash ? "on" : "off"} | ${bits} | ${fmt(r.ppl, 5)} | ${fmt(d, 3)} | ${r.kl.toExponential(3)} |`);
    }
  for (const m of ["fp32", ...ourMethods]) {
    const r = ours[m];
    const d = 100 * (r.ppl / ours.fp16.ppl - 1);
    console.log(`| veloxquant | ${m.split(":")[0]} | ${m.includes("rotate=1") ? "on" : "off"} | - | ${r.bits} | ${fmt(r.ppl, 5)} | ${fmt(d, 3)} | ${r.kl.toExponential(3)} |`);
  }
}
