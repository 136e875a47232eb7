"""Eager Kimi K3 decode step: the reference that every compiled path is checked against.

Knows nothing of the compiler (k3compile/) and never bends to it.
"""

from .checkpoint import CheckpointError, load_pretrained, save_checkpoint, save_random_checkpoint, tensor_specs
from .config import ConfigError, K3Config, get_config, k3_mini, k3_slice, kimi_k3
from .model import DecodeState, K3Model
from .sampling import sample
from .train import k3_mini_text, trained_checkpoint

__all__ = [
    "CheckpointError", "ConfigError", "DecodeState", "K3Config", "K3Model", "get_config", "k3_mini", "k3_slice",
    "k3_mini_text", "kimi_k3", "load_pretrained", "sample", "save_checkpoint", "save_random_checkpoint", "tensor_specs",
    "trained_checkpoint",
]
