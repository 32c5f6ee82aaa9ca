"""Packaging for megatron-ext.

The top-level folders ``optimizers/``, ``launch/`` and ``recipes/`` are installed *inside* the
``megatron_ext`` namespace (``megatron_ext.optimizers`` ...): the bare names belong to other PyPI
distributions, so nothing is installed under them.  ``package_dir`` does the mapping for both
regular and editable installs.
"""

from pathlib import Path

from setuptools import find_packages, setup

# folder on disk -> installed package
NAMESPACE_MAP = {
    "optimizers": "megatron_ext.optimizers",
    "launch": "megatron_ext.launch",
    "recipes": "megatron_ext.recipes",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    """All packages and where they live: megatron_ext.* as is, the mapped folders renamed."""
    packages = find_packages(include=["megatron_ext", "megatron_ext.*"])
    package_dir = {"megatron_ext": "megatron_ext"}
    for folder, name in NAMESPACE_MAP.items():
        packages.append(name)
        package_dir[name] = folder
        for sub in find_packages(where=folder):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    _check_no_folder_left_out(packages, package_dir)
    return packages, package_dir


def _check_no_folder_left_out(packages: list[str], package_dir: dict[str, str]) -> None:
    """Stop the build when a folder holds modules but is no package (no ``__init__.py``).

    ``find_packages`` skips such a folder without a word, so the wheel would lack it while an
    editable install (``make test``) still finds it in the working tree.
    """
    folders = {Path(package_dir.get(name, name.replace(".", "/"))) for name in packages}
    left_out = sorted(
        str(folder)
        for root in ["megatron_ext", *NAMESPACE_MAP]
        for folder in [Path(root), *Path(root).rglob("*")]
        if folder.is_dir()
        and "__pycache__" not in folder.parts
        and any(folder.glob("*.py"))
        and folder not in folders
    )
    if left_out:
        raise SystemExit(
            f"setup.py: {', '.join(left_out)} hold Python modules but no __init__.py, so they "
            "would be left out of the wheel; add an __init__.py (a one-line docstring) to each"
        )


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="megatron-ext",
    version="0.1.0",
    description="Matrix optimizers, layer-wise distributed optimizer, recipes for megatron-core",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12,<3.13",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"megatron_ext.recipes": ["*.yaml"], "megatron_ext.soma": ["*.c"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "pyyaml>=6",
        "numpy>=1.26",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",  # data.tokenizer: huggingface (a local folder, GPT-2 vocab + merges)
        "mpi4py>=4",
        "mpich>=4",
        "triton>=3",
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "psutil>=5.9",  # dist_checkpointing's async file writer
        "scikit-learn>=1.4",  # SOMA's tf-idf clustering router, DiPaCo's routers
        "psycopg[binary]>=3.1",  # DiPaCo's task queue on PostgreSQL
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",  # make test: two workers, a test file each at a time
            "ruff>=0.6",
            "mypy>=1.11",  # make lint: scripts/typecheck.py over the typed core
            "emerging-optimizers==0.3.0",
            "transformers>=5,<6",
        ],
        # megatron-ext convert: Hugging Face <-> megatron-core checkpoints
        "convert": ["transformers>=5,<6", "safetensors>=0.4"],
    },
    # The shipped trainers, optimizers, commands and benchmarks register in code
    # (megatron_ext/registry.py); another distribution adds its own through the entry-point
    # groups megatron_ext.trainers, .optimizers, .commands and .benchmarks.
    entry_points={
        "console_scripts": ["megatron-ext=megatron_ext.launch.cli:main"],
    },
)
