"""`python -m rollplex.bench <workload> [...]` — the product's benchmarks; each checks correctness, then
times. Kernel and engine experiments live outside the package (experiments/)."""

import sys

WORKLOADS = {
    "memory": "rollplex.bench.memory",
    "serve": "rollplex.bench.serve",
    "spec": "rollplex.bench.spec",  # the rollout's tail with speculative decoding (replayed drafts)
    "step": "rollplex.bench.step",
    "sglang": "rollplex.bench.sglang",  # SGLang (in its own process) beside the native engine: smoke | rollout
    "weights": "rollplex.bench.weights",  # the weight-sharing planner's tables (rollplex.weights)
    "parallel": "rollplex.bench.parallel",  # under torchrun: train | decode | disaggregated | step
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in WORKLOADS:
        raise SystemExit(f"usage: python -m rollplex.bench {{{','.join(WORKLOADS)}}} [options]")
    import importlib

    importlib.import_module(WORKLOADS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
    from rollplex.parallel.launch import end_rank

    end_rank()
