"""Training: the token data pipeline (`brrr data build`), tokenizer training, and the single-device trainer
(`brrr train`) that writes Hugging Face-compatible checkpoints. See docs/training.md."""
