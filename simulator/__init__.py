"""The virtual world: every rank of a mesh hosted in one process.

``python -m simulator -n 8 train.py`` runs a script on 8 virtual ranks;
``python -m simulator --reference train.py`` runs it as one big device.
"""

from simulator.backend import ReferenceBackend, ShapeOnlyBackend, SimBackend
from simulator.launch import run_script
from simulator.schedule_sim import simulate_schedule
from simulator.virtual_comm import VirtualCommunicator

__all__ = [
    "ReferenceBackend",
    "ShapeOnlyBackend",
    "SimBackend",
    "VirtualCommunicator",
    "run_script",
    "simulate_schedule",
]
