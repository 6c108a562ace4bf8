#!/usr/bin/env python3
"""Golden checksums for `ferrolm quantize`, from llama.cpp's own quantizer (llama-quantize's
`llama_model_quantize`, through llama-cpp-python 0.3.36 = llama.cpp b11312).

The packaged SmolLM2-135M (Q4_1) is first requantized to F16 (allow_requantize), the small F16
input; that F16 file is then quantized to each file type. Each output's sha256, size and
per-tensor types go to crates/ferrolm/tests/golden/quantize.json; the test quantizes with ferrolm
the same way and compares the bytes' checksums.

Usage: scripts/quantize_golden.py [OUT.json]   (writes temporary files under /tmp)
"""
import ctypes
import hashlib
import json
import os
import sys
import tempfile

import llama_cpp
from gguf import GGUFReader

HOME = os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
SOURCE = os.path.join(HOME, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
# (name on ferrolm's command line, llama_ftype)
TYPES = [("f16", 1), ("bf16", 32), ("q8_0", 7), ("q4_0", 2), ("q4_1", 3), ("q5_0", 8),
         ("q5_1", 9), ("q4_k_m", 15), ("q6_k", 18)]


def quantize(src, dst, ftype, requantize=False):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 1
    p.allow_requantize = requantize
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize {src} -> {dst}: {rc}"


def describe(path):
    data = open(path, "rb").read()
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "types": types}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "crates", "ferrolm", "tests", "golden", "quantize.json")
    result = {"source": "llama-cpp-python 0.3.36 (llama.cpp b11312) llama_model_quantize, "
                        "scripts/quantize_golden.py",
              "input": "SmolLM2-135M-Instruct.Q4_1.gguf requantized to F16", "outputs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        f16 = os.path.join(tmp, "input-f16.gguf")
        quantize(SOURCE, f16, 1, requantize=True)
        result["f16_input"] = describe(f16)
        for name, ftype in TYPES:
            dst = os.path.join(tmp, f"smollm2-{name}.gguf")
            quantize(f16, dst, ftype)
            result["outputs"][name] = describe(dst)
            print(name, result["outputs"][name]["sha256"], file=sys.stderr)
            os.remove(dst)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
