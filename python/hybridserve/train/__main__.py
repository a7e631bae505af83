"""``python -m hybridserve.train {train,eval,export} ...``"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hybridserve.train")
    sub = p.add_subparsers(dest="cmd", required=True)
    from hybridserve.train import train as tr
    tr.add_train_args(sub.add_parser("train", help="train (or resume) the default model"))
    args = p.parse_args(argv)
    if args.cmd == "train":
        tr.train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
