"""Offline inputs for the verl GRPO baseline: a random-weight model, a character tokenizer and an arithmetic dataset.

The model is the one ``benchmarks/bench_grpo_gpu.py`` (verl_mega's GRPO benchmark) uses: the Qwen2.5-1.5B
architecture (``bench_model_gpu.QWEN25_1_5B``), random bf16 weights saved as safetensors, and verl_mega's
character-level ``tokenizers`` tokenizer filled with reserved tokens up to the model's 151,936-entry vocabulary.
verl applies a chat template to every prompt, so a pass-through one (the message text, nothing added) is set.
The prompts are verl_mega's ``addition_small`` task (``a+b=``, operands 0..4), written as verl's RLHFDataset
expects them (parquet with ``prompt`` as chat messages, ``reward_model.ground_truth``, ``data_source``).

    python3 benchmarks/verl_baseline/prepare_verl_inputs.py --model-dir /tmp/verl_bench/model \\
        --data-dir /tmp/verl_bench/data [--tiny]      # --tiny: a 2-layer model for CPU checks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def name_chatml_tokens(tokenizer_json: Path) -> None:
    """verl's rollout tokenizes prompts through a per-family "Continuous Token" builder; for model_type qwen2 it
    looks up ``<|im_end|>`` and needs ``"\\n"`` to encode to exactly one token. Give four reserved ids those names
    (the vocabulary keeps its size; the pass-through chat template never renders them). transformers 5 loads this
    directory as a Qwen2Tokenizer (model_type qwen2), whose byte-level pre-tokenizer turns a newline into "Ċ", hence
    both spellings."""
    tj = json.loads(tokenizer_json.read_text())
    vocab = tj["model"]["vocab"]
    for i, tok in enumerate(["<|im_start|>", "<|im_end|>", "\n", "\u010a"]):
        if tok not in vocab:
            vocab[tok] = vocab.pop(f"<|reserved_{i}|>")
    tokenizer_json.write_text(json.dumps(tj, ensure_ascii=False))


def make_model(path: Path, tiny: bool) -> None:
    import torch

    from verl_mega.models.tiny import build_char_tokenizer, make_tiny_hf_model, tokenizer_vocab_size

    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        print(f"model already at {path}")
        return
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    if tiny:
        vocab = tokenizer_vocab_size() + 8  # room for the reserved ids that name_chatml_tokens renames
        make_tiny_hf_model(tmp, seed=0, vocab_size=vocab, hidden_size=128, intermediate_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=2048,
                           with_tokenizer=False)
        build_char_tokenizer(tmp, fill_to=vocab)
        name_chatml_tokens(tmp / "tokenizer.json")
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        from bench_model_gpu import QWEN25_1_5B  # the shape verl_mega's GRPO benchmark uses

        cfg = AutoConfig.for_model(**QWEN25_1_5B)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(str(tmp), safe_serialization=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        build_char_tokenizer(tmp, fill_to=QWEN25_1_5B["vocab_size"])
        name_chatml_tokens(tmp / "tokenizer.json")
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # what transformers 5 reads; the class stays as saved
    os.replace(tmp, path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tok("3+4=", add_special_tokens=False).input_ids, ids
    cfg = json.loads((path / "config.json").read_text())
    print(f"model at {path}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']},"
          f" tokenizer {type(tok).__name__} vocab {len(tok)}, eos {tok.eos_token_id}, pad {tok.pad_token_id}")


def write_dataset(data_dir: Path, num_prompts: int, seed: int) -> Path:
    from verl_mega.data.arithmetic import generate_arithmetic

    records = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"index": i, "split": "train"},
        }
        for i, r in enumerate(generate_arithmetic(num_prompts, seed=seed, ops="+", max_operand=4))
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # verl also reads .jsonl (through datasets' json builder)
        out = data_dir / "train.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        out = data_dir / "train.parquet"
        pq.write_table(pa.Table.from_pylist(records), out)
    print(f"{len(records)} prompts -> {out} (first: {records[0]['prompt'][0]['content']!r} -> "
          f"{records[0]['reward_model']['ground_truth']})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 1.5B-class one")
    args = ap.parse_args()
    make_model(Path(args.model_dir), args.tiny)
    write_dataset(Path(args.data_dir), args.num_prompts, args.seed)


if __name__ == "__main__":
    main()
