"""A model's tokenizer, loaded and checked against the model before anything heavy is built."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def load_tokenizer(path: Path, *, trust_remote_code: bool = False, model_vocab_size: int | None = None,
                   chat_template: str | None = None, model_path: Path | None = None):
    """The tokenizer of `path`, checked (:func:`check_tokenizer`): one-line error when the directory has none (every
    prompt would encode to []), it has no EOS token, or (given the model's vocab size) its vocabulary does not fit.
    ``chat_template`` (model.chat_template: Jinja text, or a file of it) replaces the tokenizer's own. Given the
    model's directory (``model_path``), its special-token ids and the chat template's markers are checked too
    (:func:`check_special_tokens`, :func:`check_template_markers`)."""
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
    if model_path is not None:
        check_special_tokens(tokenizer, str(path), Path(model_path))
    check_template_markers(tokenizer, str(path))
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


def _ids(value: Any) -> set[int]:
    """A config's token id field (an int, a list of them, or null) as a set."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _model_token_ids(model_path: Path) -> dict[str, tuple[set[int], str]]:
    """The model's bos/eos/pad ids from config.json (or its text_config) and generation_config.json, each with
    where it was read, for the message."""
    found: dict[str, tuple[set[int], str]] = {}
    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((model_path / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
        for kind in ("bos", "eos", "pad"):
            ids = _ids(data.get(f"{kind}_token_id", text.get(f"{kind}_token_id")))
            if ids:
                seen, where = found.get(kind, (set(), ""))
                said = f"{name}'s {kind}_token_id {sorted(ids)[0] if len(ids) == 1 else sorted(ids)}"
                found[kind] = (seen | ids, f"{where} and {said}" if where else said)
    return found


def check_special_tokens(tokenizer: Any, path: str, model_path: Path) -> None:
    """The tokenizer's bos, eos and pad ids are the model's (config.json, generation_config.json): a tokenizer of
    the right size whose ids are permuted, or another model's, would otherwise be used silently, and generation
    stops at the tokenizer's eos id. An eos id may be any of the model's eos ids (instruct models list several);
    a pad id may also be one of the model's other special ids (tokenizers often pad with eos). An id the model's
    files do not give is not checked."""
    model = _model_token_ids(model_path)
    specials = set().union(*(ids for ids, _ in model.values())) if model else set()
    for kind in ("eos", "bos", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is None or kind not in model:
            continue
        ids, where = model[kind]
        if token_id in (specials if kind == "pad" else ids):
            continue
        token = getattr(tokenizer, f"{kind}_token", None)
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer's {kind}_token {token!r} is id {token_id}, "
                         f"but the model's {where} (in {model_path}); the tokenizer does not match the model: set "
                         f"model.tokenizer_path to the model's own tokenizer (if it is, make the model's "
                         f"{kind}_token_id {token_id} in its config)")


# Turn markers of chat templates that are special tokens in their model's tokenizer: ChatML, Llama 3, Phi
# (<|im_start|>, <|eot_id|>, <|user|>) and DeepSeek (<｜User｜>)
_MARKER = re.compile(r"<\|[^|<>\s]{1,64}\|>|<｜[^｜<>\s]{1,64}｜>")


def check_template_markers(tokenizer: Any, path: str) -> None:
    """Every turn marker of the chat template (model.chat_template, or the tokenizer's own) is one token of this
    tokenizer: a template written for another model's tokenizer would wrap every prompt in markers the model has
    never seen, spelled out piece by piece."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    for text in texts:
        if not isinstance(text, str):
            continue
        for marker in sorted(set(_MARKER.findall(text))):
            pieces = tokenizer.encode(marker, add_special_tokens=False)
            token_id = tokenizer.convert_tokens_to_ids(marker)
            # one token (a sentencepiece tokenizer may put a lone prefix-space piece before it)
            if token_id is None or token_id == tokenizer.unk_token_id or token_id not in pieces or len(pieces) > 2:
                raise ValueError(f"model.tokenizer_path={path!r}: the chat template uses {marker!r}, which this "
                                 f"tokenizer splits into {len(pieces)} tokens (it is not one of its special tokens); "
                                 f"set model.tokenizer_path to the model's own tokenizer, or model.chat_template to "
                                 f"a template for this one")
