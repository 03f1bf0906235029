// What the prompt-cache test scripts share: checks that count their failures (the script exits 1
// after printing them all), and stories260K converted to GGUF in the scratch folder.
import path from "node:path";
import {execFileSync} from "node:child_process";
import {cli, models, scratch} from "./env.mjs";

export function checks() {
  let failures = 0;
  return {
    check(ok, what) {
      if (!ok) {
        failures++;
        console.error(`FAIL: ${what}`);
      }
    },
    // Exits 1 when a check failed, else prints `done`.
    finish(done) {
      if (failures) {
        console.error(`${failures} check(s) failed`);
        process.exit(1);
      }
      console.log(done);
    },
  };
}

// stories260K as a GGUF (`veloxquant convert`), in the scratch folder.
export function storiesGguf() {
  const gguf = path.join(scratch, "stories260K.gguf");
  execFileSync(cli, ["convert", path.join(models, "stories260K.bin"), "--tokenizer", path.join(models, "tok512.bin"), "-o", gguf]);
  return gguf;
}
