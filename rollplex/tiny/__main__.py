"""`python -m rollplex.tiny OUT_DIR [--seed N] [--family qwen2_5_vl|qwen3_vl]`: an embedded tiny checkpoint,
written to OUT_DIR."""

import argparse

from .checkpoint import FAMILIES, write_tiny


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    args = ap.parse_args(argv)
    out = write_tiny(args.out_dir, args.seed, args.family)
    print(f"wrote tiny {args.family} checkpoint to {out}")


if __name__ == "__main__":
    main()
