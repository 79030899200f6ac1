"""The benchmark's model: a random-weight Llama and a WordLevel tokenizer, built locally.

Nothing is downloaded: ``build_llama(path, size)`` writes a Hugging Face model directory that
vLLM loads offline (``HF_HUB_OFFLINE=1``), with weights drawn from a fixed seed, so greedy output is
deterministic and depends on every KV entry (a wrong or foreign KV changes the output). The
tokenizer maps ``w0 .. w{V-1}`` to one token each, so a prompt of n words is n tokens exactly.

Sizes: ``full`` is the reference shape (hidden 1024, 12 layers, 16 query heads and 8 KV
heads of 64, intermediate 2816: about 141M parameters, 48 KiB of fp32 KV per token), big enough
that prefill dominates on a CPU; ``tiny`` (hidden 128, 2 layers) is for developing the harness.
Adapted from tests/engine/tiny_model.py (which stays the test suite's own).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SIZES", "ModelSize", "build_llama", "prompt_ids"]

VOCAB_WORDS = 4000
SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_len: int

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * dtype_bytes

    def kv_bytes_of(self, dtype: str) -> int:
        """KV bytes a token of the model takes in an engine of ``dtype`` (float32, or a 2-byte type)."""
        return self.kv_bytes_per_token(4 if dtype == "float32" else 2)

    def params(self) -> int:
        vocab = VOCAB_WORDS + len(SPECIALS)
        attn = self.hidden * self.hidden * 2 + 2 * self.hidden * self.kv_heads * self.head_size
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * vocab * self.hidden + self.hidden


SIZES = {
    "full": ModelSize(hidden=1024, layers=12, heads=16, kv_heads=8, intermediate=2816, max_len=16640),
    "tiny": ModelSize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, max_len=16640),
}


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of vocabulary words (never a special token), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [len(SPECIALS) + rng.randrange(VOCAB_WORDS) for _ in range(n)]


def build_llama(path: Path, size: ModelSize, *, seed: int = 1234) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent for one size) and return it."""
    import json

    path = Path(path)
    stamp = path / "kvgate-bench-size.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(size):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=size.max_len
    )
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.max_len, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider than the default init, so the output depends strongly on the KV
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.dim() > 1 else 0.5)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(size)))
    return path
