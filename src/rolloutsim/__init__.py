"""The engine simulator: SGLang- and vLLM-speaking engines with scheduling physics, time scale and faults.

    async with SimCluster(engines=2, api="sglang", profile="incident", time_scale=100.0) as cluster:
        cluster.urls, cluster.engines[0].running_count, cluster.engines[0].set_fault("freeze")

See docs/simulator.md.
"""

from __future__ import annotations

from rolloutsim.cluster import SimCluster
from rolloutsim.engine import SimEngine
from rolloutsim.engine_model import EngineModel
from rolloutsim.faults import FAULT_KINDS, Fault
from rolloutsim.profiles import PROFILES, SimEngineConfig, make_config
from rolloutsim.request import FinishReason, RequestState, SimRequest

__all__ = (
    "FAULT_KINDS",
    "PROFILES",
    "EngineModel",
    "Fault",
    "FinishReason",
    "RequestState",
    "SimCluster",
    "SimEngine",
    "SimEngineConfig",
    "SimRequest",
    "make_config",
)
