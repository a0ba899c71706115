"""The byte-level GPT and its switchable attention."""
from model.gpt import ATTENTIONS, GPT, VOCAB_SIZE, GPTConfig

__all__ = ["ATTENTIONS", "GPT", "GPTConfig", "VOCAB_SIZE"]
