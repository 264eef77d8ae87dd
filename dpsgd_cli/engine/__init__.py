"""Running grids and storing their results."""

from dpsgd_cli.engine.results import COLUMNS, ResultStore
from dpsgd_cli.engine.runner import GridRun, Task, TaskResult, execute, plan_grid, run_task
from dpsgd_cli.engine.summary import summary_frame

__all__ = ["COLUMNS", "GridRun", "ResultStore", "Task", "TaskResult", "execute", "plan_grid", "run_task",
           "summary_frame"]
