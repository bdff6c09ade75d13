#!/bin/bash
# Runs ON the lent GPU machine, from the project root, after the kit (/tmp/site) and Ray (/tmp/site_ray) are in.
# Each call copies the carried part(s) .stage/verl/v*/part_* into /tmp/stage_verl (kept while the machine stays up);
# with 'install' it reassembles them and installs verl 0.9.1 + its missing requirements into /tmp/site_verl.
#   bash benchmarks/verl_baseline/stage_verl.sh install      # carry: .stage/verl (one part, ~4.7 MB)
# Then: export PYTHONPATH=/tmp/site:/tmp/site_ray:/tmp/site_verl:$PWD
mkdir -p /tmp/stage_verl
for d in .stage/verl/v*; do [ -d "$d" ] && cp "$d"/part_* /tmp/stage_verl/ 2>/dev/null; done
ls /tmp/stage_verl
[ "${1:-}" = install ] || exit 0
if [ ! -d /tmp/site_verl/verl ]; then
  set -e
  (cd /tmp/stage_verl && cat part_* > bundle.tar && tar xf bundle.tar)
  W=/tmp/stage_verl/wheels
  # datasets 5.2.0 needs pyarrow>=24 and huggingface-hub>=1.31; else fall back to 4.8.5 (pyarrow>=21, hub<2)
  if ! python3 - <<'EOF'
import importlib.metadata as m, sys
from packaging.version import Version as V
def ver(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "MISSING"
print("image:", ", ".join(f"{n} {ver(n)}" for n in ("pyarrow", "huggingface_hub", "pandas", "peft", "accelerate")))
pa, hub = V(ver("pyarrow")), V(ver("huggingface_hub"))
sys.exit(0 if pa >= V("24") and V("1.31") <= hub < V("3") else 1)
EOF
  then
    echo "using datasets 4.8.5 (fallback)"; rm -f $W/datasets-5.*.whl; mv $W/fallback/datasets-*.whl $W/
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_verl $W/*.whl
  echo "installed into /tmp/site_verl"
fi
PYTHONPATH=/tmp/site:/tmp/site_ray:/tmp/site_verl python3 -c "
import verl, hydra, omegaconf, tensordict, transfer_queue, datasets, torchdata, codetiming, orjson, ray, vllm, pandas, peft
print('verl', verl.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'tensordict', tensordict.__version__,
      'datasets', datasets.__version__)"
