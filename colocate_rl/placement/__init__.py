"""Who runs where: the actor ranks and the engines in this process (``local``), as Ray actors sharing
each GPU (``ray_colocated``), or on separate Ray placement groups (``disaggregated``). ``launch``
picks by placement.mode and placement.launcher (placement/base.py)."""

from colocate_rl.placement.base import PLACEMENTS, Workers, check_shared_folder, launch, launcher

__all__ = ["PLACEMENTS", "Workers", "check_shared_folder", "launch", "launcher"]
