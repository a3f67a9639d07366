"""Device profiling: the fit recovers a known device; measuring runs the engine's runner on a real model."""

from __future__ import annotations

import pytest

from exitplan.profiling.device import Overheads, device_entry, fit_device, measure, predict

QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def test_fit_recovers_the_device_that_made_the_times(catalog) -> None:
    model = catalog.model(QWEN).model_copy(update={"dtype_bytes": 4})
    scale = {1: 2.5, 2: 1.2, 4: 1.1, 8: 1.0, 16: 1.0}  # one-row GEMV streams faster than small GEMMs
    truth = device_entry("cpu", 2e11, 1.5e10, 24, 0.1, "truth", scale)
    rows = [{"model": QWEN, "kind": "decode", "layers": L, "batch": b, "context": c, "new_tokens": b}
            for L in (12, 24) for b in (1, 2, 4, 8, 16) for c in (64, 512)]
    rows += [{"model": QWEN, "kind": "prefill", "layers": 24, "batch": 1, "context": 0, "new_tokens": n}
             for n in (16, 64, 256, 1024)]
    for row, seconds in zip(rows, predict(rows, model, truth, Overheads(2e-3, 5e-4)), strict=True):
        row["seconds"] = float(seconds)
    device, (step, seq, _), errors = fit_device(rows, {QWEN: model}, "cpu", 24, 0.1)
    assert errors["max_rel_err"] < 0.01 and device.efficiency.overlap and errors["overlap"] == 1.0
    assert device.bf16_tflops == pytest.approx(0.2, rel=0.05)
    assert device.hbm_bandwidth_gbps == pytest.approx(15, rel=0.05)
    assert step == pytest.approx(2e-3, rel=0.2) and seq == pytest.approx(5e-4, rel=0.2)
    fitted = device.efficiency.memory_scale
    assert fitted[16] == 1.0 and all(fitted[b] == pytest.approx(scale[b], rel=0.05) for b in (1, 2, 4))
    assert "fitted by profile_device" in device.efficiency.source


def test_fit_keeps_the_sum_form_for_times_made_by_a_device_that_does_not_overlap(catalog) -> None:
    model = catalog.model(QWEN).model_copy(update={"dtype_bytes": 4})
    scale = {1: 0.6, 4: 1.05, 8: 0.95, 16: 1.0}  # a GEMV step streams slower than a batched one (AVX512-BF16 vLLM)
    truth = device_entry("cpu", 8e10, 2e10, 24, 0.1, "truth", scale, overlap=False)
    rows = [{"model": QWEN, "kind": "decode", "layers": 24, "batch": b, "context": c, "new_tokens": b}
            for b in (1, 4, 8, 16) for c in (64, 256)]
    rows += [{"model": QWEN, "kind": "prefill", "layers": 24, "batch": 1, "context": 0, "new_tokens": n}
             for n in (32, 128, 512)]
    for row, seconds in zip(rows, predict(rows, model, truth, Overheads(7e-3, 1.5e-3)), strict=True):
        row["seconds"] = float(seconds)
    device, (step, seq, _), errors = fit_device(rows, {QWEN: model}, "cpu", 24, 0.1)
    assert device.efficiency.overlap is False and errors["overlap"] == 0.0
    fitted = device.efficiency.memory_scale
    assert fitted[16] == 1.0 and all(fitted[b] == pytest.approx(scale[b], rel=0.05) for b in (1, 4, 8))
    assert errors["max_rel_err"] < 1e-3 and errors["max_rel_err"] < errors["roofline_max_rel_err"]
    assert device.bf16_tflops == pytest.approx(0.08, rel=0.05)
    assert device.hbm_bandwidth_gbps == pytest.approx(20, rel=0.05)
    assert step == pytest.approx(7e-3, rel=0.1) and seq == pytest.approx(1.5e-3, rel=0.2)
    assert "sum of compute and memory time" in device.efficiency.source


def test_measure_times_decode_and_prefill_with_the_runner(tiny_llama, tmp_path) -> None:
    from exitplan.earlyexit.partial_model import EarlyExitLM

    tiny_llama.save_pretrained(str(tmp_path))
    model = EarlyExitLM.from_pretrained(tmp_path)
    rows = measure(model, batch_sizes=[1, 4], contexts=[8, 32], prefill_lengths=[4, 16], repeats=2)
    assert [(r["kind"], r["batch"], r["context"]) for r in rows][:4] == [
        ("decode", 1, 8), ("decode", 1, 32), ("decode", 4, 8), ("decode", 4, 32)]
    assert len(rows) == 6 and all(r["seconds"] > 0 and r["layers"] == 2 for r in rows)


def test_fit_recovers_attention_kv_per_model_compute_and_per_request_cost(catalog) -> None:
    big = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    models = {name: catalog.model(name).model_copy(update={"dtype_bytes": 2}) for name in (QWEN, big)}
    truth = device_entry("cpu", 2e11, 4e10, 24, 0.1, "truth", {1: 0.5, 4: 0.9, 16: 1.0}, overlap=False,
                         attention=0.45, kv_memory=0.1)
    truth = truth.model_copy(update={"model_compute": {QWEN: 0.95, big: 1 / 0.95}})
    rows = [{"model": name, "kind": "decode", "layers": models[name].num_layers, "batch": b, "context": c,
             "new_tokens": b} for name in models for b in (1, 4, 16) for c in (64, 256, 1024)]
    rows += [{"model": name, "kind": "prefill", "layers": models[name].num_layers, "batch": 1, "context": 0,
              "new_tokens": n} for name in models for n in (32, 128, 512, 2048)]
    for row in rows:
        row["seconds"] = float(predict([row], models[row["model"]], truth, Overheads(6e-3, 1e-4, 0.05))[0])
    device, (step, _, prompt), errors = fit_device(rows, models, "cpu", 24, 0.1)
    assert errors["max_rel_err"] < 0.01
    assert device.efficiency.attention == pytest.approx(0.45, rel=0.05)
    assert device.efficiency.kv_memory == pytest.approx(0.1, rel=0.05)
    assert device.model_compute[QWEN] == pytest.approx(0.95, rel=0.03)
    assert device.model_compute[QWEN] * device.model_compute[big] == pytest.approx(1.0)  # geometric mean 1
    assert device.bf16_tflops == pytest.approx(0.2, rel=0.05) and step == pytest.approx(6e-3, rel=0.1)
    assert prompt == pytest.approx(0.05, rel=0.1)  # a request's own cost, seen only in the prefills


def test_fit_of_one_model_names_no_compute_multiplier(catalog) -> None:
    model = catalog.model(QWEN).model_copy(update={"dtype_bytes": 2})
    truth = device_entry("cpu", 1e11, 2e10, 24, 0.1, "truth", overlap=False)
    rows = [{"model": QWEN, "kind": "decode", "layers": 24, "batch": b, "context": 64, "new_tokens": b}
            for b in (1, 8)] + [{"model": QWEN, "kind": "prefill", "layers": 24, "batch": 1, "context": 0,
                                 "new_tokens": 256}]
    for row in rows:
        row["seconds"] = float(predict([row], model, truth, Overheads(5e-3, 0.0))[0])
    device, *_ = fit_device(rows, {QWEN: model}, "cpu", 24, 0.1)
    assert device.model_compute == {}
