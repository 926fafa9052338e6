"""Training: the token data pipeline (`brrr data build`), tokenizer training, and one training loop (trainer.py)
over tasks (task.py): pretraining (`brrr train`, also under torchrun over parallel/), LoRA SFT (`brrr finetune`) and
the EAGLE draft head (`brrr train-draft`). See docs/training.md."""
