"""The planner's commands, each from one config: ``paratrain plan`` (:mod:`.plan`), ``paratrain tp-plan``
(:mod:`.tp_plan`) and ``paratrain dry-run`` (:mod:`.dry_run`). They build models by name, which the planner (layer 3)
never does; the CLI parses a command's flags into its config and calls one function here."""
