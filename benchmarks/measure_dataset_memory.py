"""What a prompt dataset holds, against its file's size: a generated JSONL of arithmetic prompts loaded through
``PromptDataset.from_files`` with the bundled tiny model's character tokenizer (the worst case: one token per
character).

    python benchmarks/measure_dataset_memory.py [--mb 20] [--json OUT]

Memory is measured with ``tracemalloc`` (every Python allocation, numpy's and ``array``'s included): ``held`` is
what is still allocated once the dataset is built, ``peak`` the most that was allocated while it was built; both
as multiples of the file's size. Also the process's peak RSS (it includes the interpreter, torch-free imports and
the tokenizer). ``docs/data.md`` shows the result.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_jsonl(path: Path, megabytes: float) -> int:
    rng = random.Random(0)
    size = rows = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            prompt = " ".join(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}" for _ in range(20)) + " = ?"
            line = json.dumps({"prompt": prompt, "answer": str(rng.randint(0, 999)), "data_source": "toy",
                               "extra_info": {"index": rows, "split": "train"}}) + "\n"
            f.write(line)
            size, rows = size + len(line), rows + 1
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="size of the generated JSONL file")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from verl_mega.data.prompts import PromptDataset
    from verl_mega.models.tiny import build_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(build_char_tokenizer(Path(tmp) / "tok")))
        path = Path(tmp) / "prompts.jsonl"
        rows = write_jsonl(path, args.mb)
        size = path.stat().st_size
        tracemalloc.start()
        start = time.perf_counter()
        ds = PromptDataset.from_files(str(path), tokenizer, max_prompt_length=512)
        seconds = time.perf_counter() - start
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    result = {"file_mb": size / 1e6, "prompts": rows, "kept": len(ds), "held_x": held / size, "peak_x": peak / size,
              "nbytes_x": ds.nbytes / size, "load_s": seconds,
              "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"file {result['file_mb']:.1f} MB, {rows} prompts: held {result['held_x']:.2f}x the file "
          f"(dataset.nbytes {result['nbytes_x']:.2f}x), peak while loading {result['peak_x']:.2f}x, "
          f"load {seconds:.1f} s under tracemalloc, process max RSS {result['max_rss_mb']:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
