// The official E2B JS SDK, unmodified, against tetherd's E2B front.
//
// Each top-level test is named after the SDK call it judges and asserts what the SDK documents for
// it, so a program written for E2B runs unchanged on tetherd. The server is found through the
// environment (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY); TETHER_E2B_OTHER_KEY is a valid key of
// another tenant and TETHER_E2B_BAD_KEY an invalid one.
//
// Every test body has its own deadline (the harness stops waiting and fails the test), every
// sandbox a test creates is killed afterwards, and a missing server fails every test at once after
// a single connection probe. Run with `npm test` or tests/e2b_sdk/run.sh js; summary-reporter.mjs
// prints the closing table and the `e2b-js: N passed, M failed` line.

import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';

// The suite always exercises the real control plane, whatever the caller's shell has set. Unset,
// not 'false': E2B's own suites take their debug branches when the variable is set at all.
delete process.env.E2B_DEBUG;

const {
  AuthenticationError,
  CommandExitError,
  FileNotFoundError,
  FileType,
  FilesystemEventType,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  TimeoutError,
} = await import('e2b');

const HOME = '/home/user';
const REQUEST_TIMEOUT_MS = 20_000;
const DEFAULT_BOUND_MS = 60_000;
const FIXTURE_BOUND_MS = 45_000;
const RUN_ID = 'js' + randomBytes(6).toString('hex');

// === configuration ===

const REQUIRED_ENV = [
  'E2B_API_URL',
  'E2B_SANDBOX_URL',
  'E2B_API_KEY',
  'TETHER_E2B_OTHER_KEY',
  'TETHER_E2B_BAD_KEY',
];
const missingEnv = REQUIRED_ENV.filter((name) => !process.env[name]);
const ENV = missingEnv.length
  ? null
  : {
      apiUrl: process.env.E2B_API_URL,
      sandboxUrl: process.env.E2B_SANDBOX_URL,
      apiKey: process.env.E2B_API_KEY,
      otherKey: process.env.TETHER_E2B_OTHER_KEY,
      badKey: process.env.TETHER_E2B_BAD_KEY,
    };

// === impl reachability probe ===

const probes = new Map();

function probe(url) {
  if (!probes.has(url)) {
    probes.set(
      url,
      new Promise((resolve) => {
        const u = new URL(url);
        const port = Number(u.port || (u.protocol === 'https:' ? 443 : 80));
        const socket = net.connect({ host: u.hostname, port });
        const done = (err) => {
          socket.destroy();
          resolve(err);
        };
        socket.setTimeout(3000, () => done(`timed out connecting to ${u.host}`));
        socket.once('connect', () => done(null));
        socket.once('error', (e) => done(`${e.code ?? e.name}: ${e.message}`));
      }),
    );
  }
  return probes.get(url);
}

async function requireServer() {
  if (!ENV) throw new Error(`environment not set: ${missingEnv.join(', ')}`);
  for (const url of new Set([ENV.apiUrl, ENV.sandboxUrl])) {
    const err = await probe(url);
    if (err) throw new Error(`E2B front unreachable at ${url}: ${err}`);
  }
  return ENV;
}

// === impl bounded execution and sandbox bookkeeping ===

class BoundExceeded extends Error {
  constructor(what, ms) {
    super(`${what} did not finish within ${ms / 1000} s (server hang?)`);
    this.name = 'BoundExceeded';
  }
}

function bounded(promise, ms, what) {
  let timer;
  const limit = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new BoundExceeded(what, ms)), ms);
  });
  return Promise.race([promise, limit]).finally(() => clearTimeout(timer));
}

const allCreated = new Map(); // sandboxId -> apiKey, swept once more at the end

async function killQuietly(sandboxId, apiKey) {
  try {
    await bounded(
      Sandbox.kill(sandboxId, { apiKey, requestTimeoutMs: REQUEST_TIMEOUT_MS }),
      FIXTURE_BOUND_MS,
      `Sandbox.kill(${sandboxId})`,
    );
    return null;
  } catch (e) {
    return e;
  }
}

class Ctx {
  constructor(env) {
    this.env = env;
    this.created = new Map();
    this.figures = [];
  }

  /** Creates a sandbox (tagged with this run's id) and remembers it for teardown. */
  async create(opts = {}) {
    const apiKey = opts.apiKey ?? this.env.apiKey;
    const metadata = { suite: 'tether-e2b-js', run: RUN_ID, ...(opts.metadata ?? {}) };
    const sbx = await bounded(
      Sandbox.create({ requestTimeoutMs: REQUEST_TIMEOUT_MS, ...opts, apiKey, metadata }),
      FIXTURE_BOUND_MS,
      'Sandbox.create',
    );
    this.created.set(sbx.sandboxId, apiKey);
    allCreated.set(sbx.sandboxId, apiKey);
    return sbx;
  }

  /** Drops a sandbox the test killed itself (and asserted on) from teardown. */
  forget(sandboxId) {
    this.created.delete(sandboxId);
  }

  /** Reports a measured figure; the summary reporter prints it under the table. */
  figure(t, text) {
    t.diagnostic(`figure: ${text}`);
  }

  async cleanup() {
    const errors = [];
    for (const [id, key] of this.created) {
      const err = await killQuietly(id, key);
      if (err) errors.push(`${id}: ${err.name}: ${err.message}`);
      else allCreated.delete(id);
    }
    if (errors.length) throw new Error(`teardown could not kill: ${errors.join('; ')}`);
  }
}

/** One top-level test named after an SDK call, with its own bound and sandbox teardown. */
function sdkTest(name, fn, { timeoutMs = DEFAULT_BOUND_MS } = {}) {
  test(name, { timeout: timeoutMs + 2 * FIXTURE_BOUND_MS }, async (t) => {
    const env = await requireServer();
    const ctx = new Ctx(env);
    let failure = null;
    try {
      await bounded(fn(ctx, t), timeoutMs, name);
    } catch (e) {
      failure = e;
    }
    try {
      await ctx.cleanup();
    } catch (e) {
      failure ??= e;
    }
    if (failure) throw failure;
  });
}

after(async () => {
  for (const [id, key] of allCreated) await killQuietly(id, key);
  // A request abandoned by a bound may still hold a socket open; once every test has reported,
  // nothing else is worth waiting for. Unref'd, so a clean run exits on its own first.
  setTimeout(() => process.exit(), 5000).unref();
});

// === utilities ===

const unique = (prefix) => `${prefix}-${randomBytes(4).toString('hex')}`;
const bogusSandboxId = () => 'i' + randomBytes(10).toString('hex');
const sha256 = (data) => createHash('sha256').update(data).digest('hex');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function waitUntil(predicate, ms, stepMs = 200) {
  const deadline = Date.now() + ms;
  for (;;) {
    if (await predicate()) return true;
    if (Date.now() >= deadline) return false;
    await sleep(stepMs);
  }
}

async function listIds(metadata, apiKey) {
  const opts = { query: { metadata }, requestTimeoutMs: REQUEST_TIMEOUT_MS };
  if (apiKey) opts.apiKey = apiKey;
  const paginator = Sandbox.list(opts);
  const ids = new Set();
  let pages = 0;
  while (paginator.hasNext) {
    pages += 1;
    assert.ok(pages <= 50, 'Sandbox.list paginator never ends');
    for (const s of await paginator.nextItems()) ids.add(s.sandboxId);
  }
  return ids;
}

async function runningPidsWith(sbx, marker) {
  const procs = await sbx.commands.list();
  return procs.filter((p) => p.args.some((a) => a.includes(marker))).map((p) => p.pid);
}

async function rejectsWith(promise, cls, what) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof cls, `${what}: expected ${cls.name}, got ${e?.name}: ${e?.message}`);
    return e;
  }
  assert.fail(`${what}: expected ${cls.name}, but it succeeded`);
}

async function readStream(stream) {
  const hash = createHash('sha256');
  let size = 0;
  const reader = stream.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    hash.update(value);
    size += value.length;
  }
  return { size, digest: hash.digest('hex') };
}

function streamOf(buffer, chunk = 65536) {
  let offset = 0;
  return new ReadableStream({
    pull(controller) {
      if (offset >= buffer.length) {
        controller.close();
        return;
      }
      controller.enqueue(new Uint8Array(buffer.subarray(offset, offset + chunk)));
      offset += chunk;
    },
  });
}

// === control plane ===

sdkTest('Sandbox.create (metadata, envs, timeoutMs)', async (ctx) => {
  const sbx = await ctx.create({
    metadata: { purpose: 'create', owner: 'suite' },
    envs: { TETHER_SUITE_A: 'alpha beta', TETHER_SUITE_B: 'b' },
    timeoutMs: 120_000,
  });
  // Ids must be DNS-label safe without dashes: the `49983-<id>.<domain>` routing depends on it.
  assert.match(sbx.sandboxId, /^[a-z0-9]+$/);

  const info = await sbx.getInfo();
  assert.equal(info.sandboxId, sbx.sandboxId);
  assert.equal(info.metadata.purpose, 'create');
  assert.equal(info.metadata.owner, 'suite');
  assert.equal(info.metadata.run, RUN_ID);
  const lifetime = (info.endAt - info.startedAt) / 1000;
  assert.ok(lifetime >= 100 && lifetime <= 140, `timeoutMs=120000 gave a lifetime of ${lifetime} s`);

  const r = await sbx.commands.run('printf "%s|%s" "$TETHER_SUITE_A" "$TETHER_SUITE_B"');
  assert.equal(r.stdout, 'alpha beta|b');
});

sdkTest('Sandbox.list (metadata filter)', async (ctx) => {
  const group = unique('grp');
  const a = await ctx.create({ metadata: { group, role: 'a', odd: 'x y&z=1/é' } });
  const b = await ctx.create({ metadata: { group, role: 'b' } });

  assert.deepEqual(await listIds({ run: RUN_ID, group }), new Set([a.sandboxId, b.sandboxId]));
  assert.deepEqual(await listIds({ group, role: 'a' }), new Set([a.sandboxId]));
  assert.deepEqual(await listIds({ group, role: 'b' }), new Set([b.sandboxId]));
  assert.deepEqual(await listIds({ group, odd: 'x y&z=1/é' }), new Set([a.sandboxId]));
  assert.deepEqual(await listIds({ group, role: 'nobody' }), new Set());

  const items = await Sandbox.list({ query: { metadata: { group, role: 'a' } } }).nextItems();
  assert.deepEqual(
    items.map((s) => s.sandboxId),
    [a.sandboxId],
  );
  assert.equal(items[0].state, 'running');
  assert.equal(items[0].metadata.role, 'a');
  assert.ok(items[0].endAt > new Date());
});

sdkTest('Sandbox.getInfo', async (ctx) => {
  const sbx = await ctx.create({ metadata: { k: 'v' }, timeoutMs: 300_000 });
  for (const info of [await sbx.getInfo(), await Sandbox.getInfo(sbx.sandboxId)]) {
    assert.equal(info.sandboxId, sbx.sandboxId);
    assert.ok(info.templateId);
    assert.equal(info.metadata.k, 'v');
    assert.equal(info.state, 'running');
    assert.ok(info.startedAt instanceof Date && info.startedAt <= new Date(Date.now() + 5000));
    assert.ok(info.endAt > new Date());
    assert.ok(info.envdVersion);
    assert.ok(info.cpuCount >= 1);
    assert.ok(info.memoryMB >= 1);
  }
});

sdkTest('Sandbox.setTimeout', async (ctx) => {
  const sbx = await ctx.create({ timeoutMs: 300_000 });
  const remaining = async () => ((await sbx.getInfo()).endAt - Date.now()) / 1000;

  await sbx.setTimeout(30_000);
  let left = await remaining();
  assert.ok(Math.abs(left - 30) <= 10, `setTimeout(30000) left ${left} s`);

  await Sandbox.setTimeout(sbx.sandboxId, 600_000);
  left = await remaining();
  assert.ok(Math.abs(left - 600) <= 10, `setTimeout(600000) left ${left} s`);

  // A short timeout really ends the sandbox; watched through the list, which does not touch it.
  await sbx.setTimeout(2_000);
  const gone = await waitUntil(async () => !(await listIds({ run: RUN_ID })).has(sbx.sandboxId), 30_000, 500);
  assert.ok(gone, 'sandbox still listed 30 s after setTimeout(2000)');
  await rejectsWith(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError, 'getInfo after expiry');
});

sdkTest('Sandbox.kill', async (ctx) => {
  const sbx = await ctx.create();
  assert.equal(await sbx.isRunning(), true);
  assert.equal(await sbx.kill(), true);
  ctx.forget(sbx.sandboxId);

  await rejectsWith(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError, 'getInfo after kill');
  assert.ok(!(await listIds({ run: RUN_ID })).has(sbx.sandboxId), 'killed sandbox still listed');
  // Killing again is not an error: the SDK documents `false` for a sandbox that is gone.
  assert.equal(await Sandbox.kill(sbx.sandboxId), false);
  assert.equal(await sbx.isRunning(), false);
});

sdkTest('Sandbox.connect (by id)', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/from-first.txt`, 'first');

  const same = await Sandbox.connect(sbx.sandboxId, { requestTimeoutMs: REQUEST_TIMEOUT_MS });
  assert.equal(same.sandboxId, sbx.sandboxId);
  assert.equal(await same.files.read(`${HOME}/from-first.txt`), 'first');
  await same.files.write(`${HOME}/from-second.txt`, 'second');
  assert.equal(await sbx.files.read(`${HOME}/from-second.txt`), 'second');
  assert.equal((await same.commands.run('echo connected')).stdout, 'connected\n');
});

// === commands ===

sdkTest('commands.run (exit 0)', async (ctx) => {
  const sbx = await ctx.create();
  const r = await sbx.commands.run('echo hello');
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, 'hello\n');
  assert.equal(r.stderr, '');
});

sdkTest('commands.run (non-zero -> CommandExitError)', async (ctx) => {
  const sbx = await ctx.create();
  const e = await rejectsWith(sbx.commands.run('echo out; echo err >&2; exit 3'), CommandExitError, 'exit 3');
  assert.equal(e.exitCode, 3);
  assert.equal(e.stdout, 'out\n');
  assert.equal(e.stderr, 'err\n');
  assert.equal((await sbx.commands.run('true')).exitCode, 0);
});

sdkTest('commands.run (onStdout / onStderr)', async (ctx) => {
  const sbx = await ctx.create();
  const out = [];
  const err = [];
  const r = await sbx.commands.run('for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  });
  assert.equal(out.join(''), 'out1\nout2\nout3\n');
  assert.equal(err.join(''), 'err1\nerr2\nerr3\n');
  assert.equal(r.stdout, out.join(''));
  assert.equal(r.stderr, err.join(''));
});

sdkTest('commands.run (envs)', async (ctx) => {
  const sbx = await ctx.create({ envs: { TETHER_LAYER: 'sandbox', TETHER_KEEP: 'kept' } });
  let r = await sbx.commands.run('printf "%s %s %s" "$TETHER_LAYER" "$TETHER_KEEP" "$TETHER_CMD"', {
    envs: { TETHER_LAYER: 'command', TETHER_CMD: 'with space' },
  });
  assert.equal(r.stdout, 'command kept with space');
  r = await sbx.commands.run('printf "%s" "${TETHER_CMD-unset}"');
  assert.equal(r.stdout, 'unset');
});

sdkTest('commands.run (cwd)', async (ctx) => {
  const sbx = await ctx.create();
  assert.equal((await sbx.commands.run('pwd')).stdout, `${HOME}\n`);
  const target = `${HOME}/cwd-test/sub`;
  assert.equal(await sbx.files.makeDir(target), true);
  assert.equal((await sbx.commands.run('pwd', { cwd: target })).stdout, `${target}\n`);
  await rejectsWith(
    sbx.commands.run('pwd', { cwd: `${HOME}/does-not-exist` }),
    InvalidArgumentError,
    'missing cwd',
  );
});

sdkTest("commands.run (user 'user' / 'root')", async (ctx) => {
  const sbx = await ctx.create();
  for (const user of ['user', 'root']) {
    const r = await sbx.commands.run(`echo as-${user}`, { user });
    assert.equal(r.exitCode, 0);
    assert.equal(r.stdout, `as-${user}\n`);
  }
  await sbx.files.write(`${HOME}/by-user.txt`, 'u', { user: 'user' });
  assert.equal(await sbx.files.read(`${HOME}/by-user.txt`, { user: 'user' }), 'u');
});

sdkTest('commands.run (timeoutMs expiry -> TimeoutError)', async (ctx) => {
  const sbx = await ctx.create();
  const marker = unique('tmo');
  const started = Date.now();
  await rejectsWith(
    sbx.commands.run(`sleep 30; : ${marker}`, { timeoutMs: 1000 }),
    TimeoutError,
    'sleep 30 with timeoutMs 1000',
  );
  const elapsed = (Date.now() - started) / 1000;
  assert.ok(elapsed < 10, `timeoutMs=1000 took ${elapsed} s`);
  // E2B semantics: the command's timeout is the process's own deadline, so it is gone too.
  assert.ok(
    await waitUntil(async () => (await runningPidsWith(sbx, marker)).length === 0, 10_000),
    'process survived its timeout',
  );
  assert.equal((await sbx.commands.run('echo alive')).stdout, 'alive\n');
});

sdkTest('commands.run (background) + wait', async (ctx) => {
  const sbx = await ctx.create();
  const started = Date.now();
  const handle = await sbx.commands.run('sleep 4; echo done; echo e >&2', {
    background: true,
    timeoutMs: 20_000,
  });
  assert.ok(Date.now() - started < 3000, 'background: true waited for the command');
  assert.ok(handle.pid > 0, `pid ${handle.pid}`);
  const result = await handle.wait();
  assert.equal(result.exitCode, 0);
  assert.equal(result.stdout, 'done\n');
  assert.equal(result.stderr, 'e\n');
});

sdkTest('commands.run (background) + kill', async (ctx) => {
  const sbx = await ctx.create();
  const marker = unique('bgk');
  const handle = await sbx.commands.run(`sleep 30; : ${marker}`, { background: true, timeoutMs: 20_000 });
  assert.ok(
    await waitUntil(async () => (await runningPidsWith(sbx, marker)).includes(handle.pid), 5000),
    'background command not listed',
  );
  const started = Date.now();
  assert.equal(await handle.kill(), true);
  const e = await rejectsWith(handle.wait(), CommandExitError, 'wait after kill');
  assert.notEqual(e.exitCode, 0);
  assert.ok(Date.now() - started < 10_000, 'wait after kill took over 10 s');
  assert.ok(
    await waitUntil(async () => (await runningPidsWith(sbx, marker)).length === 0, 5000),
    'killed command still listed after 5 s',
  );
  assert.equal(await sbx.commands.kill(handle.pid), false);
});

sdkTest('commands.connect (by pid)', async (ctx) => {
  const sbx = await ctx.create();
  const handle = await sbx.commands.run('sleep 2; echo after-connect; exit 4', {
    background: true,
    timeoutMs: 20_000,
  });
  await handle.disconnect();
  const again = await sbx.commands.connect(handle.pid, { timeoutMs: 20_000 });
  assert.equal(again.pid, handle.pid);
  const e = await rejectsWith(again.wait(), CommandExitError, 'connected wait');
  assert.equal(e.exitCode, 4);
  assert.ok(e.stdout.includes('after-connect\n'), `stdout was ${JSON.stringify(e.stdout)}`);
});

sdkTest('commands.sendStdin (stdin: true)', async (ctx) => {
  const sbx = await ctx.create();
  const handle = await sbx.commands.run('read -r a; read -r b; echo "got:$a+$b"', {
    background: true,
    stdin: true,
    timeoutMs: 20_000,
  });
  await sbx.commands.sendStdin(handle.pid, 'first\n');
  await handle.sendStdin(new TextEncoder().encode('second\n'));
  const result = await handle.wait();
  assert.equal(result.stdout, 'got:first+second\n');
});

sdkTest('commands.list', async (ctx) => {
  const sbx = await ctx.create();
  const marker = unique('lst');
  const handle = await sbx.commands.run(`sleep 30; : ${marker}`, { background: true, timeoutMs: 20_000 });
  try {
    assert.ok(
      await waitUntil(async () => (await runningPidsWith(sbx, marker)).join() === String(handle.pid), 5000),
      'background command not listed (exactly once)',
    );
    const info = (await sbx.commands.list()).find((p) => p.pid === handle.pid);
    assert.equal(info.cmd, '/bin/bash');
    assert.equal(info.args.at(-1), `sleep 30; : ${marker}`);
  } finally {
    await handle.kill();
  }
  assert.ok(
    await waitUntil(async () => (await runningPidsWith(sbx, marker)).length === 0, 5000),
    'killed command still listed after 5 s',
  );
});

// === files ===

sdkTest('files.write (string)', async (ctx) => {
  const sbx = await ctx.create();
  const p = `${HOME}/str.txt`;
  const info = await sbx.files.write(p, 'hello ünïcode\nline 2\n');
  assert.equal(info.path, p);
  assert.equal(info.name, 'str.txt');
  assert.equal(info.type, FileType.FILE);
  assert.equal(await sbx.files.read(p), 'hello ünïcode\nline 2\n');
  await sbx.files.write(p, 'short');
  assert.equal(await sbx.files.read(p), 'short');
  const rel = await sbx.files.write('rel/dir/relative.txt', 'rel');
  assert.equal(rel.path, `${HOME}/rel/dir/relative.txt`);
  assert.equal(await sbx.files.read(`${HOME}/rel/dir/relative.txt`), 'rel');
});

sdkTest('files.write (ArrayBuffer / Blob)', async (ctx) => {
  const sbx = await ctx.create();
  const data = Buffer.concat([randomBytes(200_000), Buffer.from([0, 255, 0])]);
  const ab = data.buffer.slice(data.byteOffset, data.byteOffset + data.length);
  const info = await sbx.files.write(`${HOME}/ab.bin`, ab);
  assert.equal(info.path, `${HOME}/ab.bin`);
  assert.deepEqual(Buffer.from(await sbx.files.read(`${HOME}/ab.bin`, { format: 'bytes' })), data);
  await sbx.files.write(`${HOME}/blob.bin`, new Blob([data]));
  assert.deepEqual(Buffer.from(await sbx.files.read(`${HOME}/blob.bin`, { format: 'bytes' })), data);
});

sdkTest('files.write (ReadableStream)', async (ctx) => {
  const sbx = await ctx.create();
  const data = randomBytes(3 * 1024 * 1024 + 17);
  // A stream goes out as a streamed octet-stream body by default.
  await sbx.files.write(`${HOME}/s1.bin`, streamOf(data));
  assert.equal(sha256(await sbx.files.read(`${HOME}/s1.bin`, { format: 'bytes' })), sha256(data));
  // And through multipart/form-data when asked.
  await sbx.files.write(`${HOME}/s2.bin`, streamOf(data), { useOctetStream: false });
  assert.equal(sha256(await sbx.files.read(`${HOME}/s2.bin`, { format: 'bytes' })), sha256(data));
});

sdkTest('files.write (WriteEntry[])', async (ctx) => {
  const sbx = await ctx.create();
  const entries = [
    { path: `${HOME}/multi/a.txt`, data: 'A text' },
    { path: `${HOME}/multi/deep/er/b.bin`, data: new Uint8Array([0, 66, 255]).buffer },
    { path: `${HOME}/multi/c.txt`, data: new Blob(['C']) },
  ];
  const infos = await sbx.files.write(entries);
  assert.deepEqual(infos.map((i) => i.path).sort(), entries.map((e) => e.path).sort());
  assert.equal(await sbx.files.read(`${HOME}/multi/a.txt`), 'A text');
  assert.deepEqual(
    [...(await sbx.files.read(`${HOME}/multi/deep/er/b.bin`, { format: 'bytes' }))],
    [0, 66, 255],
  );
  assert.equal(await sbx.files.read(`${HOME}/multi/c.txt`), 'C');

  // With a stream entry the SDK switches to one streamed upload per file.
  const infos2 = await sbx.files.writeFiles([
    { path: `${HOME}/multi2/x.bin`, data: streamOf(Buffer.from('xx')) },
    { path: `${HOME}/multi2/y.txt`, data: 'yy' },
  ]);
  assert.deepEqual(infos2.map((i) => i.path).sort(), [`${HOME}/multi2/x.bin`, `${HOME}/multi2/y.txt`]);
  assert.equal(await sbx.files.read(`${HOME}/multi2/x.bin`), 'xx');
  assert.equal(await sbx.files.read(`${HOME}/multi2/y.txt`), 'yy');
});

sdkTest("files.read (format 'text')", async (ctx) => {
  const sbx = await ctx.create();
  const text = 'ascii, ünïcødé, 日本語, emoji 🙂\n'.repeat(100);
  await sbx.files.write(`${HOME}/t.txt`, text);
  const got = await sbx.files.read(`${HOME}/t.txt`);
  assert.equal(typeof got, 'string');
  assert.equal(got, text);
  await sbx.commands.run(`printf 'from-shell' > ${HOME}/shell.txt`);
  assert.equal(await sbx.files.read(`${HOME}/shell.txt`, { format: 'text' }), 'from-shell');
});

sdkTest("files.read (format 'bytes' / 'blob')", async (ctx) => {
  const sbx = await ctx.create();
  const data = Buffer.alloc(256 * 1000);
  for (let i = 0; i < data.length; i++) data[i] = i % 256;
  await sbx.files.write(`${HOME}/b.bin`, data.buffer.slice(data.byteOffset, data.byteOffset + data.length));
  const bytes = await sbx.files.read(`${HOME}/b.bin`, { format: 'bytes' });
  assert.ok(bytes instanceof Uint8Array);
  assert.deepEqual(Buffer.from(bytes), data);
  const blob = await sbx.files.read(`${HOME}/b.bin`, { format: 'blob' });
  assert.deepEqual(Buffer.from(await blob.arrayBuffer()), data);
  await sbx.files.write(`${HOME}/empty.bin`, '');
  assert.equal((await sbx.files.read(`${HOME}/empty.bin`, { format: 'bytes' })).length, 0);
});

sdkTest("files.read (format 'stream')", async (ctx) => {
  const sbx = await ctx.create();
  const data = randomBytes(5 * 1024 * 1024 + 3);
  await sbx.files.write(`${HOME}/st.bin`, streamOf(data));
  const { size, digest } = await readStream(await sbx.files.read(`${HOME}/st.bin`, { format: 'stream' }));
  assert.equal(size, data.length);
  assert.equal(digest, sha256(data));
});

sdkTest('files.list (depth)', async (ctx) => {
  const sbx = await ctx.create();
  const root = `${HOME}/tree`;
  await sbx.files.write(`${root}/a.txt`, '12345');
  await sbx.files.write(`${root}/d1/b.txt`, 'b');
  await sbx.files.write(`${root}/d1/d2/c.txt`, 'c');

  const one = await sbx.files.list(root);
  assert.deepEqual(new Set(one.map((e) => e.path)), new Set([`${root}/a.txt`, `${root}/d1`]));
  const byName = Object.fromEntries(one.map((e) => [e.name, e]));
  assert.equal(byName['a.txt'].type, FileType.FILE);
  assert.equal(byName['a.txt'].size, 5);
  assert.equal(byName.d1.type, FileType.DIR);

  const two = await sbx.files.list(root, { depth: 2 });
  assert.deepEqual(
    new Set(two.map((e) => e.path)),
    new Set([`${root}/a.txt`, `${root}/d1`, `${root}/d1/b.txt`, `${root}/d1/d2`]),
  );
  const three = await sbx.files.list(root, { depth: 3 });
  assert.ok(
    three.some((e) => e.path === `${root}/d1/d2/c.txt`),
    'depth 3 misses d1/d2/c.txt',
  );
  assert.equal(three.length, 5);
  await rejectsWith(sbx.files.list(`${HOME}/no-such-dir`), NotFoundError, 'list of a missing dir');
});

sdkTest('files.exists', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/ex/here.txt`, 'x');
  assert.equal(await sbx.files.exists(`${HOME}/ex/here.txt`), true);
  assert.equal(await sbx.files.exists(`${HOME}/ex`), true);
  assert.equal(await sbx.files.exists(`${HOME}/ex/missing.txt`), false);
  assert.equal(await sbx.files.exists(`${HOME}/nope/missing.txt`), false);
});

sdkTest('files.getInfo', async (ctx) => {
  const sbx = await ctx.create();
  const p = `${HOME}/info/file.txt`;
  await sbx.files.write(p, '0123456789');
  const info = await sbx.files.getInfo(p);
  assert.equal(info.name, 'file.txt');
  assert.equal(info.path, p);
  assert.equal(info.type, FileType.FILE);
  assert.equal(info.size, 10);
  assert.ok(info.modifiedTime instanceof Date);
  assert.ok(Math.abs(info.modifiedTime - Date.now()) < 300_000);
  const d = await sbx.files.getInfo(`${HOME}/info`);
  assert.equal(d.type, FileType.DIR);
  assert.equal(d.name, 'info');
  await rejectsWith(sbx.files.getInfo(`${HOME}/info/missing`), NotFoundError, 'getInfo of a missing file');
});

sdkTest('files.makeDir', async (ctx) => {
  const sbx = await ctx.create();
  assert.equal(await sbx.files.makeDir(`${HOME}/mk`), true);
  assert.equal(await sbx.files.makeDir(`${HOME}/mk`), false);
  assert.equal(await sbx.files.makeDir(`${HOME}/mk/a/b/c`), true);
  assert.equal((await sbx.files.getInfo(`${HOME}/mk/a/b`)).type, FileType.DIR);
  assert.equal((await sbx.commands.run(`test -d ${HOME}/mk/a/b/c && echo dir`)).stdout, 'dir\n');
});

sdkTest('files.rename', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/old.txt`, 'content');
  const info = await sbx.files.rename(`${HOME}/old.txt`, `${HOME}/new.txt`);
  assert.equal(info.path, `${HOME}/new.txt`);
  assert.equal(info.name, 'new.txt');
  assert.equal(await sbx.files.exists(`${HOME}/old.txt`), false);
  assert.equal(await sbx.files.read(`${HOME}/new.txt`), 'content');
  await sbx.files.write(`${HOME}/dold/inner.txt`, 'in');
  await sbx.files.rename(`${HOME}/dold`, `${HOME}/dnew`);
  assert.equal(await sbx.files.read(`${HOME}/dnew/inner.txt`), 'in');
  assert.equal(await sbx.files.exists(`${HOME}/dold`), false);
  await rejectsWith(
    sbx.files.rename(`${HOME}/never.txt`, `${HOME}/x.txt`),
    NotFoundError,
    'rename of a missing file',
  );
});

sdkTest('files.remove', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/rm.txt`, 'x');
  await sbx.files.remove(`${HOME}/rm.txt`);
  assert.equal(await sbx.files.exists(`${HOME}/rm.txt`), false);
  await sbx.files.write(`${HOME}/rmdir/a/b.txt`, 'x');
  await sbx.files.remove(`${HOME}/rmdir`);
  assert.equal(await sbx.files.exists(`${HOME}/rmdir`), false);
  assert.equal((await sbx.commands.run(`test -e ${HOME}/rmdir || echo gone`)).stdout, 'gone\n');
});

sdkTest('files.watchDir', async (ctx) => {
  const sbx = await ctx.create();
  const watched = `${HOME}/watched`;
  await sbx.files.makeDir(watched);
  const seen = [];
  let exitErr;
  const handle = await sbx.files.watchDir(watched, (e) => seen.push(e), {
    timeoutMs: 0,
    onExit: (err) => {
      exitErr = err;
    },
  });
  try {
    await sbx.files.write(`${watched}/new-file.txt`, 'hello');
    const created = await waitUntil(
      () => seen.some((e) => e.name === 'new-file.txt' && e.type === FilesystemEventType.CREATE),
      10_000,
    );
    assert.ok(created, `no CREATE event for new-file.txt; got ${JSON.stringify(seen)}`);
    await sbx.commands.run(`echo x > ${watched}/by-shell.txt`);
    const kinds = [FilesystemEventType.CREATE, FilesystemEventType.WRITE];
    const byShell = await waitUntil(
      () => seen.some((e) => e.name === 'by-shell.txt' && kinds.includes(e.type)),
      10_000,
    );
    assert.ok(byShell, `no event for by-shell.txt; got ${JSON.stringify(seen)}`);
  } finally {
    await handle.stop();
  }
  assert.equal(exitErr, undefined, `watch ended with ${exitErr}`);
});

sdkTest(
  'files 64 MiB round trip (sha256)',
  async (ctx, t) => {
    const sbx = await ctx.create();
    const size = 64 * 1024 * 1024;
    const data = randomBytes(size);
    const digest = sha256(data);
    const p = `${HOME}/big.bin`;

    let t0 = Date.now();
    await sbx.files.write(p, streamOf(data, 1 << 20));
    const tWrite = (Date.now() - t0) / 1000;
    assert.equal((await sbx.files.getInfo(p)).size, size);

    const r = await sbx.commands.run(`sha256sum ${p}`, { timeoutMs: 120_000 });
    assert.equal(r.stdout.split(/\s+/)[0], digest);

    t0 = Date.now();
    const streamed = await readStream(await sbx.files.read(p, { format: 'stream' }));
    const tRead = (Date.now() - t0) / 1000;
    assert.equal(streamed.size, size);
    assert.equal(streamed.digest, digest);

    t0 = Date.now();
    const whole = await sbx.files.read(p, { format: 'bytes', requestTimeoutMs: 120_000 });
    const tBytes = (Date.now() - t0) / 1000;
    assert.equal(whole.length, size);
    assert.equal(sha256(whole), digest);
    const rate = (secs) => `${(size / 2 ** 20 / secs).toFixed(0)} MiB/s (${secs.toFixed(2)} s)`;
    ctx.figure(t, `64 MiB: write ${rate(tWrite)}, streamed read ${rate(tRead)}, bytes read ${rate(tBytes)}`);
  },
  { timeoutMs: 300_000 },
);

// === errors, auth and isolation ===

sdkTest('files.read missing -> NotFoundError', async (ctx) => {
  const sbx = await ctx.create();
  const e = await rejectsWith(
    sbx.files.read(`${HOME}/definitely-missing.txt`),
    NotFoundError,
    'read of a missing file',
  );
  assert.ok(e instanceof FileNotFoundError, `expected FileNotFoundError, got ${e.name}`);
  await rejectsWith(
    sbx.files.read(`${HOME}/missing-dir/x.bin`, { format: 'bytes' }),
    NotFoundError,
    'bytes read of a missing file',
  );
});

sdkTest('missing sandbox: connect/kill/getInfo/setTimeout', async () => {
  const bogus = bogusSandboxId();
  await rejectsWith(
    Sandbox.connect(bogus, { requestTimeoutMs: REQUEST_TIMEOUT_MS }),
    SandboxNotFoundError,
    'connect',
  );
  assert.equal(await Sandbox.kill(bogus), false);
  await rejectsWith(Sandbox.getInfo(bogus), SandboxNotFoundError, 'getInfo');
  await rejectsWith(Sandbox.setTimeout(bogus, 60_000), SandboxNotFoundError, 'setTimeout');
});

sdkTest('bad API key -> AuthenticationError', async (ctx) => {
  const sbx = await ctx.create();
  const apiKey = ctx.env.badKey;
  await rejectsWith(
    Sandbox.create({ apiKey, requestTimeoutMs: REQUEST_TIMEOUT_MS }),
    AuthenticationError,
    'create',
  );
  await rejectsWith(Sandbox.list({ apiKey }).nextItems(), AuthenticationError, 'list');
  // Authentication comes before any lookup: an existing id does not change the answer.
  await rejectsWith(Sandbox.getInfo(sbx.sandboxId, { apiKey }), AuthenticationError, 'getInfo');
  await rejectsWith(Sandbox.kill(sbx.sandboxId, { apiKey }), AuthenticationError, 'kill');
  await rejectsWith(Sandbox.connect(sbx.sandboxId, { apiKey }), AuthenticationError, 'connect');
  assert.equal((await sbx.commands.run('echo still-here')).stdout, 'still-here\n');
});

sdkTest("other tenant's sandbox -> not visible", async (ctx) => {
  const other = ctx.env.otherKey;
  const mine = await ctx.create({ metadata: { tenant: 'main' } });
  const theirs = await ctx.create({ apiKey: other, metadata: { tenant: 'other' } });

  await rejectsWith(Sandbox.getInfo(mine.sandboxId, { apiKey: other }), SandboxNotFoundError, 'getInfo');
  await rejectsWith(Sandbox.connect(mine.sandboxId, { apiKey: other }), SandboxNotFoundError, 'connect');
  await rejectsWith(
    Sandbox.setTimeout(mine.sandboxId, 5000, { apiKey: other }),
    SandboxNotFoundError,
    'setTimeout',
  );
  assert.equal(await Sandbox.kill(mine.sandboxId, { apiKey: other }), false);

  assert.deepEqual(await listIds({ run: RUN_ID }, other), new Set([theirs.sandboxId]));
  assert.ok(!(await listIds({ run: RUN_ID })).has(theirs.sandboxId), "the other tenant's sandbox is listed");
  await rejectsWith(Sandbox.getInfo(theirs.sandboxId), SandboxNotFoundError, 'getInfo of theirs');

  assert.equal((await mine.commands.run('echo mine')).stdout, 'mine\n');
  assert.ok(
    (await mine.getInfo()).endAt > new Date(Date.now() + 30_000),
    "the other tenant shortened the owner's sandbox",
  );
});

async function rawEnvd(env, sandboxId, method, urlPath, token, body) {
  const headers = { 'E2b-Sandbox-Id': sandboxId, 'E2b-Sandbox-Port': '49983' };
  if (token !== undefined) headers['X-Access-Token'] = token;
  if (method === 'POST') {
    headers['Content-Type'] = 'application/json';
    headers['Connect-Protocol-Version'] = '1';
  }
  const res = await fetch(env.sandboxUrl.replace(/\/$/, '') + urlPath, {
    method,
    headers,
    body,
    signal: AbortSignal.timeout(15_000),
  });
  await res.arrayBuffer();
  return res.status;
}

sdkTest('envd X-Access-Token enforced (raw HTTP)', async (ctx) => {
  const a = await ctx.create();
  const b = await ctx.create();
  const tokenA = a.envdAccessToken;
  const tokenB = b.envdAccessToken;
  assert.ok(tokenA, 'create must issue an envdAccessToken');
  assert.notEqual(tokenA, tokenB);
  await a.files.write(`${HOME}/secret.txt`, 'a-secret');
  const body = JSON.stringify({ path: HOME, depth: 1 });
  const rpc = '/filesystem.Filesystem/ListDir';
  const env = ctx.env;

  assert.equal(await rawEnvd(env, a.sandboxId, 'POST', rpc, tokenA, body), 200);
  assert.equal(await rawEnvd(env, a.sandboxId, 'POST', rpc, undefined, body), 401);
  assert.equal(await rawEnvd(env, a.sandboxId, 'POST', rpc, 'wrong-token', body), 401);
  assert.equal(await rawEnvd(env, a.sandboxId, 'POST', rpc, tokenB, body), 401);
  const files = `/files?path=${encodeURIComponent(`${HOME}/secret.txt`)}`;
  assert.equal(await rawEnvd(env, a.sandboxId, 'GET', files, tokenA), 200);
  assert.equal(await rawEnvd(env, a.sandboxId, 'GET', files, undefined), 401);
  assert.equal(await rawEnvd(env, a.sandboxId, 'GET', files, tokenB), 401);
});

sdkTest('path escape (/etc/shadow, ../../etc/passwd)', async (ctx) => {
  const sbx = await ctx.create();
  const readOrNull = async (p, format = 'text') => {
    try {
      return await sbx.files.read(p, { format });
    } catch (e) {
      if (e instanceof SandboxError || e instanceof AuthenticationError) return null;
      throw e;
    }
  };

  // 1. /etc/shadow is not readable in the sandbox view; never host content.
  let hostShadow = null;
  try {
    hostShadow = readFileSync('/etc/shadow');
  } catch {
    // not readable here: nothing to compare against
  }
  const got = await readOrNull('/etc/shadow', 'bytes');
  if (got && hostShadow) {
    const gotBuf = Buffer.from(got);
    assert.ok(!gotBuf.equals(hostShadow), "files.read('/etc/shadow') returned the host's /etc/shadow");
    for (const line of hostShadow.toString('latin1').split('\n')) {
      const hash = line.split(':')[1];
      if (hash && hash.length > 4)
        assert.ok(!gotBuf.includes(Buffer.from(hash, 'latin1')), 'a host password hash leaked');
    }
  }

  // 2. Relative traversal resolves inside the sandbox: the files API sees exactly what the
  //    sandbox's own processes see at that path, never more.
  for (const rel of ['../../etc/passwd', '../../../../../../../../etc/passwd']) {
    const viaFiles = await readOrNull(rel);
    let viaShell = null;
    try {
      viaShell = (await sbx.commands.run('cat /etc/passwd')).stdout;
    } catch (e) {
      if (!(e instanceof CommandExitError)) throw e;
    }
    if (viaFiles !== null)
      assert.equal(viaFiles, viaShell, `files.read(${rel}) differs from the sandbox's view`);
  }
});

sdkTest('sandbox isolation (host file out of reach)', async (ctx) => {
  const sbx = await ctx.create();
  // A file that exists only on the host, outside any sandbox, is out of reach of the files API by
  // any path, and of the sandbox's own processes.
  const dir = mkdtempSync(path.join(os.tmpdir(), 'tether-e2b-canary-'));
  const canary = path.join(dir, 'canary.txt');
  const secret = 'host-only-' + randomBytes(16).toString('hex');
  writeFileSync(canary, secret);
  try {
    for (const p of [canary, '../../../../../../../..' + canary]) {
      let content = null;
      try {
        content = await sbx.files.read(p);
      } catch (e) {
        if (!(e instanceof SandboxError || e instanceof AuthenticationError)) throw e;
      }
      if (content !== null) assert.ok(!content.includes(secret), `files.read(${p}) returned a host file`);
    }
    const r = await sbx.commands.run(`cat ${canary} 2>/dev/null || true`);
    assert.ok(!r.stdout.includes(secret), 'a sandboxed process read a host file');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

// === envd fidelity (what envd itself answers, where a guess would differ) ===

sdkTest('commands.run: E2B_SANDBOX / E2B_SANDBOX_ID / E2B_TEMPLATE_ID and /run/e2b', async (ctx) => {
  const sbx = await ctx.create();
  let r = await sbx.commands.run('echo "$E2B_SANDBOX $E2B_SANDBOX_ID $E2B_TEMPLATE_ID"');
  assert.equal(r.stdout, `true ${sbx.sandboxId} base\n`);
  r = await sbx.commands.run(
    'cat /run/e2b/.E2B_SANDBOX; echo; cat /run/e2b/.E2B_SANDBOX_ID; echo; cat /run/e2b/.E2B_TEMPLATE_ID',
  );
  assert.equal(r.stdout, `true\n${sbx.sandboxId}\nbase`);
  r = await sbx.commands.run('echo "$E2B_SANDBOX"', { envs: { E2B_SANDBOX: 'mine' } });
  assert.equal(r.stdout, 'mine\n');
});

sdkTest('commands.kill (the process is gone when kill answers)', async (ctx) => {
  const sbx = await ctx.create();
  // Busy processes beside it make a late reaper show.
  for (let i = 0; i < 2; i++) {
    await sbx.commands.run("exec timeout 60 sh -c 'while :; do :; done'", { background: true });
  }
  for (let i = 0; i < 10; i++) {
    const cmd = await sbx.commands.run('sleep 10', { background: true });
    assert.equal(await sbx.commands.kill(cmd.pid), true);
    await assert.rejects(sbx.commands.run(`kill -0 ${cmd.pid}`), CommandExitError);
  }
});

sdkTest("files.* with user 'root', and envd's rights for every user", async (ctx) => {
  const sbx = await ctx.create();
  // As root: /root, private to root; relative paths start there.
  const info = await sbx.files.write('/root/secret.txt', 's3cret', { user: 'root' });
  assert.equal(info.path, '/root/secret.txt');
  assert.equal(await sbx.files.read('/root/secret.txt', { user: 'root' }), 's3cret');
  assert.equal((await sbx.files.write('rel.txt', 'r', { user: 'root' })).path, '/root/rel.txt');
  let r = await sbx.commands.run('stat -c %U:%G:%a /root/secret.txt /root/rel.txt', {
    user: 'root',
  });
  assert.equal(r.stdout, 'root:root:644\nroot:root:644\n');
  // The user's own commands still cannot enter /root.
  await assert.rejects(sbx.commands.run('cat /root/secret.txt'), CommandExitError);
  // envd acts with root's rights for every user and gives what it creates to that user.
  await sbx.files.write('/etc/app.conf', 'conf');
  await sbx.files.write('/0/a/b.txt', 'deep');
  r = await sbx.commands.run('stat -c %U:%G /etc/app.conf /0 /0/a /0/a/b.txt');
  assert.equal(r.stdout, 'user:user\n'.repeat(4));
  assert.equal(await sbx.files.read('/0/a/b.txt'), 'deep');
  // The rest of the files API, as root.
  assert.equal(await sbx.files.makeDir('/root/d/e', { user: 'root' }), true);
  assert.equal(await sbx.files.exists('/root/d/e', { user: 'root' }), true);
  const names = (await sbx.files.list('/root', { user: 'root' })).map((e) => e.name);
  assert.ok(names.includes('d'), names.join(','));
  const moved = await sbx.files.rename('/root/secret.txt', '/root/d/moved.txt', { user: 'root' });
  assert.equal(moved.path, '/root/d/moved.txt');
  assert.equal((await sbx.files.getInfo('/root/d/moved.txt', { user: 'root' })).size, 6);
  await sbx.files.remove('/root/d', { user: 'root' });
  assert.equal(await sbx.files.exists('/root/d', { user: 'root' }), false);
  // A signed upload URL for root lands in root's home.
  const url = await sbx.uploadUrl('hello.txt', { user: 'root' });
  const form = new FormData();
  form.append('file', new Blob(['signed hello']), 'hello.txt');
  const resp = await fetch(url, { method: 'POST', body: form });
  assert.equal(resp.status, 200, await resp.text());
  assert.equal(await sbx.files.read('/root/hello.txt', { user: 'root' }), 'signed hello');
  assert.equal(await sbx.files.exists(`${HOME}/hello.txt`), false);
});

sdkTest('files.remove (missing path: success, as os.RemoveAll)', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.remove(`${HOME}/${unique('never-there')}`);
  await sbx.files.remove(unique('relative-never-there'));
  await sbx.files.remove(`${HOME}/${unique('no-dir')}/below/file.txt`);
});

sdkTest("files.getInfo / files.list (symlink: target's type and mode)", async (ctx) => {
  const sbx = await ctx.create();
  const d = `${HOME}/${unique('links')}`;
  await sbx.files.write(`${d}/target.txt`, 'pointed at');
  await sbx.files.makeDir(`${d}/sub`);
  await sbx.commands.run(
    `cd ${d} && chmod 600 target.txt && ln -s target.txt file-link` +
      ` && ln -s sub dir-link && ln -s file-link chain-link`,
  );
  const link = await sbx.files.getInfo(`${d}/file-link`);
  assert.equal(link.name, 'file-link');
  assert.equal(link.path, `${d}/file-link`);
  assert.equal(link.type, FileType.FILE);
  assert.equal(link.mode, 0o600);
  assert.equal(link.symlinkTarget, `${d}/target.txt`);
  const chain = await sbx.files.getInfo(`${d}/chain-link`);
  assert.deepEqual([chain.type, chain.symlinkTarget], [FileType.FILE, `${d}/target.txt`]);
  const dlink = await sbx.files.getInfo(`${d}/dir-link`);
  assert.equal(dlink.type, FileType.DIR);
  assert.equal(dlink.mode, 0o755);
  assert.equal(dlink.symlinkTarget, `${d}/sub`);
  const listed = Object.fromEntries((await sbx.files.list(d)).map((e) => [e.name, e]));
  assert.equal(listed['file-link'].type, FileType.FILE);
  assert.equal(listed['file-link'].symlinkTarget, `${d}/target.txt`);
  assert.equal(listed['dir-link'].type, FileType.DIR);
  assert.equal(listed['target.txt'].symlinkTarget, undefined);
});

sdkTest("downloadUrl (expired signature -> envd's 401)", async (ctx) => {
  const sbx = await ctx.create({ secure: true });
  const p = `${HOME}/signed.txt`;
  await sbx.files.write(p, 'signed content');
  const expired = await sbx.downloadUrl(p, { useSignatureExpiration: -10_000 });
  const res = await fetch(expired, { signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS) });
  assert.equal(res.status, 401);
  assert.deepEqual(JSON.parse(await res.text()), {
    code: 401,
    message: 'signature is already expired',
  });
  const inForce = await sbx.downloadUrl(p, { useSignatureExpiration: 10_000 });
  const ok = await fetch(inForce, { signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS) });
  assert.equal(ok.status, 200);
  assert.equal(await ok.text(), 'signed content');
});

sdkTest('files.watchDir (upload of a new file: CREATE, CHMOD, WRITE)', async (ctx) => {
  const sbx = await ctx.create();
  const watched = `${HOME}/${unique('watch-up')}`;
  await sbx.files.makeDir(watched);
  const seen = [];
  const handle = await sbx.files.watchDir(watched, (e) => seen.push(e), { timeoutMs: 0 });
  try {
    await sbx.files.write(`${watched}/uploaded.txt`, 'payload');
    const mine = () => seen.filter((e) => e.name === 'uploaded.txt');
    await waitUntil(() => mine().length >= 3, 5_000);
    assert.deepEqual(
      mine()
        .slice(0, 3)
        .map((e) => e.type),
      [FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE],
      `got ${JSON.stringify(seen)}`,
    );
  } finally {
    await handle.stop();
  }
});

sdkTest('commands.run (background) timeoutMs -> TimeoutError on wait', async (ctx) => {
  const sbx = await ctx.create();
  const marker = unique('bgto');
  const handle = await sbx.commands.run(`sleep 30; : ${marker}`, {
    background: true,
    timeoutMs: 2000,
  });
  const started = Date.now();
  // envd ends the stream with the call's deadline_exceeded, not with the killed process's end.
  const err = await rejectsWith(handle.wait(), TimeoutError, 'wait past timeoutMs');
  assert.ok(!/killed or reached its end of life/.test(err.message), err.message);
  assert.ok(Date.now() - started < 10_000);
  assert.ok(await waitUntil(async () => (await runningPidsWith(sbx, marker)).length === 0, 10_000));
});

sdkTest("Sandbox.kill under a running command -> 'sandbox was killed'", async (ctx) => {
  const sbx = await ctx.create();
  const cmd = await sbx.commands.run('sleep 60', { background: true });
  await sbx.kill();
  ctx.forget(sbx.sandboxId);
  const err = await cmd.wait().catch((e) => e);
  assert.ok(err instanceof SandboxError, `expected SandboxError, got ${err?.name}: ${err?.message}`);
  assert.ok(
    err.message.includes('sandbox was killed or reached its end of life'),
    err.message,
  );
});

sdkTest("Sandbox.create (unknown template -> E2B's 404)", async (ctx) => {
  await requireServer();
  const name = unique('no-such-template');
  const err = await rejectsWith(
    Sandbox.create(name, { requestTimeoutMs: REQUEST_TIMEOUT_MS }),
    SandboxError,
    'create of an unknown template',
  );
  assert.equal(err.statusCode, 404);
  assert.ok(err.message.includes(`template '${name}' not found`), err.message);
});

sdkTest('files.write metadata (kept as user.e2b.* xattrs)', async (ctx) => {
  const sbx = await ctx.create();
  const p = `${HOME}/${unique('meta')}.txt`;
  const meta = { author: 'suite', purpose: 'upload' };
  assert.deepEqual((await sbx.files.write(p, 'first', { metadata: meta })).metadata, meta);
  assert.deepEqual((await sbx.files.getInfo(p)).metadata, meta);
  // On the file itself, as the sandbox's own processes see it.
  const r = await sbx.commands.run(
    `python3 -c "import os; print(os.getxattr('${p}', 'user.e2b.author').decode())"`,
  );
  assert.equal(r.stdout, 'suite\n');
  // Set inside the sandbox: shown as metadata, in getInfo and in list.
  const q = `${HOME}/${unique('meta-set')}.txt`;
  await sbx.files.write(q, 'content');
  await sbx.commands.run(`python3 -c "import os; os.setxattr('${q}', 'user.e2b.author', b'mish')"`);
  assert.deepEqual((await sbx.files.getInfo(q)).metadata, { author: 'mish' });
  const listed = Object.fromEntries((await sbx.files.list(HOME)).map((e) => [e.path, e]));
  assert.deepEqual(listed[q].metadata, { author: 'mish' });
  // Overwriting without metadata clears what an earlier upload stored.
  await sbx.files.write(p, 'second');
  const after = (await sbx.files.getInfo(p)).metadata;
  assert.ok(after === undefined || Object.keys(after).length === 0, JSON.stringify(after));
});

sdkTest('Sandbox.getMetrics (instance and static, range)', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.commands.run(
    'head -c 30000000 /dev/urandom | sha256sum > /dev/null; head -c 8000000 /dev/urandom > /tmp/m.bin; sync',
  );
  const metrics = await sbx.getMetrics();
  assert.equal(metrics.length, 1, JSON.stringify(metrics));
  const m = metrics[0];
  assert.ok(m.cpuCount >= 1, JSON.stringify(m));
  assert.ok(m.cpuUsedPct > 0 && m.cpuUsedPct <= 100, JSON.stringify(m));
  assert.ok(m.memUsed > 0 && m.memUsed <= m.memTotal, JSON.stringify(m));
  // A VM's disk use is its image's allocation on the host, which lags the guest's writes.
  assert.ok(m.diskUsed > 0 && m.diskUsed <= m.diskTotal, JSON.stringify(m));
  assert.ok(Math.abs(m.timestamp.getTime() - Date.now()) < 60_000, JSON.stringify(m));
  assert.equal((await Sandbox.getMetrics(sbx.sandboxId)).length, 1);
  const anHourAgo = new Date(Date.now() - 3_600_000);
  assert.deepEqual(await Sandbox.getMetrics(sbx.sandboxId, { end: anHourAgo }), []);
  await rejectsWith(
    Sandbox.getMetrics(bogusSandboxId(), { requestTimeoutMs: REQUEST_TIMEOUT_MS }),
    SandboxNotFoundError,
    'metrics of a missing sandbox',
  );
});

// === snapshots and forks (providers that take snapshots: TETHER_SUITE_SNAPSHOTS) ===

const SNAPSHOTS = Boolean(process.env.TETHER_SUITE_SNAPSHOTS);

function snapshotTest(name, fn) {
  if (!SNAPSHOTS) {
    test(name, { skip: 'the provider of this run takes no snapshots' }, () => {});
    return;
  }
  sdkTest(name, fn, { timeoutMs: 240_000 });
}

async function allSnapshots(opts = {}) {
  const pages = Sandbox.listSnapshots({ requestTimeoutMs: REQUEST_TIMEOUT_MS, ...opts });
  const ids = [];
  let n = 0;
  while (pages.hasNext) {
    n += 1;
    assert.ok(n <= 50, 'Sandbox.listSnapshots paginator never ends');
    for (const s of await pages.nextItems()) ids.push(s.snapshotId);
  }
  return ids;
}

snapshotTest('Sandbox.createSnapshot / listSnapshots / deleteSnapshot', async (ctx) => {
  const sbx = await ctx.create();
  const name = unique('snap');
  const named = await sbx.createSnapshot({ name });
  assert.ok(named.snapshotId && named.names.some((n) => n.includes(name)), JSON.stringify(named));
  const unnamed = await Sandbox.createSnapshot(sbx.sandboxId);
  assert.ok(unnamed.snapshotId && unnamed.snapshotId !== named.snapshotId);
  try {
    const every = await allSnapshots();
    assert.ok(every.includes(named.snapshotId) && every.includes(unnamed.snapshotId));
    // One per page, by sandbox: the cursor reaches both.
    const paged = await allSnapshots({ sandboxId: sbx.sandboxId, limit: 1 });
    assert.deepEqual(new Set(paged), new Set([named.snapshotId, unnamed.snapshotId]));
    assert.deepEqual(await allSnapshots({ name }), [named.snapshotId]);
    assert.deepEqual(await allSnapshots({ name: `${name}:default` }), [named.snapshotId]);
    assert.deepEqual(await allSnapshots({ name: `${name}-does-not-exist` }), []);
    const other = await allSnapshots({ apiKey: ctx.env.otherKey });
    assert.ok(!other.includes(named.snapshotId) && !other.includes(unnamed.snapshotId));
    assert.equal(await Sandbox.deleteSnapshot(named.snapshotId, { apiKey: ctx.env.otherKey }), false);
  } finally {
    assert.equal(await Sandbox.deleteSnapshot(named.snapshotId), true);
    assert.equal(await Sandbox.deleteSnapshot(unnamed.snapshotId), true);
  }
  assert.equal(await Sandbox.deleteSnapshot(named.snapshotId), false);
});

snapshotTest('Sandbox.create(<snapshot id>): its files, outliving its sandbox', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/app/config.json`, '{"env":"test"}');
  const snap = await sbx.createSnapshot();
  try {
    await sbx.kill();
    ctx.forget(sbx.sandboxId);
    const one = await Sandbox.create(snap.snapshotId, { requestTimeoutMs: REQUEST_TIMEOUT_MS });
    ctx.created.set(one.sandboxId, ctx.env.apiKey);
    const two = await Sandbox.create(snap.snapshotId, { requestTimeoutMs: REQUEST_TIMEOUT_MS });
    ctx.created.set(two.sandboxId, ctx.env.apiKey);
    assert.equal(await one.files.read(`${HOME}/app/config.json`), '{"env":"test"}');
    await one.files.write(`${HOME}/app/config.json`, 'changed');
    assert.equal(await two.files.read(`${HOME}/app/config.json`), '{"env":"test"}');
    const err = await rejectsWith(
      Sandbox.create(snap.snapshotId, { apiKey: ctx.env.otherKey, requestTimeoutMs: REQUEST_TIMEOUT_MS }),
      SandboxError,
      "another tenant's create from the snapshot",
    );
    assert.equal(err.statusCode, 404);
  } finally {
    await Sandbox.deleteSnapshot(snap.snapshotId);
  }
});

snapshotTest('Sandbox.fork (one, two, by id; another tenant; a killed sandbox)', async (ctx) => {
  const sbx = await ctx.create();
  await sbx.files.write(`${HOME}/state.txt`, 'state before fork');
  const forks = [];
  const keep = (list) => {
    for (const f of list) if (f instanceof Sandbox) {
      forks.push(f);
      ctx.created.set(f.sandboxId, ctx.env.apiKey);
    }
    return list;
  };
  const [fork] = keep(await sbx.fork());
  assert.ok(fork instanceof Sandbox && fork.sandboxId !== sbx.sandboxId);
  assert.ok((await sbx.isRunning()) && (await fork.isRunning()));
  assert.equal(await fork.files.read(`${HOME}/state.txt`), 'state before fork');
  await fork.files.write(`${HOME}/state.txt`, 'modified in fork');
  assert.equal(await sbx.files.read(`${HOME}/state.txt`), 'state before fork');
  const two = keep(await sbx.fork({ count: 2, timeoutMs: 60_000 }));
  assert.equal(two.length, 2);
  assert.ok(two.every((f) => f instanceof Sandbox), two.map(String).join(', '));
  assert.equal(new Set(two.map((f) => f.sandboxId)).size, 2);
  const byId = keep(await Sandbox.fork(sbx.sandboxId));
  assert.ok(byId.length === 1 && (await byId[0].isRunning()));
  await rejectsWith(
    Sandbox.fork(sbx.sandboxId, { apiKey: ctx.env.otherKey }),
    SandboxNotFoundError,
    "another tenant's fork",
  );
  assert.deepEqual(await allSnapshots({ sandboxId: sbx.sandboxId }), []);
  await sbx.kill();
  ctx.forget(sbx.sandboxId);
  await rejectsWith(sbx.fork(), SandboxNotFoundError, 'fork of a killed sandbox');
});

// === ports (providers that reach a sandbox's ports: TETHER_SUITE_PORTS) ===

const PORTS = Boolean(process.env.TETHER_SUITE_PORTS);

/** GET `path` from the front with `host` as the Host header: what a browser sends. */
async function frontGet(host, path) {
  const front = new URL(ENV.apiUrl);
  const http = await import('node:http');
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: front.hostname, port: front.port, path, headers: { Host: host }, timeout: REQUEST_TIMEOUT_MS },
      (res) => {
        const chunks = [];
        res.on('data', (c) => chunks.push(c));
        res.on('end', () => resolve([res.statusCode, Buffer.concat(chunks).toString()]));
      },
    );
    req.on('error', reject);
    req.end();
  });
}

sdkTest('Sandbox.create({ network: { httpsPorts } }) (the proxy speaks TLS to those ports)', async (ctx, t) => {
  if (!PORTS) {
    t.skip('the provider of this run does not reach sandbox ports');
    return;
  }
  const sbx = await ctx.create({ network: { httpsPorts: [8443] } });
  const info = await sbx.getInfo();
  assert.deepEqual(info.network?.httpsPorts, [8443]);
  await sbx.files.write(
    '/tmp/tls/serve.py',
    [
      'import http.server, ssl, sys, os',
      "os.chdir('/tmp/tls')",
      'ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)',
      "ctx.load_cert_chain('/tmp/tls/c.pem', '/tmp/tls/k.pem')",
      "srv = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)",
      'srv.socket = ctx.wrap_socket(srv.socket, server_side=True)',
      'srv.serve_forever()',
      '',
    ].join('\n'),
  );
  await sbx.files.write('/tmp/tls/hello.txt', 'hello over tls');
  await sbx.commands.run(
    'cd /tmp/tls && openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost' +
      ' -keyout k.pem -out c.pem -days 1 2>/dev/null',
  );
  await sbx.commands.run('exec python3 /tmp/tls/serve.py 8443', { background: true });
  await sbx.commands.run('exec python3 /tmp/tls/serve.py 9443', { background: true });
  const deadline = Date.now() + 20_000;
  let status, body;
  for (;;) {
    [status, body] = await frontGet(sbx.getHost(8443), '/hello.txt');
    if (status === 200) break;
    assert.equal(status, 502, body);
    assert.ok(Date.now() < deadline, 'the TLS server never came up');
    await sleep(200);
  }
  assert.equal(body, 'hello over tls');
  // A port not listed is spoken to in plain HTTP: the TLS server does not answer it.
  [status, body] = await frontGet(sbx.getHost(9443), '/hello.txt');
  assert.notEqual(status, 200);
  assert.ok(!body.includes('hello over tls'), body);
  // envd's port cannot be listed.
  await rejectsWith(ctx.create({ network: { httpsPorts: [49983] } }), SandboxError, "envd's port");
});

// === network updates (providers that enforce egress rules: TETHER_SUITE_EGRESS) ===

const EGRESS = Boolean(process.env.TETHER_SUITE_EGRESS);

sdkTest("Sandbox.updateNetwork: a running sandbox's egress rules replaced whole, enforced at once, lifted again", async (ctx) => {
  const sbx = await ctx.create();
  // A rule is enforced or refused, never dropped: a host name is refused everywhere.
  const bad = await rejectsWith(sbx.updateNetwork({ denyOut: ['example.com'] }), SandboxError, 'a host-name rule');
  assert.match(bad.message, /denyOut/);
  if (!EGRESS) {
    await rejectsWith(sbx.updateNetwork({ denyOut: ['10.255.255.1/32'] }), SandboxError, 'rules on a provider without them');
    return;
  }
  // A denied network is refused at once, inside the sandbox: nothing leaves it.
  const probe = "timeout 5 bash -c 'exec 3<>/dev/tcp/10.255.255.1/80'; echo $?";
  await sbx.updateNetwork({ denyOut: ['10.255.255.0/24'], allowOut: ['10.255.255.2'] });
  const started = Date.now();
  const r = await sbx.commands.run(probe, { requestTimeoutMs: REQUEST_TIMEOUT_MS });
  assert.equal(r.stdout.trim().split('\n').at(-1), '1', r.stdout + r.stderr);
  assert.ok(Date.now() - started < 4000, 'the refusal was not at once');
  // By id; an empty update lifts every rule; another tenant's sandbox is not found.
  await Sandbox.updateNetwork(sbx.sandboxId, {});
  const err = await rejectsWith(
    Sandbox.updateNetwork(sbx.sandboxId, {}, { apiKey: ctx.env.otherKey }),
    SandboxError,
    "another tenant's network update",
  );
  assert.ok(err instanceof SandboxNotFoundError || err.statusCode === 404, `${err.name}: ${err.message}`);
});

// === pause without memory (providers that can: TETHER_SUITE_PAUSE_FILESYSTEM) ===

const PAUSE_FILESYSTEM = Boolean(process.env.TETHER_SUITE_PAUSE_FILESYSTEM);

async function bootId(sbx) {
  const id = (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim();
  assert.match(id, /^[0-9a-f-]{36}$/);
  return id;
}

if (PAUSE_FILESYSTEM) {
  sdkTest("Sandbox.pause({ keepMemory: false }) / connect({ onResume: 'reboot' }): a boot that keeps the files", async (ctx) => {
    const sbx = await ctx.create();
    await sbx.files.write(`${HOME}/fs-only.txt`, 'kept across the boot');
    await sbx.commands.run('sleep 600', { background: true });
    const before = await bootId(sbx);
    assert.equal(await sbx.pause({ keepMemory: false }), true);
    assert.equal(await sbx.isRunning(), false);
    assert.equal((await sbx.getInfo()).state, 'paused');
    assert.equal(await sbx.pause({ keepMemory: false }), false, 'paused already');
    const resumed = await sbx.connect({ timeoutMs: 60_000 });
    assert.equal(resumed.sandboxId, sbx.sandboxId);
    assert.equal(await resumed.files.read(`${HOME}/fs-only.txt`), 'kept across the boot');
    assert.equal((await resumed.commands.run('pgrep -x sleep || echo none')).stdout, 'none\n');
    const after = await bootId(resumed);
    assert.notEqual(after, before);
    // A pause with memory keeps processes at a plain connect; a reboot drops them.
    await resumed.commands.run('sleep 600', { background: true });
    assert.equal(await resumed.pause(), true);
    const again = await resumed.connect({ timeoutMs: 60_000 });
    assert.equal(await bootId(again), after);
    assert.equal(await again.pause(), true);
    const rebooted = await again.connect({ timeoutMs: 60_000, onResume: 'reboot' });
    const third = await bootId(rebooted);
    assert.ok(third !== before && third !== after, 'a reboot is a new boot');
    assert.equal((await rebooted.commands.run('pgrep -x sleep || echo none')).stdout, 'none\n');
  }, { timeoutMs: 180_000 });

  sdkTest("Sandbox.create({ lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } }): resumed only by connect", async (ctx) => {
    const sbx = await ctx.create({ timeoutMs: 3_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } });
    await sbx.files.write(`${HOME}/marker.txt`, 'auto-pause-fs-only');
    const before = await bootId(sbx);
    assert.ok(await waitUntil(async () => (await sbx.getInfo()).state === 'paused', 30_000), 'paused at its timeout');
    await rejectsWith(sbx.files.read(`${HOME}/marker.txt`, { requestTimeoutMs: REQUEST_TIMEOUT_MS }), SandboxError, 'traffic to a stopped sandbox');
    assert.equal((await sbx.getInfo()).state, 'paused', 'traffic does not resume it');
    const resumed = await sbx.connect({ timeoutMs: 60_000 });
    assert.equal(await resumed.files.read(`${HOME}/marker.txt`), 'auto-pause-fs-only');
    assert.notEqual(await bootId(resumed), before);
  }, { timeoutMs: 120_000 });
} else {
  test('Sandbox.pause({ keepMemory: false })', { skip: 'the provider of this run cannot pause without memory' }, () => {});
}
