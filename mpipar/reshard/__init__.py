"""Reshard: the planner (pure) and the executor (over a communicator)."""

from mpipar.reshard.executor import execute_plan
from mpipar.reshard.planner import Piece, ReshardPlan, ReshardStep, plan_reshard

__all__ = ["Piece", "ReshardPlan", "ReshardStep", "execute_plan", "plan_reshard"]
