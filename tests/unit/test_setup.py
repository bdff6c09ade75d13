"""Job assembly checks that run before anything heavy: tokenizers (trust_remote_code, missing files)."""

import json
from pathlib import Path

import pytest

from verl_mega.models.tiny import build_char_tokenizer
from verl_mega.trainer.setup import load_tokenizer

CUSTOM_CODE = '''from transformers import PreTrainedTokenizerFast


class UpperTokenizer(PreTrainedTokenizerFast):
    """Upper-cases text before encoding: code that only runs with trust_remote_code."""

    def encode(self, text, *args, **kwargs):
        return super().encode(text.upper(), *args, **kwargs)
'''


def _custom_tokenizer(path: Path) -> Path:
    build_char_tokenizer(path)
    (path / "upper_tokenizer.py").write_text(CUSTOM_CODE)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "upper_tokenizer.UpperTokenizer"]}, tokenizer_class="UpperTokenizer")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_trust_remote_code_is_honoured(tmp_path):
    path = _custom_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError) as info:
        load_tokenizer(path)
    assert str(info.value) == (f"model.tokenizer_path={str(path)!r} ships its own tokenizer code; set "
                               f"model.trust_remote_code=true if you trust that directory")
    tok = load_tokenizer(path, trust_remote_code=True)
    assert type(tok).__name__ == "UpperTokenizer"  # the directory's own code ran
    plain = load_tokenizer(build_char_tokenizer(tmp_path / "plain"))
    assert tok.encode("ab", add_special_tokens=False) == plain.encode("AB", add_special_tokens=False)
    assert plain.encode("ab", add_special_tokens=False) != plain.encode("AB", add_special_tokens=False)


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(tmp_path / "m")
