"""Prefix caches: one module per cache, each a plain class with SGLang-compatible methods.

``radix`` (token or page radix tree), ``swa_radix`` (hybrid sliding-window models),
``block_hash`` (vLLM-style hash-chained blocks), ``chunk`` (no sharing); ``common`` holds the key
normalisation, counters and event helpers they share. Import the classes from their modules.
"""
