"""Chunking and the chained hash (DESIGN section 3)."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chunking import InvalidTokens, ModelFingerprint, chain_hashes, chunk_tokens

FP = ModelFingerprint("m", "float16", 32, 8, 128)
tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=700)


def test_chain_matches_the_design_formula():
    toks = list(range(600))
    chunks = chain_hashes(toks, FP, 256)
    assert [(c.start, c.end) for c in chunks] == [(0, 256), (256, 512), (512, 600)]
    h = hashlib.sha256(FP.canonical()).digest()
    for c in chunks:
        h = hashlib.sha256(h + np.asarray(toks[c.start : c.end], dtype="<i4").tobytes()).digest()
        assert c.chained_hash == h


@given(tokens_st, st.integers(1, 300))
@settings(max_examples=60, deadline=None)
def test_chunks_cover_tokens_and_last_partial_is_kept(toks, size):
    chunks = chain_hashes(toks, FP, size)
    assert chunks[0].start == 0 and chunks[-1].end == len(toks)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert all(c.num_tokens == size for c in chunks[:-1]) and 1 <= chunks[-1].num_tokens <= size
    assert [(c.start, c.end) for c in chunks] == chunk_tokens(len(toks), size)


@given(tokens_st, st.integers(0, 699), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_a_changed_token_changes_its_chunk_and_every_later_one(toks, pos, new):
    pos %= len(toks)
    if toks[pos] == new:
        new = (new + 1) % 2**31
    other = list(toks)
    other[pos] = new
    a, b = chain_hashes(toks, FP, 64), chain_hashes(other, FP, 64)
    first = pos // 64
    assert all(x.chained_hash == y.chained_hash for x, y in zip(a[:first], b[:first]))
    assert all(x.chained_hash != y.chained_hash for x, y in zip(a[first:], b[first:]))


def test_prefix_shares_hashes_and_model_changes_all():
    toks = list(range(1000))
    a = chain_hashes(toks, FP, 256)
    b = chain_hashes(toks[:700], FP, 256)
    assert [c.chained_hash for c in a[:2]] == [c.chained_hash for c in b[:2]]
    other = chain_hashes(toks, ModelFingerprint("m", "bfloat16", 32, 8, 128), 256)
    assert not {c.chained_hash for c in a} & {c.chained_hash for c in other}


def test_the_cpu_chunk_format_has_its_own_fingerprint_and_the_gpu_one_keeps_its_digest():
    """The CPU chunk format (its byte order depends on the block size) gets a fingerprint of its
    own per block size, so its chunks are never opened as another format; the GPU format's
    fingerprint is what it was before the field existed (stored chunks keep their keys)."""
    import torch

    from gateway.types import KVModel
    from kernels.layouts import KVGeometry, KVLayout

    def fp(layout: KVLayout, block_size: int) -> ModelFingerprint:
        g = KVGeometry(num_layers=32, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=block_size,
                       layout=layout)
        return KVModel("m", g).fingerprint

    gpu = {fp(KVLayout.KV_FIRST, 16), fp(KVLayout.BLOCK_FIRST, 16), fp(KVLayout.BLOCK_FIRST, 32)}
    assert gpu == {FP} and FP.canonical() == (
        b'{"dtype":"float16","head_size":128,"layout_version":1,"model":"m","num_kv_heads":8,'
        b'"num_layers":32,"tp_rank":0,"tp_size":1}'
    )  # unchanged: no chunk_format field for the GPU format
    cpu16, cpu32 = fp(KVLayout.CPU, 16), fp(KVLayout.CPU, 32)
    assert len({FP.digest, cpu16.digest, cpu32.digest}) == 3
    assert b"block_size=16" in cpu16.canonical()


def test_hashes_do_not_depend_on_the_process_or_hash_seed():
    code = (
        "from gateway.chunking import *;"
        "print(chain_hashes(list(range(300)), ModelFingerprint('m','float16',32,8,128))[-1].chained_hash.hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outs == {chain_hashes(list(range(300)), FP)[-1].chained_hash.hex()}


@pytest.mark.parametrize(
    "bad",
    [[], [-1], [2**31], [1.5, 2.0], [[1, 2]], ["a"], [True, False], np.array([], dtype=np.int64)],
)
def test_bad_tokens_are_refused(bad):
    with pytest.raises(InvalidTokens):
        chain_hashes(bad, FP)


def test_vocab_bound():
    chain_hashes([0, 999], FP, vocab_size=1000)
    with pytest.raises(InvalidTokens):
        chain_hashes([0, 1000], FP, vocab_size=1000)
