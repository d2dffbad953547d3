// Closing summary of the E2B JS SDK compatibility suite, as a node:test reporter.
//
// It runs next to the spec reporter and, once the run is over, prints one row per SDK call tested
// (each top-level test is named after its call) with PASS or FAIL, the measured figures the tests
// reported as diagnostics, and the line `e2b-js: N passed, M failed`. A reporter sees every
// outcome, including tests cancelled by their timeout, which the test file itself cannot.

const FIGURE_PREFIX = 'figure: ';

export default async function* summaryReporter(source) {
  const rows = [];
  const figures = [];
  for await (const event of source) {
    const data = event.data ?? {};
    if (event.type === 'test:diagnostic' && typeof data.message === 'string') {
      if (data.message.startsWith(FIGURE_PREFIX)) figures.push(data.message.slice(FIGURE_PREFIX.length));
      continue;
    }
    if (event.type !== 'test:pass' && event.type !== 'test:fail') continue;
    if (data.nesting !== 0) continue;
    const details = data.details ?? {};
    if (details.type === 'suite') continue;
    if (event.type === 'test:pass') {
      rows.push({
        name: data.name,
        result: details.skip !== undefined || data.skip ? 'SKIP' : 'PASS',
        why: '',
      });
    } else {
      rows.push({ name: data.name, result: 'FAIL', why: reason(details.error) });
    }
  }
  if (rows.length === 0) {
    yield 'e2b-js: 0 passed, 0 failed\n';
    return;
  }
  const width = Math.max('SDK call'.length, ...rows.map((r) => r.name.length));
  let out = `\n===== E2B SDK compatibility: js e2b =====\n`;
  if (process.env.E2B_API_URL)
    out += `server: ${process.env.E2B_API_URL} (envd ${process.env.E2B_SANDBOX_URL ?? ''})\n`;
  out += `${'SDK call'.padEnd(width)}  result\n`;
  let passed = 0;
  let failed = 0;
  for (const row of rows) {
    if (row.result === 'PASS') passed += 1;
    if (row.result === 'FAIL') failed += 1;
    out += `${row.name.padEnd(width)}  ${row.result}${row.why ? `  (${row.why})` : ''}\n`;
  }
  for (const figure of figures) out += `${figure}\n`;
  out += `e2b-js: ${passed} passed, ${failed} failed\n`;
  yield out;
}

function reason(error) {
  if (!error) return '';
  // node:test wraps the test's own error in ERR_TEST_FAILURE; the cause is the interesting part.
  const inner = error.cause ?? error;
  const text = String(inner?.message ?? inner)
    .replace(/\s+/g, ' ')
    .trim();
  const name = inner?.name && inner.name !== 'Error' ? `${inner.name}: ` : '';
  return (name + text).slice(0, 110);
}
