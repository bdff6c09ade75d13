"""A model's tokenizer, loaded and checked against the model before anything heavy is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: Path, *, trust_remote_code: bool = False, model_vocab_size: int | None = None,
                   chat_template: str | None = None):
    """The tokenizer of `path`, checked (:func:`check_tokenizer`): one-line error when the directory has none (every
    prompt would encode to []), it has no EOS token, or (given the model's vocab size) its vocabulary does not fit.
    ``chat_template`` (model.chat_template: Jinja text, or a file of it) replaces the tokenizer's own."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ValueError(f"model.tokenizer_path={str(path)!r} ships its own tokenizer code; set "
                             f"model.trust_remote_code=true if you trust that directory") from None
        raise
    check_tokenizer(tokenizer, str(path), model_vocab_size=model_vocab_size or len(tokenizer))
    if chat_template is not None:
        text = chat_template.strip()  # a .jinja file (checked by TrainConfig.check_paths), or the template itself
        tokenizer.chat_template = Path(text).read_text() if text.endswith(".jinja") else chat_template
    return tokenizer


def check_tokenizer(tokenizer: Any, path: str, *, model_vocab_size: int) -> None:
    """The tokenizer encodes text to tokens, has an end-of-sequence token, and its vocabulary fits the model's:
    no id beyond the embedding, and not less than half of it (a sign of another model family's tokenizer)."""
    if not tokenizer.encode("The answer is 42.", add_special_tokens=False):
        raise ValueError(f"model.tokenizer_path={path!r} has no tokenizer files (tokenizer.json or a vocabulary); "
                         f"point model.tokenizer_path at the model's tokenizer")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has no end-of-sequence token, so generation "
                         f"could never stop; set eos_token in its tokenizer_config.json")
    size = len(tokenizer)
    if size > model_vocab_size:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has {size} tokens but the model's vocabulary "
                         f"has {model_vocab_size} (vocab_size in config.json); use the model's own tokenizer")
    if size < model_vocab_size // 2:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has {size} tokens, less than half of the "
                         f"model's vocabulary of {model_vocab_size}; it belongs to another model: use the model's "
                         f"own tokenizer")
