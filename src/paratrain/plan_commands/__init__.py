"""The planner's commands, each from one config: ``paratrain plan`` (:mod:`.plan`) and ``paratrain tp-plan``
(:mod:`.tp_plan`). They build models by name (``workloads.model_names``), which the planner (layer 3) never does; the
CLI parses a command's flags into its config and calls one function here. ``paratrain dry-run``'s is
:mod:`paratrain.dry_run.command`."""
