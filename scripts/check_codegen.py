"""Check offline that the dense kernels compile to the same code in two trees (no GPU needed).

Usage:
    python scripts/check_codegen.py                  # HEAD against the working tree
    python scripts/check_codegen.py --new HEAD       # self-check: HEAD against HEAD, all identical
    python scripts/check_codegen.py --base HEAD~2 --new HEAD --arch 90 --kernel fwd_kernel
Options: --jobs N (parallel compiler processes, default: CPU count), --out DIR (keep the artifacts
there; by default a temporary folder, kept only when something differs), --show-diff N (lines of
diff printed per differing kernel, default 30).
Takes about 3-4 minutes on 2 CPU cores (200 compiles); more cores, less time.
Exit status: 0 every specialisation compiled on both sides to identical code; 1 one differs or
failed to compile on either side; 2 bad arguments or a revision that cannot be read.

What it does. Each side's library package is materialised in a temporary folder (a revision via
`git show REV:kernels/tritonattn/<file>`, the working tree as a snapshot of its files taken at start, so edits
made while the check runs do not leak in). Worker subprocesses (never both packages in one
interpreter; TRITON_INTERPRET unset) compile a fixed list of specialisations of the dense code
paths with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` for sm_90 (Hopper)
and sm_89 (Ada): ptxas runs too, from Triton's wheel, but nothing is launched. The TTGIR, the PTX
and a little metadata (shared memory, global scratch, warps, stages) of each are normalised and
compared:
- TTGIR: `loc(...)` debug locations and `#loc` aliases are removed, and SSA value names (which
  Triton takes from source variable names) are renumbered by first appearance, so moved lines or a
  renamed local variable do not count; the structure and every operation still must match.
- PTX: `.loc`/`.file` lines, debug labels (`$L__tmp*`, `$L__func_*`) and the DWARF `.debug_*`
  sections are removed. Identical PTX is the same program, but not always the same machine code:
  ptxas reads the line info too, and moving kernel code into a `@triton.jit` helper (same PTX
  instructions, other `.loc` lines) changed the SASS instruction order of one decode specialisation
  (sm_90, `cuobjdump -sass`), so a timing measured before such an edit need not hold after it.

Specialisations (the arguments Triton's launcher would build for contiguous tensors: every pointer
and every `stride_*` integer with the 16-divisibility hint, other integers plain "i32", scales
"fp32"; arguments that only the varlen or paged paths use are passed as Triton makes them when they
are None / False, see DENSE_VALUES, and are simply absent from older trees):
- prefill `fwd_kernel`, `bwd_dkdv_kernel`, `bwd_dq_kernel`: bf16, fp16 x head dim 64, 128 x causal
  or not x USE_TMA (sm_90: True and False, with `HOPPER_FWD` / `HOPPER_BWD` of kernels/tritonattn/config/tables.py;
  sm_89: False, with `SMALL_SMEM_FWD` / `SMALL_SMEM_BWD`, what an Ada GPU is given).
  `bwd_preprocess_kernel`: bf16, fp16 x 64, 128 (BLOCK_M=64, Triton's default 4 warps, 3 stages).
- decode `decode_kernel`: bf16, head dim 128, append x split x causal, STORE_LSE=False (the API's
  default), BLOCK_H=BLOCK_NEW=16 (GQA group 4, one new token) with `_HOPPER_DECODE` (sm_90) or
  `SMALL_SMEM_DECODE` (sm_89). `combine_kernel`: bf16, head dim 128, SPLITS_PAD 2 (1 warp) and
  64 (4 warps), the launcher's warp rule.
The tile tables are read from each side's own kernels/tritonattn/config/tables.py, so a config change shows up as
a difference (in the "config" column).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"  # --new / --base value meaning the files on disk
ARCHS = (90, 89)
ARTIFACTS = ("config", "ttgir", "ptx", "meta")  # compared in this order; "config" = the spec itself

# Arguments of the varlen / paged paths and the value the dense launchers give them. A kernel
# argument that is neither in the spec nor here falls back to its default in the signature (noted
# in the report); one without a default is an error.
DENSE_VALUES = {
    "Cu_seqlens_q": None,
    "Cu_seqlens_k": None,
    "stride_lseh": None,
    "IS_VARLEN": False,
    "Block_table": None,
    "stride_btb": None,
    "NUM_BLOCKS": None,
    "PAGED": False,
    "PAGE_SIZE": 1,
    "USE_PDL": False,  # decode / combine: programmatic dependent launch off (as on sm_89)
    "Cache_seqlens": None,
    "stride_kblk": None,
    "stride_vblk": None,
    "IS_KVCACHE": False,
    "KV_APPEND": False,
    # the options at their defaults (no variant, no dropout, no seqused_k), as AttnOptions passes them
    "window_left": -1,
    "window_right": -1,
    "softcap": 0.0,
    "HAS_WINDOW": False,
    "HAS_SOFTCAP": False,
    "HAS_ALIBI": False,
    "HAS_SINKS": False,
    "HAS_SEQUSED_K": False,
    "Alibi": None,
    "stride_alibi_b": None,
    "Sinks": None,
    "Seqused_k": None,
    "Rng": None,
    "keep_threshold": None,
    "dropout_scale": None,
    "HAS_DROPOUT": False,
    "WIDE_PAGES": False,
    "N_NEW": None,
    "Cache_leftpad": None,
    "HAS_LEFTPAD": False,
}
# Constexprs a spec gives that older trees' kernels may not have yet (dropped for those): EARLY_NEW,
# the decode kernel's early load of the new rows, which the dense launcher sets to APPEND, and ONE_LOOP,
# its single masked loop for short splits (compared off: the two loops that older trees always run).
OPTIONAL_CONSTS = {"EARLY_NEW", "ONE_LOOP"}
METADATA_KEYS = ("num_warps", "num_stages", "num_ctas", "shared", "global_scratch_size", "global_scratch_align",
                 "tmem_size")


# ============================================================================================
# Specialisations (worker side: the tile tables come from the materialised package)
# ============================================================================================
def _table(configs, name: str) -> dict:
    """A tile table of the tree's config module (public names; trees before the layered layout kept them
    underscored in tritonattn.config.tables)."""
    return getattr(configs, name) if hasattr(configs, name) else getattr(configs, "_" + name)


def _prefill_specs(configs, arch: int):
    fwd_table = _table(configs, "HOPPER_FWD" if arch >= 90 else "SMALL_SMEM_FWD")
    bwd_table = _table(configs, "HOPPER_BWD" if arch >= 90 else "SMALL_SMEM_BWD")
    for dt in ("bf16", "fp16"):
        for d in (64, 128):
            dims = {"HEAD_DIM": d, "HEAD_DIM_PAD": d}
            yield ("prefill_kernels", "bwd_preprocess_kernel", f"{dt} d{d}",
                   {"Out": f"*{dt}", "DO": f"*{dt}", "Delta": "*fp32", "H": "i32", "M": "i32"},
                   {**dims, "BLOCK_M": 64}, (4, 3))
            for causal in (False, True):
                for tma in ((True, False) if arch >= 90 else (False,)):
                    label = f"{dt} d{d} {'causal' if causal else 'full'} {'tma' if tma else 'ptr'}"
                    flags = {**dims, "IS_CAUSAL": causal, "USE_TMA": tma}
                    ints = {"H": "i32", "M": "i32", "N": "i32", "GROUP": "i32", "softmax_scale": "fp32"}
                    cfg = fwd_table[d]
                    yield ("prefill_kernels", "fwd_kernel", label,
                           {**{p: f"*{dt}" for p in ("Q", "K", "V", "Out")}, "Lse": "*fp32", **ints},
                           {**flags, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, (cfg.num_warps, cfg.num_stages))
                    for kernel, cfg, outs in (("bwd_dkdv_kernel", bwd_table[d][0], ("DK", "DV")),
                                              ("bwd_dq_kernel", bwd_table[d][1], ("DQ",))):
                        yield ("prefill_kernels", kernel, label,
                               {**{p: f"*{dt}" for p in ("Q", "K", "V", "DO", *outs)}, "Lse": "*fp32",
                                "Delta": "*fp32", **ints},
                               {**flags, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
                               (cfg.num_warps, cfg.num_stages))


def _decode_specs(configs, arch: int):
    dt, d = "bf16", 128
    cfg = _table(configs, "HOPPER_DECODE" if arch >= 90 else "SMALL_SMEM_DECODE")[d]
    block_h = min(max(16, 4), max(16, cfg.max_rows))  # the launcher's rule for 4 query rows
    block_new = min(cfg.block_n, 16)  # ... and for one new token
    for append in (False, True):
        for split in (False, True):
            for causal in (False, True):
                label = (f"{dt} d{d} {'append' if append else 'noappend'} {'split' if split else 'nosplit'} "
                         f"{'causal' if causal else 'full'}")
                part = "*fp32" if split else f"*{dt}"  # unsplit, the launcher passes `out` for the scratch
                types = {**{p: f"*{dt}" for p in ("Q", "K_cache", "V_cache", "K_new", "V_new", "Out")},
                         "Cache_seqlens": "*i32", "Lse": f"*{dt}", "Out_part": part, "Lse_part": part,
                         "H_KV": "i32", "GROUP": "i32", "M": "i32", "M_NEW": "i32", "N_CACHE": "i32",
                         "SPLIT_N": "i32:D",  # a multiple of BLOCK_N
                         "softmax_scale": "fp32"}
                consts = {"HEAD_DIM": d, "HEAD_DIM_PAD": d, "BLOCK_H": block_h, "BLOCK_N": cfg.block_n,
                          "BLOCK_NEW": block_new, "IS_CAUSAL": causal, "APPEND": append, "SPLIT": split,
                          "STORE_LSE": False, "EARLY_NEW": append, "ONE_LOOP": False}
                yield "decode_kernels", "decode_kernel", label, types, consts, (cfg.num_warps, cfg.num_stages)
    for splits_pad in (2, 64):
        yield ("decode_kernels", "combine_kernel", f"{dt} d{d} splits_pad{splits_pad}",
               {"Out_part": "*fp32", "Lse_part": "*fp32", "Out": f"*{dt}", "Lse": f"*{dt}",
                "H": "i32", "M": "i32", "NUM_SPLITS": "i32"},
               {"HEAD_DIM": d, "HEAD_DIM_PAD": d, "SPLITS_PAD": splits_pad, "STORE_LSE": False},
               (4 if splits_pad * d >= 4096 else 1, 1))


def enumerate_specs(configs, archs, kernel_filter: str = ""):
    """[(name, module, kernel, arch, label, types, constexprs, (num_warps, num_stages))], sorted by name."""
    specs = []
    for arch in archs:
        for gen in (_prefill_specs, _decode_specs):
            for module, kernel, label, types, consts, launch in gen(configs, arch):
                if kernel_filter and kernel_filter not in f"{module}.{kernel}":
                    continue
                name = f"sm{arch}.{module}.{kernel}.{label.replace(' ', '-')}"
                specs.append((name, module, kernel, arch, label, types, consts, launch))
    return sorted(specs)


def build_source_args(fn, types: dict, consts: dict):
    """ASTSource's (signature, constexprs, attrs) for `fn`, built from its own arg_names.

    Returns them and the notes on arguments that fell back to their defaults.
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = {p.name: p for p in fn.params}
    defaults = inspect.signature(fn.fn).parameters
    signature, constexprs, attrs, notes = {}, {}, {}, []
    consts = {k: v for k, v in consts.items() if k in fn.arg_names or k not in OPTIONAL_CONSTS}
    for i, name in enumerate(fn.arg_names):
        hint = False
        if name in consts:
            if not params[name].is_constexpr:
                raise TypeError(f"{fn.__name__}: spec gives {name} as a constexpr, the kernel does not declare one")
            ty, constexprs[name] = "constexpr", consts[name]
        elif name in types:
            ty, _, flag = types[name].partition(":")
            hint = ty.startswith("*") or flag == "D"
        elif name.startswith("stride_") and name not in DENSE_VALUES:
            ty, hint = "i32", True  # contiguous tensors of head dim >= 16: every stride divisible by 16
        else:
            if name in DENSE_VALUES:
                value = DENSE_VALUES[name]
            elif defaults[name].default is not inspect.Parameter.empty:
                value = defaults[name].default
                notes.append(f"{name}={value!r} (its default: not in DENSE_VALUES)")
            else:
                raise KeyError(f"{fn.__name__}: no dense value for argument {name!r}; add it to DENSE_VALUES")
            # what Triton's launcher makes of this value: None (and 1) become constexprs
            ty, spec = ("constexpr", None) if params[name].is_constexpr else native_specialize_impl(
                BaseBackend, value, False, True, True)
            if ty == "constexpr":
                constexprs[name] = value
            hint = spec == "D"
        signature[name] = ty
        if hint:
            attrs[(i,)] = [["tt.divisibility", 16]]
    unused = set(types) | set(consts)
    unused -= set(fn.arg_names)
    if unused:
        raise KeyError(f"{fn.__name__}: spec names arguments the kernel does not have: {sorted(unused)}")
    return signature, constexprs, attrs, notes


# ============================================================================================
# Normalisation
# ============================================================================================
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_SSA = re.compile(r"%[A-Za-z_$.][\w$.\-]*|%\d+")


def _drop_loc_calls(line: str) -> str:
    """Remove every `loc(...)` (balanced parentheses, quoted strings skipped) from one MLIR line."""
    out, i = [], 0
    while True:
        j = line.find("loc(", i)
        while j > 0 and (line[j - 1].isalnum() or line[j - 1] in "_#."):
            j = line.find("loc(", j + 4)
        if j < 0:
            out.append(line[i:])
            return "".join(out).rstrip()
        out.append(line[i:j].rstrip(" "))
        depth, k = 0, j + 3
        while k < len(line):
            c = line[k]
            if c == '"':
                k = _QUOTED.match(line, k).end()
                continue
            depth += (c == "(") - (c == ")")
            k += 1
            if depth == 0:
                break
        i = k


def normalise_ttgir(text: str) -> str:
    lines = [_drop_loc_calls(line) for line in text.splitlines() if not re.match(r"\s*#loc\d* = ", line)]
    text = "\n".join(lines) + "\n"
    names: dict = {}

    def rename(part: str) -> str:
        return _SSA.sub(lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), part)

    # SSA names outside quoted strings, numbered by first appearance
    pieces, pos = [], 0
    for m in _QUOTED.finditer(text):
        pieces += [rename(text[pos:m.start()]), m.group(0)]
        pos = m.end()
    pieces.append(rename(text[pos:]))
    return "".join(pieces)


def normalise_ptx(text: str) -> str:
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(".section") and ".debug_" in s:
            break  # DWARF sections run to the end of the file
        if s.startswith((".loc", ".file")) or re.match(r"\$L__(tmp|func_begin|func_end)\d+:$", s):
            continue
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


# ============================================================================================
# Worker: compile one shard of the specialisations of one materialised package
# ============================================================================================
def worker(pkg_root: Path, out: Path, shard: int, shards: int, archs, kernel_filter: str) -> int:
    sys.path.insert(0, str(pkg_root))
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:  # the layered layout's tables, else an older tree's flat module
        configs = importlib.import_module("tritonattn.config.tables")
    except ModuleNotFoundError:
        configs = importlib.import_module("tritonattn._configs")
    if pkg_root.resolve() not in Path(configs.__file__).resolve().parents:
        raise RuntimeError(f"imported {configs.__file__}, not the package under {pkg_root}")
    out.mkdir(parents=True, exist_ok=True)
    for name, module, kernel, arch, label, types, consts, (num_warps, num_stages) in \
            enumerate_specs(configs, archs, kernel_filter)[shard::shards]:
        record = {"name": name, "kernel": f"{module}.{kernel}", "arch": arch, "label": label}
        t0 = time.time()
        try:
            fn = _find_kernel(importlib, module, kernel)
            signature, constexprs, attrs, notes = build_source_args(fn, _scale_types(fn, types), consts)
            record["notes"] = notes
            # compared: what the tile tables and the spec decide (the full signature is in the TTGIR)
            record["config"] = {**{k: repr(v) for k, v in consts.items()}, "num_warps": num_warps,
                                "num_stages": num_stages}
            record["dense_extras"] = {k: repr(v) for k, v in constexprs.items() if k not in consts}
            record["signature"] = signature
            record["attrs"] = sorted(str(k) for k in attrs)
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": num_warps, "num_stages": num_stages})
            meta = compiled.metadata._asdict()
            record["meta"] = {k: meta[k] for k in METADATA_KEYS if k in meta}
            for ext, norm in (("ttgir", normalise_ttgir), ("ptx", normalise_ptx)):
                (out / f"{name}.raw.{ext}").write_text(compiled.asm[ext])
                (out / f"{name}.{ext}").write_text(norm(compiled.asm[ext]))
        except Exception as e:  # reported in the table, never skipped
            record["error"] = f"{type(e).__name__}: {e}".strip()
        record["seconds"] = round(time.time() - t0, 2)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        print(f"{'FAIL' if 'error' in record else 'ok  '} {record['seconds']:6.1f}s {name}", flush=True)
    return 0


# Where each kernel family lives in the layered layout (tritonattn.jit.*); older trees kept them in
# tritonattn.<module> (prefill_kernels, decode_kernels).
JIT_MODULES = {"prefill_kernels": ("tritonattn.jit.prefill_fwd", "tritonattn.jit.prefill_bwd"),
               "decode_kernels": ("tritonattn.jit.decode",)}


def _find_kernel(importlib, module: str, kernel: str):
    """`kernel` of the family `module`, from the layered layout's jit modules or an older tree's flat one."""
    for name in JIT_MODULES.get(module, ()):
        try:
            found = getattr(importlib.import_module(name), kernel, None)
        except ModuleNotFoundError:
            break
        if found is not None:
            return found
    return getattr(importlib.import_module(f"tritonattn.{module}"), kernel)


SCALE_PARAMETERS = ("softmax_scale", "qk_scale", "sm_scale")  # the runtime scale, by tree: all fp32 scalars


def _scale_types(fn, types: dict) -> dict:
    """`types` with the scale parameters this kernel has (softmax_scale; older trees: qk_scale, sm_scale)."""
    if "softmax_scale" not in types:
        return types
    types = {k: v for k, v in types.items() if k not in SCALE_PARAMETERS}
    types.update({name: "fp32" for name in SCALE_PARAMETERS if name in fn.arg_names})
    return types


# ============================================================================================
# Driver
# ============================================================================================
def materialise(rev: str, dest: Path) -> str:
    """Write `rev`'s library package (or the working tree's) under dest/tritonattn; returns a description.
    The package is kernels/tritonattn/ (kernels/ itself in revisions older than the source-root layout); its
    modules import each other relatively, so either is materialised under the one name."""
    pkg = dest / "tritonattn"
    pkg.mkdir(parents=True)
    if rev == WORKTREE:
        src = REPO / "kernels" / "tritonattn"
        for f in sorted(src.rglob("*.py")):  # the layers' folders too
            if "__pycache__" not in f.parts:
                target = pkg / f.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "kernels"],
                               capture_output=True, text=True).stdout.split("\n")
        n = len([d for d in dirty if d])
        return f"working tree (snapshot {time.strftime('%H:%M:%S')}, {n} file{'s' * (n != 1)} changed from HEAD)"
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    files = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", sha, "--", "kernels/"],
                           capture_output=True, text=True, check=True).stdout.split()
    prefix = "kernels/tritonattn/" if any(f.startswith("kernels/tritonattn/") for f in files) else "kernels/"
    for path in (f for f in files if f.startswith(prefix)):
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{sha}:{path}"], capture_output=True, check=True)
        target = pkg / path[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob.stdout)
    return f"{rev} ({sha})"


def compare(base_dir: Path, new_dir: Path, show_diff: int):
    """Table rows (kernel, arch, label, differs, detail) and printable diffs, per spec name."""
    names = sorted({p.name[:-5] for d in (base_dir, new_dir) for p in d.glob("*.json")})
    rows, diffs, extras = [], [], set()
    for name in names:
        recs = []
        for d in (base_dir, new_dir):
            p = d / f"{name}.json"
            recs.append(json.loads(p.read_text()) if p.exists() else {"error": "not compiled (worker failed)"})
        head = next(r for r in recs if "kernel" in r)
        for side, r in zip(("base", "new"), recs):
            if r.get("dense_extras"):
                args = ", ".join(f"{k}={v}" for k, v in r["dense_extras"].items())
                extras.add(f"{side} {head['kernel']}: {args}")
        errors = [(side, r["error"]) for side, r in zip(("base", "new"), recs) if "error" in r]
        for side, err in errors:  # each distinct message once, in full (Triton's shows the source line)
            text = f"{side} {head['kernel']} failed to compile:\n    " + "\n    ".join(err.splitlines()[:show_diff])
            if text not in diffs:
                diffs.append(text)
        if errors:  # in the table: the last line, which names the error
            errors = [f"{side}: {[ln for ln in err.splitlines() if ln.strip()][-1].strip()[:150]}"
                      for side, err in errors]
            rows.append((head["kernel"], head["arch"], head["label"], "ERROR", "; ".join(errors)))
            continue
        differs = []
        for art in ARTIFACTS:
            if art in ("config", "meta"):
                a, b = (json.dumps(r[art], indent=1, sort_keys=True).splitlines() for r in recs)
            else:
                a, b = ((d / f"{name}.{art}").read_text().splitlines() for d in (base_dir, new_dir))
            if a != b:
                differs.append(art)
                diff = list(difflib.unified_diff(a, b, f"base/{name}.{art}", f"new/{name}.{art}", lineterm="", n=2))
                diffs.append("\n".join(diff[:show_diff] + ([f"... ({len(diff) - show_diff} more lines)"]
                                                           if len(diff) > show_diff else [])))
        notes = sorted(set(recs[0].get("notes", []) + recs[1].get("notes", [])))
        detail = "; ".join((["differs: " + ", ".join(differs)] if differs else []) + notes)
        rows.append((head["kernel"], head["arch"], head["label"], "no" if differs else "yes", detail))
    rows.sort(key=lambda r: (r[0], -r[1], r[2]))
    return rows, diffs, sorted(extras)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision (or WORKTREE), default HEAD")
    ap.add_argument("--new", default=WORKTREE, help="git revision or WORKTREE (the files on disk, default)")
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--kernel", default="", help="only kernels whose module.name contains this")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None, help="keep the materialised trees and artifacts here")
    ap.add_argument("--show-diff", type=int, default=30, metavar="N")
    ap.add_argument("--worker", nargs=3, metavar=("PKG_ROOT", "OUT", "SHARD/SHARDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        shard, shards = map(int, args.worker[2].split("/"))
        return worker(Path(args.worker[0]), Path(args.worker[1]), shard, shards, args.arch, args.kernel)

    t0 = time.time()
    out = args.out or Path(tempfile.mkdtemp(prefix="check_codegen_"))
    out.mkdir(parents=True, exist_ok=True)
    sides = {}
    for side, rev in (("base", args.base), ("new", args.new)):
        try:
            sides[side] = materialise(rev, out / side / "src")
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"cannot materialise {side} = {rev}: {e}", file=sys.stderr)
            return 2
        print(f"{side}: {sides[side]}")

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    shards = max(1, args.jobs // 2)
    procs = []
    for side in sides:
        env_side = dict(env, TRITON_CACHE_DIR=str(out / side / "triton_cache"))  # fresh: every spec compiles
        for i in range(shards):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out / side / "src"),
                   str(out / side / "artifacts"), f"{i}/{shards}", "--arch", *map(str, args.arch),
                   "--kernel", args.kernel]
            log = open(out / side / f"worker{i}.log", "w")
            procs.append((side, i, log, subprocess.Popen(cmd, env=env_side, stdout=log, stderr=subprocess.STDOUT,
                                                         cwd=out)))
    failed_workers = []
    for side, i, log, proc in procs:
        if proc.wait() != 0:
            failed_workers.append((side, i))
        log.close()
    for side in sides:  # Triton's cache (cubins and all) is large and not needed past this point
        shutil.rmtree(out / side / "triton_cache", ignore_errors=True)
    for side, i in failed_workers:
        tail = (out / side / f"worker{i}.log").read_text().splitlines()[-15:]
        print(f"\nworker {side}#{i} failed:\n    " + "\n    ".join(tail))

    rows, diffs, extras = compare(out / "base" / "artifacts", out / "new" / "artifacts", args.show_diff)
    wk = max([len(r[0]) for r in rows] + [6])
    wl = max([len(r[2]) for r in rows] + [14])
    print(f"\n{'kernel':<{wk}}  {'arch':<6}  {'specialisation':<{wl}}  identical")
    for kernel, arch, label, same, detail in rows:
        print(f"{kernel:<{wk}}  sm_{arch:<3}  {label:<{wl}}  {same:<9}  {detail}".rstrip())
    n_same = sum(r[3] == "yes" for r in rows)
    bad = len(rows) - n_same + len(failed_workers)
    if extras:
        print("\narguments not in the spec, passed as the dense launchers pass them (constexprs):")
        print("\n".join(f"    {e}" for e in extras))
    for d in diffs:
        print("\n" + d)
    print(f"\n{n_same}/{len(rows)} specialisations identical ({args.base} vs "
          f"{'the working tree' if args.new == WORKTREE else args.new}); {time.time() - t0:.0f}s")
    if bad or not rows or args.out:
        print(f"artifacts: {out}")
    else:
        shutil.rmtree(out)
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
