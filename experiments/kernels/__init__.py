"""Kernel experiments: where a decode step's and a training pass's GPU time goes (`profile`), decoder
layers under other GEMM choices (`layer`), the engine's host loop (`hostloop`), the decode hook's cost
(`hook`) and a Triton skinny GEMM (`skinny_gemm`, timed by `profile --parts gemm`)."""
