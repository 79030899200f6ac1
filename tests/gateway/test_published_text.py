"""Publishing a prefix as text with its tokenizer, through a live ``kvgate serve`` and the CLI.

Where transformers is installed the text is tokenized on the server with a tokenizer built here
(a word-level Hugging Face tokenizer saved to a directory, nothing downloaded) and published as
those token ids; where it is not, the answer is a 422 that says so and nothing is published. In
both, a body naming text and token ids at once, text without a tokenizer, or a tokenizer that
cannot be loaded is refused and changes nothing."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from tests.gateway.test_cli import run
from tests.support.audit_events import live_rows
from tests.support.server_fixture import LiveServer, running_server

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
WORDS = [f"w{i}" for i in range(40)]


def _tokenizer_dir(path: Path) -> Path:
    """A word-level tokenizer ("<s>" = 1, "w<i>" = 3 + i; a leading BOS with special tokens),
    saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # a BOS
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    with running_server(tmp_path_factory.mktemp("kvgate-published-text")) as server:
        yield server


async def test_published_text_with_a_tokenizer_or_a_clear_refusal(live: LiveServer, tmp_path: Path):
    op = live.headers(live.operator_token())
    text = " ".join(WORDS[i % 40] for i in range(40))  # 40 words: two whole chunks of 16 and 8 tokens
    async with live.client() as http:
        await live.create_tenant(http, "acme-text")
        r = await http.post("/v1/admin/scopes", json={"name": "text-scope", "members": ["acme-text"]}, headers=op)
        assert r.status_code == 201, r.text
        refused = [
            {"token_ids": list(range(40)), "text": text, "tokenizer": "x"},  # both
            {"text": text},  # text without its tokenizer
            {"token_ids": list(range(40)), "tokenizer": "x"},  # a tokenizer without text
            {"text": text, "tokenizer": str(tmp_path / "no-such-tokenizer")},  # nothing to load there
        ]
        for extra in refused:
            r = await http.post("/v1/admin/prefixes", json={"scope": "text-scope", "model": "m", **extra}, headers=op)
            assert r.status_code == 422, (extra, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
        if not HAS_TRANSFORMERS:
            assert "transformers" in r.json()["detail"]  # the last one: what to install, or to send ids
        assert (await http.get("/v1/admin/prefixes", params={"scope": "text-scope"}, headers=op)).json() == []
        if not HAS_TRANSFORMERS:
            return
        tok_dir = _tokenizer_dir(tmp_path / "tok")
        ids = [3 + i % 40 for i in range(40)]
        for special, expected in ((False, ids), (True, [1, *ids])):
            r = await http.post("/v1/admin/prefixes", json={
                "scope": "text-scope", "model": "m", "text": text, "tokenizer": str(tok_dir), "add_special_tokens": special,
            }, headers=op)
            assert r.status_code == 201, r.text
            got = r.json()
            assert got["digest"] == _digest(expected) and got["num_tokens"] == len(expected) and got["whole_chunks"] == 2
        rows = [e for e in await live_rows(live, "prefix.publish") if e["details"]["scope"] == "text-scope"]
        assert [e["details"]["tokenizer"] for e in rows] == [str(tok_dir)] * 2
        assert rows[0]["details"]["digest"] == _digest(ids)


def test_published_text_from_the_command_line(tmp_path: Path):
    run(tmp_path, "tenants", "create", "acme")
    run(tmp_path, "prefixes", "scope-create", "team", "--member", "acme")
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(WORDS[i % 40] for i in range(600)))
    # refusals: one line, exit 2, no traceback, nothing published
    for args in (("--text-file", str(text)), ("--tokenizer", "x"),
                 ("--text-file", str(text), "--tokenizer", "x", "--tokens", "1,2"),
                 ("--text-file", str(text), "--tokenizer", str(tmp_path / "no-such-tokenizer"))):
        proc = run(tmp_path, "prefixes", "publish", "team", "--model", "m", *args, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
    if not HAS_TRANSFORMERS:
        assert "transformers" in proc.stderr
    assert "active" not in run(tmp_path, "prefixes", "list").stdout
    if not HAS_TRANSFORMERS:
        return
    tok_dir = _tokenizer_dir(tmp_path / "tok")
    got = json.loads(run(tmp_path, "prefixes", "publish", "team", "--model", "m", "--text-file", str(text),
                         "--tokenizer", str(tok_dir), "--no-add-special-tokens").stdout)
    assert got["digest"] == _digest([3 + i % 40 for i in range(600)]) and got["whole_chunks"] == 2
