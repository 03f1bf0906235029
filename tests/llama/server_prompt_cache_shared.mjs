// Two llama-servers behind two `veloxquant prompt-cache` proxies sharing one Redis, then one Redis
// Cluster (issue 30), then one Redis sealed with a secret and a namespace (issue 36): a
// prefix computed through one is a hit for the other; a Redis that goes away and a llama-server
// that is killed cost a recompute or one failed request, never a wrong answer, and the proxy keeps
// serving.
//
// redis-server, both llama-servers and both proxies run on 127.0.0.1 at ports picked here and are
// stopped by their pids. Chunks of 64 tokens at fp16 (exact), so every text is the text without
// the cache.
import fs from "node:fs";
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch} from "./lib/env.mjs";
import {startServer, post, freePort, spawnTied} from "./lib/server.mjs";
import {startProxy, lastLine} from "./lib/proxy.mjs";

let failures = 0;
function check(ok, what) {
  if (!ok) {
    failures++;
    console.error(`FAIL: ${what}`);
  }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const C = 64;
const gguf = path.join(scratch, "stories260K.gguf");
execFileSync(cli, ["convert", path.join(models, "stories260K.bin"), "--tokenizer", path.join(models, "tok512.bin"), "-o", gguf]);

async function startRedisNode(extra = []) {
  const port = await freePort();
  const child = spawnTied("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                       "--dir", scratch, ...extra], {stdio: "ignore"});
  const exited = new Promise((r) => child.once("exit", r));
  for (let i = 0; i < 100; i++) {
    try {
      if (execFileSync("redis-cli", ["-p", String(port), "ping"], {encoding: "utf8", stdio: ["ignore", "pipe", "ignore"]}).trim() === "PONG") break;
    } catch {
      // not up yet
    }
    await sleep(100);
  }
  return {port, url: `redis://127.0.0.1:${port}`, async stop() {
    if (child.exitCode === null && child.signalCode === null) process.kill(child.pid, "SIGKILL");
    await exited;
  }};
}
const startRedis = () => startRedisNode();

// Three masters, no replicas (redis-cli --cluster create), every slot covered.
async function startRedisCluster() {
  const nodes = [];
  for (let i = 0; i < 3; i++)
    nodes.push(await startRedisNode(["--cluster-enabled", "yes", "--cluster-config-file", path.join(scratch, `nodes-${i}.conf`),
                                     "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]));
  execFileSync("redis-cli", ["--cluster", "create", ...nodes.map((n) => `127.0.0.1:${n.port}`), "--cluster-replicas", "0", "--cluster-yes"],
               {stdio: "ignore"});
  for (const n of nodes)
    for (let i = 0; i < 100; i++) {
      const info = execFileSync("redis-cli", ["-p", String(n.port), "cluster", "info"], {encoding: "utf8"});
      if (info.includes("cluster_state:ok")) break;
      await sleep(100);
    }
  return {nodes, url: `redis-cluster://127.0.0.1:${nodes[0].port},127.0.0.1:${nodes[1].port}`,
          async stop() { for (const n of nodes) await n.stop(); }};
}

const startProxyOn = (upstream, slots, store) =>
  startProxy(["--upstream", upstream, "--model", gguf, "--slot-dir", slots, "--store", store, "--levels", "fp16", "--chunk-tokens", String(C)]);

const words = fs.readFileSync(path.join(models, "tinystories_val.txt"), "utf8").split(/\s+/).slice(0, 110).join(" ");
const request = {prompt: words, n_predict: 32, temperature: 0, top_k: 1, seed: 1};

const redis = await startRedis();
const side = (name) => {
  const slots = path.join(scratch, `slots-${name}`);
  fs.mkdirSync(slots);
  return {slots, args: ["-m", gguf, "-c", "512", "-np", "1", "-t", "1", "--cache-ram", "0", "--slot-save-path", slots]};
};
const a = side("a"), b = side("b");
const serverA = await startServer(a.args), serverB = await startServer(b.args);
const proxyA = await startProxyOn(serverA.url, a.slots, redis.url), proxyB = await startProxyOn(serverB.url, b.slots, redis.url);
try {
  // A prefix computed through A is a hit through B.
  const viaA = await proxyA.logged(() => post(proxyA.url, "/completion", request));
  console.log(`through A: ${viaA.timings.prompt_n} evaluated; ${lastLine(proxyA.log())}`);
  check(/0 restored from the store, [1-9]\d* stored/.test(lastLine(proxyA.log())), "A stored the prefix in Redis");
  const viaB = await proxyB.logged(() => post(proxyB.url, "/completion", request));
  console.log(`through B: ${viaB.timings.prompt_n} evaluated; ${lastLine(proxyB.log())}`);
  check(/ [1-9]\d* restored from the store/.test(lastLine(proxyB.log())), "B restored A's prefix from Redis");
  check(viaB.timings.prompt_n < C + 1, `B's server evaluated only the tail (${viaB.timings.prompt_n})`);
  check(viaB.content === viaA.content, "the same text through both");

  // Redis goes away: the next request is computed by the server, the proxy says why and keeps serving.
  await redis.stop();
  await post(serverB.url, "/slots/0?action=erase", {});
  const noRedis = await proxyB.logged(() => post(proxyB.url, "/completion", request));
  console.log(`without Redis: ${noRedis.timings.prompt_n} evaluated; B's log tail:\n${proxyB.log().trim().split("\n").slice(-3).join("\n")}`);
  check(noRedis.content === viaA.content, "without Redis: the same text");
  check(proxyB.alive(), "proxy B still runs without its store");

  // A killed llama-server: the request fails with a clear error (502), the proxy keeps running.
  await serverA.stop();
  const r = await fetch(`${proxyA.url}/completion`, {method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(request)});
  const body = await r.text();
  console.log(`killed server: ${r.status} ${body.slice(0, 160)}`);
  check(r.status === 502 && body.includes("did not answer"), "a killed llama-server is a 502 naming it");
  check(proxyA.alive(), "proxy A still runs");
} finally {
  await proxyA.stop();
  await proxyB.stop();
  await serverA.stop();
  await serverB.stop();
  await redis.stop();
}
// The same through a Redis Cluster of three masters; then one master is killed: what it held is
// gone, the request is computed by the server (or restored in part from the surviving masters) and
// gives the same text.
{
  const cluster = await startRedisCluster();
  const sa = await startServer(a.args), sb = await startServer(b.args);
  const pa = await startProxyOn(sa.url, a.slots, cluster.url), pb = await startProxyOn(sb.url, b.slots, cluster.url);
  try {
    const viaA = await pa.logged(() => post(pa.url, "/completion", request));
    const viaB = await pb.logged(() => post(pb.url, "/completion", request));
    console.log(`cluster: through A ${viaA.timings.prompt_n} evaluated, through B ${viaB.timings.prompt_n}; ${lastLine(pb.log())}`);
    check(/ [1-9]\d* restored from the store/.test(lastLine(pb.log())), "cluster: B restored A's prefix");
    check(viaB.timings.prompt_n < C + 1, `cluster: B's server evaluated only the tail (${viaB.timings.prompt_n})`);
    check(viaB.content === viaA.content, "cluster: the same text through both");
    await cluster.nodes[1].stop();
    await post(sb.url, "/slots/0?action=erase", {});
    const hurt = await pb.logged(() => post(pb.url, "/completion", request));
    console.log(`cluster with a master killed: ${hurt.timings.prompt_n} evaluated; ${lastLine(pb.log())}`);
    check(hurt.content === viaA.content, "cluster with a master killed: the same text");
    check(pb.alive(), "cluster with a master killed: the proxy keeps serving");
  } finally {
    await pa.stop();
    await pb.stop();
    await sa.stop();
    await sb.stop();
    await cluster.stop();
  }
}
// A sealed store (issue 36): both proxies with one secret and one namespace share the prefix; a
// proxy with another secret, or in another namespace, restores nothing and gives the same text.
{
  const sealedRedis = await startRedis();
  const sa = await startServer(a.args), sb = await startServer(b.args);
  const url = (q) => `${sealedRedis.url}?${q}`;
  const pa = await startProxyOn(sa.url, a.slots, url("secret=s3cret&namespace=deploy-1"));
  let pb = await startProxyOn(sb.url, b.slots, url("secret=s3cret&namespace=deploy-1"));
  try {
    const viaA = await pa.logged(() => post(pa.url, "/completion", request));
    const viaB = await pb.logged(() => post(pb.url, "/completion", request));
    console.log(`sealed: through A ${viaA.timings.prompt_n} evaluated, through B ${viaB.timings.prompt_n}; ${lastLine(pb.log())}`);
    check(/ [1-9]\d* restored from the store/.test(lastLine(pb.log())), "sealed: B restored A's prefix with the same secret");
    check(viaB.content === viaA.content, "sealed: the same text through both");
    const keys = execFileSync("redis-cli", ["-p", String(sealedRedis.port), "--scan"], {encoding: "utf8"});
    check(keys.includes("vq-ns") && !/\{vq-[0-9a-f]{8}-/.test(keys), "sealed: every key is the namespace's");
    for (const [q, what] of [["secret=other&namespace=deploy-1", "MAC"], ["secret=s3cret&namespace=deploy-2", "not stored"]]) {
      await pb.stop();
      await post(sb.url, "/slots/0?action=erase", {});
      pb = await startProxyOn(sb.url, b.slots, url(q));
      const r = await pb.logged(() => post(pb.url, "/completion", request));
      console.log(`sealed, ${q.replace(/secret=[^&]*/, "secret=...")}: ${r.timings.prompt_n} evaluated; ${pb.log().trim().split("\n").slice(-2).join(" | ")}`);
      check(/ 0 restored from the store/.test(lastLine(pb.log())), `sealed, ${what}: nothing restored`);
      check(r.content === viaA.content, `sealed, ${what}: the same text`);
      check(!pb.log().includes("s3cret") && !pb.log().includes("other&"), "the secret is never logged");
    }
    // Nothing the wrong secret's proxy did cost deploy-1 its prefix (it may not overwrite the index).
    await pb.stop();
    await post(sb.url, "/slots/0?action=erase", {});
    pb = await startProxyOn(sb.url, b.slots, url("secret=s3cret&namespace=deploy-1"));
    const again = await pb.logged(() => post(pb.url, "/completion", request));
    check(/ [1-9]\d* restored from the store/.test(lastLine(pb.log())), "sealed: deploy-1's prefix survived the wrong secret's proxy");
    check(again.content === viaA.content, "sealed: the same text again");
  } finally {
    await pa.stop();
    await pb.stop();
    await sa.stop();
    await sb.stop();
    await sealedRedis.stop();
  }
}
if (failures) {
  console.error(`${failures} check(s) failed; proxy B log:\n${proxyB.log()}`);
  process.exit(1);
}
console.log("ok");
