"""Training of hybridserve's default model: a small Qwen3.5 (Gated DeltaNet + gated
attention, one MTP layer) on the Python standard library of the training interpreter.

``python -m hybridserve.train --help`` lists the commands (corpus, tokenizer, train,
eval, export).
"""
