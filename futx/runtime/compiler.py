"""Compile one registry entry with the CuTe DSL, export it as an object and link a loadable library.

Runs on any machine with the DSL installed (no GPU needed): the target comes from `CUTE_DSL_ARCH`.
`export_spec` is meant to run in a fresh process per variant (see build.py) so that the DSL's
environment switches (SASS dumps) apply and MLIR state never leaks between variants.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from futx.runtime.dsl_libs import installed_runtime_lib, tvm_ffi_lib_dir
from futx.runtime.fingerprint import COMPILE_OPTIONS
from futx.runtime.registry import KernelSpec
SASS_OPCODES = ("QGMMA", "HGMMA", "HMMA", "LDL", "STL", "LDG.E.128", "LDS", "STS", "SHFL", "BAR",
                "WARPGROUP.DEPBAR")   # a wait per wgmma: ptxas serialized them (e.g. short of registers)


def compile_spec(spec: KernelSpec, arch: str = "sm_90a"):
    """Compile in this process and return the DSL's compiled (TVM-FFI callable) function."""
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    if os.environ["CUTE_DSL_ARCH"] != arch:
        raise RuntimeError(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']} but {arch} was requested")
    import cutlass.cute as cute

    module = importlib.import_module(spec.module)
    factory = getattr(module, spec.factory, None)
    if factory is None:
        raise AttributeError(f"{spec.key}: module {spec.module} has no factory {spec.factory!r}")
    fn, fake_args = factory(**spec.param_dict, **({"extra": spec.extra} if spec.extra is not None else {}))
    return cute.compile(fn, *fake_args, options=COMPILE_OPTIONS)


def sass_stats(sass_text: str) -> dict[str, int]:
    """Count opcodes that the compile checks care about."""
    counts = {op: 0 for op in SASS_OPCODES}
    for line in sass_text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m:
            continue
        opcode = m.group(1)
        base = opcode.split(".")[0]
        for op in SASS_OPCODES:
            if op == base or (("." in op) and opcode.startswith(op)):
                counts[op] += 1
    return counts


def link_shared(obj: Path, out: Path, runtime_lib: Path) -> None:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("linking a kernel library needs a C++ compiler driver (g++); set CXX")
    cmd = [cxx, "-shared", "-fPIC", "-o", str(out), str(obj),
           f"-L{runtime_lib.parent}", "-lcute_dsl_runtime", f"-L{tvm_ffi_lib_dir()}", "-ltvm_ffi",
           "-Wl,-rpath,$ORIGIN", "-Wl,--no-as-needed"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"link failed ({' '.join(cmd)}):\n{res.stderr}")


def export_spec(spec: KernelSpec, out_dir: str | Path, arch: str = "sm_90a", sass: bool = True) -> dict[str, Any]:
    """Compile `spec`, write `<out>/obj/<key>.o` and `<out>/lib/<key>.so`; return its manifest entry.

    `sass=True` (futx build, CI) also dumps and counts the SASS, which needs nvdisasm >= 13.4; the JIT path
    at run time passes False so a machine with an older CUDA toolkit can still compile."""
    out_dir = Path(out_dir)
    (out_dir / "obj").mkdir(parents=True, exist_ok=True)
    (out_dir / "lib").mkdir(parents=True, exist_ok=True)
    dump = Path(tempfile.mkdtemp(prefix=f"futx-sass-{spec.key}-"))
    if sass:
        os.environ["CUTE_DSL_KEEP"] = "cubin,sass"
        os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    t0 = time.time()
    try:
        compiled = compile_spec(spec, arch)
        compile_s = time.time() - t0
        obj = out_dir / "obj" / f"{spec.key}.o"
        compiled.export_to_c(str(obj), function_name=spec.symbol)
        if arch.encode() not in obj.read_bytes():
            # the DSL reads CUTE_DSL_ARCH once, at import: a process that imported it earlier builds for its default
            raise RuntimeError(f"{spec.key}: the object holds no {arch} code (the DSL was imported before "
                               f"CUTE_DSL_ARCH={arch} was set in this process)")
        runtime_lib = installed_runtime_lib()
        if runtime_lib is None:
            raise RuntimeError("libcute_dsl_runtime.so not found: install nvidia-cutlass-dsl[cu13]")
        lib = out_dir / "lib" / f"{spec.key}.so"
        link_shared(obj, lib, runtime_lib)
        sass_text = "\n".join(p.read_text(errors="replace") for p in sorted(dump.glob("*.sass")))
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    stats = sass_stats(sass_text) if sass_text else {}
    return {
        "object": f"obj/{spec.key}.o",
        "library": f"lib/{spec.key}.so",
        "symbol": spec.symbol,
        "params": {k: v for k, v in spec.params},
        "sass": stats,
        "sass_found": bool(sass_text),
        "compile_s": round(compile_s, 2),
    }
