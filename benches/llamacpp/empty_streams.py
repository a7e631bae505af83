"""Which requests of the peer workload llama-server streams without any text (issue 35).

llama-server's streaming path holds a token's text back while the generated text ends
in what its ``validate_utf8`` takes for an incomplete UTF-8 character (a lead byte
0xC0-0xF7 followed by fewer bytes than it announces), and its final stream chunk carries
``text: ""`` (it assumes everything was sent). A random-weight model that greedily
repeats a lead-byte token (Qwen's byte tokens 0xC0, 0xC1, 0xC2, ...) therefore streams
nothing at all, though it generates every token and says so in ``usage``. The
non-streaming response of the same request returns the bytes (as U+FFFD).

This asks llama-server (one slot, not timed) for each request's greedy tokens without
streaming, replays its holding-back rule over the tokens' bytes, and lists the requests
whose stream would carry no text: those, and their tokens, are the "empty" column of
``llamacpp_peer.py``. ``--tokens N`` looks at the first N tokens only (cheaper on the 0.8b
shape; a stream still empty after N repeated lead bytes stays empty in practice).

    python benches/llamacpp/empty_streams.py --shape 0.1b --gguf q4_k_m
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benches/, for the llamacpp package

from llamacpp import build, servers, side_by_side  # noqa: E402


def held_back(text: bytes) -> bool:
    """llama-server's ``validate_utf8(text) < text.size()``: a lead byte among the last
    four bytes with fewer bytes after it than its sequence needs."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return True
    return False


def streamed_text(pieces: list[bytes]) -> bytes:
    """The bytes llama-server's stream would carry for these token pieces (its rule:
    after each token, send what is unsent unless the text ends incomplete; nothing at
    the end)."""
    text, sent = b"", 0
    for p in pieces:
        text += p
        if not held_back(text):
            sent = len(text)
    return text[:sent]


def token_bytes(tokenizer) -> callable:
    """Token id -> its bytes, for a byte-level BPE tokenizer (GPT-2's byte alphabet)."""
    # GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other
    # bytes for 256 + their rank among the others.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    rest = [b for b in range(256) if b not in keep]
    dec = {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(rest)}
    special = set(tokenizer.all_special_ids)

    def f(tok: int) -> bytes:
        s = tokenizer.convert_ids_to_tokens(tok)
        if tok in special or any(ch not in dec for ch in s):
            return b""  # llama-server renders control tokens as "" in completions
        return bytes(dec[ch] for ch in s)

    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.1b", choices=("0.1b", "0.8b"))
    ap.add_argument("--gguf", default="q4_k_m", help="llama-quantize type of the file (made by llamacpp_peer.py)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=0, help="look at the first N tokens only (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run stops its server
    from transformers import AutoTokenizer

    work = build.cache_root() / "work" / f"peer-{a.shape}"
    gguf = work / f"model-{a.gguf.upper()}.gguf"
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run llamacpp_peer.py --shape {a.shape} --gguf {a.gguf} once")
    piece = token_bytes(AutoTokenizer.from_pretrained(str(work / "hf")))
    wl = side_by_side.peer_workload(a.num_prompts, a.seed)
    empty, total = [], 0
    # --poll 0: ggml's threads sleep at barriers; nothing here is timed.
    with servers.llama_server(build.llama_server(2), gguf, parallel=1, threads=a.threads,
                              log=work / "logs" / "empty-streams.log", extra=["--poll", "0"]) as srv:
        for r in wl.requests:
            n = min(r.output_len, a.tokens) if a.tokens else r.output_len
            body = {"prompt": list(r.prompt), "n_predict": n, "temperature": 0, "ignore_eos": True,
                    "return_tokens": True, "stream": False, "cache_prompt": False}
            req = urllib.request.Request(f"{srv.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=900) as resp:
                toks = json.loads(resp.read())["tokens"]
            total += r.output_len
            if not streamed_text([piece(t) for t in toks]):
                empty.append(r)
                print(f"{r.request_id}: prompt {len(r.prompt)}, max_tokens {r.output_len}: no text in "
                      f"{len(toks)} tokens; first tokens {toks[:6]} = {[piece(t) for t in toks[:6]]}", flush=True)
    e = sum(r.output_len for r in empty)
    print(f"{a.shape} {a.gguf.upper()}: {len(empty)} of {len(wl.requests)} streams empty, {e} of {total} output "
          f"tokens ({100 * e / total:.1f} %); a tok/s that drops them is low by a factor {total / (total - e):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
