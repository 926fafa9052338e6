"""The engine core: a step is plan -> execute -> commit over a typed plan (plan.py), with features plugged in
through a few hooks (feature.py); `EngineCore` (engine_core.py) runs it."""
from brrr.engine.core.engine_core import EngineCore, StepFailed
from brrr.engine.core.feature import Feature
from brrr.engine.core.plan import InFlight, SampleSlot, StepPlan, StepResult
from brrr.engine.core.requests import check_request

__all__ = ["EngineCore", "Feature", "InFlight", "SampleSlot", "StepFailed", "StepPlan", "StepResult", "check_request"]
