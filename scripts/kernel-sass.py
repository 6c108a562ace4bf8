#!/usr/bin/env python3
"""The machine code (SASS) of ferrolm's CUDA kernels, on a machine without a GPU or a toolkit.

NVRTC (the library ferrolm itself loads) compiles the kernels' whole source (kernels.cu with
its i-quant and delta-net parts, as `compile_kernels --source` prints it) to a cubin for one
architecture; cuobjdump and nvdisasm disassemble it. The three come as Python wheels,
installed once under --tools. Per kernel it prints registers, shared memory and the counts of
the instructions that matter to a decode product (global and shared loads, bulk copies, integer
dot products, barriers, branches), and with --order the sequence of loads and arithmetic: a
load issued after arithmetic that waits for an earlier load is a round trip in series (this is
how the rows of the Q4_K product were found one after another, PERFORMANCE.md, session 6).
With --against REV it says, per kernel, whether the code differs from kernels.cu at git
revision REV, the rest of the source as it is now (register names aside): a change that
leaves a kernel's SASS alone needs no GPU to show it costs nothing.

  scripts/kernel-sass.py matvecq_Q4_K matvecs_Q4_K --order
  scripts/kernel-sass.py --define MATVEC_UNROLL=1 matvec_gluq_Q4_K
  scripts/kernel-sass.py --against HEAD~1 --all
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "crates", "ferrolm-cuda", "src", "kernels.cu")
WHEELS = ["nvidia-cuda-nvrtc", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"]
COUNTED = ["LDG", "LDS", "STG", "UBLKCP", "IDP", "FFMA", "BAR", "SYNCS", "SHFL", "BRA"]


# The NVRTC that compiles the kernels a GPU machine runs (scripts/test and scripts/gpu-pack.sh
# install it): the newest NVRTC's code differs a little (dq4k_pipe_16_4x2: 121 registers
# against 123).
SHIPPED_NVRTC = os.path.join(os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm")),
                             "nvrtc", "nvidia", "cuda_nvrtc", "lib")


def tools(directory):
    """(libnvrtc path, directory holding cuobjdump and nvdisasm), installing the wheels once; the
    shipped NVRTC where it is installed."""
    def find():
        lib = glob.glob(os.path.join(directory, "nvidia", "*", "lib", "libnvrtc.so*"))
        bins = glob.glob(os.path.join(directory, "nvidia", "*", "bin", "nvdisasm"))
        objdump = glob.glob(os.path.join(directory, "nvidia", "*", "bin", "cuobjdump"))
        if lib and bins and objdump:
            return sorted(lib)[0], os.path.dirname(bins[0])
        return None

    found = find()
    if found is None:
        print(f"installing {' '.join(WHEELS)} into {directory}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", directory]
                       + WHEELS, check=True)
        found = find()
    if found is None:
        sys.exit(f"no libnvrtc, cuobjdump or nvdisasm under {directory}")
    shipped = sorted(glob.glob(os.path.join(SHIPPED_NVRTC, "libnvrtc.so.*")))
    return (shipped[0], found[1]) if shipped else found


def cubin(lib, source, arch):
    """The cubin NVRTC makes of `source` (text) for `arch`."""
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None,
                                None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC: {log.value.decode()}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, out)
    return out.raw


def whole_source():
    """The source NVRTC compiles: kernels.cu with the i-quants' tables and kernels and the
    delta-net kernels put in by ferrolm-cuda (its compile_kernels example prints it)."""
    return subprocess.run(["cargo", "run", "-q", "--release", "-p", "ferrolm-cuda", "--example",
                           "compile_kernels", "--", "--source"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def with_old_kernels(whole, old):
    """The whole source with kernels.cu's two parts (before and after its `// @IQUANTS` line)
    replaced by those of `old`, another revision's kernels.cu."""
    with open(SOURCE) as f:
        now = f.read()
    mark = "// @IQUANTS"
    for part, was in zip(now.split(mark, 1), old.split(mark, 1)):
        whole = whole.replace(part, was, 1)
    return whole


def with_defines(text, defines):
    head = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines)
    return head + text


def cuobjdump(bindir, *args):
    """cuobjdump's output (it finds nvdisasm on PATH)."""
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([os.path.join(bindir, "cuobjdump"), *args], env=env,
                          capture_output=True, text=True, check=True).stdout


def disassemble(bindir, path):
    """{kernel: [instruction text without addresses]} of every function in the cubin."""
    text = cuobjdump(bindir, "-sass", path)
    kernels, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            kernels[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if name and m:
            kernels[name].append(m.group(1))
    return kernels


def resources(bindir, path):
    """{kernel: "REG:n SHARED:n"} from cuobjdump -res-usage."""
    text = cuobjdump(bindir, "-res-usage", path)
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            out[name] = " ".join(re.findall(r"(?:REG|SHARED):\d+", line))
    return out


def opcode(ins):
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernels", nargs="*", help="kernel names (e.g. matvecq_Q4_K)")
    ap.add_argument("--all", action="store_true", help="every kernel")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--define", action="append", default=[], help="NAME or NAME=VALUE")
    ap.add_argument("--order", action="store_true", help="the sequence of loads and arithmetic")
    ap.add_argument("--full", action="store_true", help="print the SASS")
    ap.add_argument("--against", metavar="REV", help="compare with kernels.cu at git REV")
    ap.add_argument("--tools", default=os.path.join(tempfile.gettempdir(), "ferrolm-sass-tools"))
    args = ap.parse_args()
    lib, bindir = tools(args.tools)
    with tempfile.TemporaryDirectory() as tmp:
        def build(text, tag):
            path = os.path.join(tmp, f"{tag}.cubin")
            with open(path, "wb") as f:
                f.write(cubin(lib, with_defines(text, args.define), args.arch))
            return disassemble(bindir, path), resources(bindir, path)

        now, res = build(whole_source(), "now")
        names = sorted(now) if args.all or not args.kernels else args.kernels
        before = None
        if args.against:
            rel = os.path.relpath(SOURCE, ROOT)
            old = subprocess.run(["git", "-C", ROOT, "show", f"{args.against}:{rel}"],
                                 capture_output=True, text=True, check=True).stdout
            before, _ = build(with_old_kernels(whole_source(), old), "before")
        for name in names:
            if name not in now:
                print(f"{name}: not in the module")
                continue
            code = now[name]
            ops = [opcode(i) for i in code]
            counts = " ".join(f"{c} {sum(o.startswith(c) for o in ops)}" for c in COUNTED)
            line = f"{name}: {res.get(name, '')} instructions {len(code)} | {counts}"
            if before is not None:
                plain = lambda c: [re.sub(r"\b(U?R|U?P)\d+\b", r"\1", i) for i in c]
                if name not in before:
                    line += " | new"
                elif plain(before[name]) == plain(code):
                    line += " | same as " + args.against
                else:
                    line += f" | differs from {args.against} ({len(before[name])} instructions)"
            print(line)
            if args.order:
                keep = ("LDG", "LDS", "UBLKCP", "IDP", "BAR", "SYNCS", "SHFL")
                seq = [o for o in ops if o.startswith(keep)]
                # runs of the same opcode as OPxN
                runs, last, n = [], None, 0
                for o in seq + [None]:
                    if o == last:
                        n += 1
                        continue
                    if last is not None:
                        runs.append(last if n == 1 else f"{last}x{n}")
                    last, n = o, 1
                print("  " + " ".join(runs))
            if args.full:
                print("\n".join("  " + i for i in code))


if __name__ == "__main__":
    main()
