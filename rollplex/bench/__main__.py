"""`python -m rollplex.bench <workload> [...]` — GPU benchmarks; each checks correctness, then times."""

import sys

WORKLOADS = {
    "model": "rollplex.bench.model",
    "rollout": "rollplex.bench.rollout",
    "memory": "rollplex.bench.memory",
    "serve": "rollplex.bench.serve",
    "step": "rollplex.bench.step",
    "weights": "rollplex.bench.weights",
    "hook": "rollplex.bench.hook",
    "profile": "rollplex.bench.profile",
    "hostloop": "rollplex.bench.hostloop",
    "layer": "rollplex.bench.layer",
    "parallel": "rollplex.bench.parallel",  # under torchrun: train | decode | disaggregated | step
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in WORKLOADS:
        raise SystemExit(f"usage: python -m rollplex.bench {{{','.join(WORKLOADS)}}} [options]")
    import importlib

    importlib.import_module(WORKLOADS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
