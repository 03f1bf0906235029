// What every llama.cpp test script needs: node-llama-cpp (imported from VQ_NODE_LLAMA_DIR, where
// npm installed it), our CLI, the models folder and a scratch folder of its own (created empty).
import path from "node:path";
import fs from "node:fs";
import {pathToFileURL} from "node:url";

function need(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set (run this script through ctest)`);
  return v;
}

export const cli = need("VQ_CLI");
export const models = need("VQ_MODELS");
export const scratch = need("VQ_SCRATCH");
fs.rmSync(scratch, {recursive: true, force: true});
fs.mkdirSync(scratch, {recursive: true});

const entry = path.join(need("VQ_NODE_LLAMA_DIR"), "node_modules", "node-llama-cpp", "dist", "index.js");
export const nlc = await import(pathToFileURL(entry).href);

// One llama.cpp instance per process, CPU only, never building from source.
let llamaPromise = null;
export function llama() {
  if (!llamaPromise) llamaPromise = nlc.getLlama({gpu: false, build: "never", logLevel: nlc.LlamaLogLevel.error});
  return llamaPromise;
}
