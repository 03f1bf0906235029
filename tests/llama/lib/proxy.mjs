// `veloxquant prompt-cache` for a test: started with --listen 127.0.0.1:0 (the port is read from its
// first line), its log kept, stopped by its pid (SIGTERM), and tied to the test process.
import {cli} from "./env.mjs";
import {spawnTied} from "./server.mjs";

export async function startProxy(args) {
  const child = spawnTied(cli, ["prompt-cache", ...args, "--listen", "127.0.0.1:0"], {stdio: ["ignore", "pipe", "pipe"]});
  let out = "", log = "";
  child.stderr.on("data", (d) => (log += d));
  const exited = new Promise((r) => child.once("exit", r));
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`prompt-cache did not start:\n${log}`)), 60000);
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    child.once("exit", (code) => reject(new Error(`prompt-cache exited with ${code}:\n${log}`)));
  });
  const alive = () => child.exitCode === null && child.signalCode === null;
  const lines = () => log.split("\n").filter((l) => l.includes("prompt tokens")).length;
  // Runs `send` (a request through the proxy) and waits for the proxy's line about it: the proxy
  // stores the slot after the reply went out, then says what it did.
  async function logged(send) {
    const before = lines();
    const reply = await send();
    for (let i = 0; i < 3000 && lines() <= before && alive(); i++) await new Promise((r) => setTimeout(r, 20));
    return reply;
  }
  return {url, log: () => log, alive, logged, async stop() {
    if (alive()) process.kill(child.pid, "SIGTERM");
    await exited;
  }};
}

// The proxy's last per-request line.
export const lastLine = (log) => log.trim().split("\n").filter((l) => l.includes("prompt tokens")).pop() || "";
