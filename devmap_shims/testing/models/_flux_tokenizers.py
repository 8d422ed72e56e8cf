"""Small tokenizers made locally, for the tiny Flux pipeline.

Flux uses a CLIP tokenizer (byte-level BPE, ``vocab.json`` + ``merges.txt``) and a
T5 tokenizer (SentencePiece Unigram, ``tokenizer.json``). Both are written here from
a vocabulary defined in code and loaded back with ``from_pretrained`` on the written
folder, which is the one constructor path that transformers 4.x and 5.x share (their
``__init__`` signatures differ: 4.x takes file names, 5.x vocab objects).
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import Any

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
CLIP_MODEL_MAX_LENGTH = 77

T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
_T5_WORDS = ("a", "the", "of", "cat", "dog", "photo", "on", "in", "with", "and", "red", "blue")
_T5_SYMBOLS = string.ascii_letters + string.digits + string.punctuation


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable-character table of GPT-2/CLIP byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def clip_vocab() -> tuple[dict[str, int], list[str]]:
    """A complete byte-level CLIP vocabulary (every byte, with and without ``</w>``) and a few merges.

    No input can fall outside it, so tokenization never needs the unknown token.
    """
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars]
    merges = [("c", "a"), ("ca", "t</w>"), ("o", "f</w>"), ("a", "n"), ("an", "d</w>")]
    for left, right in merges:
        tokens.append(left + right)
    tokens += [CLIP_BOS, CLIP_EOS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return vocab, [f"{a} {b}" for a, b in merges]


def write_clip_tokenizer_files(folder: Path) -> None:
    vocab, merges = clip_vocab()
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {
        "model_max_length": CLIP_MODEL_MAX_LENGTH,
        "bos_token": CLIP_BOS,
        "eos_token": CLIP_EOS,
        "unk_token": CLIP_EOS,
        "pad_token": CLIP_EOS,
        "do_lower_case": True,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def t5_unigram_vocab() -> list[tuple[str, float]]:
    """Pieces and log-probabilities of a tiny SentencePiece-style Unigram vocabulary."""
    pieces: list[tuple[str, float]] = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0)]
    pieces += [("\u2581" + w, -2.0) for w in _T5_WORDS]
    pieces.append(("\u2581", -4.0))
    pieces += [("\u2581" + c, -6.0) for c in _T5_SYMBOLS if c not in _T5_WORDS]
    pieces += [(c, -7.0) for c in _T5_SYMBOLS]
    return pieces


def _t5_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.Unigram(t5_unigram_vocab(), unk_id=2))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("  ", " "), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {T5_EOS}", pair=f"$A {T5_EOS} $B {T5_EOS}", special_tokens=[(T5_EOS, 1)]
    )
    for special in (T5_PAD, T5_EOS, T5_UNK):
        tok.add_special_tokens([special])
    return tok.to_str()


def write_t5_tokenizer_files(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(_t5_tokenizer_json(), encoding="utf-8")
    config = {
        "model_max_length": 512,
        "eos_token": T5_EOS,
        "unk_token": T5_UNK,
        "pad_token": T5_PAD,
        "extra_ids": 0,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def tiny_clip_tokenizer() -> Any:
    """A ``CLIPTokenizer`` over :func:`clip_vocab` (514 tokens), made without network access."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="devmap-clip-tok-") as tmp:
        write_clip_tokenizer_files(Path(tmp))
        return CLIPTokenizer.from_pretrained(tmp, local_files_only=True)


def tiny_t5_tokenizer() -> Any:
    """A ``T5TokenizerFast`` over :func:`t5_unigram_vocab`, made without network access."""
    from transformers import T5TokenizerFast

    with tempfile.TemporaryDirectory(prefix="devmap-t5-tok-") as tmp:
        write_t5_tokenizer_files(Path(tmp))
        return T5TokenizerFast.from_pretrained(tmp, local_files_only=True)
