"""Shared memory of kernel launches compiled for GPUs that are not here: Triton cross-compiles
without a GPU (`ASTSource` + `GPUTarget`), and the bytes a block needs are known once the TritonGPU
module has its shared memory allocated, before LLVM and ptxas run.

`specs_of(records, target)` turns `tritonattn.launch.fast.recording`'s launch records into plain JSON specs
(the kernel's module and name, the signature Triton's launcher would build, constexprs, alignment
hints, launch options); `shared_bytes(specs)` compiles each spec in worker processes started without
TRITON_INTERPRET (the interpreter's kernels cannot be compiled) and returns the bytes per spec.
Run as a script, this file is that worker: JSON specs on stdin, one JSON result per line on stdout.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
POINTER_TYPES = {"torch.float16": "*fp16", "torch.bfloat16": "*bf16", "torch.float32": "*fp32",
                 "torch.int32": "*i32", "torch.int64": "*i64", "torch.float8_e4m3fn": "*fp8e4nv"}


# --------------------------------------------------------------------------------------------
# Launch records -> JSON specs (in the test process; no compiler needed)
# --------------------------------------------------------------------------------------------
def spec_of(record, arch: int) -> dict:
    """The compile spec of one `LaunchRecord` for sm_<arch>, specialised as Triton's launcher does:
    constexpr parameters and None arguments compiled in, an integer equal to 1 as the constant 1,
    16-divisible integers and 16-byte aligned pointers with the divisibility hint."""
    import torch

    from tritonattn.launch.fast import is_constexpr

    fn = getattr(record.fn, "fn", record.fn)  # the Python function behind the JIT (or interpreted) kernel
    params = list(inspect.signature(fn).parameters.values())
    signature, constexprs, divisible = {}, {}, []
    for i, (param, value) in enumerate(zip(params, record.args)):
        name = param.name
        if is_constexpr(param.annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[str(value.dtype)]
            if value.data_ptr() % 16 == 0:
                divisible.append(i)
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    divisible.append(i)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot specialise argument {name}={value!r}")
    constexpr_names = [p.name for p in params if is_constexpr(p.annotation)]
    options = {"num_warps": record.num_warps, "num_stages": record.num_stages}
    if record.launch_pdl:
        options["launch_pdl"] = True
    if record.maxnreg is not None:
        options["maxnreg"] = record.maxnreg
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "divisible": divisible, "options": options, "arch": arch, "constexpr_names": constexpr_names}


def spec_key(spec: dict) -> str:
    """The spec as text: equal keys compile to the same kernel."""
    return json.dumps(spec, sort_keys=True)


TILE_CONSTEXPRS = ("HEAD_DIM_PAD", "USE_TMA", "NUM_STAGES")  # besides BLOCK_*: what sizes a block's shared memory


def class_key(spec: dict) -> str:
    """The spec's launch class: kernel, launch options, pointer dtypes and tile constexprs (BLOCK_*,
    TILE_CONSTEXPRS), without the semantic flags (causal, variants, paging). One compile per class is the
    coarse check CI runs under every Triton of the supported range: each tile of each table compiles."""
    tiles = {k: v for k, v in spec["constexprs"].items() if k.startswith("BLOCK") or k in TILE_CONSTEXPRS}
    pointers = sorted({v for v in spec["signature"].values() if v.startswith("*")})
    return json.dumps({"name": spec["name"], "options": spec["options"], "arch": spec["arch"], "tiles": tiles,
                       "pointers": pointers}, sort_keys=True)


def tile_key(spec: dict) -> str:
    """The spec without the launcher's integer and alignment specialisations (an integer argument equal to
    1 compiled in as a constant, divisibility hints): those change address arithmetic and vector widths,
    not the tiles a block stages in shared memory, so one compile per tile key measures them all."""
    declared = set(spec["constexpr_names"])
    signature = {k: ("i32" if v == "constexpr" and k not in declared and spec["constexprs"][k] == 1 else v)
                 for k, v in spec["signature"].items()}
    constexprs = {k: v for k, v in spec["constexprs"].items() if signature[k] == "constexpr"}
    return json.dumps(dict(spec, signature=signature, constexprs=constexprs, divisible=[]), sort_keys=True)


# --------------------------------------------------------------------------------------------
# Compiling (in worker processes without TRITON_INTERPRET)
# --------------------------------------------------------------------------------------------
def _compile_shared(spec: dict) -> int:
    """Bytes of shared memory one block of the spec's kernel needs on sm_<arch>."""
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}
    target = GPUTarget("cuda", spec["arch"], 32)
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel starts at TTGIR: compile it whole (ptxas too)
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, spec["signature"], spec["constexprs"], attrs)
        return int(triton.compile(src, target=target, options=spec["options"]).metadata.shared)
    src = ASTSource(fn, spec["signature"], spec["constexprs"], attrs)
    backend = make_backend(target)
    options = backend.parse_options(spec["options"])
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    metadata: dict = {}
    module = stages["ttir"](module, metadata)
    module = stages["ttgir"](module, metadata)
    try:  # make_llir's passes up to shared-memory allocation (Triton 3.6), without LLVM and ptxas
        from triton._C.libtriton import nvidia, passes
        from triton.backends.nvidia.compiler import get_ptx_version_from_options

        pm = ir.pass_manager(module.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, spec["arch"],
                                                            get_ptx_version_from_options(options, target.arch))
        pm.run(module, "shared_memory")
        shared = module.get_int_attr("ttg.shared")
    except (ImportError, AttributeError, TypeError):  # another Triton: the whole LLVM stage
        stages["llir"](module, metadata)
        shared = metadata["shared"]
    return int(shared or 0)


def _worker() -> None:
    for line in sys.stdin:
        spec = json.loads(line)
        try:
            result = {"shared": _compile_shared(spec)}
        except Exception as exc:  # a spec that does not compile is a failure the test reports
            result = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        print(json.dumps(result), flush=True)


def shared_bytes(specs: Sequence[dict], jobs: int = 0) -> List[Dict]:
    """{"shared": bytes} or {"error": text} per spec, compiled in `jobs` worker processes (default: CPUs)."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(REPO_ROOT / "kernels"), str(REPO_ROOT), env.get("PYTHONPATH")]  # tritonattn, then the tests' own
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    chunks = [list(range(i, len(specs), jobs)) for i in range(jobs)]

    def run(indices):
        text = "".join(json.dumps(specs[i]) + "\n" for i in indices)
        out = subprocess.run([sys.executable, __file__], input=text, capture_output=True, text=True, env=env,
                             cwd=REPO_ROOT)
        lines = out.stdout.splitlines()
        if out.returncode != 0 or len(lines) != len(indices):
            raise RuntimeError(f"cross-compile worker failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
        return zip(indices, map(json.loads, lines))

    results: List[Dict] = [{} for _ in specs]
    with ThreadPoolExecutor(jobs) as pool:
        for pairs in pool.map(run, chunks):
            for i, result in pairs:
                results[i] = result
    return results


if __name__ == "__main__":
    _worker()
