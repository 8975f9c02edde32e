"""`python -m rollplex.tiny OUT_DIR [--seed N]`: the embedded tiny Qwen2.5-VL checkpoint, written to OUT_DIR."""

import argparse

from .checkpoint import write_tiny


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollplex.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = write_tiny(args.out_dir, args.seed)
    print(f"wrote tiny Qwen2.5-VL checkpoint to {out}")


if __name__ == "__main__":
    main()
