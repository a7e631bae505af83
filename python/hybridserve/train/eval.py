"""Quality of a trained checkpoint: bits per byte on held-out text beside ``gzip -9`` and
``xz -9`` of the same bytes, and the MTP head's top-1 agreement with the trunk.

Two held-out sets: the corpus's held-out stdlib documents, and Python sources outside
the standard library (an installed package's ``.py`` files, sorted; aiohttp by default,
which hybridserve's server depends on, so every installation has it).

The model scores the documents joined by ``<|endoftext|>`` (the first token predicted
from an ``<|endoftext|>`` context, as in training), in windows of ``seq_len`` tokens; the
separators' cost is counted and their bytes are not, so the figure is, if anything,
pessimistic. The compressors see the documents' bytes concatenated.

MTP agreement: at each position t the MTP layer gets h_t and the embedding of the true
token t+1 and proposes t+2; it agrees when that equals the trunk's greedy token at t+2
(its argmax after the true token t+1) -- the rate at which a greedy speculative
decoder would accept the MTP draft on this text.

MTP chain agreement by pass d (1..``mtp_depth``): the layer chained as the drafter chains it
(:func:`.mtp.mtp_chain`: pass d fed pass d-1's output state and the text's token), its
pass-d argmax against the trunk's greedy token at that position; "all" counts the chains
whose passes 1..d all agree, the text's stand-in for greedy acceptance at draft position d.
"""

from __future__ import annotations

import gzip
import importlib.util
import lzma
import math
import os

import torch

from hybridserve.train import corpus


def compressed_bits_per_byte(data: bytes) -> dict[str, float]:
    n = len(data)
    return {"gzip -9": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / n,
            "xz -9": 8 * len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=9)) / n}


def package_sources(package: str, max_bytes: int = 0) -> list[corpus.Document]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed (or is not a package); pass another with --external")
    root = list(spec.submodule_search_locations)[0]
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "tests", "test"))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), os.path.dirname(root)).replace(os.sep, "/")
                with open(os.path.join(dirpath, fn), "rb") as f:
                    docs.append(corpus.Document(rel, f.read().decode("utf-8", errors="replace")))
    docs.sort(key=lambda d: d.relpath)
    if max_bytes:
        out = []
        for d in docs:
            if total + len(d.text.encode()) > max_bytes and out:
                break
            out.append(d)
            total += len(d.text.encode())
        docs = out
    return docs


@torch.no_grad()
def score(model, mtp, tok, docs: list[corpus.Document], seq_len: int = 512, batch: int = 8,
          mtp_depth: int = 4) -> dict[str, float]:
    eot = tok.token_to_id("<|endoftext|>")
    stream = [eot]
    for enc in tok.encode_batch([d.text for d in docs]):
        stream.extend(enc.ids)
        stream.append(eot)
    nbytes = sum(len(d.text.encode("utf-8")) for d in docs)
    ids = torch.tensor(stream, dtype=torch.long)
    windows = [ids[s:s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len)]
    nats = 0.0
    agree = mtp_n = mtp_true = 0
    chain_agree = [0] * mtp_depth
    chain_all = [0] * mtp_depth
    chain_n = 0
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        for w in ([torch.stack(group)] if len({len(g) for g in group}) == 1 else [g[None] for g in group]):
            if w.shape[1] < 2:
                continue
            inp, labels = w[:, :-1], w[:, 1:]
            h = model.model(input_ids=inp).last_hidden_state
            logits = model.lm_head(h).float()
            nats += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum").item()
            t = inp.shape[1]
            if t < 2:
                continue
            pos = torch.arange(t - 1).unsqueeze(0).expand(inp.shape[0], -1)
            hid = h[:, :t - 1]
            m = mtp(hid, model.model.embed_tokens(inp[:, 1:]), model.model.rotary_emb(hid, pos), pos)
            draft = model.lm_head(m).argmax(-1)          # proposes token j+2 from row j
            trunk = logits[:, 1:].argmax(-1)             # trunk's greedy token j+2 after true j+1
            agree += (draft == trunk).sum().item()
            mtp_true += (draft == labels[:, 1:]).sum().item()
            mtp_n += draft.numel()
            if mtp_depth and t > mtp_depth:
                from hybridserve.train.mtp import mtp_chain
                n = t - mtp_depth  # chains with every pass inside the window
                outs = mtp_chain(mtp, h, model.model.embed_tokens(inp), model.model.rotary_emb, mtp_depth)
                ok = torch.ones(inp.shape[0], n, dtype=torch.bool)
                for d, m in enumerate(outs, start=1):
                    hit = model.lm_head(m[:, :n]).argmax(-1) == logits[:, d:d + n].argmax(-1)
                    ok &= hit
                    chain_agree[d - 1] += hit.sum().item()
                    chain_all[d - 1] += ok.sum().item()
                chain_n += ok.numel()
    return {"bytes": nbytes, "tokens": len(stream) - 1, "bits_per_byte": nats / math.log(2) / nbytes,
            "mtp_agreement": agree / max(1, mtp_n), "mtp_top1_accuracy": mtp_true / max(1, mtp_n),
            "mtp_chain_agreement": [c / max(1, chain_n) for c in chain_agree],
            "mtp_chain_all_agree": [c / max(1, chain_n) for c in chain_all]}


def evaluate(model_dir: str, *, external: str = "aiohttp", max_bytes: int = 0, seq_len: int = 512,
             stdlib_root: str | None = None) -> dict[str, dict[str, float]]:
    from hybridserve.train.export import load_trained
    from hybridserve.train.tokenizer import load_tokenizer
    model, mtp = load_trained(model_dir)
    tok = load_tokenizer(model_dir)
    _, held = corpus.split(corpus.documents(stdlib_root))
    sets = {"stdlib held-out": held, f"{external} sources": package_sources(external)}
    out = {}
    for name, docs in sets.items():
        if max_bytes:
            docs = _cap(docs, max_bytes)
        data = b"".join(d.text.encode("utf-8") for d in docs)
        res = score(model, mtp, tok, docs, seq_len=seq_len)
        out[name] = {**res, **compressed_bits_per_byte(data), "files": len(docs)}
    return out


def _cap(docs, max_bytes):
    out, total = [], 0
    for d in docs:
        n = len(d.text.encode("utf-8"))
        if out and total + n > max_bytes:
            break
        out.append(d)
        total += n
    return out


def format_table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| held-out text | files | bytes | model bits/byte | gzip -9 | xz -9 | MTP agreement | MTP top-1 = true |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['files']} | {r['bytes']:,} | **{r['bits_per_byte']:.3f}** | {r['gzip -9']:.3f} | "
                     f"{r['xz -9']:.3f} | {r['mtp_agreement']:.3f} | {r['mtp_top1_accuracy']:.3f} |")
    if any(r.get("mtp_chain_agreement") for r in results.values()):
        lines += ["", "| held-out text | MTP chain agreement by pass | all passes so far agree |", "|---|---|---|"]
        for name, r in results.items():
            lines.append(f"| {name} | {', '.join(f'{x:.3f}' for x in r['mtp_chain_agreement'])} | "
                         f"{', '.join(f'{x:.3f}' for x in r['mtp_chain_all_agree'])} |")
    return "\n".join(lines)
