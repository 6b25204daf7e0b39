"""The action span mask from one call per reply (method.action_mask.prefix_texts) is the mask that
decoding every prefix with ``tokenizer.decode`` gave: on many replies, under byte-level BPE
families, a SentencePiece-style decoder with byte fallback, and a tokenizer whose ``decode``
post-processes the text (the plain path), with multi-byte characters and special tokens."""

from __future__ import annotations

import copy
import random

import pytest
from support import FAMILIES, family_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from serl_cli.method import action_mask
from serl_cli.method.action_mask import action_span_mask, prefix_lengths, prefix_texts
from serl_cli.rollout.prompts import DEFAULT_ACTION_FORMAT as ACTION_FORMAT

TEXTS = [
    "<think>go left</think><action>left</action>",
    "I think 北 is blocked 🚧 so <action>up</action>",
    "<action>click[Größe 42 — café ✓]</action>",
    "search[日本語のテキスト 🎌🎌]",
    "<action> down </action> and then <action>right</action>",
    "no action at all, only words: ünïcödé ½ ∑ 😀",
    "<action>left</action><action>up",
    "think[ok] click[buy now]",
]


def reference_mask(tokenizer, action_ids, unparsed="none", action_format=None, spans="last"):
    """serl's mask before one call per reply: a ``decode`` of every prefix (fdff64e)."""
    from serl_cli.rollout.prompts import action_span, authors_action_spans

    ends, text = [], ""
    for k in range(len(action_ids)):
        text = tokenizer.decode(action_ids[: k + 1], skip_special_tokens=True)
        ends.append(len(text))
    if spans == "authors":
        found = authors_action_spans(text)
    else:
        span = action_span(text, action_format) if action_format is not None else action_span(text)
        found = [span] if span is not None else []
    if not found:
        if unparsed == "none":
            return [0] * len(action_ids)
        found = [(0, len(text))]
    mask, prev = [], 0
    for e in ends:
        mask.append(1 if e > prev and any(prev < end and e > start for start, end in found) else 0)
        prev = e
    return mask


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama 2's decoder (Metaspace, byte fallback, strip the first space) on a small BPE: a
    prefix ending inside a character decodes to U+FFFD, and the first space goes."""
    # no merges, ASCII characters only: every other character falls back to its UTF-8 bytes
    chars = sorted({c for t in TEXTS for c in t.replace(" ", "▁") if c.isascii()} | {"▁"})
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def replies(tokenizer, n: int = 60, seed: int = 0) -> list[list[int]]:
    """Encoded texts (some with a special token inside or at the end) and random id sequences,
    which cut multi-byte characters anywhere."""
    rng = random.Random(seed)
    specials = tokenizer.all_special_ids
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        out += [ids, ids + [tokenizer.eos_token_id], ids[:3] + [rng.choice(specials)] + ids[3:]]
    vocab = len(tokenizer)
    for _ in range(n):
        out.append([rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    return out


TOKENIZERS = {f: (lambda f=f: family_tokenizer(f)) for f in FAMILIES} | {"sentencepiece-like": sentencepiece_like}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_one_call_per_reply_gives_every_prefix_decode_and_the_same_mask(name):
    tok = TOKENIZERS[name]()
    assert action_mask._backend_decoder(tok) is not None  # the one-call path is the one under test
    for ids in replies(tok):
        assert prefix_texts(tok, ids) == [tok.decode(ids[: k + 1], skip_special_tokens=True) for k in range(len(ids))]
        for args in (("none", None, "last"), ("whole", None, "last"), ("none", ACTION_FORMAT, "last")):
            assert action_span_mask(tok, ids, *args) == reference_mask(tok, ids, *args)
        assert action_span_mask(tok, ids, "whole", None, "authors") == reference_mask(
            tok, ids, "whole", None, "authors"
        )


def with_added_tokens(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Added tokens that are not special (Qwen's ``<tool_call>``), one with a space and one with
    characters outside the byte table: ``ByteLevel`` decodes those from their UTF-8. On a copy:
    ``family_tokenizer`` is cached for the other tests."""
    tok = copy.deepcopy(tok)
    tok.add_tokens(["<tool_call>", "go north", "café ✓"])
    return tok


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_prefix_lengths_in_one_pass_are_every_prefix_decode_length(name):
    tok = with_added_tokens(TOKENIZERS[name]())
    backend = action_mask._backend_decoder(tok)
    added = tok.convert_tokens_to_ids(["<tool_call>", "go north", "café ✓"])
    rng = random.Random(1)
    for ids in replies(tok, n=200):
        ids = ids + [rng.choice(added)] + ids[: rng.randint(0, 5)]
        expected = [tok.decode(ids[: k + 1], skip_special_tokens=True) for k in range(len(ids))]
        assert prefix_lengths(tok, ids) == ([len(t) for t in expected], expected[-1])
        # the one-pass path is the one that answered, for every byte-level family
        assert (action_mask._byte_level_lengths(tok, backend, ids) is not None) == (name != "sentencepiece-like")
    assert prefix_lengths(tok, []) == ([], "")


def test_the_one_pass_lengths_cut_characters_as_decode_does():
    """A prefix that ends inside a character has one U+FFFD where its bytes stop; a stray
    continuation byte is one more; worked by hand on 北 (E5 8C 97)."""
    tok = family_tokenizer("qwen2.5")
    table = {b: c for c, b in action_mask._BYTE_OF_CHAR.items()}
    byte_ids = tok.convert_tokens_to_ids([table[b] for b in [0xE5, 0x8C, 0x97, 0x8C, ord("a")]])
    # "\ufffd", "\ufffd", "北", "北\ufffd", "北\ufffda"
    assert prefix_lengths(tok, byte_ids) == ([1, 1, 1, 2, 3], "北\ufffda")


def test_the_prefixes_really_differ_from_the_text_prefixes():
    """The cases the test above covers exist: some prefix of a reply is not a prefix of its text."""
    tok = sentencepiece_like()
    ids = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "北🚧".encode()])  # byte fallback
    texts = prefix_texts(tok, ids)
    assert texts[-1] == "北🚧" and texts[0] == "\ufffd"
    assert any(not texts[-1].startswith(t) for t in texts)


def test_a_tokenizer_that_cleans_up_spaces_takes_the_plain_path():
    """WordPiece with ``clean_up_tokenization_spaces``: decode changes the backend's text, so
    each prefix goes through ``decode`` and the mask is the reference's."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS * 10, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]", clean_up_tokenization_spaces=True
    )
    assert action_mask._backend_decoder(fast) is None
    for ids in replies(fast, n=10):
        assert action_span_mask(fast, ids, "whole") == reference_mask(fast, ids, "whole")
