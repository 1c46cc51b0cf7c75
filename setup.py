from pathlib import Path

from setuptools import setup

DOCS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "mkdocs-click>=0.8"]
EXTRAS = {
    "deepspeed": ["deepspeed>=0.14"],
    # transformers; datasets reads the job's JSON-lines, Parquet and text files; accelerate is what transformers.Trainer needs
    "hf": ["transformers>=4.56", "datasets>=2.14", "accelerate>=1.0"],
    # LoRA adapters through the Trainer integration
    "peft": ["peft>=0.10"],
    # TRL's SFT, DPO and GRPO trainers under SP (ulysses_sp.integrations.trl): written against trl 1.16's fused LM head
    "trl": ["trl>=1.16"],
    # sp-bench's tables, progress bars and plots
    "bench": ["rich>=13", "tqdm>=4.60", "matplotlib>=3.7"],
    # what the tests need: they check the transformers and DeepSpeed integrations and sp-bench's outputs too
    # ring-flash-attn and yunchang are pure Python (flash-attn is only their optional extra): the tests run them
    # as sp-bench peers on the CPU fake of flash-attn
    "dev": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "transformers>=4.56", "datasets>=2.14", "accelerate>=1.0", "peft>=0.10",
            "deepspeed>=0.17", "rich>=13", "tqdm>=4.60",
            "matplotlib>=3.7", "ring-flash-attn>=0.1.8", "yunchang>=0.6.4", "trl>=1.16", *DOCS],
    # the docs site (mkdocs.yml): `mkdocs serve`; the tests build it with --strict
    "docs": DOCS,
    # flash-attn builds only against CUDA; kept apart from `all`.
    "cuda": ["flash-attn>=2.5", "ring-flash-attn>=0.1"],
}
EXTRAS["all"] = sorted({req for name in ("deepspeed", "hf", "peft", "trl", "bench", "docs", "dev") for req in EXTRAS[name]})

setup(
    name="ulysses-sp",
    version="0.1.0",
    description="Sequence parallelism for long-context transformer training: one attention interface, "
    "pluggable backends (Ulysses, all-gather, ring, hybrid), DeepSpeed and Hugging Face integration.",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `backends/`, `mixers/` and `cli/` sit at the top of the repository but install inside the package,
    # so nothing named plainly `backends`, `mixers` or `cli` lands in site-packages.
    packages=["ulysses_sp", "ulysses_sp.models", "ulysses_sp.models.adapters", "ulysses_sp.integrations", "ulysses_sp.job", "ulysses_sp.kernels",
              "ulysses_sp.testing", "ulysses_sp.backends", "ulysses_sp.mixers", "ulysses_sp.cli"],
    package_dir={"ulysses_sp.backends": "backends", "ulysses_sp.mixers": "mixers", "ulysses_sp.cli": "cli"},
    # A range, not a pin: on a CPU machine install the CPU build first
    # (`pip install torch==2.13.0` here); this requirement is then already met.
    install_requires=["torch>=2.4", "click>=8.0"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["sp-bench=ulysses_sp.cli.main:main"]},
)
