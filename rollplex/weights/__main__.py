"""`python -m rollplex.weights` (also `python -m rollplex.bench weights`): the weight-sharing tables.

Plans every (model, training layout, rollout TP) cell on the models' real parameter shapes (CPU,
no weights) and prints markdown: the sharing table per model, what the colocated runtime realises
of it (plain FSDP layouts), then the per-GPU footprint of the footprint model on its GPU count.
`--explain MODEL,TRAIN,TP` prints one cell parameter by parameter.
"""

from __future__ import annotations

import argparse

from .layout import RolloutLayout
from .planner import plan
from .qwen import preset_specs
from .report import Links
from .tables import DEFAULT_TRAIN, footprint_table, make_cells, parse_train, runtime_table, sharing_table


def explain(model: str, train: str, tp: int, args) -> None:
    specs = preset_specs(model)
    p = plan(specs, parse_train(train, args.vision_tp), RolloutLayout(tp, args.vision_tp), args.gpus_per_node,
             not args.no_shared_dtype)
    print(f"{model}, training {p.train.label}, rollout TP {tp}: mapping {p.mapping.name} "
          f"(optimal: {p.choice.optimal}), rollout groups {p.rollout_groups()}")
    print("| parameter (first of its kind) | count | placement | rank 0 share | rank 0 shared / rollout elements "
          "| copies from ranks |")
    print("|---|---|---|---|---|---|")
    seen = set()
    for s in specs:
        if s.signature() in seen:
            continue
        seen.add(s.signature())
        q = p.param(s.name, 0)
        kind = "none" if q.share is None else ("view" if q.share.is_view else "joint buffer")
        placement = s.placement if s.tower == "text" or args.vision_tp else "Replicate (vision tower)"
        srcs = sorted({c.src for c in q.copies})
        print(f"| {s.name} {s.shape} | {p.counts[s.signature()]} | {placement} | {kind} | "
              f"{q.shared_numel} / {q.rollout.numel} | {srcs} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.weights", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-vl-7b,qwen2.5-vl-32b")
    ap.add_argument("--train", default=",".join(DEFAULT_TRAIN), help="training layouts, e.g. fsdp32,tp4xfsdp8")
    ap.add_argument("--rollout-tp", default="1,2,4,8")
    ap.add_argument("--footprint", default="qwen2.5-vl-32b:32", help="MODEL:GPUS for the per-GPU footprint table")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--vision-tp", action="store_true", help="shard the vision tower under TP (default: replicate)")
    ap.add_argument("--no-shared-dtype", action="store_true",
                    help="training shards are not in the rollout dtype (fp32 shards + bf16 mixed precision)")
    ap.add_argument("--intra-gbs", type=float, default=Links.intra_gbs)
    ap.add_argument("--inter-gbs", type=float, default=Links.inter_gbs)
    ap.add_argument("--hbm-gbs", type=float, default=Links.hbm_gbs)
    ap.add_argument("--explain", default=None, help="MODEL,TRAIN,TP: one cell parameter by parameter")
    args = ap.parse_args(argv)
    if args.explain:
        model, train, tp = args.explain.split(",")
        explain(model, train, int(tp), args)
        return
    links = Links(args.intra_gbs, args.inter_gbs, args.hbm_gbs)
    trains = [parse_train(t, args.vision_tp) for t in args.train.split(",")]
    tps = [int(x) for x in args.rollout_tp.split(",")]
    fp_model, fp_gpus = args.footprint.rsplit(":", 1)
    print(f"bf16 weights; {args.gpus_per_node} GPUs per node; vision tower "
          f"{'sharded' if args.vision_tp else 'replicated'} under TP; ESTIMATED rebuild times assume "
          f"{links.intra_gbs:g} GB/s intra-node, {links.inter_gbs:g} GB/s inter-node, {links.hbm_gbs:g} GB/s local "
          "copies per GPU. GiB per GPU, largest rank.\n")
    for model in args.models.split(","):
        cells = make_cells(model, preset_specs(model), trains, tps, args.vision_tp, links, args.gpus_per_node,
                           not args.no_shared_dtype)
        print(f"### {model}\n\n{sharing_table(cells)}\n")
        runtime = runtime_table(preset_specs(model), trains, tps, links, args.gpus_per_node)
        if runtime.count("\n") > 1:
            print(f"### {model} in the runtime (FSDP over every rank, TP engines grouped for sharing, window "
                  f"shares only)\n\n{runtime}\n")
        if model == fp_model:
            fp = [c for c in cells if c.train.world == int(fp_gpus)]
            print(f"### {model} on {fp_gpus} GPUs: per-GPU footprint (GiB)\n\n{footprint_table(fp)}\n")


if __name__ == "__main__":
    main()
