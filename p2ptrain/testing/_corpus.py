"""A text corpus and a tokenizer made on the spot, for tests of text and language-model runs on a
machine that reaches no model hub: a few of Python's own modules as text files, and a byte-level
BPE ``tokenizer.json`` trained on them (``tokenizers``, the ``data`` extra)."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

EOS = "<|endoftext|>"
STDLIB_FILES = ("this.py", "colorsys.py", "bisect.py", "keyword.py", "glob.py")


def text_corpus(root: Path, files: Sequence[str] = STDLIB_FILES, vocab_size: int = 300,
                eos: str = EOS) -> tuple[Path, Path]:
    """``(root/texts, root/tokenizer.json)``: the standard library's ``files`` copied as ``NAME.txt``,
    and a BPE tokenizer trained on them with ``eos`` as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = root / "texts"
    texts.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in files:
        (texts / f"{name}.txt").write_bytes((stdlib / name).read_bytes())
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in sorted(texts.iterdir())], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return texts, root / "tokenizer.json"
