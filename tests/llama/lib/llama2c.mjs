// A llama2.c checkpoint (legacy layout, what run.c and our Checkpoint::load read; see
// include/veloxquant/model/checkpoint.hpp) with seeded random weights, written by the test itself
// so a second model needs nothing outside ../shared/. Same seed and shape: the same bytes.
//
// writeRandomCheckpoint(path, shape, seed) with shape {dim, hidden, layers, heads, kvHeads, vocab,
// seqLen, sharedClassifier}. Weights: matrices N(0, 1/in) (the residual stream keeps its scale),
// RMS-norm gains 1, embeddings N(0, embScale^2), the classifier (when not shared) N(0, clsScale^2/dim)
// so the logits of a normalized state have a standard deviation about clsScale: a peaked but not
// degenerate next-token distribution (perplexity finite and far from both 1 and the vocabulary).
import fs from "node:fs";

// mulberry32: a small, well-known 32-bit PRNG; Box-Muller turns two uniforms into a normal.
function rng(seed) {
  let a = seed >>> 0;
  const uniform = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  return () => {
    const u = 1 - uniform();  // (0, 1]: log(u) is finite
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * uniform());
  };
}

export function writeRandomCheckpoint(path, shape, seed, {embScale = 1, clsScale = 3} = {}) {
  const {dim, hidden, layers, heads, kvHeads, vocab, seqLen, sharedClassifier} = shape;
  if (dim % heads !== 0 || heads % kvHeads !== 0) throw new Error(`bad shape ${JSON.stringify(shape)}`);
  const headSize = dim / heads, kvDim = headSize * kvHeads;
  const normal = rng(seed);
  const parts = [];
  const header = new Int32Array([dim, hidden, layers, heads, kvHeads, sharedClassifier ? vocab : -vocab, seqLen]);
  parts.push(Buffer.from(header.buffer));
  const block = (n, f) => {
    const a = new Float32Array(n);
    for (let i = 0; i < n; ++i) a[i] = f();
    parts.push(Buffer.from(a.buffer));
  };
  const matrix = (count, out, inp) => block(count * out * inp, () => normal() / Math.sqrt(inp));
  const ones = (n) => block(n, () => 1);
  block(vocab * dim, () => embScale * normal());  // token_embedding [vocab, dim]
  ones(layers * dim);                              // rms_att
  matrix(layers, dim, dim);                        // wq [L, dim, dim]
  matrix(layers, kvDim, dim);                      // wk [L, kv_dim, dim]
  matrix(layers, kvDim, dim);                      // wv
  matrix(layers, dim, dim);                        // wo
  ones(layers * dim);                              // rms_ffn
  matrix(layers, hidden, dim);                     // w1 [L, hidden, dim]
  matrix(layers, dim, hidden);                     // w2 [L, dim, hidden]
  matrix(layers, hidden, dim);                     // w3
  ones(dim);                                       // rms_final
  block(seqLen * headSize, () => 0);               // freq_cis_real and _imag (unused: RoPE is recomputed)
  if (!sharedClassifier) block(vocab * dim, () => clsScale * normal() / Math.sqrt(dim));  // wcls [vocab, dim]
  fs.writeFileSync(path, Buffer.concat(parts));
}
