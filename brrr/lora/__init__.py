"""LoRA adapters: PEFT's file format (peft_format), training (brrr finetune) and serving many in one batch."""
from brrr.lora.peft_format import LoraAdapter, LoraConfig, check_against, load_adapter, save_adapter, target_names

__all__ = ["LoraAdapter", "LoraConfig", "check_against", "load_adapter", "save_adapter", "target_names"]
