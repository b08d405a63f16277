"""The controller: workflows that turn prompts into groups of trajectories, the staleness rule,
and the queue that hands the trainer batches within the bound."""

from areal_jax.controller.controller import ControllerCounters, Group, PromptsExhausted, RolloutController
from areal_jax.controller.staleness import StalenessRule
from areal_jax.controller.workflow import EpisodeClient, Workflow, WorkflowError, get_workflow

__all__ = ["ControllerCounters", "EpisodeClient", "Group", "PromptsExhausted", "RolloutController",
           "StalenessRule", "Workflow", "WorkflowError", "get_workflow"]
