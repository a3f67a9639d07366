"""The Performance History Table's arithmetic and persistence, and the confidence breach counter."""

from __future__ import annotations

import pytest

from exitplan.profiling.cbc import BreachCounter
from exitplan.profiling.pht import PerformanceHistoryTable, PHTEntry, options


def _entry(name: str, **kw) -> PHTEntry:
    base = {"model": name, "num_layers": 24, "perplexity": 3.5, "exit_layers": [8, 16, 20],
            "exit_distribution": {8: 0.5, 16: 0.2, 20: 0.1, 24: 0.2}, "prefill_s": 1e-4, "decode_s": 2e-4,
            "head_s": 1e-3, "load_s_per_layer": 0.05, "load_s_base": 0.5, "base_bytes": 1000, "layer_bytes": 100,
            "head_bytes": 100, "kv_token_layer_bytes": 2}
    return PHTEntry(**(base | kw))


def test_breach_rate_and_depth() -> None:
    e = _entry("a")
    assert e.breach_rate(8) == pytest.approx(0.5) and e.breach_rate(20) == pytest.approx(0.2)
    assert e.depth_for(0.5) == 8 and e.depth_for(0.35) == 16 and e.depth_for(0.1) == 24
    assert e.weight_bytes(8) == 1000 + 800 + 100 and e.weight_bytes(24) == 3400
    assert e.kv_bytes_per_token(8) == 18 and e.kv_bytes_per_token(24) == 48


def test_options_are_costed_and_sorted() -> None:
    current, other = _entry("a"), _entry("b", load_s_base=100.0)
    costed = options(current, 8, [other], context_tokens=1000, remaining_tokens=500, max_breach_rate=0.5)
    assert [o.action for o in costed] == ["load", "switch"]
    load = costed[0]
    assert load.exit_layer == 24
    assert load.seconds == pytest.approx(16 * 0.05 + 1000 * 24 * 1e-4 + 500 * (24 * 2e-4 + 1e-3))
    cheap = _entry("b", load_s_base=0.0, load_s_per_layer=0.0)
    assert options(_entry("a", load_s_per_layer=10.0), 8, [cheap], 1000, 500, 0.5)[0].action == "switch"
    hopeless = _entry("c", exit_distribution={24: 1.0}, exit_layers=[8])
    assert [o.model for o in options(current, 8, [hopeless], 1000, 500, 0.5)] == ["a", "c"]


def test_table_persists_atomically(tmp_path) -> None:
    path = tmp_path / "pht.json"
    table = PerformanceHistoryTable(path)
    table.update(_entry("a"))
    again = PerformanceHistoryTable(path)
    assert again["a"] == _entry("a") and "a" in again and "b" not in again
    assert path.stat().st_size < 1024
    best, depth = again.best(["a"], lambda m, d: 4, 0.35)
    assert (best, depth) == ("a", 16)


def test_breach_counter_window() -> None:
    cbc = BreachCounter(window=4, cbc_max=2)
    assert [cbc.record(b) for b in (True, True, False, True)] == [False, False, False, True]
    assert cbc.record(False) is False  # the first breach left the window: 2 in the last 4
    cbc.reset()
    assert cbc.breaches == 0 and cbc.total_breaches == 3
    with pytest.raises(ValueError, match="cbc_max"):
        BreachCounter(window=4, cbc_max=4)
