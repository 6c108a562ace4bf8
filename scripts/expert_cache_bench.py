#!/usr/bin/env python3
"""Streamed experts, measured: a synthetic Qwen3-MoE whose experts are several times larger than
the expert cache, run by `ferrolm bench` with the experts streamed (and, for comparison, mapped).

Reports per run: peak RSS (the binary's own VmHWM, cross-checked with /usr/bin/time -v), pp and
tg tokens/s, the cache's hit rate and bytes read; and asserts that a streamed run's peak RSS
stays within cache + dense weights + a stated overhead.

RSS counts the mapped file pages the process touched; pages read with pread sit in the kernel's
page cache, which is not part of RSS. That is why streamed experts are never touched through
the mapping. The page cache still matters for speed: a "cold" run first asks the kernel to drop
the file's cached pages (posix_fadvise DONTNEED, no root needed), so its reads go to the disk;
a "warm" run reads from the page cache.

Usage: scripts/expert_cache_bench.py [--ferrolm target/release/ferrolm] [--cache-mb 160] ...
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# What a run holds besides the expert cache and the dense weights: the binary and its libraries,
# thread stacks, the KV cache and activations of a short context, allocator slack.
OVERHEAD_MB = 64


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench(a, model, cache_mb):
    cmd = ["/usr/bin/time", "-v", a.ferrolm, "bench", "-m", model, "-p", str(a.p), "-n",
           str(a.n), "-r", "1", "-t", str(a.threads), "--expert-cache", str(cache_mb), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
    result["time_max_rss_bytes"] = int(m.group(1)) * 1024 if m else None
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("--dir", default=None, help="where to write the model (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1024, help="each expert's hidden size")
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--experts-used", type=int, default=8)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--cache-mb", type=int, default=160)
    ap.add_argument("-p", type=int, default=128, help="prompt tokens (pp test)")
    ap.add_argument("-n", type=int, default=32, help="generated tokens (tg test)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-resident", action="store_true", help="skip the mapped-experts run")
    a = ap.parse_args()

    tmp = None
    if a.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ferrolm-expert-bench-")
        a.dir = tmp.name
    model = os.path.join(a.dir, "qwen3moe-streamed.gguf")
    subprocess.run([a.ferrolm, "synth", "--arch", "qwen3moe", "--layers", str(a.layers),
                    "--embd", str(a.embd), "--heads", "8", "--kv-heads", "2", "--ff", str(a.ff),
                    "--experts", str(a.experts), "--experts-used", str(a.experts_used),
                    "--type", a.type, "-o", model], check=True, capture_output=True)
    file_bytes = os.path.getsize(model)

    runs = []
    for label, cache_mb, cold in [("streamed, cold", a.cache_mb, True),
                                  ("streamed, warm", a.cache_mb, False),
                                  ("mapped (resident)", 0, False)]:
        if cache_mb == 0 and a.no_resident:
            continue
        if cold:
            drop_page_cache(model)
        runs.append((label, cache_mb, bench(a, model, cache_mb)))

    streamed = [r for _, c, r in runs if c > 0]
    expert_bytes = streamed[0]["expert_cache"]["expert_bytes"]
    dense_bytes = file_bytes - expert_bytes
    mb = lambda b: b / (1 << 20)
    print(f"model: qwen3moe {a.layers} layers x {a.experts} experts (top-{a.experts_used}) of "
          f"{a.embd} x {a.ff}, {a.type}: file {mb(file_bytes):.0f} MB, experts "
          f"{mb(expert_bytes):.0f} MB, dense {mb(dense_bytes):.1f} MB; cache {a.cache_mb} MB "
          f"({expert_bytes / (a.cache_mb << 20):.1f}x smaller than the experts); "
          f"{a.threads} threads, pp{a.p} tg{a.n}, one repetition each")
    print()
    print("| run | cache MB | peak RSS MB (VmHWM) | peak RSS MB (time -v) | pp t/s | tg t/s | "
          "hit rate | MB read |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, cache_mb, r in runs:
        c = r.get("expert_cache")
        print(f"| {label} | {cache_mb or '-'} | {mb(r['peak_rss_bytes']):.0f} | "
              f"{mb(r['time_max_rss_bytes']):.0f} | {r[f'pp{a.p}']:.1f} | {r[f'tg{a.n}']:.1f} | "
              + (f"{100 * c['hit_rate']:.1f}% | {mb(c['bytes_read']):.0f} |" if c else "- | - |"))
    print()
    ceiling = (a.cache_mb << 20) + dense_bytes + (OVERHEAD_MB << 20)
    ok = True
    for label, cache_mb, r in runs:
        if cache_mb == 0:
            continue
        peak = max(r["peak_rss_bytes"], r["time_max_rss_bytes"] or 0)
        verdict = "holds" if peak <= ceiling else "EXCEEDS"
        ok &= peak <= ceiling
        print(f"{label}: peak RSS {mb(peak):.0f} MB {verdict} the ceiling cache + dense + "
              f"{OVERHEAD_MB} MB overhead = {mb(ceiling):.0f} MB")
    if tmp:
        tmp.cleanup()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
