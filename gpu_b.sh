#!/usr/bin/env bash
export PYTHONUNBUFFERED=1
timeout 560 python -m pytest -q -p no:cacheprovider tests/gpu/test_recipes_gpu.py -rs --durations=0 > $OUT/recipes.log 2>&1; echo "recipes rc=$?"
tail -40 $OUT/recipes.log
