"""The communication of a tensor- or pipeline-parallel step: TP's all-reduces and PP's stage-to-stage sends.

Per decoder layer, tensor parallelism all-reduces the activations twice (after attention's output projection and
after the MLP's down projection: Megatron-LM's layout, which vLLM's Llama and Qwen2 follow); each all-reduce carries
``tokens x hidden x dtype`` bytes. One all-reduce of ``n`` bytes over ``p`` GPUs costs, for each algorithm,

    t = call + (p - 2) x peer + 2 (p - 1) / p x n / bus_bandwidth

the fixed cost of one call (launch and synchronisation, at two GPUs), a cost per further GPU in the group, and the
ring's bandwidth term (NCCL's bus bandwidth: ``busbw = algbw x 2 (p - 1) / p``). vLLM dispatches small messages on
NVLink to its custom one-shot all-reduce and the rest to NCCL's ring; the model takes the faster of the algorithms
that apply (the custom one only on NVLink and below its buffer size), which is what that dispatch is tuned to pick.
A PP send costs one call plus ``n / bandwidth`` over the link. The ring's constants are the catalog's ``Link``
(``latency_us``, ``peer_latency_us``, ``bandwidth_gbps``) and ``Efficiency.link``; the custom all-reduce's are below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exitplan.catalog import Gpu

CUSTOM_AR_CALL_S = 3.3e-6
"""vLLM's custom all-reduce, fixed cost at TP2: 3.7 us for 512 B and 4.5 us for 32 KB on H100 NVLink, 3.3 us the
intercept of a fit over TP 2/4/8 (sglang PR #2904, "custom allreduce" table; vLLM's kernel, which sglang adopted)."""

CUSTOM_AR_PEER_S = 0.37e-6
"""vLLM's custom all-reduce, cost per GPU beyond two: 3.7 / 4.8 / 5.9 us at 512 B on TP 2/4/8 (sglang PR #2904)."""

CUSTOM_AR_BUS_FRACTION = 0.25
"""vLLM's custom all-reduce, bus bandwidth as a fraction of the link's: the slope from 32 KB to 1 MB on H100 is 15.4,
26.3 and 26.0 us per MB at TP 2/4/8 (sglang PR #2904), a bus bandwidth of 60-70 GB/s, a quarter of the 300 GB/s the
catalog gives the H100's NVLink (latency-optimised: few thread blocks, not NCCL's full-link ring)."""

CUSTOM_AR_MAX_BYTES = 8 * 1024**2
"""Largest message vLLM's custom all-reduce takes (its ``CustomAllreduce(max_size=8192 * 1024)`` buffer); larger
ones go to NCCL."""


@dataclass(frozen=True)
class Algorithm:
    """One all-reduce algorithm's cost constants (the module docstring's formula).

    Attributes:
        call_s: Fixed cost of one call at two GPUs.
        peer_s: Cost per GPU beyond two.
        bus_bytes_per_s: Bus bandwidth (bytes/s) of the ring term.
        max_bytes: Largest message the algorithm takes (``inf``: any).
    """

    call_s: float
    peer_s: float
    bus_bytes_per_s: float
    max_bytes: float = float("inf")

    def seconds(self, n_bytes: np.ndarray | float, p: int) -> np.ndarray | float:
        """Seconds of one all-reduce of ``n_bytes`` over ``p`` GPUs (``inf`` above ``max_bytes``)."""
        t = self.call_s + (p - 2) * self.peer_s + 2.0 * (p - 1) / p * n_bytes / self.bus_bytes_per_s
        if isinstance(t, np.ndarray):
            return np.where(n_bytes <= self.max_bytes, t, np.inf)
        return t if n_bytes <= self.max_bytes else float("inf")


@dataclass(frozen=True)
class Interconnect:
    """The all-reduce and send costs of one GPU type's intra-node link.

    Attributes:
        ring: NCCL's ring (any size, any link).
        custom: vLLM's custom all-reduce (NVLink only; ``None`` on PCIe, where vLLM disables it beyond two GPUs
            and GeForce cards lack the peer-to-peer access it needs).
    """

    ring: Algorithm
    custom: Algorithm | None

    @classmethod
    def of(cls, gpu: Gpu) -> Interconnect:
        """The interconnect of ``gpu``'s catalog entry."""
        link = gpu.link
        bandwidth = link.bandwidth_gbps * 1e9
        ring = Algorithm(link.latency_us * 1e-6, link.peer_latency_us * 1e-6, bandwidth * gpu.efficiency.link)
        custom = (Algorithm(CUSTOM_AR_CALL_S, CUSTOM_AR_PEER_S, bandwidth * CUSTOM_AR_BUS_FRACTION,
                            CUSTOM_AR_MAX_BYTES) if link.kind == "nvlink" else None)
        return cls(ring, custom)

    def all_reduce_s(self, n_bytes: np.ndarray | float, p: int) -> np.ndarray | float:
        """Seconds of one all-reduce of ``n_bytes`` over ``p`` GPUs: the faster algorithm that applies."""
        if p <= 1:
            return 0.0 * n_bytes
        best = self.ring.seconds(n_bytes, p)
        return best if self.custom is None else np.minimum(best, self.custom.seconds(n_bytes, p))

    def send_s(self, n_bytes: np.ndarray | float) -> np.ndarray | float:
        """Seconds of one stage-to-stage send of ``n_bytes``: an NCCL call and the link's achieved bandwidth (the
        ring's own constants)."""
        return self.ring.call_s + n_bytes / self.ring.bus_bytes_per_s

    def step_s(self, n_bytes: np.ndarray | float, layers: float, tp: int, pp: int) -> np.ndarray | float:
        """Communication of one step whose activations are ``n_bytes``: two all-reduces per layer, ``pp - 1``
        sends (PP stages run one after another, so their sends add up)."""
        total = 2.0 * layers * self.all_reduce_s(n_bytes, tp)
        if pp > 1:
            total = total + (pp - 1) * self.send_s(n_bytes)
        return total
