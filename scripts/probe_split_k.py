"""Where the split-K exchange's time goes: prefill GEMM at (M, N, K) with splits 1..4, CUDA-graph replay.

    python scripts/probe_split_k.py [--shapes 512x2048x512,512x2048x2048] [--ab bf16] [--once]
--once: one call per (shape, splits) and nothing else (for Nsight Compute).
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x2048x512,512x2048x2048,512x2048x8192")
    ap.add_argument("--ab", default="bf16")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--variants", default="n128")
    args = ap.parse_args()
    import futx.ops  # noqa: F401
    from futx.ops import prefill

    dt = torch.bfloat16 if args.ab == "bf16" else torch.float8_e4m3fn
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        a = torch.randn(m, k, device="cuda").to(dt)
        w = torch.randn(n, k, device="cuda").to(dt)
        kw = {} if args.ab == "bf16" else dict(a_scale=torch.ones(m, device="cuda"), b_scale=torch.ones(n, device="cuda"))
        pol = "bf16" if args.ab == "bf16" else "scale_bf16"
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for v, s in ((v, int(x)) for v in args.variants.split(",") for x in args.splits.split(",")):
            fn = lambda: prefill.gemm(a, w, pol, out=out, variant=v, splits=s, **kw)
            fn()
            torch.cuda.synchronize()
            if args.once:
                continue
            g = torch.cuda.CUDAGraph()
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st), torch.cuda.graph(g, stream=st):
                for _ in range(20):
                    fn()
            torch.cuda.current_stream().wait_stream(st)
            ts = []
            for _ in range(9):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1000 / 20)
            ts.sort()
            print(f"{args.ab} {m}x{n}x{k} {v} splits={s}: {ts[4]:.2f} us", flush=True)


if __name__ == "__main__":
    main()
