"""Who runs where, by placement.mode: ``colocated`` (every GPU shared by an actor rank and an engine
worker; launched in this process, ``local``, or on Ray, ``ray_colocated``) and ``disaggregated``
(separate Ray placement groups, ``ray_disaggregated``). ``launch`` starts the mode's resolved
launcher (placement/base.py)."""

from colocate_rl.placement.base import PLACEMENTS, Placement, check_shared_folder, launch

__all__ = ["PLACEMENTS", "Placement", "check_shared_folder", "launch"]
