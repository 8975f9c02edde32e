"""`python -m experiments.memory.pinning`: what the first pinned host allocation costs, and whether torch's
pinned allocator settings make it cheaper.

`optimizer_offload=moments` keeps AdamW's moments in one pinned host buffer made at the first page-out
(~28 GiB for the 3B); page-locking that much took ~16 s on an H100 host, inside the first step. torch's
caching host allocator can instead allocate pageable memory and register it with `cudaHostRegister` from
several threads (`pinned_use_cuda_host_register`, `pinned_num_register_threads` in PYTORCH_CUDA_ALLOC_CONF).
Each (setting, size) runs in a fresh process, since the allocator reads its settings once: the time of one
`torch.empty(..., pin_memory=True)`, then a 1 GiB device-to-host copy into it (GB/s: pinned memory copies at
the link's speed, pageable memory far slower). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, sys, time, torch
n = int(float(sys.argv[1]) * 2**30)
torch.empty(1, device="cuda"); torch.cuda.synchronize()
t = time.perf_counter(); buf = torch.empty(n, dtype=torch.uint8, pin_memory=True); alloc = time.perf_counter() - t
src = torch.ones(min(n, 2**30), dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
t = time.perf_counter(); buf[: src.numel()].copy_(src, non_blocking=True); torch.cuda.synchronize()
gbps = src.numel() / (time.perf_counter() - t) / 1e9
print(json.dumps({"alloc_s": round(alloc, 3), "copy_gbps": round(gbps, 1), "pinned": buf.is_pinned(),
                  "ok": bool(buf[: src.numel()].eq(1).all())}))
"""


def run(size_gib: float, conf: str | None) -> dict:
    env = dict(os.environ)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_ALLOC_CONF"] = conf
    out = subprocess.run([sys.executable, "-c", CHILD, str(size_gib)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.memory.pinning")
    ap.add_argument("--sizes", default="1,8", help="GiB, comma list")
    ap.add_argument("--threads", default="0,1,8,16",
                    help="0: the default cudaHostAlloc; N > 0: cudaHostRegister from N threads")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rows = []
    for size in (float(s) for s in a.sizes.split(",")):
        for n in (int(t) for t in a.threads.split(",")):
            conf = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{n}" if n else None
            r = {"size_gib": size, "register_threads": n, **run(size, conf)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    print("\n| GiB | register threads | alloc s | GiB/s | D2H GB/s | pinned |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['size_gib']:g} | {r['register_threads'] or 'cudaHostAlloc'} | error: {r['error']} | | | |")
            continue
        print(f"| {r['size_gib']:g} | {r['register_threads'] or 'cudaHostAlloc'} | {r['alloc_s']:.2f} | "
              f"{r['size_gib'] / max(r['alloc_s'], 1e-9):.1f} | {r['copy_gbps']:.1f} | {r['pinned'] and r['ok']} |")


if __name__ == "__main__":
    main()
