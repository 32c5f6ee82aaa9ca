"""``megatron-ext recipe check-megatron PATH`` on a small Megatron-LM-shaped tree written here.

The tree holds a launch script (paths from positional arguments: placeholders), a BERT script
(not GPT: not read), functional-test ``model_config.yaml`` files -- one sample-based with TP=2,
sequence parallelism and full recomputation (agrees), one with ``--decoupled-lr`` (agrees: the
embedding and output layer's LR compared too), one with ``--fp8-format`` (refused, its
reason), one ``MODE: inference`` (not read) -- and one reading ``${REPEAT}`` (refused until
``--var REPEAT=1``). A recipe made wrong on purpose must be reported as differing, with its
fields: the comparison with Megatron-LM can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = """#!/bin/bash
CHECKPOINT_PATH=$1
VOCAB_FILE=$2
MERGE_FILE=$3
DATA_PATH=$4
torchrun --nproc_per_node 2 --nnodes 1 pretrain_gpt.py \\
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 \\
  --min-lr 1e-4 --train-iters 20 --lr-warmup-iters 3 --lr-decay-style cosine \\
  --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --data-path $DATA_PATH \\
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --save-interval 10
"""
SAMPLES = """ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 32
  --max-position-embeddings: 32
  --position-embedding-type: rope
  --swiglu: true
  --disable-bias-linear: true
  --tensor-model-parallel-size: 2
  --sequence-parallel: true
  --recompute-granularity: full
  --recompute-method: uniform
  --recompute-num-layers: 1
  --micro-batch-size: 2
  --global-batch-size: 8
  --train-samples: 1000
  --lr-warmup-samples: 100
  --lr-decay-style: cosine
  --lr: 3.0e-4
  --min-lr: 3.0e-5
  --adam-beta2: 0.95
  --tokenizer-type: GPTSentencePieceTokenizer
  --tokenizer-model: ${DATA_PATH}/tokenizer.model
  --data-path: ${DATA_PATH}/my_text_document
  --save: ${CHECKPOINT_SAVE_PATH}
  --save-interval: 100
  --wandb-project: ""
  --bf16: true
"""
BASE_ARGS = SAMPLES.split("  --position-embedding-type")[0].replace(
    "ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n", ""
) + (
    "  --micro-batch-size: 2\n  --global-batch-size: 8\n  --train-iters: 10\n  --lr: 1.0e-3\n"
    "  --data-path: ${DATA_PATH}/doc\n"
)
CASES = {
    "examples/tiny/train_tiny.sh": SCRIPT,
    "examples/bert/train_bert.sh": "torchrun pretrain_bert.py --num-layers 2\n",
    "tests/functional_tests/test_cases/gpt/tiny_samples/model_config.yaml": SAMPLES,
    "tests/functional_tests/test_cases/moe/tiny_decoupled/model_config.yaml": BASE_ARGS
    + "  --decoupled-lr: 5.0e-4\n",
    "tests/functional_tests/test_cases/gpt/tiny_fp8/model_config.yaml": BASE_ARGS
    + "  --fp16: true\n  --fp8-format: hybrid\n",
    "tests/functional_tests/test_cases/gpt/tiny_inference/model_config.yaml": "MODE: inference\n"
    + BASE_ARGS,
}
EXPECTED = {
    "examples/tiny/train_tiny.sh": "agree",
    "tests/functional_tests/test_cases/gpt/tiny_samples/model_config.yaml": "agree",
    "tests/functional_tests/test_cases/moe/tiny_decoupled/model_config.yaml": "agree",
    "tests/functional_tests/test_cases/gpt/tiny_fp8/model_config.yaml": "refused",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron-lm")
    for name, text in CASES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_check_megatron_reports_each_file_and_the_total(tree: Path, capsys) -> None:
    """The CLI in-process: the table, then --json (the same results), exit 0 (nothing
    differs); the placeholders each case was given are stated."""
    from megatron_ext.launch.cli import main

    assert main(["recipe", "check-megatron", str(tree), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    statuses = {c["path"]: c["status"] for c in report["cases"]}
    assert statuses == EXPECTED
    assert report["total"] == {
        "files": 4,
        "agree": 3,
        "refused": 1,
        "differs": 0,
        "agree_share": round(3 / 4, 4),
    }
    cases = {c["path"]: c for c in report["cases"]}
    fp8 = cases["tests/functional_tests/test_cases/gpt/tiny_fp8/model_config.yaml"]
    assert "--fp8-format hybrid (" in fp8["reason"]
    assert "with fp16 parameters is not one of megatron-ext's precisions" in fp8["reason"]
    script = cases["examples/tiny/train_tiny.sh"]["placeholders"]
    assert "--data-path /placeholder/data/corpus_text_document (for $4)" in script
    assert "--vocab-file /placeholder/tokenizer/gpt2-vocab.json (for $2)" in script


def test_variables_and_a_wrong_recipe(tree: Path, monkeypatch) -> None:
    """``${REPEAT}`` in --seed: refused by Megatron-LM's parser until --var REPEAT=1 sets it;
    a recipe whose LR, dropout and TP are made wrong after conversion is reported as differing
    in those fields (transformer, optimizer, lr, parallel)."""
    from megatron_ext.megatron import from_megatron
    from megatron_ext.megatron.check_megatron import check_file

    seed = tree / "tests/functional_tests/test_cases/gpt/tiny_seed/model_config.yaml"
    seed.parent.mkdir(parents=True)
    seed.write_text(BASE_ARGS + "  --seed: ${REPEAT}\n")
    refused = check_file(seed, tree, {}, None, "H100")
    assert refused.status == "refused"
    assert "argument --seed: invalid int value: '${REPEAT}'" in refused.reason
    assert check_file(seed, tree, {"REPEAT": "1"}, None, "H100").status == "agree"

    convert = from_megatron.convert

    def wrong(*args, **kwargs):
        out = convert(*args, **kwargs)
        out.set("optimizer.lr", 2e-3)
        out.set("model.hidden_dropout", 0.0)
        return out

    monkeypatch.setattr(from_megatron, "convert", wrong)
    result = check_file(seed, tree, {"REPEAT": "1"}, None, "H100")
    assert result.status == "differs"
    assert result.fields["transformer"] == ["hidden_dropout: 0.0 != 0.1"]
    assert result.fields["optimizer"] == ["lr: 0.002 != 0.001"]
    assert result.fields["lr"][0].startswith("lr at step 0: 0.002 != 0.001")


def test_a_wrong_decoupled_floor_differs(tree: Path, monkeypatch) -> None:
    """The decoupled LR's floor made wrong after conversion: the optimizer field and the
    embedding and output layer's LR at the decay's end differ (megatron-core's param group
    under its scheduler); the run's own LR still agrees."""
    from megatron_ext.megatron import from_megatron
    from megatron_ext.megatron.check_megatron import check_file

    case = tree / "tests/functional_tests/test_cases/gpt/tiny_floor/model_config.yaml"
    case.parent.mkdir(parents=True)
    case.write_text(BASE_ARGS + "  --decoupled-lr: 5.0e-4\n  --decoupled-min-lr: 4.0e-5\n")
    assert check_file(case, tree, {}, None, "H100").status == "agree"
    convert = from_megatron.convert

    def wrong(*args, **kwargs):
        out = convert(*args, **kwargs)
        out.set("optimizer.decoupled_min_lr", 1e-5)
        return out

    monkeypatch.setattr(from_megatron, "convert", wrong)
    result = check_file(case, tree, {}, None, "H100")
    assert result.status == "differs"
    assert result.fields["optimizer"] == ["decoupled_min_lr: 1e-05 != 4e-05"]
    assert result.fields["lr"] and all(d.startswith("decoupled lr at") for d in result.fields["lr"])
