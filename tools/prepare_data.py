"""Write verl-format parquet prompt files for GSM8K, MATH, DAPO-Math-17K or AIME 2024 (one CPU process).

    python tools/prepare_data.py gsm8k                       # data/gsm8k/train.parquet, data/gsm8k/test.parquet
    python tools/prepare_data.py math --output DIR
    python tools/prepare_data.py dapo-math --source ORG/NAME[@REVISION]|DIR
    python tools/prepare_data.py aime2024 --file train=aime.parquet

By default the dataset comes from its hub ID, fetched into the Hugging Face cache (HF_HUB_OFFLINE=1: from the
cache alone). ``--source`` names another hub ID or a local directory holding the dataset in its hub layout;
``--file SPLIT=PATH`` (repeatable) takes local parquet/JSON/JSONL files instead. The rows are what verl's
examples/data_preprocess scripts write (docs/data.md); the tool prints the reward.function that scores them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_mega.data.prepare import DATASETS, PrepareError, prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/prepare_data.py", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=sorted(DATASETS), help="which dataset")
    parser.add_argument("--output", help="directory to write into (default: data/<dataset>)")
    parser.add_argument("--source", help="hub dataset ID (ORG/NAME[@REVISION]) or local directory (default: the "
                                         "dataset's hub ID)")
    parser.add_argument("--config", help="the dataset's configuration (default: main for gsm8k, else the card's)")
    parser.add_argument("--file", action="append", default=[], metavar="SPLIT=PATH",
                        help="a local parquet/JSON/JSONL file of one split, instead of --source (repeatable)")
    args = parser.parse_args(argv)
    files: dict[str, list[str]] = {}
    for item in args.file:
        split, sep, path = item.partition("=")
        if not sep or not split or not path:
            parser.error(f"--file {item!r}: write it as SPLIT=PATH, e.g. --file train=train.parquet")
        files.setdefault(split, []).append(path)
    if files and args.source:
        parser.error("give --source or --file, not both")
    output = args.output or str(Path("data") / args.dataset)
    try:
        written = prepare(args.dataset, output, source=args.source, config=args.config, files=files)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path, rows in written.values():
        print(f"wrote {rows} rows to {path}")
    print(f"score them with reward.function={DATASETS[args.dataset].reward}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
