"""The planner's errors: a user's mistake gets a message that names the bad value, never a traceback.

    PlannerError                 anything the CLI reports as `planner: <message>` and exit code 2
     ├── ProfileError            a profile file or directory is missing, unreadable or malformed
     ├── NoFeasibleBatch         no profiled batch size survives the preemption and SLO filters
     └── MemoryPlanError         the memory facts are missing or no replica fits
    RunError                     a measurement failed (a replica died, every request failed): exit code 1
"""

from __future__ import annotations


class PlannerError(ValueError):
    """A planner input is wrong or insufficient; the message says which and what to do."""


class ProfileError(PlannerError):
    """A profile (directory of point files, or a CSV) cannot be read."""


class NoFeasibleBatch(PlannerError):
    """No profiled batch size meets the constraints."""


class MemoryPlanError(PlannerError):
    """Memory facts are missing, or not even one replica fits."""


class RunError(RuntimeError):
    """A profile or validation run failed for a reason outside the user's input."""
