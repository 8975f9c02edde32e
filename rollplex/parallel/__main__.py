"""`python -m torch.distributed.run --nproc-per-node N -m rollplex.parallel COMMAND`: the older name of
`... -m rollplex.bench parallel COMMAND` (rollplex/bench/parallel.py), kept so that existing command lines
run. Nothing in the package imports this module: the benches sit above the runtime they measure."""

from ..bench.parallel import main

if __name__ == "__main__":
    main()
