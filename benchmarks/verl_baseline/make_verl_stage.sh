#!/bin/bash
# On this (CPU) box, in the project checkout: download the cp312 wheels that verl 0.9.1 needs on the lent H200
# machine beyond the kit (vLLM 0.26.0 + megatron-core, /tmp/site) and Ray 2.52.0 (/tmp/site_ray), and pack them into
# .stage/verl/v0/part_0 (… v1/part_1 if the bundle ever grows past 46 MiB; it is ~4.7 MB now).
#   bash benchmarks/verl_baseline/make_verl_stage.sh
# On the GPU machine, benchmarks/verl_baseline/stage_verl.sh installs them into /tmp/site_verl (see README.md).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
WORK=${VERL_STAGE_WORK:-/tmp/verl-stage}
git -C "$ROOT" check-ignore -q .stage/verl || { echo "$ROOT/.stage/verl is not git-ignored" >&2; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK/wheels/fallback" "$WORK/sdist"
PLAT=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 17 24 27 28 31 34 35 39; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$WORK/wheels" -r "$HERE/verl-requirements.txt"
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 / hydra 1.3 pin: their parsers are generated for 4.9) exists
# only as an sdist; it is pure Python, so build the wheel here.
python3 -m pip download -q --no-deps --no-binary=:all: -d "$WORK/sdist" antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" "$WORK"/sdist/antlr4-python3-runtime-4.9.3.tar.gz
# datasets 5.2.0 wants pyarrow>=24 and huggingface-hub>=1.31; if the machine's image is older, stage_verl.sh
# installs this one instead (pyarrow>=21, huggingface-hub<2).
python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK/wheels/fallback" datasets==4.8.5
(cd "$WORK" && tar cf bundle.tar wheels)
rm -rf "$ROOT/.stage/verl" && mkdir -p "$ROOT/.stage/verl"
(cd "$ROOT/.stage/verl" && split -b 46m -d -a 1 "$WORK/bundle.tar" part_ \
    && for f in part_*; do mkdir -p "v${f#part_}" && mv "$f" "v${f#part_}/"; done)
ls -l "$WORK"/wheels "$WORK"/wheels/fallback
du -sh "$ROOT"/.stage/verl/*
