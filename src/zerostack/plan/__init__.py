"""Choose the layout from the model and the hardware: a cost model over every feasible layout.

:mod:`.hardware` describes the machine (nominal profiles, or this machine calibrated);
:mod:`.cost` predicts one layout's step time and memory; :mod:`.search` enumerates the layouts,
drops the infeasible ones with the reason, and ranks the rest (``zerostack plan``).
"""

from .cost import Candidate, Prediction, model_flops, predict
from .hardware import PROFILES, Hardware, PlanError, calibrate, profile

__all__ = [
    "Candidate",
    "Hardware",
    "PROFILES",
    "PlanError",
    "Prediction",
    "calibrate",
    "model_flops",
    "predict",
    "profile",
]
