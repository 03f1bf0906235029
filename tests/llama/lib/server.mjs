// A real llama-server for a test (issue 30): built from the pinned package's llama.cpp source by
// tools/llama/build-llama.sh, found through VQ_LLAMA_SERVER. It is started on 127.0.0.1 at a port
// picked here (a free one the OS gave a listener, closed just before), waited for on /health, and
// stopped by its pid (SIGTERM, then SIGKILL after 5 s), and dies with the test process. Its output
// is kept for the failure message.
import net from "node:net";
import {spawn} from "node:child_process";

export const serverBin = process.env.VQ_LLAMA_SERVER;
if (!serverBin) throw new Error("VQ_LLAMA_SERVER is not set (run this script through ctest)");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// spawn(), with the child tied to this process (util-linux's setpriv --pdeathsig, which then execs
// the command: the pid is the command's): a test that fails, throws or is killed by ctest's timeout
// leaves no server behind.
export function spawnTied(command, args, options) {
  return spawn("setpriv", ["--pdeathsig", "KILL", "--", command, ...args], options);
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.unref();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const {port} = s.address();
      s.close(() => resolve(port));
    });
  });
}

export async function startServer(args, {timeoutMs = 120000} = {}) {
  const port = await freePort();
  const child = spawnTied(serverBin, [...args, "--host", "127.0.0.1", "--port", String(port)], {stdio: ["ignore", "pipe", "pipe"]});
  let log = "";
  child.stdout.on("data", (d) => (log += d));
  child.stderr.on("data", (d) => (log += d));
  const exited = new Promise((r) => child.once("exit", r));
  const url = `http://127.0.0.1:${port}`;
  const stop = async () => {
    if (child.exitCode !== null || child.signalCode !== null) return;
    process.kill(child.pid, "SIGTERM");
    const done = await Promise.race([exited.then(() => true), sleep(5000).then(() => false)]);
    if (!done) process.kill(child.pid, "SIGKILL");
    await exited;
  };
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`llama-server exited with ${child.exitCode}:\n${log.slice(-3000)}`);
    try {
      const r = await fetch(`${url}/health`);
      if (r.ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      await stop();
      throw new Error(`llama-server did not become healthy in ${timeoutMs} ms:\n${log.slice(-3000)}`);
    }
    await sleep(200);
  }
  return {url, pid: child.pid, stop, log: () => log};
}

// POST a JSON body; the parsed reply, or an Error with the status and the reply's text.
export async function post(url, route, body) {
  const r = await fetch(url + route, {method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(body)});
  const text = await r.text();
  if (!r.ok) throw new Error(`POST ${route}: ${r.status} ${text.slice(0, 500)}`);
  return JSON.parse(text);
}
