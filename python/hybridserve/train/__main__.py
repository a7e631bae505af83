"""``python -m hybridserve.train {train,eval,export,mtp,samples} ...``"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hybridserve.train")
    sub = p.add_subparsers(dest="cmd", required=True)
    from hybridserve.train import train as tr
    tr.add_train_args(sub.add_parser("train", help="train (or resume) the default model"))
    ex = sub.add_parser("export", help="a run's checkpoint as an HF directory (bf16 safetensors)")
    ex.add_argument("run_dir")
    ex.add_argument("out_dir")
    ev = sub.add_parser("eval", help="bits/byte beside gzip -9 / xz -9, and MTP agreement")
    ev.add_argument("model_dir")
    ev.add_argument("--external", default="aiohttp", help="installed package whose sources are the "
                    "outside-the-stdlib held-out set (default: %(default)s)")
    ev.add_argument("--max-bytes", type=int, default=0, help="cap each set (0: all)")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--json", default=None, help="also write the results here")
    from hybridserve.train import mtp_tune
    mtp_tune.add_args(sub.add_parser("mtp", help="fine-tune only the MTP layer (trunk frozen) toward the trunk's "
                                     "own next-next-token distribution; writes a copy of the checkpoint"))
    sa = sub.add_parser("samples", help="a few greedy completions and chat answers (hybridserve's engine)")
    sa.add_argument("model_dir")
    sa.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.cmd == "train":
        tr.train(args)
    elif args.cmd == "export":
        from hybridserve.train.export import export
        print(export(args.run_dir, args.out_dir))
    elif args.cmd == "mtp":
        mtp_tune.tune(args)
    elif args.cmd == "samples":
        from hybridserve.train.samples import format_samples, samples
        print(format_samples(samples(args.model_dir, args.max_tokens)))
    elif args.cmd == "eval":
        import json
        import torch
        from hybridserve.train.eval import evaluate, format_table
        if args.threads:
            torch.set_num_threads(args.threads)
        res = evaluate(args.model_dir, external=args.external, max_bytes=args.max_bytes)
        print(format_table(res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
