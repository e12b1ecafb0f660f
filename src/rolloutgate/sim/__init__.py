"""The engine simulator: SGLang- and vLLM-speaking engines with scheduling physics, time scale and faults.

    async with SimCluster(engines=2, api="sglang", profile="incident", time_scale=100.0) as cluster:
        cluster.urls, cluster.engines[0].running_count, cluster.engines[0].set_fault("freeze")

See docs/simulator.md.
"""

from __future__ import annotations

from rolloutgate.sim.cluster import SimCluster
from rolloutgate.sim.engine import SimEngine
from rolloutgate.sim.engine_model import EngineModel
from rolloutgate.sim.faults import FAULT_KINDS, Fault
from rolloutgate.sim.profiles import PROFILES, SimEngineConfig, make_config
from rolloutgate.sim.request import FinishReason, RequestState, SimRequest

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
