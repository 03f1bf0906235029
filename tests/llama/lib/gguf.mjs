// A converted GGUF with its llama.rope.freq_base rewritten in place: a model llama.cpp runs and our
// reader refuses (it supports only 10000, as llama2.c), for the tests of what works without our
// reader (the prompt cache on a shape-only model, vq profiles fitted through llama.cpp).
import fs from "node:fs";

// Writes `dst`: `src` with rope.freq_base = `base`. Returns the value `src` held (10000 for ours).
export function writeRopePatched(src, dst, base) {
  const b = fs.readFileSync(src);
  const key = Buffer.from("llama.rope.freq_base");
  const at = b.indexOf(key) + key.length + 4;  // after the key: its type (u32), then the f32 value
  const before = b.readFloatLE(at);
  b.writeFloatLE(base, at);
  fs.writeFileSync(dst, b);
  return before;
}
