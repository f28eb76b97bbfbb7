"""The contract's data types: what hooks receive and return, and what policies see.

Plugins and policies import these from here (``rota.types``); the names are stable.
"""

from __future__ import annotations

from rota._orchestrator.state import TenantRecord, Waiter
from rota._tenant.link import OrchestratorLink
from rota._types import Grant, ParkMode, ParkPlan, ParkResult, Placement, ReleaseInfo, ReleaseRequest, TurnRequest

__all__ = ["Grant", "OrchestratorLink", "ParkMode", "ParkPlan", "ParkResult", "Placement", "ReleaseInfo",
           "ReleaseRequest", "TenantRecord", "TurnRequest", "Waiter"]
