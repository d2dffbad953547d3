"""Benchmark driver: the official E2B Python SDK, long-lived, timed from inside.

Started once by `cargo run --release -p tether-tests --bin bench`, so interpreter start-up and
imports are not measured. Reads one JSON command per line on stdin, answers one JSON line on
stdout: {"s": seconds} (time.perf_counter() around the SDK call alone) or {"error": "..."}.
The server comes from E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.

Commands: {"op": "open"} (the sandbox later commands use), {"op": "exec", "cmd": C},
{"op": "write", "path": P, "size": N}, {"op": "read", "path": P, "size": N},
{"op": "create_first"} (create a sandbox, run `true` in it; timed; then killed, untimed),
{"op": "close"}.
"""

import json
import os
import sys
import time

os.environ.pop("E2B_DEBUG", None)

from e2b import Sandbox  # noqa: E402

_payloads = {}


def payload(size):
    if size not in _payloads:
        block = bytes(((i * 2654435761) >> 24) & 0xFF for i in range(4096))
        _payloads[size] = (block * (size // 4096 + 1))[:size]
    return _payloads[size]


def main():
    sb = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "open":
                t = time.perf_counter()
                sb = Sandbox.create(timeout=3600)
                res = {"s": time.perf_counter() - t}
            elif op == "exec":
                t = time.perf_counter()
                r = sb.commands.run(cmd["cmd"])
                s = time.perf_counter() - t
                res = {"s": s, "bytes": len(r.stdout), "exit": r.exit_code}
            elif op == "write":
                data = payload(cmd["size"])
                t = time.perf_counter()
                sb.files.write(cmd["path"], data)
                res = {"s": time.perf_counter() - t}
            elif op == "read":
                t = time.perf_counter()
                back = sb.files.read(cmd["path"], format="bytes")
                s = time.perf_counter() - t
                if len(back) != cmd["size"]:
                    raise RuntimeError(f"read {len(back)} bytes, {cmd['size']} expected")
                res = {"s": s}
            elif op == "create_first":
                t = time.perf_counter()
                tmp = Sandbox.create(timeout=600)
                tmp.commands.run("true")
                s = time.perf_counter() - t
                tmp.kill()
                res = {"s": s}
            elif op == "close":
                if sb is not None:
                    sb.kill()
                print(json.dumps({"s": 0.0}), flush=True)
                return
            else:
                res = {"error": f"unknown op {op}"}
        except Exception as e:  # reported to the bench, which fails loudly
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
