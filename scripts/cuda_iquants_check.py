#!/usr/bin/env python3
"""Compiles crates/ferrolm-cuda/src/kernels_iquants.cu (not yet part of the CUDA backend) with
NVRTC, on a machine without a GPU: kernels.cu, then the lattice tables (from
crates/ferrolm-quant/src/iq_grids.rs, as ferrolm_quant::lattice_tables_c renders them), then the
file, then a kernel that instantiates every type's `load` and `dot`. It checks that the source
compiles, nothing about its results (that needs a GPU run).

  scripts/cuda_iquants_check.py [--arch sm_90] [--tools DIR]
"""
import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "crates", "ferrolm-cuda", "src")
TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0",
         "TQ2_0", "Q1_0", "Q2_0", "NVFP4"]


def sass_script():
    spec = importlib.util.spec_from_file_location("kernel_sass",
                                                  os.path.join(ROOT, "scripts", "kernel-sass.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def nvrtc(directory):
    """libnvrtc from the nvidia-cuda-nvrtc wheel under `directory`, installed there once."""
    pattern = os.path.join(directory, "nvidia", "*", "lib", "libnvrtc.so*")
    if not glob.glob(pattern):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", directory,
                        "nvidia-cuda-nvrtc"], check=True)
    found = sorted(glob.glob(pattern))
    if not found:
        sys.exit(f"no libnvrtc under {directory}")
    return found[0]


def tables():
    grids = open(os.path.join(ROOT, "crates", "ferrolm-quant", "src", "iq_grids.rs")).read()
    out = ""
    for m in re.finditer(r"static (\w+): \[(u64|u32); (\d+)\] = \[(.*?)\];", grids, re.S):
        name, ty, n, body = m.groups()
        vals = re.findall(r"0x[0-9a-f]+", body)
        assert len(vals) == int(n), name
        out += f"__device__ const {ty} {name}[{n}] = {{{','.join(v + 'u' for v in vals)}}};\n"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--tools", default=os.path.join(tempfile.gettempdir(), "ferrolm-sass-tools"))
    args = ap.parse_args()
    sass = sass_script()
    lib = nvrtc(args.tools)
    checks = " ".join(f"CHECK({t})" for t in TYPES)
    kernel = f"""
extern "C" __global__ void iq_check(const u8* row, const int* aq, float* out) {{
    Act a;
    for (int k = 0; k < 8; k++) a.q[k] = aq[k];
    a.d = 0.5f; a.s = 0.f; a.sum[0] = 0; a.sum[1] = 0;
    float w[32], r = 0.f;
#define CHECK(T) T::load(row, threadIdx.x, 8, w); r += w[threadIdx.x & 31] + T::dot(row, threadIdx.x, 8, a);
    {checks}
    out[threadIdx.x] = r;
}}
"""
    source = (open(os.path.join(SRC, "kernels.cu")).read() + "\n" + tables()
              + open(os.path.join(SRC, "kernels_iquants.cu")).read() + kernel)
    cubin = sass.cubin(lib, source, args.arch)
    print(f"kernels_iquants.cu compiles for {args.arch} ({len(cubin)} bytes of cubin)")


if __name__ == "__main__":
    main()
