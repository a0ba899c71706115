"""The byte-level GPT and its switchable attention."""
from model.gpt import ATTENTIONS, GPT, VOCAB_SIZE, CapturedStep, GPTConfig

__all__ = ["ATTENTIONS", "CapturedStep", "GPT", "GPTConfig", "VOCAB_SIZE"]
