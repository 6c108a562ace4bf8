#!/usr/bin/env python3
"""Load test of `ferrolm serve`: N concurrent streaming clients, R requests in all.

Starts the server itself (default model, a free loopback port, --parallel N), warms every
slot, then runs the load and checks that every request completed with exactly --max-tokens
tokens (ignore_eos, finish_reason "length"), none lost or duplicated, and that the server's
resident memory is back to its idle level afterwards. Prints aggregate generated tokens/s and
the client-side time-to-first-token percentiles; exits non-zero on any failure.

    python3 scripts/load_test.py --concurrency 32 --requests 256 --max-tokens 16

With --schema, every request asks for JSON valid against a schema (an array of at least 200
small integers: structured outputs' constrained sampling, a mask every token); with up to 400
--max-tokens no answer can close it, so every one still runs to --max-tokens, and each one that
ends earlier must parse as such an array.

Python standard library only.
"""
import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [
    "Once upon a time",
    "The history of the printing press",
    "def quicksort(items):",
    "A recipe for bread:",
    "The three laws of motion are",
    "Dear diary, today",
    "In the year 2050, cities",
    "The best way to learn a language is",
]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# At least 200 items of at least one token each and a separator: no answer of fewer than
# 400 tokens can close it, so every answer runs to --max-tokens as without a schema.
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 99},
    "minItems": 200,
}


def one_request(port, i, max_tokens, timeout, schema=False, temperature=0.7):
    """Streams one completion; returns (id, completion_tokens, finish, ttft, total, text, gaps)
    where gaps are the seconds between consecutive pieces of text (inter-token latency)."""
    request = {
        "model": "smollm2",
        "prompt": f"{PROMPTS[i % len(PROMPTS)]} ({i})",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if schema:
        request["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    body = json.dumps(request)
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"request {i}: HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, last, gaps = None, None, []
    ids, text, finish, usage, done = set(), [], None, None, False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"request {i}: {chunk['error']}")
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            if c["text"]:
                now = time.monotonic()
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
            text.append(c["text"])
            if c["finish_reason"]:
                finish = c["finish_reason"]
    conn.close()
    if not done or len(ids) != 1 or usage is None:
        raise RuntimeError(f"request {i}: incomplete stream (done={done}, ids={ids}, usage={usage})")
    total = time.monotonic() - start
    return ids.pop(), usage["completion_tokens"], finish, ttft, total, "".join(text), gaps


def run_load(port, concurrency, requests, max_tokens, timeout, schema=False, temperature=0.7):
    results, errors = [None] * requests, []
    next_i = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= requests:
                    return
                next_i[0] += 1
            try:
                results[i] = one_request(port, i, max_tokens, timeout, schema, temperature)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, errors, time.monotonic() - start


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def metric(port, name):
    """One counter of the server's /metrics, or None."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ferrolm"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=0, help="server slots (default: concurrency)")
    ap.add_argument("--ctx-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    ap.add_argument("--schema", action="store_true", help="constrain every answer to a JSON schema")
    ap.add_argument("--model", help="a GGUF file (default: the default model)")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: the server's default)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more argument for `serve` (repeat it), e.g. --serve-arg=--kv-memory=1")
    args = ap.parse_args()
    parallel = args.parallel or args.concurrency
    # Killed, still stop the server (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))

    server = subprocess.Popen(
        [args.binary, "serve", "--port", "0", "--parallel", str(parallel),
         "-c", str(args.ctx_size), "-t", str(args.threads),
         "--max-queue", str(max(64, args.requests)), "--model-name", "smollm2"]
        + (["-m", args.model] if args.model else [])
        + (["--device", args.device] if args.device else [])
        + args.serve_arg,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            if not line:
                break
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        if port is None:
            sys.exit("the server did not start")
        # Drain the request log so the server never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()

        # Warm every slot so that the idle level includes the touched KV caches.
        _, errors, _ = run_load(
            port, parallel, parallel, args.max_tokens, args.timeout, args.schema,
            args.temperature,
        )
        if errors:
            sys.exit(f"warm-up failed: {errors[:3]}")
        time.sleep(0.5)
        idle = rss_kib(server.pid)

        results, errors, wall = run_load(
            port, args.concurrency, args.requests, args.max_tokens, args.timeout, args.schema,
            args.temperature,
        )
        time.sleep(0.5)
        after = rss_kib(server.pid)
        paused = metric(port, "ferrolm_requests_paused_total")

        failures = list(errors)
        done = [r for r in results if r is not None]
        if len(done) != args.requests:
            failures.append(f"{args.requests - len(done)} requests lost")
        ids = [r[0] for r in done]
        if len(set(ids)) != len(ids):
            failures.append("duplicated answer ids")
        for i, r in enumerate(results):
            if not r:
                continue
            if args.schema and r[2] == "stop" and r[1] <= args.max_tokens:
                try:
                    value = json.loads(r[5])
                    ok = isinstance(value, list) and all(
                        isinstance(x, int) and 0 <= x <= 99 for x in value
                    )
                except ValueError:
                    ok = False
                if not ok:
                    failures.append(f"request {i}: not valid against the schema: {r[5]!r}")
            elif r[1] != args.max_tokens or r[2] != "length":
                failures.append(f"request {i}: {r[1]} tokens, finish {r[2]}")
        if after > idle * 1.10 + 16 * 1024:
            failures.append(f"memory did not return to idle: {idle} KiB idle, {after} KiB after")
        tokens = sum(r[1] for r in done)
        ttfts = [r[3] for r in done if r[3] is not None]
        gaps = [g for r in done for g in r[6]]
        figures = {
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "schema": args.schema,
            "wall_s": round(wall, 2),
            "generated_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(done) / wall, 2),
            "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 3) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
            "itl_p50_ms": round(1e3 * percentile(gaps, 50), 2) if gaps else None,
            "itl_p99_ms": round(1e3 * percentile(gaps, 99), 2) if gaps else None,
            "paused": paused,
            "rss_idle_mib": round(idle / 1024, 1),
            "rss_after_mib": round(after / 1024, 1),
        }
        if args.json:
            print(json.dumps(figures))
        else:
            for k, v in figures.items():
                print(f"{k:>18}: {v}")
        if failures:
            print("FAILED:", *failures[:20], sep="\n  ", file=sys.stderr)
            sys.exit(1)
        print("load test: ok")
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
