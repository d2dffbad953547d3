// Benchmark driver: the official E2B JS SDK, long-lived, timed from inside.
//
// Started once by `cargo run --release -p tether-tests --bin bench` (node e2b_driver.mjs), so
// Node's start-up and module loading are not measured. Same line protocol as e2b_driver.py:
// one JSON command per line on stdin, one JSON answer per line on stdout, {"s": seconds}
// (performance.now() around the SDK call alone) or {"error": "..."}. The SDK is the pinned one
// installed under tests/e2b_sdk/js by tests/e2b_sdk/setup.sh.

import { createRequire } from 'node:module';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath, pathToFileURL } from 'node:url';

delete process.env.E2B_DEBUG;

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '..', 'e2b_sdk', 'js', 'package.json'));
const { Sandbox } = await import(pathToFileURL(require.resolve('e2b')).href);

const payloads = new Map();
function payload(size) {
  if (!payloads.has(size)) {
    const block = new Uint8Array(4096);
    for (let i = 0; i < 4096; i++) block[i] = Number((BigInt(i) * 2654435761n) >> 24n) & 0xff;
    const buf = new Uint8Array(size);
    for (let o = 0; o < size; o += 4096) buf.set(block.subarray(0, Math.min(4096, size - o)), o);
    payloads.set(size, buf);
  }
  return payloads.get(size);
}

const secs = (t) => (performance.now() - t) / 1000;
let sb = null;

async function handle(cmd) {
  switch (cmd.op) {
    case 'open': {
      const t = performance.now();
      sb = await Sandbox.create({ timeoutMs: 3_600_000 });
      return { s: secs(t) };
    }
    case 'exec': {
      const t = performance.now();
      const r = await sb.commands.run(cmd.cmd);
      return { s: secs(t), bytes: r.stdout.length, exit: r.exitCode };
    }
    case 'write': {
      const data = payload(cmd.size);
      const t = performance.now();
      await sb.files.write(cmd.path, data.buffer);
      return { s: secs(t) };
    }
    case 'read': {
      const t = performance.now();
      const back = await sb.files.read(cmd.path, { format: 'bytes' });
      const s = secs(t);
      if (back.length !== cmd.size) throw new Error(`read ${back.length} bytes, ${cmd.size} expected`);
      return { s };
    }
    case 'create_first': {
      const t = performance.now();
      const tmp = await Sandbox.create({ timeoutMs: 600_000 });
      await tmp.commands.run('true');
      const s = secs(t);
      await tmp.kill();
      return { s };
    }
    case 'close':
      if (sb) await sb.kill();
      return { s: 0 };
    default:
      return { error: `unknown op ${cmd.op}` };
  }
}

console.log(JSON.stringify({ ready: true }));
const rl = readline.createInterface({ input: process.stdin });
for await (const line of rl) {
  const cmd = JSON.parse(line);
  let res;
  try {
    res = await handle(cmd);
  } catch (e) {
    res = { error: `${e?.name}: ${e?.message}` };
  }
  console.log(JSON.stringify(res));
  if (cmd.op === 'close') break;
}
process.exit(0);
