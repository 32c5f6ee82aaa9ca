"""Bad input, command by command (issue 38): each probe is one ``megatron-ext`` command line a
user could type by mistake. Every one must end with its exit code (2: a user error; 1 or 3
where the command says so), exactly one line on stderr that starts ``megatron-ext`` and names
the problem, no traceback, and nothing written or changed in the folder it ran in.

The probes run in-process (:func:`megatron_ext.launch.cli.main` with an argument list, stderr
captured, ``SystemExit`` caught): 170 subprocesses would cost minutes. A few run as the real
command (:func:`test_real_command_probes`), where only a process shows it: the interpreter's
own output at exit, the first stderr line above the libraries' warnings, a closed pipe.

The fixtures are files a user could hand a command: a YAML that is not a recipe, a binary
file, a Hugging Face folder whose ``config.json`` is broken or whose weights are truncated, a
checkpoint whose manifest was edited, a DiPaCo run whose ``run.json`` is garbage, ...
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ext.launch.cli import main

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class Probe:
    """``megatron-ext ARGV`` must exit ``code`` with one stderr line containing ``says``."""

    argv: str
    says: str
    code: int = 2

    def __str__(self) -> str:
        return self.argv


def _make_fixtures(root: Path) -> None:
    """The files the probes point at (relative paths; the probes run in ``root``)."""
    (root / "text.txt").write_text("a few words of text\n" * 20)
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (root / "afile").write_text("a file, not a folder\n")
    (root / "empty_dir").mkdir()
    (root / "bad.yaml").write_text("model: [unclosed\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "empty.yaml").write_text("")
    (root / "unknown_trainer.yaml").write_text("trainer: nope\nrun_dir: out/r\n")
    (root / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    (root / "nokey.jsonl").write_text('{"body": "text without the key"}\n')
    (root / "flags.txt").write_text("--num-layers abc --hidden-size 64\n")
    (root / "unknown_flags.txt").write_text("--no-such-megatron-flag 3\n")
    for name, config in {
        "hf_badjson": "{not json",
        "hf_bert": json.dumps({"model_type": "bert"}),
        "hf_trunc": json.dumps(TINY_LLAMA),
        "hf_noweights": json.dumps(TINY_LLAMA),
        "hf_missing_field": json.dumps({"model_type": "llama", "vocab_size": 96}),
    }.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(config)
    (root / "hf_trunc" / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    (root / "mcore_badjson").mkdir()
    (root / "mcore_badjson" / "model.json").write_text("{garbage")
    (root / "mcore_badjson" / "step_000000").mkdir()
    (root / "mcore_badjson" / "hf_config.json").write_text("{garbage")
    (root / "mcore_noweights").mkdir()
    (root / "mcore_noweights" / "model.json").write_text("{}")
    (root / "mcore_noweights" / "step_000000").mkdir()
    # a checkpoint whose manifest was edited by hand, one whose manifest is not JSON, one of
    # the old layout (no manifest), each with its own run folder
    for run, manifest in {
        "ckpt_edited": {"format": 1, "step": 10, "files": "not a mapping"},
        "ckpt_badjson": "{garbage",
        "ckpt_old": None,
    }.items():
        step = root / run / "checkpoints" / "step_000010"
        step.mkdir(parents=True)
        (step / "__0_0.distcp").write_bytes(b"x" * 64)
        (step / "metadata.json").write_text("{}")
        if manifest is not None:
            text = manifest if isinstance(manifest, str) else json.dumps(manifest)
            (step / "manifest.json").write_text(text)
    other = root / "dipaco_original" / "queue.db"  # a copied run names the original's queue
    for run, files in {
        "dipaco_badrun": {"dipaco/run.json": "{garbage"},
        "dipaco_badqueue": {
            "dipaco/run.json": json.dumps({"queue": "sqlite:///dipaco_badqueue/queue.db"}),
            "queue.db": "not a database, just text " * 40,
        },
        "dipaco_copied": {
            "dipaco/run.json": json.dumps({"queue": f"sqlite:///{other}"}),
            "queue.db": "",
        },
        "dipaco_original": {"queue.db": ""},
    }.items():
        for name, text in files.items():
            (root / run / name).parent.mkdir(parents=True, exist_ok=True)
            (root / run / name).write_text(text)
    # an indexed dataset (megatron-core's .idx header: magic, version, dtype code 8 = uint16)
    # whose ids reach 300: beyond the byte tokenizer's 258
    (root / "bigids.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, 8))
    (root / "bigids.bin").write_bytes(struct.pack("<4H", 5, 300, 7, 2))
    (root / "notidx.idx").write_bytes(b"garbage header")
    (root / "notidx.bin").write_bytes(b"\x00\x01")
    (root / "results_badjson" / "bench").mkdir(parents=True)
    (root / "results_badjson" / "bench" / "figures.json").write_text("{garbage")
    (root / "results_nojson" / "bench").mkdir(parents=True)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` -> (size, mtime in ns); every folder -> None (a temporary
    file written and removed again changes its folder's mtime: that is no partial write)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("probes")
    _make_fixtures(root)
    return root


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``megatron-ext ARGV`` run by :func:`main` in ``cwd``."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


L = "launch tiny_cpu_gpt --dry-run run_dir=out/launch"  # a launch that must stop at a probe
P = "plan gpt_8b model.vocab_size=128256"
PROBES = [
    # ---- the command line itself
    Probe("", "the following arguments are required: COMMAND"),
    Probe("nosuch", "invalid choice: 'nosuch'"),
    Probe("plan gpt_8b --nodez 8", "unrecognized arguments: --nodez"),
    Probe("launch", "the following arguments are required: recipe"),
    Probe("launch tiny_cpu_gpt --dryrun", "unrecognized arguments: --dryrun"),
    Probe("recipe", "the following arguments are required: ACTION"),
    Probe("docs results extra=1", "takes no key=value overrides"),
    # ---- launch: the recipe file
    Probe("launch nosuch_recipe --dry-run", "not found; shipped recipes"),
    Probe("launch garbage.yaml --dry-run", "recipe file 'garbage.yaml' not found"),
    Probe("launch bad.yaml --dry-run", "bad.yaml"),
    Probe("launch list.yaml --dry-run", "list.yaml"),
    Probe("launch empty.yaml --dry-run", "empty.yaml"),
    Probe("launch binary.bin --dry-run", "binary.bin"),
    Probe("launch afile --dry-run", "afile"),
    Probe("launch empty_dir --dry-run", "empty_dir"),
    Probe("launch unknown_trainer.yaml --dry-run", "trainer='nope'"),
    # ---- launch: overrides (options before, between and after them)
    Probe(f"{L} optimizer.lr=abc", "optimizer.lr"),
    Probe(f"{L} optimizer.lr=-1", "optimizer.lr"),
    Probe(f"{L} optimizer.name=adamww", "did you mean"),
    Probe(f"{L} optimizer.nosuch=1", "optimizer.'nosuch'"),
    Probe(f"{L} optimizer=3", "optimizer"),
    Probe(f"{L} nosuch.key=1", "nosuch"),
    Probe(f"{L} =3", "=3"),
    Probe(f"{L} optimizer.lr", "optimizer.lr"),
    Probe(f"{L} training.steps=0", "training.steps"),
    Probe(f"{L} training.steps=-5", "training.steps"),
    Probe(f"{L} training.steps=1.5", "training.steps"),
    Probe(f"{L} training.steps=50", "training.lr_wsd_decay_steps"),
    Probe(f"{L} training.micro_batch_size=0", "training.micro_batch_size"),
    Probe(f"{L} training.global_batch_size=7", "global"),
    Probe(f"{L} training.precision=fp16x", "training.precision"),
    Probe(f"{L} training.seq_length=0", "training.seq_length"),
    Probe(f"{L} training.lr_decay_style=nope", "training.lr_decay_style"),
    Probe(f"{L} training.lr_warmup_steps=-1", "training.lr_warmup_steps"),
    Probe(f"{L} parallel.tensor_model_parallel_size=3", "tensor_model_parallel_size"),
    Probe(f"{L} parallel.pipeline_model_parallel_size=0", "pipeline_model_parallel_size"),
    Probe(f"{L} parallel.backend=mpi2", "parallel.backend"),
    Probe(f"{L} model.num_layers=0", "model.num_layers"),
    Probe(f"{L} model.num_attention_heads=3", "num_attention_heads"),
    Probe(f"{L} model.nosuch_field=1", "model.'nosuch_field'"),
    Probe(f"{L} model.normalization=BatchNorm", "model.normalization"),
    Probe(f"{L} logging.log_interval=0", "logging.log_interval"),
    Probe(f"{L} seed=abc", "seed"),
    Probe(f"{L} data.tokenizer=nosuch", "data.tokenizer"),
    Probe(f"{L} data.split=a,b", "data.split"),
    Probe(f"{L} --nproc-per-node 0", "--nproc-per-node"),
    Probe(f"{L} --nproc-per-node abc", "invalid int value: 'abc'"),
    Probe(f"{L} --nnodes 0", "--nnodes"),
    Probe(f"{L} --nnodes 2 --node-rank 5 --rdzv-endpoint h:29500", "--node-rank"),
    Probe(f"{L} --nnodes 2 --node-rank 0 --rdzv-endpoint nohostport", "--rdzv-endpoint"),
    Probe(f"{L} --nnodes 2 --node-rank 0 --rdzv-endpoint h:port", "--rdzv-endpoint"),
    # ---- launch --dry-run makes the launch's own checks, and writes nothing
    Probe("launch tiny_cpu_gpt run_dir=afile/run --dry-run", "is not writable"),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[] data.path=nodata",
        "data.path='nodata'",
    ),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[text.txt] "
        "data.path=out/d data.tokenizer=sentencepiece data.tokenizer_model=nosuch.model",
        "nosuch.model",
    ),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[text.txt] "
        "data.path=out/d data.tokenizer=sentencepiece data.tokenizer_model=text.txt",
        "text.txt",
    ),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[] data.path=bigids",
        "holds token id 300, beyond the model's vocabulary of 258",
    ),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[] data.path=bigids "
        "model.vocab_size=200",
        "vocabulary of 200",
    ),
    Probe(
        "launch tiny_cpu_gpt --dry-run run_dir=out/x data.source=[] data.path=notidx",
        "not a megatron-core index file",
    ),
    # ---- train (the per-rank entry point) refuses a bad recipe before any process group
    Probe("train nosuch_recipe", "not found; shipped recipes"),
    Probe("train tiny_cpu_gpt optimizer.lr=abc run_dir=out/t", "optimizer.lr"),
    Probe("train bad.yaml", "bad.yaml"),
    # ---- plan
    Probe(f"{P} --nodes 0", "--nodes 0"),
    Probe(f"{P} --nodes -1", "--nodes -1"),
    Probe(f"{P} --nodes abc", "invalid int value"),
    Probe(f"{P} --gpus-per-node 0", "--gpus-per-node 0"),
    Probe(f"{P} --gpu v100", "invalid choice: 'v100'"),
    Probe(f"{P} --mfu 0", "--mfu"),
    Probe(f"{P} --mfu 1.5", "--mfu"),
    Probe(f"{P} --mfu -1", "--mfu"),
    Probe(f"{P} --reserve-gb -1", "--reserve-gb"),
    Probe(f"{P} --reserve-gb 200", "--reserve-gb 200"),
    Probe(f"{P} --nvlink-gbps 0", "--nvlink-gbps"),
    Probe(f"{P} --network-gbps -5", "--network-gbps"),
    Probe(f"{P} model.nosuch=1", "model.'nosuch'"),
    Probe(f"{P} --nodes 8 model.num_layers=abc", "model.num_layers"),
    Probe("plan nosuch_recipe", "not found; shipped recipes"),
    Probe("plan bad.yaml", "bad.yaml"),
    Probe("plan gpt_8b --nodes 8", "model.vocab_size"),
    Probe("plan soma_tiny", "soma"),
    # ---- recipe from-megatron-args
    Probe("recipe from-megatron-args nosuch.txt -o r.yaml", "nosuch.txt"),
    Probe("recipe from-megatron-args binary.bin -o r.yaml", "binary.bin"),
    Probe("recipe from-megatron-args empty_dir -o r.yaml", "empty_dir"),
    Probe("recipe from-megatron-args text.txt -o r.yaml", "text.txt"),
    Probe("recipe from-megatron-args flags.txt -o r.yaml", "flags.txt"),
    Probe("recipe from-megatron-args unknown_flags.txt -o r.yaml", "unknown_flags.txt"),
    Probe("recipe from-megatron-args flags.txt -o empty_dir", "is a folder"),
    Probe("recipe from-megatron-args flags.txt -o afile/r.yaml", "afile"),
    Probe("recipe from-megatron-args flags.txt", "-o/--output"),
    # ---- data build
    Probe("data build --output out/d", "the following arguments are required: inputs"),
    Probe("data build text.txt", "the following arguments are required: --output"),
    Probe("data build nosuch.txt --output out/d", "nosuch.txt"),
    Probe("data build binary.bin --output out/d", "binary.bin"),
    Probe("data build empty_dir --output out/d", "empty_dir"),
    Probe("data build text.txt --output afile/d", "afile"),
    Probe("data build text.txt --output out/d --json-key", "expected one argument"),
    Probe("data build text.txt --output out/d --tokenizer nosuch", "invalid choice: 'nosuch'"),
    Probe("data build text.txt --output out/d --tokenizer sentencepiece", "--tokenizer-model"),
    Probe(
        "data build text.txt --output out/d --tokenizer sentencepiece --tokenizer-model nosuch",
        "nosuch",
    ),
    Probe(
        "data build text.txt --output out/d --tokenizer sentencepiece --tokenizer-model text.txt",
        "text.txt",
    ),
    Probe(
        "data build text.txt --output out/d --tokenizer sentencepiece --tokenizer-model binary.bin",
        "binary.bin",
    ),
    Probe("data build bad.jsonl --output out/d", "bad.jsonl"),
    Probe("data build nokey.jsonl --output out/d", "text"),
    # ---- data tokenizer
    Probe("data tokenizer nosuch.txt --output out/t", "nosuch.txt"),
    Probe("data tokenizer text.txt --output out/t --vocab-size 0", "--vocab-size"),
    Probe("data tokenizer text.txt --output out/t --vocab-size -3", "--vocab-size"),
    Probe("data tokenizer text.txt --output out/t --vocab-size 100000", "--vocab-size"),
    Probe("data tokenizer text.txt --output out/t --model-type word", "invalid choice"),
    Probe("data tokenizer text.txt --output afile/t", "afile"),
    Probe("data tokenizer empty_dir --output out/t", "empty_dir"),
    # ---- ckpt verify / upgrade
    Probe("ckpt verify nosuch", "nosuch"),
    Probe("ckpt verify afile", "afile"),
    Probe("ckpt verify empty_dir", "no checkpoint here"),
    Probe("ckpt verify ckpt_edited", "manifest.json", code=1),
    Probe("ckpt verify ckpt_badjson", "manifest.json", code=1),
    Probe("ckpt verify ckpt_old", "needs `megatron-ext ckpt upgrade", code=3),
    Probe("ckpt upgrade nosuch out/u", "nosuch"),
    Probe("ckpt upgrade empty_dir out/u", "no checkpoint"),
    Probe("ckpt upgrade ckpt_old afile", "afile"),
    Probe("ckpt upgrade ckpt_old empty_dir", "empty_dir"),
    Probe("ckpt upgrade ckpt_old ckpt_old/checkpoints/inside", "inside"),
    Probe("ckpt upgrade ckpt_old ckpt_old/checkpoints/step_000010/x", "inside"),
    Probe("ckpt nosuch", "invalid choice"),
    # ---- convert hf-to-mcore
    Probe("convert hf-to-mcore nosuch out/c", "nosuch"),
    Probe("convert hf-to-mcore empty_dir out/c", "no config.json"),
    Probe("convert hf-to-mcore afile out/c", "afile"),
    Probe("convert hf-to-mcore hf_badjson out/c", "config.json"),
    Probe("convert hf-to-mcore hf_bert out/c", "model_type='bert'"),
    Probe("convert hf-to-mcore hf_missing_field out/c", "config.json"),
    Probe("convert hf-to-mcore hf_trunc out/c", "hf_trunc"),
    Probe("convert hf-to-mcore hf_noweights out/c", "hf_noweights"),
    Probe("convert hf-to-mcore hf_trunc hf_badjson", "not empty"),
    Probe("convert hf-to-mcore hf_trunc afile/c", "afile"),
    Probe("convert hf-to-mcore hf_trunc", "the following arguments are required: out"),
    # ---- convert mcore-to-hf
    Probe("convert mcore-to-hf nosuch out/h", "nosuch"),
    Probe("convert mcore-to-hf empty_dir out/h", "hf_config.json"),
    Probe("convert mcore-to-hf mcore_badjson out/h", "mcore_badjson"),
    Probe("convert mcore-to-hf mcore_noweights out/h --recipe tiny_cpu_gpt", "metadata.json"),
    Probe("convert mcore-to-hf mcore_badjson hf_badjson", "not empty"),
    Probe(
        "convert mcore-to-hf ckpt_old/checkpoints/step_000010 out/h --recipe nosuch_recipe",
        "nosuch_recipe",
    ),
    Probe(
        "convert mcore-to-hf ckpt_old/checkpoints/step_000010 out/h --recipe soma_tiny",
        "soma",
    ),
    # ---- convert check
    Probe("convert check nosuch mcore_badjson", "nosuch"),
    Probe("convert check hf_badjson mcore_badjson", "config.json"),
    Probe("convert check hf_trunc nosuch", "nosuch"),
    Probe("convert check hf_trunc mcore_badjson", "mcore_badjson"),
    Probe("convert check hf_trunc mcore_noweights", "mcore_noweights"),
    Probe("convert check hf_trunc mcore_badjson --tokens 0", "--tokens"),
    Probe("convert check hf_trunc mcore_badjson --min-cosine 2", "--min-cosine"),
    Probe("convert check hf_trunc mcore_badjson --min-argmax-agreement -1", "--min-argmax"),
    # ---- tools eps-sweep
    Probe("tools eps-sweep nosuch", "nosuch"),
    Probe("tools eps-sweep hf_badjson", "config.json"),
    Probe("tools eps-sweep hf_trunc --out out/e", "hf_trunc"),
    Probe("tools eps-sweep mcore_badjson --out out/e", "mcore_badjson"),
    Probe("tools eps-sweep hf_trunc --tokens 0 --out out/e", "--tokens"),
    Probe("tools eps-sweep hf_trunc --sequences 0 --out out/e", "--sequences"),
    # ---- soma
    Probe("soma eval nosuch_recipe", "not found; shipped recipes"),
    Probe("soma eval tiny_cpu_gpt", "soma"),
    Probe("soma eval soma_tiny run_dir=empty_dir", "empty_dir"),
    Probe("soma eval soma_tiny run_dir=empty_dir --k 0", "--k"),
    Probe("soma generate soma_tiny run_dir=empty_dir", "--prompt"),
    Probe("soma generate soma_tiny run_dir=empty_dir --prompt hi", "empty_dir"),
    Probe("soma generate soma_tiny run_dir=empty_dir --prompt hi --bytes 0", "--bytes"),
    Probe("soma generate soma_tiny run_dir=empty_dir --prompt hi --temperature -1", "--temp"),
    Probe("soma generate tiny_cpu_gpt --prompt hi", "soma"),
    Probe("soma variance --out afile/v", "afile"),
    # ---- dipaco
    Probe("dipaco worker nosuch_recipe", "not found; shipped recipes"),
    Probe("dipaco worker tiny_cpu_gpt", "not dipaco"),
    Probe("dipaco worker dipaco_tiny --max-tasks 0", "--max-tasks"),
    Probe("dipaco status nosuch", "nosuch"),
    Probe("dipaco status afile", "afile"),
    Probe("dipaco status empty_dir", "empty_dir"),
    Probe("dipaco status dipaco_badrun", "run.json"),
    Probe("dipaco status dipaco_badqueue", "queue.db"),
    Probe("dipaco status dipaco_copied", "a copied run?"),
    # ---- docs
    Probe("docs results --results nosuch", "nosuch"),
    Probe("docs results --results afile", "afile"),
    Probe("docs results --results results_badjson", "figures.json"),
    Probe("docs results --results results_badjson --check", "figures.json"),
    Probe("docs results --results results_nojson", "no benchmark JSON"),
    # ---- bench (values no benchmark can run with: none of these may start one)
    Probe("bench nosuch", "invalid choice: 'nosuch'"),
    Probe("bench plan --gpus 0 --out out/b", "--gpus"),
    Probe("bench plan --gpus -8 --out out/b", "--gpus"),
    Probe("bench plan --gpu v100 --out out/b", "v100"),
    Probe("bench plan --recipes soma_tiny --out out/b", "soma_tiny"),
    Probe("bench plan --recipes nosuch_recipe --out out/b", "nosuch_recipe"),
    Probe("bench plan --optimizers nosuch --out out/b", "nosuch"),
    Probe("bench plan --gpus-per-node 0 --out out/b", "--gpus-per-node"),
    Probe("bench soma --threads 0", "--threads"),
    Probe("bench soma --n-pert 0", "--n-pert"),
    Probe("bench soma --batch 0", "--batch"),
    Probe("bench optimizers --threads 0", "--threads"),
    Probe("bench optimizers --steps 0", "--steps"),
    Probe("bench convergence nosuch_recipe", "not found; shipped recipes"),
    Probe("bench convergence tiny_cpu_gpt optimizer.lr=abc", "optimizer.lr"),
    Probe("bench precision nosuch_recipe", "not found; shipped recipes"),
    Probe("bench ramp nosuch_recipe", "not found; shipped recipes"),
    Probe("bench ramp tiny_cpu_gpt --start 0", "--start"),
    Probe("bench paper nosuch", "invalid choice"),
    Probe("bench paper soma --seeds 2", "--seeds must be >= 3"),
    Probe("bench dipaco --tasks 0", "--tasks"),
]


def test_the_probe_list_is_long_and_covers_every_command() -> None:
    from megatron_ext.commands import commands

    assert len(PROBES) >= 150 and len({p.argv for p in PROBES}) == len(PROBES)
    probed = {p.argv.split()[0] for p in PROBES if p.argv}
    assert set(commands()) <= probed


@pytest.mark.parametrize("probe", PROBES, ids=str)
def test_bad_input_is_one_line(probe: Probe, probe_dir: Path) -> None:
    before = _tree(probe_dir)
    code, _, err = run_in_process(probe.argv.split(), probe_dir)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert code == probe.code, err
    assert len(lines) == 1 and lines[0].startswith("megatron-ext"), err
    assert probe.says in lines[0], lines[0]
    assert _tree(probe_dir) == before, "the probe wrote or changed a file"


def _real(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGATRON_EXT_"))}
    return subprocess.run(
        [str(Path(sys.executable).with_name("megatron-ext")), *argv],
        cwd=cwd,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_real_command_probes(probe_dir: Path) -> None:
    """What only a process shows: a closed pipe ends quietly; the first stderr line of a failed
    conversion is the error (no library warning above it); a bad flag after the overrides."""
    plan = subprocess.run(
        f"{Path(sys.executable).with_name('megatron-ext')} {P} --nodes 8 | head -1",
        shell=True,
        cwd=probe_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.stdout.startswith("plan: gpt_8b on 8 x 8") and plan.stderr == "", plan.stderr
    before = _tree(probe_dir)
    proc = _real(["convert", "hf-to-mcore", "hf_trunc", "out/c"], probe_dir)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("megatron-ext: error: "), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    proc = _real(["launch", "tiny_cpu_gpt", "run_dir=afile/r", "--dry-run"], probe_dir)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert _tree(probe_dir) == before
