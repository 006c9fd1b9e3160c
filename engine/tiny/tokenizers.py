"""Tokenizers for the tiny built-in models, built with the `tokenizers` library (no files, no hub)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def byte_fallback_tokenizer(leading: list[str], special: list[str]) -> Tokenizer:
    """Ids 0.. for ``leading`` tokens, then the 256 byte tokens, then ``special`` tokens.

    Any text encodes to byte tokens (BPE without merges plus byte fallback), so every prompt tokenizes.
    """
    vocab = {token: i for i, token in enumerate(leading)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in special:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in leading + special])
    return tokenizer


def word_level_tokenizer(words: list[str], special: list[str], unk: str) -> Tokenizer:
    """A word-level vocabulary: ``special`` tokens first, then ``words`` split on whitespace and punctuation."""
    vocab: dict[str, int] = {}
    for token in [*special, *words]:
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer
