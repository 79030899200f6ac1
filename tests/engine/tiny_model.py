"""A tiny Llama (hidden 64, 2 layers, 2 heads, float32) and a WordLevel tokenizer, built locally.

``build_tiny_llama(path)`` writes a Hugging Face model directory that vLLM loads offline
(``HF_HUB_OFFLINE=1``): random weights from a fixed seed, so greedy output is deterministic and
depends on every KV entry (a wrong or foreign KV shows up in the output). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VOCAB_WORDS", "build_tiny_llama", "prompt_words"]

VOCAB_WORDS = 1000


def prompt_words(n: int, seed: int = 0) -> str:
    """A prompt of ``n`` whitespace-separated vocabulary words (one token each), deterministic."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


def build_tiny_llama(path: Path, *, seed: int = 1234) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent) and return it."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=4096
    )
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so outputs depend strongly on KV
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path
