"""Long-context evaluation: perplexity at fixed context lengths (context_ppl.py) and passkey retrieval at each
length and depth (needle.py), `brrr eval ppl --context` and `brrr eval needle`."""
