"""Tuning space of the kernels: the design alternatives the routers never pick.

The package registry holds only what the routers launch (decode.plan.choose for the projections, the default
kernel per cache format for decode attention; docs/routing.md). The variants here stay compilable and
measurable, but are not shipped and not built by the default `futx build`:

    decode.gemv.int4[g64].m16.*               the INT4 persistent GEMV with two token groups (M bucket 16)
    decode.gemv.int4.m8.*.{nofold,r2}         the persistent GEMV without the fold / scales converted at the load
    decode.gemv.int4.m1.*[.w8].{p1,p3,p4,rolling,ring4,ring8,fold}   the tile GEMV with other batch sizes / a rolling
                                              prefetch / a shared-memory ring / the folded nibble bias
    decode.gemv.int4.m1.residual[.w8].split   the tile GEMV with split-K over the CTAs of a tile
    decode.tile.int4.m8.{residual[.w8],store,swiglu[.norm]}[.nb<c>]   the multi-token tile GEMV the router does not
                                              pick (the residual epilogue; 4 warps)
    decode.gemv.int4.m1.*.w{6,12,16}[.norm|.p3]   the M = 1 tile GEMV at the fill rule's warp counts
    decode.gemv.int4.m1.*[.w8][.norm|.p3].nb{2,3,4}   the M = 1 tile GEMV with several n-blocks per CTA
    decode.skinny.int4.m{16,32}.*[.s3|.s4|.c2]  the skinny kernel with its weights through the ring (the INT4 g128
                                              router runs its register-weights form, P15), shorter rings (more CTAs
                                              per SM), two MMA chains
    decode.skinny.int4.m16.*.{rw1,rw4}, .m32.*.{rw,rw4}, .m64.*.rww1   the register-weights skinny kernel the bucket
                                              does not route
    decode.skinny.int4[g64].m{16,32}.*.{wg,wgo,rwg,rwgo}  the skinny kernel on warpgroup MMA (decode/skinny_wgmma.py)
    decode.skinny.e4m3.m16.*.{ws,wsk}         the warp-specialized E4M3 kernel at M <= 16 (routed from 17 rows, P18)
    decode.skinny.e4m3.m32.*, .m64.*.rww      the E4M3 kernels P18 replaced (the ring and register-weights kernels)
    decode.attn.int4.d128.rot.{table,s2,vlut,w6v,fx}   INT4 attention alternatives (catalog VARIANTS)
    prefill.gemm.<ab>.<chain>[.n256|.n256.st|.n256.pp.g16|.n256.pp.c1|.n256.pp.c2x2|.n256.c2x2]   prefill schedules
                                              and clusters (catalog prefill.TUNING)
    decode.persistent.chain                   the persistent kernel's task loop on trivial tasks (issue 29)
    decode.persistent.projections.m1[.c2]     a layer's four projections as tasks of one persistent launch, 1 or 2
                                              CTAs per SM (issue 29)
    decode.persistent.ring.int4.d128[.m8].{la,s4,s8}   the ring layer with its consumers one stage ahead / a ring
                                              of 4 or 8 stages (catalog persistent.RING_TUNING; issue 29)

Use from Python (benchmarks, GPU tests), before naming a key:

    import tuning_space; tuning_space.register()     # then futx.runtime.get_kernel(key) / build(only=...) see them

or from the shell, to compile on demand (AOT, like `futx build`, into the same kind of directory):

    python scripts/tuning_space.py list [--only PATTERN]
    python scripts/tuning_space.py build --out DIR [--only PATTERN] [--jobs N] [--force] [--no-runtime]
    python scripts/tuning_space.py missing --aot DIR [--only PATTERN]    # keys DIR's manifest lacks (no DSL needed)

For a GPU run in AOT mode, build the tuning space into the stage's build directory before staging, e.g.
`python scripts/tuning_space.py build --out .gpu/aot --no-runtime && scripts/gpu/stage.sh` (the build keeps
the manifest's other entries, and stage.sh ships every entry of that manifest).

The specs are built by the catalogs' own spec functions, so keys and compile parameters match what the
routers' `kernel=`/`variant=` overrides name. The CPU compile check (tests/test_kernel_compile.py) compiles the
package catalogs' SPECS only, never these.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode import plan  # noqa: E402
from futx.runtime import registry  # noqa: E402
from futx.runtime.catalog import decode_attention as attn_catalog  # noqa: E402
from futx.runtime.catalog import decode_linear as linear_catalog  # noqa: E402
from futx.runtime.catalog import persistent as persistent_catalog  # noqa: E402
from futx.runtime.catalog import prefill as prefill_catalog  # noqa: E402
from futx.runtime.registry import KernelSpec  # noqa: E402


def linear_specs() -> list[KernelSpec]:
    """Decode projection variants that decode.plan.choose(kernel="auto") never returns."""
    specs = [linear_catalog.gemv_spec(f, g, e, m) for f, g in linear_catalog.FORMATS
             for e in plan.EPILOGUES for m in plan.GEMV_M_TILES if m not in plan.gemv_buckets(f)]
    specs += [linear_catalog.gemv_spec("int4", 128, e, 8, v) for v in plan.GEMV_VARIANTS if v
              for e in plan.EPILOGUES]
    shipped = {s.key for s in linear_catalog.SPECS}
    specs += [s for s in (linear_catalog.tile_spec(f, g, e, w, v) for f, g in plan.TILE_FORMATS
                          for v in plan.TILE_VARIANTS if v for e in plan.EPILOGUES for w in linear_catalog.TILE_WARPS)
              if s.key not in shipped]
    specs += [linear_catalog.tile_spec(f, g, e, w, v, norm=True) for f, g in plan.TILE_FORMATS
              for v in plan.TILE_VARIANTS if v
              for e in plan.NORM_EPILOGUES for w in linear_catalog.TILE_WARPS]
    specs += [linear_catalog.tile_spec(f, g, e, w, split=True) for f, g in plan.TILE_FORMATS
              for e in plan.TILE_SPLIT_EPILOGUES for w in linear_catalog.TILE_WARPS]
    specs += linear_catalog.multi_token_tile_specs(routed=False)
    specs += linear_catalog.fill_tile_specs()
    specs += linear_catalog.nblocks_tile_specs()
    # the 64-row bucket has its own (one CTA per SM) variants, the smaller buckets every other one
    specs += [linear_catalog.skinny_spec("int4", 128, e, m, v) for m in plan.SKINNY_M_TILES
              for v in plan.SKINNY_VARIANTS if v not in plan.skinny_routed_variants("int4", 128, m)
              and ((v in plan.WIDE_VARIANTS) == (m == 64) or v in plan.ANY_BUCKET_VARIANTS) for e in plan.EPILOGUES]
    specs += [linear_catalog.skinny_spec("int4", 64, e, m, v) for v in ("wg", "wgo", "rwg", "rwgo")
              for e in plan.EPILOGUES for m in (16, 32)]
    # the warp-specialized kernel on E4M3 weights (decode/skinny_ws_e4m3.py), every token bucket, where not routed
    # (P18 routes it from 17 rows on), and the kernels P18 replaced there
    specs += [linear_catalog.skinny_spec("e4m3", 128, e, m, v) for m in plan.SKINNY_M_TILES
              for v in plan.E4M3_WS_VARIANTS + plan.skinny_replaced_variants("e4m3", 128, m)
              if v not in plan.skinny_routed_variants("e4m3", 128, m) for e in plan.EPILOGUES]
    return specs


def attention_specs() -> list[KernelSpec]:
    """INT4 decode attention variants (rotated, head dim 128) that the op runs only when `variant=` names them."""
    return [attn_catalog.attn_spec("int4", 128, True, v) for v in attn_catalog.TUNING]


def prefill_specs() -> list[KernelSpec]:
    """Prefill GEMM schedules the variant rule never picks (coop 128x256, stagger, raster group 16, no cluster),
    for every shipped chain (futx.runtime.catalog.prefill.TUNING); the op also compiles them on demand."""
    return prefill_catalog.tuning_specs()


def persistent_specs() -> list[KernelSpec]:
    """The persistent kernel's task loop on trivial tasks (decode/persistent_loop.py): the GPU test of its counters
    and the measurement of a handoff; the projections alone on the tile bodies; the ring layer's variants (issue 29)."""
    return [KernelSpec(key="decode.persistent.chain", module="decode.persistent_loop", factory="chain_target",
                       sources=("decode/persistent_loop.py", "decode/persistent_host.py", "decode/persistent_schedule.py",
                                "decode/ptx.py"),
                       doc="the persistent task loop on a chain of 3-input tile tasks (ordering test, handoff)"),
            *(KernelSpec(key="decode.persistent.projections.m1" + ("" if c == 1 else f".c{c}"),
                         module="decode.persistent_layer", factory="projections_target", params=(("ctas_per_sm", c),),
                         sources=persistent_catalog.SOURCES,
                         expect_sass=("HMMA",),
                         doc=f"a decode layer's four INT4 projections (M = 1) as tasks of one persistent launch, the "
                             f"tile GEMV's bodies ordered by counters (attention not in it yet), {c} CTA(s) per SM")
              for c in (1, 2)),
            *(persistent_catalog.ring_spec("int4", tokens, False, v)
              for tokens in persistent_catalog.TOKENS for v in persistent_catalog.RING_TUNING),
            *(persistent_catalog.ring_spec("int4", 1, True, v) for v in persistent_catalog.RING_TRACED_TUNING)]


def specs(patterns: str | None = None) -> list[KernelSpec]:
    """Every tuning-space spec, or those whose key matches one of the comma-separated glob patterns."""
    out = linear_specs() + attention_specs() + prefill_specs() + persistent_specs()
    if patterns:
        pats = [p for p in patterns.split(",") if p]
        out = [s for s in out if any(fnmatch.fnmatchcase(s.key, p) for p in pats)]
    return out


def register() -> list[KernelSpec]:
    """Add the tuning space to this process's registry (idempotent); returns its specs."""
    all_ = specs()
    registry.all_specs()  # load the package catalog first, so a key clash with it raises here
    registry.register(*all_)
    return all_


def build(out: str | Path, only: str | None = None, **kwargs):
    """Compile the tuning-space variants matching `only` (default: all) into `out` (see futx.runtime.build)."""
    from futx.runtime.build import build as _build

    register()
    keys = [s.key for s in specs(only)]
    if not keys:
        raise ValueError(f"no tuning-space variant matches {only!r}")
    return _build(out, only=keys, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tuning_space.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list the tuning-space keys")
    ls.add_argument("--only", default=None, help="comma-separated glob patterns of kernel keys")
    b = sub.add_parser("build", help="compile tuning-space variants ahead of time into DIR")
    b.add_argument("--out", required=True, help="output directory (re-running skips up-to-date kernels)")
    b.add_argument("--only", default=None, help="comma-separated glob patterns, e.g. 'decode.attn.*.fx'")
    b.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    b.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    b.add_argument("--force", action="store_true", help="rebuild even up-to-date kernels")
    b.add_argument("--no-runtime", action="store_true", help="do not copy libcute_dsl_runtime.so into DIR/lib")
    mi = sub.add_parser("missing", help="print the tuning-space keys an AOT directory's manifest lacks")
    mi.add_argument("--aot", required=True, help="AOT directory (holding manifest.json)")
    mi.add_argument("--only", default=None, help="comma-separated glob patterns of kernel keys")
    args = ap.parse_args(argv)
    if args.command == "list":
        for s in specs(args.only):
            print(f"{s.key:56s} {s.module}  {dict(s.params)}")
        return 0
    if args.command == "missing":
        import json

        path = Path(args.aot) / "manifest.json"
        staged = json.loads(path.read_text()).get("entries", {}) if path.is_file() else {}
        missing = [s.key for s in specs(args.only) if s.key not in staged]
        for key in missing:
            print(key)
        return 0
    manifest = build(args.out, only=args.only, arch=args.arch, jobs=args.jobs, force=args.force,
                     bundle_runtime=not args.no_runtime)
    print(f"{len(specs(args.only))} tuning variants built; {len(manifest['entries'])} kernels in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
